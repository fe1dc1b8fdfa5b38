"""Static fill on the Alibaba 2023 "openb" trace, with FGD's protocol (ATC'23).

Pods of ``openb_pod_list_default.csv`` (GPU pods and CPU-only pods) are drawn with
replacement (``random.Random(seed)``, seeds 42-51) until the GPU they ask for reaches 130%
of the cluster's 6,212; they are submitted in that order and never released. Arrived
demand is counted as FGD counts it (``num_gpu x gpu_milli``, so a pod asking 0.46 of a
GPU adds 0.46 and a CPU-only pod nothing), which makes the x axis FGD's. Whole-GPU mode:
every pod is placed as whole GPUs (a fractional pod takes one), so the GPUs asked for
pass capacity well before 100% arrived demand. Every pod also asks for its CPU and
memory, and every host or server declares the CPU and memory of its trace node
(``openb_node_list_gpu_node.csv``; CPU in units of 2 milli-cores, see
``bench.traces.data``); ``--gpus-only`` leaves CPU, memory and the CPU-only pods out (the
protocol of the earlier runs). The same request sequence goes to every cluster:

* dxpool: the 6,212 GPUs in boxes of 8 (one model per box), the 1,213 GPU nodes as hosts
  (each with its node's CPU and memory) with as many proxy slots as the node had GPUs,
  and also with 8 and 16 slots per host (those two on the first ``--variant-seeds`` seeds
  only, 3 by default: they cost most); placement is the broker's own (cache, placement
  index, default pipeline, CPU and memory fit); a CPU-only pod's CPU and memory are
  reserved on a host by the harness's best fit (see ``bench.traces.pool``);
* the same 1,213 servers with best fit (the tightest server by free GPUs that has the
  CPU and memory);
* homogeneous 8-GPU servers (776 of 8 and one of 4: the same 6,212 GPUs), the trace's
  CPU and memory split among them in proportion to their GPUs.

Prints, per cluster (means over seeds): GPUs allocated and unallocated at 100% arrived
demand, first refusal and first fragmentation refusal (as % of capacity arrived),
refusals by cause (GPU, host slots, CPU, memory; fragmentation by the resource no single
host had with the others) and by size; writes a plot of allocation against arrived
demand with FGD's published BestFit and FGD curves (``alibaba-gpu-v2023-fgd-results``,
GPU-sharing mode) beside it.

Usage: python -m bench.traces.openb [--quick] [--seeds 42-51] [--variant-seeds 3]
       [--gpus-only] [--pipeline default|slot-frag|cpu-balance|...] [--verify-refusals]
       [--clusters pool,pool8,pool16,servers,servers8] [--traces DIR] [--plot PATH]
"""

from __future__ import annotations

import argparse
import bisect
import csv
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.traces import pipelines
from bench.traces.allocator import FRAGMENTED, NONE, Allocator, Cause, Resources
from bench.traces.data import Pod, Server, TraceError, openb_pods, openb_servers, traces_dir
from bench.traces.pool import DecisionTimes, DxpoolPool, PoolLayout, boxes_of
from bench.traces.report import positive_int, pyplot, save, size_class, table
from bench.traces.servers import FixedServers

TUNE = 1.3  # pods are drawn until demand reaches 130% of capacity
PERCENTS = range(0, 131)
DEFAULT_PLOT = Path(__file__).parent / "plots" / "openb.png"
VARIANTS = ("dxpool, 8 slots/host", "dxpool, 16 slots/host")  # run on --variant-seeds
CLUSTER_KEYS = {
    "pool": "dxpool, slots = node GPUs",
    "pool8": "dxpool, 8 slots/host",
    "pool16": "dxpool, 16 slots/host",
    "servers": "servers, best fit",
    "servers8": "8-GPU servers, best fit",
}
"""The short names ``--clusters`` takes, for the clusters :func:`clusters` makes."""


def cluster_keys(text: str) -> list[str]:
    """An argparse type: ``pool,servers`` -> the clusters' names."""
    keys = [key.strip() for key in text.split(",") if key.strip()]
    unknown = [key for key in keys if key not in CLUSTER_KEYS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown cluster {', '.join(unknown) or text!r}: use a comma list of "
            f"{', '.join(CLUSTER_KEYS)}"
        )
    return [CLUSTER_KEYS[key] for key in keys]


