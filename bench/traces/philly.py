"""Dynamic replay of the Philly job list (``philly-pollux``) against pools of a given size.

Jobs arrive at their timestamps and hold their GPUs for their duration; there is no
queue: a job that cannot be placed when it arrives is refused. A job of more than 8
GPUs is a gang of nodes of at most 8 (16 -> 8 + 8, 12 -> 8 + 4), all or nothing: the
harness places each member and releases the ones placed when one fails. Departures at
or before an arrival's time are applied first. Each cluster size (GPUs) is run as:

* dxpool: GPUs in boxes of 8, one host per 8 GPUs with 8 and with 16 proxy slots,
  placement by the broker's own cache, placement index and pipeline;
* fixed 8-GPU servers with best fit;
* one pool refused only for capacity (:mod:`bench.traces.onepool`): a job is refused
  exactly when fewer GPUs are free than it asks, what every allocator that places each
  job that fits does. Where a pool's row equals it, no refusal was placement's, and
  refusing fewer jobs of one class would take refusing jobs of another that fit
  (admission), not a placement rule; :mod:`bench.traces.admission` tries that with a
  reserve for small jobs.

Prints, per size and cluster: refused jobs and refused GPU-hours by size class (1, 2,
4, 8, 16+: 2-3 count as 2, 4-7 as 4, 9 and up as 16+), how many refusals were
fragmentation (enough free GPUs in all, no server or host could take a node), the
time-averaged allocation, and allocator operations (placements and releases) per second
of time spent in the allocator; writes a plot of refused GPU-hours by size class.

Usage: python -m bench.traces.philly [--quick] [--sizes 512,768,1024] [--slots 8,16]
       [--racks 1] [--pipeline default|slot-frag|...] [--verify-refusals] [--traces DIR]
       [--plot PATH]
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.traces import pipelines
from bench.traces.allocator import Allocator, Cause, Grant, allocate_gang, gang_members
from bench.traces.data import Job, TraceError, philly_jobs, traces_dir
from bench.traces.onepool import OnePool
from bench.traces.pool import DxpoolPool, PoolLayout
from bench.traces.report import (
    SIZE_CLASSES,
    positive_int,
    positive_ints,
    pyplot,
    save,
    size_class,
    table,
)
from bench.traces.servers import FixedServers

DEFAULT_PLOT = Path(__file__).parent / "plots" / "philly.png"
ONE_POOL = "bound: one pool, refused only for capacity"
FIXED_SERVERS = "8-GPU servers, best fit"
QUICK_JOBS = 4000
LABELS = tuple(label for _, _, label in SIZE_CLASSES)


@dataclass
class Replay:
    """What one cluster did with the job list."""

    cluster: str
    capacity: int
    jobs: Counter[str] = field(default_factory=Counter)  # by size class
    gpu_hours: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    refused: Counter[str] = field(default_factory=Counter)
    refused_gpu_hours: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    causes: Counter[Cause] = field(default_factory=Counter)
    gpu_seconds_held: float = 0.0
    span_s: float = 0.0
    operations: int = 0
    allocator_s: float = 0.0

    @property
    def mean_allocation(self) -> float:
        """Time-averaged share of the GPUs held, first arrival to last departure."""
        return self.gpu_seconds_held / (self.capacity * self.span_s) if self.span_s else 0.0

    def refused_share(self, label: str | None = None) -> float:
        """Refused GPU-hours as a share of the submitted ones (of one size class)."""
        if label is None:
            total = sum(self.gpu_hours.values())
            return sum(self.refused_gpu_hours.values()) / total if total else 0.0
        return (
            self.refused_gpu_hours[label] / self.gpu_hours[label] if self.gpu_hours[label] else 0.0
        )


def replay(allocator: Allocator, jobs: Sequence[Job]) -> Replay:
    result = Replay(allocator.name, allocator.capacity)
    departures: list[tuple[float, int, list[Grant]]] = []
    now = jobs[0].arrival_s if jobs else 0.0
    held = 0

    def advance(to: float) -> None:
        nonlocal now
        result.gpu_seconds_held += held * (to - now)
        now = to

    for number, job in enumerate(jobs):
        while departures and departures[0][0] <= job.arrival_s:
            end, _, grants = heapq.heappop(departures)
            advance(end)
            began = time.perf_counter()
            for grant in grants:
                allocator.release(grant)
            result.allocator_s += time.perf_counter() - began
            result.operations += len(grants)
            held -= sum(grant.gpus for grant in grants)
        advance(job.arrival_s)
        label = size_class(job.gpus)
        hours = job.gpus * job.duration_s / 3600
        result.jobs[label] += 1
        result.gpu_hours[label] += hours
        members = gang_members(job.gpus)
        began = time.perf_counter()
        outcome = allocate_gang(allocator, members)
        result.allocator_s += time.perf_counter() - began
        if isinstance(outcome, Cause):
            result.refused[label] += 1
            result.refused_gpu_hours[label] += hours
            result.causes[outcome] += 1
            result.operations += 1
            continue
        result.operations += len(outcome)
        held += job.gpus
        heapq.heappush(departures, (job.arrival_s + job.duration_s, number, outcome))
    while departures:
        end, _, grants = heapq.heappop(departures)
        advance(end)
        held -= sum(grant.gpus for grant in grants)
    result.span_s = now - (jobs[0].arrival_s if jobs else 0.0)
    return result


def clusters(
    size: int,
    jobs: Sequence[Job],
    pipeline: str,
    verify: bool,
    slots: Sequence[int] = (8, 16),
    racks: int = 1,
) -> list[tuple[str, Callable[[], Allocator]]]:
    """(name, factory) of each cluster of ``size`` GPUs compared."""
    if size <= 0 or size % 8:
        raise ValueError(f"cluster sizes are positive multiples of 8 GPUs, got {size}")
    mix = Counter(member for job in jobs for member in gang_members(job.gpus))
    built = pipelines.build(pipeline, mix)
    boxes = [("GPU", 8)] * (size // 8)

    def dxpool(per_host: int) -> tuple[str, Callable[[], Allocator]]:
        name = f"dxpool, {per_host} slots/host" + (f", {racks} racks" if racks > 1 else "")
        layout = PoolLayout(boxes, [per_host] * (size // 8), racks)
        return name, lambda: DxpoolPool(name, layout, pipeline=built, verify_refusals=verify)

    pools = [dxpool(count) for count in slots]
    return [
        *pools,
        (FIXED_SERVERS, lambda: FixedServers(FIXED_SERVERS, [8] * (size // 8))),
        (ONE_POOL, lambda: OnePool(ONE_POOL, size)),
    ]


def summarize(size: int, replays: Sequence[Replay]) -> None:
    print(f"\n{size} GPUs: refused jobs / refused GPU-hours (% of submitted) by size class")
    rows = []
    for done in replays:
        cells = [
            f"{done.refused[label]} / {100 * done.refused_share(label):.2f}%" for label in LABELS
        ]
        rows.append(
            (
                done.cluster,
                *cells,
                f"{100 * done.refused_share():.2f}%",
                done.causes[Cause.FRAGMENTATION],
                done.causes[Cause.HOST_SLOTS],
                f"{100 * done.mean_allocation:.1f}%",
                f"{done.operations / done.allocator_s:,.0f}" if done.allocator_s else "-",
            )
        )
    submitted = replays[0]
    rows.append(
        (
            "(submitted: jobs / GPU-hours)",
            *(f"{submitted.jobs[label]} / {submitted.gpu_hours[label]:,.0f}" for label in LABELS),
            f"{sum(submitted.gpu_hours.values()):,.0f}",
            "",
            "",
            "",
            "",
        )
    )
    header = (
        "cluster",
        *(f"{label} GPU" for label in LABELS),
        "all GPU-hours",
        "fragmentation refusals",
        "host-slot refusals",
        "mean allocation",
        "allocator ops/s",
    )
    print(table(header, rows))


def plot(results: dict[int, list[Replay]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    figure, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for axis, (size, replays) in zip(axes[0], sorted(results.items()), strict=True):
        width = 0.8 / len(replays)
        for offset, done in enumerate(replays):
            xs = [i + offset * width for i in range(len(LABELS))]
            axis.bar(
                xs, [100 * done.refused_share(label) for label in LABELS], width, label=done.cluster
            )
        axis.set_xticks(
            [i + 0.4 - width / 2 for i in range(len(LABELS))], [f"{label} GPU" for label in LABELS]
        )
        axis.set_title(f"{size} GPUs")
        axis.set_ylabel("refused GPU-hours, % of submitted")
        axis.legend(fontsize=7)
    figure.suptitle("Philly replay: refused GPU-hours by job size")
    save(figure, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", help="folder of the trace folders")
    parser.add_argument("--sizes", type=positive_ints, default=[512, 768, 1024])
    parser.add_argument(
        "--quick", action="store_true", help=f"the first {QUICK_JOBS} jobs, 768 GPUs"
    )
    parser.add_argument("--pipeline", default="default", choices=pipelines.NAMES)
    parser.add_argument(
        "--verify-refusals", action="store_true", help="ask placement on every refusal too"
    )
    parser.add_argument(
        "--slots", type=positive_ints, default=[8, 16], help="proxy slots per host, a comma list"
    )
    parser.add_argument(
        "--racks", type=positive_int, default=1, help="racks the boxes and hosts are dealt over"
    )
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    args = parser.parse_args(argv)
    for size in args.sizes:
        if size % 8:
            parser.error(f"--sizes: cluster sizes are positive multiples of 8 GPUs, got {size}")
    try:
        jobs = philly_jobs(traces_dir(args.traces))
        sizes_clusters = [
            (
                size,
                clusters(size, jobs, args.pipeline, args.verify_refusals, args.slots, args.racks),
            )
            for size in args.sizes
        ]
    except (TraceError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.quick:
        jobs = jobs[:QUICK_JOBS]
        sizes_clusters = [
            (768, clusters(768, jobs, args.pipeline, args.verify_refusals, args.slots, args.racks))
        ]
    print(f"Philly replay: {len(jobs)} jobs, pipeline {args.pipeline}")
    results: dict[int, list[Replay]] = {}
    for size, made in sizes_clusters:
        for name, make in made:
            began = time.monotonic()
            results.setdefault(size, []).append(replay(make(), jobs))
            print(f"  {size} GPUs, {name}: {time.monotonic() - began:.1f} s", file=sys.stderr)
        summarize(size, results[size])
    plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
