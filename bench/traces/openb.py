"""Static fill on every Alibaba 2023 "openb" workload, dxpool against two baselines.

For each workload (``openb_pod_list_<workload>.csv``: default, the cpu*, gpushare*,
gpuspec* and multigpu* variants) and seed (``random.Random(seed)``, seeds 42-51), pods
are drawn with replacement until the GPUs they ask for reach 130% of the cluster's
6,212, submitted in that order and never released (FGD's protocol, ATC'23), in
**whole-GPU mode**: a pod asking a fraction of a GPU takes a whole one, so arrived
demand counts whole GPUs asked (``num_gpu``), and at 100% exactly the cluster's GPUs
have been asked for. (FGD counts fractions; in whole-GPU mode its 100% comes after the
GPUs asked have passed capacity, where every cluster is full and nothing is told
apart.) Every pod asks for its CPU and memory and may use the models of its
``gpu_spec`` (each once; any model when empty); every host or server declares its trace
node's CPU and memory (``openb_node_list_gpu_node.csv``; CPU in units of 2 milli-cores,
see ``bench.traces.data``). The same request sequence goes to every cluster, each made
of the same inventory:

* **dxpool**: the 6,212 GPUs in boxes of 8 (one model per box), the 1,213 GPU nodes as
  hosts with their CPU and memory and ``--slots`` proxy slots each (8), placed through
  the embedding API (:class:`~dxpool.broker.nodes.memory_pool.InMemoryPool`: the broker's
  cache, placement index, default pipeline and records), CPU-only pods held as host
  reservations chosen by placement;
* **best-fit servers**: the 1,213 servers as they are (GPUs fixed in them), best fit
  (the tightest server by free GPUs, of a model the pod may use, that has its CPU and
  memory), FGD's ``05-BestFit`` for whole GPUs;
* **most-free-model**: the dxpool inventory (any GPU reaches any host) with two simple
  rules: the model with the most free GPUs the pod may use, and the host with the
  fewest free slots that has the CPU and memory (``bench/traces/mostfree.py``).

Prints per workload the unallocated share of the GPUs at 100% arrived demand and the
first refused GPU pod (% of demand arrived), mean ± sd over the seeds, for the three
clusters, whether dxpool meets the targets (unallocated no more than the better
baseline; first refusal no earlier than best-fit servers'), dxpool's refusals by cause
and its decision times; draws the per-workload figures into ``--plot``.

Usage: python -m bench.traces.openb [--workloads all|default,multigpu50,...]
       [--seeds 42-51] [--quick] [--slots 8] [--clusters dxpool,servers,mostfree]
       [--pipeline default|...] [--verify-refusals] [--jobs N] [--traces DIR] [--plot PATH]
       [--save FILE] [--from-saved FILE ...]
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from bench.traces import pipelines
from bench.traces.allocator import Allocator, Cause, Resources
from bench.traces.data import (
    Pod,
    Server,
    TraceError,
    openb_pods,
    openb_servers,
    openb_workloads,
    traces_dir,
)
from bench.traces.mostfree import MostFreeModel
from bench.traces.pool import DecisionTimes, DxpoolPool, PoolLayout, boxes_of
from bench.traces.report import positive_int, pyplot, save, table
from bench.traces.servers import FixedServers

TUNE = 1.3  # pods are drawn until the GPUs asked reach 130% of capacity (--until)
DEFAULT_PLOT = Path(__file__).parent / "plots" / "openb.png"
DXPOOL, SERVERS, MOSTFREE = "dxpool", "best-fit servers", "most-free-model"
CLUSTER_KEYS = {"dxpool": DXPOOL, "servers": SERVERS, "mostfree": MOSTFREE}
"""The short names ``--clusters`` takes."""
CAUSE_HEADS = {
    Cause.CAPACITY: "GPU",
    Cause.MODEL: "model",
    Cause.HOST_SLOTS: "slots",
    Cause.CPU: "CPU",
    Cause.MEMORY: "memory",
    Cause.FRAGMENTATION: "frag GPU",
    Cause.FRAGMENTATION_CPU: "frag CPU",
    Cause.FRAGMENTATION_MEMORY: "frag memory",
}


def cluster_keys(text: str) -> list[str]:
    """An argparse type: ``dxpool,servers`` -> the clusters' names."""
    keys = [key.strip() for key in text.split(",") if key.strip()]
    unknown = [key for key in keys if key not in CLUSTER_KEYS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown cluster {', '.join(unknown) or text!r}: use a comma list of "
            f"{', '.join(CLUSTER_KEYS)}"
        )
    return [CLUSTER_KEYS[key] for key in keys]