def sample_requests(pods: Sequence[Pod], capacity: int, seed: int) -> list[Pod]:
    """Pods drawn with replacement until their demand reaches ``TUNE`` x ``capacity``."""
    rng = random.Random(seed)
    requests: list[Pod] = []
    demand = 0.0
    while demand < TUNE * capacity:
        pod = rng.choice(pods)
        requests.append(pod)
        demand += demand_of(pod)
    return requests


def demand_of(pod: Pod) -> float:
    """What a pod adds to arrived demand, in GPUs, as FGD counts it."""
    return pod.gpus * min(pod.gpu_milli, 1000) / 1000


@dataclass
class FillRun:
    """One cluster filled with one request sequence."""

    cluster: str
    seed: int
    capacity: int
    arrived: list[float] = field(default_factory=list)  # demand after each request
    allocated: list[int] = field(default_factory=list)  # GPUs held after each request
    used: list[float] = field(default_factory=list)  # demand of the placed pods, in GPUs
    refusals: list[tuple[float, int, Cause]] = field(default_factory=list)  # (% arrived, size)
    cpu_pods: int = 0  # CPU-only pods submitted

    def allocation_at(self, percent: float) -> float:
        """GPUs allocated (% of capacity) once ``percent``% of capacity has arrived."""
        index = bisect.bisect_right(self.arrived, percent * self.capacity / 100) - 1
        return 100 * self.allocated[index] / self.capacity if index >= 0 else 0.0

    def used_at(self, percent: float) -> float:
        """FGD's allocation ratio: the placed pods' demand (fractions summed), % of
        capacity, once ``percent``% of capacity has arrived."""
        index = bisect.bisect_right(self.arrived, percent * self.capacity / 100) - 1
        return 100 * self.used[index] / self.capacity if index >= 0 else 0.0

    def first_refusal(self, causes: Sequence[Cause] = tuple(Cause)) -> float | None:
        return next((at for at, _, cause in self.refusals if cause in causes), None)


def fill(
    allocator: Allocator, requests: Sequence[Pod], seed: int, resources: bool = True
) -> FillRun:
    """Submits ``requests`` in order; with ``resources`` each asks for its CPU and memory."""
    run = FillRun(allocator.name, seed, allocator.capacity)
    demand = used = 0.0
    for pod in requests:
        demand += demand_of(pod)
        gpus = pod.gpus
        run.cpu_pods += gpus == 0
        needs = Resources(pod.cpu, pod.memory_mib) if resources else NONE
        outcome = allocator.allocate(gpus, needs)
        if isinstance(outcome, Cause):
            run.refusals.append((100 * demand / allocator.capacity, gpus, outcome))
        else:
            used += demand_of(pod)
        run.arrived.append(demand)
        run.allocated.append(allocator.allocated)
        run.used.append(used)
    return run


