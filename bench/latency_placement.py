"""What latency-aware placement buys: predicted slowdown of composed nodes, score on vs off.

A multi-pod pool (2 sites x 4 pods x 4 racks; boxes of 8 GPUs, hosts of 8 proxy slots)
laid out as disaggregated pools often are: in each pod two racks of hosts, one rack of GPU
boxes and one mixed rack, with even pods holding twice the boxes of odd ones (so hosts
of a box-poor pod must sometimes reach into another pod). It takes one seeded stream of
requests, the same for every configuration:

- sizes 1, 2, 4 and 8 GPUs (40 / 20 / 25 / 15 %), each request with a workload drawn
  from the named profiles of :mod:`dxpool.fabric.overhead` (training 30 %,
  inference-online 30 %, inference-batch 25 %, compute-bound 15 %);
- each node lives for an exponentially distributed number of later arrivals, sized so
  the pool settles near ``--load`` of its GPUs allocated (0.9 by default).

Every request is placed with the default pipeline and the tree latency model on a
snapshot of the pool as the stream left it, and its placement applied (GPUs taken, host
slots used) until the node leaves. Configurations:

``latency score off``
    the default pipeline without its latency score (proposals are still nearest-first
    per host; which host wins ignores latency);
``latency score on``
    the default pipeline;
``on + max_slowdown``
    the default pipeline, and every request bounds its workload's slowdown
    (``--max-slowdown``, 1.10): the slowdown filter drops boxes too far away.

For each node composed after the warm-up (the first ``--warmup`` arrivals), the predicted
slowdown is its workload's slowdown at the round trip of its farthest GPU (a step waits
for its slowest GPU). The table gives mean and p99 of those, how many requests found no
placement, and the mean allocation ratio over the measured arrivals, so the comparison
is made at equal allocation. Slowdowns are predictions of an illustrative overhead model
(see :mod:`dxpool.fabric.overhead`), not measurements.

Writes a CDF of per-node slowdown to ``--png`` (needs the ``bench`` extra:
``pip install -e '.[bench]'``).

Usage: python bench/latency_placement.py [--requests 3000] [--warmup 1000] [--png FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dxpool.broker.placement import (
    BoxInfo,
    GpuInfo,
    HostInfo,
    Placement,
    PlacementRequest,
    Snapshot,
    place,
)
from dxpool.broker.placement.pipeline import Pipeline
from dxpool.broker.placement.registry import default_pipeline
from dxpool.fabric.latency import LatencyModel, Place, TopologyLatencyModel
from dxpool.fabric.overhead import PROFILES
from dxpool.fabric.topology import Topology

SITES = 2
PODS_PER_SITE = 4
RACKS_PER_POD = 4
GPUS_PER_BOX = 8
HOST_SLOTS = 8
SEED = 11
SIZES = ((1, 0.40), (2, 0.20), (4, 0.25), (8, 0.15))
WORKLOADS = (
    ("training", 0.30),
    ("inference-online", 0.30),
    ("inference-batch", 0.25),
    ("compute-bound", 0.15),
)


def rack_of(index: int) -> tuple[str, str, str]:
    """(site, pod, rack) of the index-th rack."""
    pod, rack = divmod(index, RACKS_PER_POD)
    site, pod_in_site = divmod(pod, PODS_PER_SITE)
    return f"dc{site}", f"p{pod_in_site}", f"r{rack}"


def build_pool(boxes_per_rack: int, hosts_per_rack: int) -> Snapshot:
    """Racks take roles in each pod: r0 and r1 hold hosts only, r2 GPU boxes only, r3
    half as many of each. Even pods hold twice the boxes of odd pods, so at high load
    some nodes must reach into another pod."""
    racks = SITES * PODS_PER_SITE * RACKS_PER_POD
    boxes: dict[str, BoxInfo] = {}
    gpus: dict[str, tuple[GpuInfo, ...]] = {}
    hosts: dict[str, HostInfo] = {}
    for rack in range(racks):
        where = rack_of(rack)
        pod, role = divmod(rack, RACKS_PER_POD)
        box_count = {2: boxes_per_rack, 3: boxes_per_rack // 2}.get(role, 0)
        if pod % 2:
            box_count //= 2
        host_count = {0: hosts_per_rack, 1: hosts_per_rack, 3: hosts_per_rack // 2}.get(role, 0)
        for k in range(box_count):
            box = f"b{rack:03d}-{k}"
            boxes[box] = BoxInfo(box, Place(f"boxes/{box}", *where), True)
            gpus[box] = tuple(
                GpuInfo(f"boxes/{box}/gpus/{slot}", box, slot, "H100", 81920, True, True)
                for slot in range(GPUS_PER_BOX)
            )
        for k in range(host_count):
            host = f"h{rack:03d}-{k}"
            hosts[host] = HostInfo(
                host, Place(f"hosts/{host}", *where), HOST_SLOTS, frozenset(), True
            )
    return Snapshot(boxes, hosts, gpus)


@dataclass(frozen=True)
class Arrival:
    count: int
    workload: str
    lifetime: int  # arrivals it outlives


def request_stream(n: int, mean_lifetime: float, rng: random.Random) -> list[Arrival]:
    sizes, size_weights = zip(*SIZES, strict=True)
    names, name_weights = zip(*WORKLOADS, strict=True)
    return [
        Arrival(
            rng.choices(sizes, size_weights)[0],
            rng.choices(names, name_weights)[0],
            max(1, round(rng.expovariate(1 / mean_lifetime))),
        )
        for _ in range(n)
    ]


@dataclass
class Pool:
    """The pool as the stream leaves it; a new snapshot per arrival shares unchanged
    records, as the broker's placement index does."""

    boxes: dict[str, BoxInfo]
    hosts: dict[str, HostInfo]
    gpus: dict[str, tuple[GpuInfo, ...]]
    allocated: int = 0
    departures: list[tuple[int, int, Placement]] = field(default_factory=list)

    @classmethod
    def of(cls, snapshot: Snapshot) -> Pool:
        return cls(dict(snapshot.boxes), dict(snapshot.hosts), dict(snapshot.gpus_by_box))

    def snapshot(self) -> Snapshot:
        return Snapshot(dict(self.boxes), dict(self.hosts), dict(self.gpus))

    def release_until(self, now: int) -> None:
        while self.departures and self.departures[0][0] <= now:
            _, _, placement = heapq.heappop(self.departures)
            self._change(placement, taken=False)

    def take(self, placement: Placement, leaves_at: int, serial: int) -> None:
        self._change(placement, taken=True)
        heapq.heappush(self.departures, (leaves_at, serial, placement))

    def _change(self, placement: Placement, *, taken: bool) -> None:
        slots_by_box: dict[str, set[int]] = {}
        for binding in placement.bindings:
            slots_by_box.setdefault(binding.box, set()).add(binding.slot)
        for box, slots in slots_by_box.items():
            self.gpus[box] = tuple(
                dataclasses.replace(gpu, free=not taken) if gpu.slot in slots else gpu
                for gpu in self.gpus[box]
            )
        host = self.hosts[placement.host]
        host_slots = {binding.host_slot for binding in placement.bindings}
        used = host.used_slots | host_slots if taken else host.used_slots - host_slots
        self.hosts[placement.host] = dataclasses.replace(host, used_slots=frozenset(used))
        self.allocated += len(placement.bindings) if taken else -len(placement.bindings)