def sample_requests(
    pods: Sequence[Pod], capacity: int, seed: int, until: float = TUNE
) -> list[Pod]:
    """Pods drawn with replacement until the GPUs they ask reach ``until`` x
    ``capacity`` (a shorter draw is the start of a longer one)."""
    rng = random.Random(seed)
    requests: list[Pod] = []
    demand = 0
    while demand < until * capacity:
        pod = rng.choice(pods)
        requests.append(pod)
        demand += pod.gpus
    return requests


@dataclass
class FillRun:
    """One cluster filled with one request sequence."""

    cluster: str
    seed: int
    capacity: int
    arrived: list[int] = field(default_factory=list)  # GPUs asked after each request
    allocated: list[int] = field(default_factory=list)  # GPUs held after each request
    refusals: list[tuple[float, int, Cause]] = field(default_factory=list)  # (% arrived, size)
    cpu_pods: int = 0  # CPU-only pods submitted
    times: list[float] = field(default_factory=list)  # dxpool's decisions, seconds
    cpu_times: list[float] = field(default_factory=list)  # their CPU time, seconds
    until: float = TUNE  # the draw's end, as a share of capacity

    def allocation_at(self, percent: float) -> float:
        """GPUs allocated (% of capacity) once ``percent``% of capacity was asked for."""
        index = bisect.bisect_right(self.arrived, percent * self.capacity / 100) - 1
        return 100 * self.allocated[index] / self.capacity if index >= 0 else 0.0

    def unallocated_at(self, percent: float) -> float:
        return 100 - self.allocation_at(percent)

    def first_refusal(self) -> float:
        """% of capacity asked for when the first GPU pod was refused (the end of the
        draw, ``until`` x 100, when none was)."""
        return next((at for at, size, _ in self.refusals if size), self.until * 100)


class ReadAtFull(Protocol):
    """What the table and the plot read of a run: its figures at 100% demand."""

    def unallocated_at(self, percent: float) -> float: ...

    def first_refusal(self) -> float: ...


@dataclass(frozen=True)
class SavedRun:
    """One cluster's run of one seed as ``--save`` wrote it: its figures at 100% only."""

    cluster: str
    seed: int
    unallocated: float
    first: float

    def unallocated_at(self, percent: float) -> float:
        if percent != 100:
            raise ValueError(f"a saved run holds the figures at 100% only, not {percent}%")
        return self.unallocated

    def first_refusal(self) -> float:
        return self.first


def load_saved(paths: Sequence[Path]) -> dict[str, dict[str, list[SavedRun]]]:
    """The runs ``--save`` wrote to ``paths`` (JSON lines), by workload and cluster, in
    the order first read; a workload saved again replaces its earlier lines."""
    results: dict[str, dict[str, list[SavedRun]]] = {}
    for path in paths:
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                line = json.loads(text)
                runs = [
                    SavedRun(line["cluster"], seed, unallocated, first)
                    for seed, unallocated, first in zip(
                        line["seeds"],
                        line["unallocated_at_100"],
                        line["first_refusal"],
                        strict=True,
                    )
                ]
            except (ValueError, KeyError, TypeError) as error:
                raise TraceError(f"{path}:{number}: not a line --save wrote ({error})") from None
            results.setdefault(line["workload"], {})[line["cluster"]] = runs
    return results


def fill(allocator: Allocator, requests: Sequence[Pod], seed: int, until: float = TUNE) -> FillRun:
    """Submits ``requests`` in order, each asking for its CPU, memory and models."""
    run = FillRun(allocator.name, seed, allocator.capacity, until=until)
    demand = 0
    for pod in requests:
        demand += pod.gpus
        run.cpu_pods += pod.gpus == 0
        needs = Resources(pod.cpu, pod.memory_mib, pod.models if pod.gpus else ())
        outcome = allocator.allocate(pod.gpus, needs)
        if isinstance(outcome, Cause):
            run.refusals.append((100 * demand / allocator.capacity, pod.gpus, outcome))
        run.arrived.append(demand)
        run.allocated.append(allocator.allocated)
    if isinstance(allocator, DxpoolPool):
        run.times = allocator.times.samples
        run.cpu_times = allocator.times.cpu
    return run


@dataclass(frozen=True)
class Setup:
    """What every cluster of a run is made of (picklable, for worker processes)."""

    servers: tuple[Server, ...]
    slots: int
    pipeline: str
    verify: bool
    clusters: tuple[str, ...]
    until: float = TUNE