def clusters(
    servers: Sequence[Server],
    pod_sizes: Sequence[int],
    pipeline: str,
    verify: bool,
    resources: bool = True,
) -> list[tuple[str, Callable[[], Allocator]]]:
    """(name, factory) of every cluster compared, each factory making a fresh one; with
    ``resources`` hosts and servers declare CPU and memory."""
    gpus_by_model = Counter[str]()
    for server in servers:
        gpus_by_model[server.model] += server.gpus
    boxes = boxes_of(dict(gpus_by_model))
    capacity = sum(server.gpus for server in servers)
    full, rest = divmod(capacity, 8)
    built = pipelines.build(pipeline, Counter(min(p, 8) for p in pod_sizes if p))
    cpus = [s.cpu for s in servers] if resources else []
    memory = [s.memory_mib for s in servers] if resources else []
    even = [8] * full + ([rest] if rest else [])
    even_cpus, even_memory = [], []
    if resources:  # the same CPU and memory in all, in proportion to each server's GPUs
        even_cpus = [sum(cpus) * gpus // capacity for gpus in even]
        even_memory = [sum(memory) * gpus // capacity for gpus in even]

    def dxpool(name: str, slots: list[int]) -> Callable[[], Allocator]:
        layout = PoolLayout(boxes, slots, host_cpus=cpus, host_memory_mib=memory)
        return lambda: DxpoolPool(name, layout, pipeline=built, verify_refusals=verify)

    return [
        (
            "dxpool, slots = node GPUs",
            dxpool("dxpool, slots = node GPUs", [s.gpus for s in servers]),
        ),
        ("dxpool, 8 slots/host", dxpool("dxpool, 8 slots/host", [8] * len(servers))),
        ("dxpool, 16 slots/host", dxpool("dxpool, 16 slots/host", [16] * len(servers))),
        (
            "servers, best fit",
            lambda: FixedServers("servers, best fit", [s.gpus for s in servers], cpus, memory),
        ),
        (
            "8-GPU servers, best fit",
            lambda: FixedServers("8-GPU servers, best fit", even, even_cpus, even_memory),
        ),
    ]


def published(traces: Path) -> dict[str, list[float]]:
    """FGD's published mean allocation curves (% of GPU capacity, columns 0-130) on the
    default trace, per policy; empty when the results folder is missing."""
    path = traces / "alibaba-gpu-v2023-fgd-results" / "analysis_allo_discrete.csv"
    if not path.is_file():
        return {}
    curves: dict[str, list[list[float]]] = {}
    with path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row["workload"] == "openb_pod_list_default":
                values = [float(row[str(k)]) for k in PERCENTS]
                curves.setdefault(row["sc_policy"], []).append(values)
    return {
        policy: [statistics.mean(c) for c in zip(*runs, strict=True)]
        for policy, runs in curves.items()
    }


def percent(value: float | None) -> str:
    return "none" if value is None else f"{value:.1f}%"


def summarize(runs: dict[str, list[FillRun]]) -> None:
    rows = []
    for name, done in runs.items():
        at_100 = statistics.mean(run.allocation_at(100) for run in done)
        first = [run.first_refusal() for run in done]
        frag = [run.first_refusal(FRAGMENTED) for run in done]
        by_cause = Counter(c for run in done for at, size, c in run.refusals if at <= 100 and size)
        cpu_only = Counter(
            c for run in done for at, size, c in run.refusals if at <= 100 and not size
        )
        rows.append(
            (
                name,
                f"{at_100:.2f}%",
                f"{100 - at_100:.2f}%",
                _spread(first),
                _spread(frag),
                " / ".join(f"{by_cause[c] / len(done):.1f}" for c in Cause),
                f"{sum(cpu_only.values()) / len(done):.1f} of "
                f"{statistics.mean(run.cpu_pods for run in done):.0f}",
                f"{statistics.mean(run.allocation_at(130) for run in done):.2f}%",
                f"{statistics.mean(run.used_at(100) for run in done):.2f}%",
            )
        )
    print(
        table(
            (
                "cluster",
                "allocated at 100%",
                "unallocated at 100%",
                "first refusal (arrived)",
                "first fragmentation refusal",
                "GPU pods refused to 100%: " + " / ".join(CAUSE_HEADS[c] for c in Cause),
                "CPU-only pods refused to 100% (of all)",
                "allocated at 130%",
                "FGD's ratio at 100% (placed fractions)",
            ),
            rows,
        )
    )
    print()
    labels = ("1", "2", "4", "8")
    size_rows = []
    for name, done in runs.items():
        cells = []
        for label in labels:
            refused = [
                (size, c)
                for run in done
                for _, size, c in run.refusals
                if size and size_class(size) == label
            ]
            stranded = sum(1 for _, c in refused if c in FRAGMENTED)
            cells.append(f"{len(refused) / len(done):.1f} ({stranded / len(done):.1f})")
        size_rows.append((name, *cells))
    print("Refusals to 130% by pod size, mean per run (of them fragmentation):")
    print(table(("cluster", *(f"{label} GPU" for label in labels)), size_rows))


CAUSE_HEADS = {
    Cause.CAPACITY: "GPU",
    Cause.HOST_SLOTS: "slots",
    Cause.CPU: "CPU",
    Cause.MEMORY: "memory",
    Cause.FRAGMENTATION: "frag GPU",
    Cause.FRAGMENTATION_CPU: "frag CPU",
    Cause.FRAGMENTATION_MEMORY: "frag memory",
}


def _spread(values: Sequence[float | None]) -> str:
    """Mean and range of first-refusal points; runs without one count as 'none'."""
    found = [v for v in values if v is not None]
    if not found:
        return "none"
    text = f"{statistics.mean(found):.1f}% ({min(found):.1f}-{max(found):.1f})"
    if len(found) < len(values):
        text += f", none in {len(values) - len(found)} runs"
    return text


def plot(runs: dict[str, list[FillRun]], fgd: dict[str, list[float]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(8, 5))
    for name, done in runs.items():
        curve = [statistics.mean(run.allocation_at(k) for run in done) for k in PERCENTS]
        axis.plot(list(PERCENTS), curve, label=f"{name} (whole GPUs)")
    first, done = next(iter(runs.items()))
    used = [statistics.mean(run.used_at(k) for run in done) for k in PERCENTS]
    axis.plot(list(PERCENTS), used, linestyle="--", label=f"{first}: FGD's ratio (fractions)")
    for policy in ("05-BestFit", "06-FGD"):
        if policy in fgd:
            axis.plot(
                list(PERCENTS),
                fgd[policy],
                linestyle=":",
                label=f"FGD paper {policy} (GPU sharing)",
            )
    axis.plot([0, 130], [0, 130], color="grey", linewidth=0.5)
    axis.set_xlim(50, 130)
    axis.set_ylim(50, 101)
    axis.set_xlabel("arrived GPU demand (FGD's: fractions summed), % of capacity")
    axis.set_ylabel("GPUs allocated, % of capacity")
    axis.set_title("openb static fill (means over seeds)")
    axis.legend(fontsize=8)
    save(figure, path)


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", help="folder of the trace folders")
    parser.add_argument("--seeds", type=parse_seeds, default=list(range(42, 52)))
    parser.add_argument("--quick", action="store_true", help="seed 42 on a tenth of the servers")
    parser.add_argument("--pipeline", default="default", choices=pipelines.NAMES)
    parser.add_argument(
        "--verify-refusals", action="store_true", help="ask placement on every refusal too"
    )
    parser.add_argument(
        "--variant-seeds",
        type=positive_int,
        default=3,
        help="how many of the seeds the 8- and 16-slot pools run (they cost the most)",
    )
    parser.add_argument(
        "--gpus-only",
        action="store_true",
        help="leave CPU, memory and CPU-only pods out (the earlier protocol)",
    )
    parser.add_argument(
        "--clusters",
        type=cluster_keys,
        default=list(CLUSTER_KEYS.values()),
        help=f"comma list of the clusters to run: {', '.join(CLUSTER_KEYS)} (all)",
    )
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    args = parser.parse_args(argv)
    resources = not args.gpus_only
    try:
        traces = traces_dir(args.traces)
        servers = openb_servers(traces)
        pods = openb_pods(traces, cpu_only=resources)
    except TraceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    seeds = args.seeds
    if args.quick:
        servers, seeds = servers[::10], seeds[:1]
    capacity = sum(server.gpus for server in servers)
    gpu_pods = sum(1 for pod in pods if pod.gpus)
    print(
        f"openb static fill: {len(servers)} servers, {capacity} GPUs, {gpu_pods} GPU pods "
        f"(whole GPUs) and {len(pods) - gpu_pods} CPU-only pods, "
        + ("CPU and memory fit" if resources else "GPUs only")
        + f", seeds {seeds[0]}-{seeds[-1]} (8/16 slots/host: the first "
        f"{args.variant_seeds}), pipeline {args.pipeline}"
    )
    runs: dict[str, list[FillRun]] = {}
    timing: dict[str, list[float]] = {}
    for name, make in clusters(
        servers, [p.gpus for p in pods], args.pipeline, args.verify_refusals, resources
    ):
        if name not in args.clusters:
            continue
        began = time.monotonic()
        for seed in seeds[: args.variant_seeds] if name in VARIANTS else seeds:
            allocator = make()
            runs.setdefault(name, []).append(
                fill(allocator, sample_requests(pods, capacity, seed), seed, resources)
            )
            if isinstance(allocator, DxpoolPool):
                timing.setdefault(name, []).extend(allocator.times.samples)
        print(f"  {name}: {time.monotonic() - began:.1f} s", file=sys.stderr)
    print()
    summarize(runs)
    for name, samples in timing.items():
        times = DecisionTimes(samples)
        p50, p99 = times.percentile(0.5), times.percentile(0.99)
        print(f"{name}: {len(samples)} placements, p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
    fgd = published(traces)
    for policy in ("05-BestFit", "06-FGD"):
        if policy in fgd:
            print(
                f"FGD paper, {policy} (GPU sharing, fractions summed): allocated at 100% "
                f"{fgd[policy][100]:.2f}%, at 130% {fgd[policy][130]:.2f}%"
            )
    plot(runs, fgd, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