@dataclass
class Outcome:
    name: str
    slowdowns: list[float] = field(default_factory=list)
    by_workload: dict[str, list[float]] = field(default_factory=dict)
    refused: int = 0
    allocation: list[float] = field(default_factory=list)
    seconds: float = 0.0


def run(
    name: str,
    pipeline: Pipeline,
    pool_snapshot: Snapshot,
    stream: list[Arrival],
    warmup: int,
    max_slowdown: float,
    latency: LatencyModel,
) -> Outcome:
    pool = Pool.of(pool_snapshot)
    total_gpus = sum(len(gpus) for gpus in pool.gpus.values())
    outcome = Outcome(name)
    started = time.perf_counter()
    for now, arrival in enumerate(stream):
        pool.release_until(now)
        request = PlacementRequest(
            "H100",
            arrival.count,
            max_slowdown=max_slowdown,
            workload=arrival.workload if max_slowdown else "",
        )
        result = place(request, pool.snapshot(), latency, pipeline)
        measured = now >= warmup
        if measured:
            outcome.allocation.append(pool.allocated / total_gpus)
        if result.placement is None:
            outcome.refused += measured
            continue
        pool.take(result.placement, now + arrival.lifetime, now)
        if measured:
            farthest = max(binding.latency_ns for binding in result.placement.bindings)
            slowdown = PROFILES[arrival.workload].slowdown(farthest)
            outcome.slowdowns.append(slowdown)
            outcome.by_workload.setdefault(arrival.workload, []).append(slowdown)
    outcome.seconds = time.perf_counter() - started
    return outcome


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def print_table(outcomes: list[Outcome]) -> None:
    header = (
        f"{'configuration':<22} {'nodes':>6} {'refused':>8} {'alloc':>6} "
        f"{'mean slowdown':>14} {'p99 slowdown':>13} {'online p99':>11} {'s/run':>7}"
    )
    print(header)
    print("-" * len(header))
    for o in outcomes:
        online = o.by_workload.get("inference-online", [])
        print(
            f"{o.name:<22} {len(o.slowdowns):>6} {o.refused:>8} "
            f"{statistics.fmean(o.allocation):>6.3f} "
            f"{statistics.fmean(o.slowdowns):>14.4f} {p99(o.slowdowns):>13.4f} "
            f"{p99(online):>11.4f} {o.seconds:>7.1f}"
        )