def clusters(setup: Setup, pods: Sequence[Pod]) -> list[tuple[str, Callable[[], Allocator]]]:
    """(name, factory) of every cluster compared, each factory making a fresh one."""
    servers = setup.servers
    by_model = Counter[str]()
    for server in servers:
        by_model[server.model] += server.gpus
    cpus = [s.cpu for s in servers]
    memory = [s.memory_mib for s in servers]
    slots = [setup.slots] * len(servers)
    built = pipelines.build(setup.pipeline, Counter(min(p.gpus, 8) for p in pods if p.gpus))
    layout = PoolLayout(boxes_of(dict(by_model)), slots, host_cpus=cpus, host_memory_mib=memory)
    made: list[tuple[str, Callable[[], Allocator]]] = [
        (
            DXPOOL,
            lambda: DxpoolPool(DXPOOL, layout, pipeline=built, verify_refusals=setup.verify),
        ),
        (
            SERVERS,
            lambda: FixedServers(
                SERVERS, [s.gpus for s in servers], cpus, memory, [s.model for s in servers]
            ),
        ),
        (MOSTFREE, lambda: MostFreeModel(MOSTFREE, dict(by_model), slots, cpus, memory)),
    ]
    return [(name, make) for name, make in made if name in setup.clusters]


def run_seed(setup: Setup, traces: Path, workload: str, seed: int) -> list[FillRun]:
    """Every cluster filled with the seed's draw of the workload's pods."""
    pods = openb_pods(traces, workload, cpu_only=True)
    capacity = sum(server.gpus for server in setup.servers)
    requests = sample_requests(pods, capacity, seed, setup.until)
    return [fill(make(), requests, seed, setup.until) for _, make in clusters(setup, pods)]


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def shown(values: Sequence[float]) -> str:
    mean, sd = mean_sd(values)
    return f"{mean:.2f} ± {sd:.2f}"


def summarize(
    results: Mapping[str, Mapping[str, Sequence[ReadAtFull]]], names: Sequence[str], capacity: int
) -> bool:
    """Prints the per-workload table; True when dxpool meets both targets on every
    workload (means over seeds)."""
    rows = []
    met_all = True
    for workload, runs in results.items():
        unallocated = {name: [run.unallocated_at(100) for run in runs[name]] for name in names}
        first = {name: [run.first_refusal() for run in runs[name]] for name in names}
        verdict = "-"
        if DXPOOL in runs and (SERVERS in runs or MOSTFREE in runs):
            bases = [statistics.mean(unallocated[n]) for n in (SERVERS, MOSTFREE) if n in runs]
            ok_unallocated = statistics.mean(unallocated[DXPOOL]) <= min(bases) + 1e-9
            ok_first = SERVERS not in runs or (
                statistics.mean(first[DXPOOL]) >= statistics.mean(first[SERVERS]) - 1e-9
            )
            met = ok_unallocated and ok_first
            met_all &= met
            verdict = (
                "yes"
                if met
                else (
                    "no: "
                    + ", ".join(
                        what
                        for what, ok in (("unallocated", ok_unallocated), ("first", ok_first))
                        if not ok
                    )
                )
            )
        rows.append(
            (
                workload,
                *(shown(unallocated[name]) for name in names),
                *(shown(first[name]) for name in names),
                verdict,
            )
        )
    header = (
        "workload",
        *(f"unallocated at 100%: {name}" for name in names),
        *(f"first refusal: {name}" for name in names),
        "targets met",
    )
    print(
        f"Unallocated GPUs at 100% of capacity asked (% of {capacity:,}) and the first "
        "refused GPU pod (% of capacity asked; the end of the draw when none was), mean ± "
        "sd over seeds:"
    )
    print(table(header, rows))
    return met_all


def causes(results: dict[str, dict[str, list[FillRun]]], name: str) -> None:
    """Refusals of GPU pods up to 100% demand by cause, mean per run."""
    rows = []
    for workload, runs in results.items():
        done = runs.get(name)
        if not done:
            continue
        counted = Counter(c for run in done for at, size, c in run.refusals if at <= 100 and size)
        cpu_only = sum(1 for run in done for at, size, _ in run.refusals if at <= 100 and not size)
        rows.append(
            (
                workload,
                *(f"{counted[c] / len(done):.1f}" for c in Cause),
                f"{cpu_only / len(done):.1f} of {statistics.mean(r.cpu_pods for r in done):.0f}",
            )
        )
    print(f"\n{name}: GPU pods refused up to 100% by cause, and CPU-only pods refused, per run:")
    print(table(("workload", *(CAUSE_HEADS[c] for c in Cause), "CPU-only pods"), rows))


def timing(results: dict[str, dict[str, list[FillRun]]]) -> None:
    every = DecisionTimes()
    rows = []
    for workload, runs in results.items():
        times = DecisionTimes(
            [t for run in runs.get(DXPOOL, []) for t in run.times],
            [t for run in runs.get(DXPOOL, []) for t in run.cpu_times],
        )
        if not times.samples:
            continue
        every.samples += times.samples
        every.cpu += times.cpu
        rows.append((workload, *_timing_cells(times)))
    if not every.samples:
        return
    rows.append(("all", *_timing_cells(every)))
    print(
        "\ndxpool's placement decisions (snapshot + place(), or the host of a CPU-only pod; "
        "refusals the counts allow skipped), wall clock and CPU time of the process:"
    )
    header = ("workload", "decisions", "p50 ms", "p99 ms", "CPU p50 ms", "CPU p99 ms")
    print(table(header, rows))


def _timing_cells(times: DecisionTimes) -> tuple[object, ...]:
    cells: list[object] = [len(times.samples)]
    for of_cpu in (False, True):
        if of_cpu and not times.cpu:
            cells += ["-", "-"]
            continue
        cells += [f"{times.percentile(q, of_cpu=of_cpu) * 1e3:.3f}" for q in (0.5, 0.99)]
    return tuple(cells)


def plot(
    results: Mapping[str, Mapping[str, Sequence[ReadAtFull]]], names: Sequence[str], path: Path
) -> None:
    plt = pyplot()
    if plt is None:
        return
    workloads = list(results)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(max(10, len(workloads) * 0.6), 8))
    width = 0.8 / len(names)
    for offset, name in enumerate(names):
        xs = [i + offset * width for i in range(len(workloads))]
        for axis, metric in ((top, "unallocated"), (bottom, "first")):
            values = [
                [
                    run.unallocated_at(100) if metric == "unallocated" else run.first_refusal()
                    for run in results[w][name]
                ]
                for w in workloads
            ]
            axis.bar(
                xs,
                [statistics.mean(v) for v in values],
                width,
                yerr=[mean_sd(v)[1] for v in values],
                label=name,
            )
    for axis in (top, bottom):
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        axis.tick_params(axis="x", labelrotation=60, labelsize=7)
        axis.legend(fontsize=7)
    top.set_ylabel("unallocated at 100% asked (% of GPUs)")
    bottom.set_ylabel("first refused GPU pod (% asked)")
    bottom.set_ylim(0, TUNE * 100)
    figure.suptitle("openb static fill, whole GPUs, CPU, memory and models (mean ± sd)")
    figure.tight_layout()
    save(figure, path)


def save_runs(path: Path, workload: str, runs: dict[str, list[FillRun]]) -> None:
    """Appends one JSON line per cluster: the figures of every seed, read at 100%."""
    with path.open("a", encoding="utf-8") as handle:
        for name, done in runs.items():
            line = {
                "workload": workload,
                "cluster": name,
                "seeds": [run.seed for run in done],
                "unallocated_at_100": [run.unallocated_at(100) for run in done],
                "first_refusal": [run.first_refusal() for run in done],
                "refusals_to_100": [
                    {
                        c.name: n
                        for c, n in Counter(
                            c for at, size, c in run.refusals if at <= 100 and size
                        ).items()
                    }
                    for run in done
                ],
                "decision_ms_p50_p99": [
                    [DecisionTimes(run.times).percentile(q) * 1e3 for q in (0.5, 0.99)]
                    for run in done
                ],
                "decision_cpu_ms_p50_p99": [
                    [
                        DecisionTimes(run.cpu_times, run.cpu_times).percentile(q) * 1e3
                        for q in (0.5, 0.99)
                    ]
                    for run in done
                ],
            }
            handle.write(json.dumps(line) + "\n")


def parse_seeds(text: str) -> list[int]:
    """``42-51`` or ``42,45``."""
    try:
        if "-" in text:
            low, high = (int(part) for part in text.split("-", 1))
            return list(range(low, high + 1))
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"seeds are FIRST-LAST or a comma list, got {text!r}"
        ) from None