def write_png(outcomes: list[Outcome], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"matplotlib is not installed, so {path} was not written: pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for outcome in outcomes:
        ordered = sorted(outcome.slowdowns)
        n = len(ordered)
        axis.step(
            [value - 1 for value in ordered],
            [(i + 1) / n for i in range(n)],
            where="post",
            label=outcome.name,
        )
    axis.set_xscale("log")
    axis.set_xlabel("predicted slowdown - 1 (log)")
    axis.set_ylabel("fraction of composed nodes")
    axis.set_title("Predicted slowdown of composed nodes (illustrative overhead model)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--boxes-per-rack", type=int, default=8)
    parser.add_argument("--hosts-per-rack", type=int, default=6)
    parser.add_argument("--load", type=float, default=0.9, help="target allocation ratio")
    parser.add_argument("--max-slowdown", type=float, default=1.10)
    parser.add_argument("--png", type=Path, default=Path("bench/latency_placement.png"))
    args = parser.parse_args()

    snapshot = build_pool(args.boxes_per_rack, args.hosts_per_rack)
    total = sum(len(gpus) for gpus in snapshot.gpus_by_box.values())
    mean_size = sum(size * weight for size, weight in SIZES)
    mean_lifetime = args.load * total / mean_size  # Little's law: live GPUs = rate x life
    stream = request_stream(args.requests, mean_lifetime, random.Random(SEED))
    latency = TopologyLatencyModel(Topology.default())
    on = default_pipeline()
    off = dataclasses.replace(on, scores=tuple(s for s in on.scores if s.plugin.name != "latency"))
    racks = SITES * PODS_PER_SITE * RACKS_PER_POD
    print(
        f"pool: {SITES} sites x {PODS_PER_SITE} pods x {RACKS_PER_POD} racks = {racks} racks; "
        f"{len(snapshot.boxes)} boxes ({total} GPUs), {len(snapshot.hosts)} hosts x "
        f"{HOST_SLOTS} slots; {args.requests} requests, first {args.warmup} not measured; "
        f"target load {args.load}"
    )
    outcomes = [
        run("latency score off", off, snapshot, stream, args.warmup, 0.0, latency),
        run("latency score on", on, snapshot, stream, args.warmup, 0.0, latency),
        run(
            f"on + max_slowdown {args.max_slowdown:g}",
            on,
            snapshot,
            stream,
            args.warmup,
            args.max_slowdown,
            latency,
        ),
    ]
    print_table(outcomes)
    write_png(outcomes, args.png)


if __name__ == "__main__":
    main()