def parser_of() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", help="folder of the trace folders")
    parser.add_argument(
        "--workloads", default="all", help="comma list of openb workloads, or all (default)"
    )
    parser.add_argument("--seeds", type=parse_seeds, default=list(range(42, 52)))
    parser.add_argument(
        "--quick", action="store_true", help="seed 42 on a tenth of the servers, 3 workloads"
    )
    parser.add_argument("--slots", type=positive_int, default=8, help="proxy slots per host")
    parser.add_argument("--pipeline", default="default", choices=pipelines.NAMES)
    parser.add_argument(
        "--verify-refusals", action="store_true", help="ask placement on every refusal too"
    )
    parser.add_argument(
        "--clusters",
        type=cluster_keys,
        default=list(CLUSTER_KEYS.values()),
        help=f"comma list of the clusters to run: {', '.join(CLUSTER_KEYS)} (all)",
    )
    parser.add_argument(
        "--jobs", type=positive_int, default=1, help="worker processes (seeds run in parallel)"
    )
    parser.add_argument(
        "--until",
        type=positive_int,
        default=round(TUNE * 100),
        help="draw pods until the GPUs asked reach this %% of capacity (130; the figures "
        "read at 100%% are the same for any value from 100 up)",
    )
    parser.add_argument(
        "--save", type=Path, help="append each workload's runs to this file (JSON lines)"
    )
    parser.add_argument(
        "--from-saved",
        type=Path,
        action="append",
        metavar="FILE",
        help="run nothing: print the table and draw the plot of the runs --save wrote to "
        "FILE (repeatable: runs of one workload set split over several runs)",
    )
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = parser_of()
    args = parser.parse_args(argv)
    try:
        traces = traces_dir(args.traces)
        servers = openb_servers(traces)
        known = openb_workloads(traces)
    except TraceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.from_saved:
        return from_saved(args.from_saved, servers, args.plot)
    workloads = known if args.workloads == "all" else args.workloads.split(",")
    unknown = [w for w in workloads if w not in known]
    if unknown:
        parser.error(
            f"--workloads: unknown {', '.join(unknown)}; the traces hold {', '.join(known)}"
        )
    seeds = args.seeds
    if args.quick:
        servers, seeds = servers[::10], seeds[:1]
        if args.workloads == "all":
            workloads = ["default", "gpuspec33", "multigpu50"]
    setup = Setup(
        tuple(servers),
        args.slots,
        args.pipeline,
        args.verify_refusals,
        tuple(args.clusters),
        args.until / 100,
    )
    names = [name for name in CLUSTER_KEYS.values() if name in args.clusters]
    capacity = sum(server.gpus for server in servers)
    print(
        f"openb static fill: {len(servers)} servers, {capacity} GPUs, {len(workloads)} "
        f"workloads, seeds {seeds[0]}-{seeds[-1]}, whole GPUs, CPU, memory and models, "
        f"dxpool hosts with {args.slots} slots, pipeline {args.pipeline}"
    )
    results: dict[str, dict[str, list[FillRun]]] = {}
    began = time.monotonic()
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else _Inline() as workers:
        for workload in workloads:  # one at a time, its seeds side by side
            futures = [workers.submit(run_seed, setup, traces, workload, s) for s in seeds]
            runs: dict[str, list[FillRun]] = {name: [] for name in names}
            for future in futures:
                for run in future.result():
                    runs[run.cluster].append(run)
            results[workload] = runs
            print(f"  {workload}: done at {time.monotonic() - began:.0f} s", file=sys.stderr)
            summarize({workload: runs}, names, capacity)
            sys.stdout.flush()
            if args.save is not None:
                save_runs(args.save, workload, runs)
    print("\nEvery workload:")
    met = summarize(results, names, capacity)
    if DXPOOL in names:
        causes(results, DXPOOL)
        timing(results)
    if DXPOOL in names and len(names) > 1:
        print(f"\ndxpool meets both targets on every workload: {'yes' if met else 'no'}")
    plot(results, names, args.plot)
    return 0


def from_saved(paths: Sequence[Path], servers: Sequence[Server], plot_path: Path) -> int:
    """Prints the per-workload table of saved runs and draws their plot."""
    try:
        saved = load_saved(paths)
    except (OSError, TraceError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    names = [name for name in CLUSTER_KEYS.values() if any(name in r for r in saved.values())]
    seeds = sorted({run.seed for runs in saved.values() for r in runs.values() for run in r})
    print(f"openb static fill, saved runs: {len(saved)} workloads, seeds {seeds}")
    met = summarize(saved, names, sum(server.gpus for server in servers))
    if DXPOOL in names and len(names) > 1:
        print(f"\ndxpool meets both targets on every workload: {'yes' if met else 'no'}")
    plot(saved, names, plot_path)
    return 0


class _Inline:
    """Runs submitted calls at once, in this process (``--jobs 1``)."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def submit(self, call: Callable[..., list[FillRun]], *args: object) -> _Done:
        return _Done(call(*args))


@dataclass(frozen=True)
class _Done:
    value: list[FillRun]

    def result(self) -> list[FillRun]:
        return self.value


if __name__ == "__main__":
    sys.exit(main())
