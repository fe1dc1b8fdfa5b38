"""How long one placement takes on pools of a given size.

Builds a snapshot of BOXES boxes of 8 GPUs and HOSTS hosts spread over racks, pods and
sites (about a third of the GPUs busy, some host slots in use), then times place() with
the default pipeline and the tree latency model, and prints the median and 90th
percentile over the runs, for three pools:

- 16 boxes x 4 hosts, a 1-GPU request (a small pool: the fixed cost of a placement);
- 64 boxes x 64 hosts and 1,000 boxes x 1,000 hosts, a 4-GPU request.

Each pool is timed two ways:

``one snapshot``
    place() again and again on the same snapshot, as a plan followed by a compose, or a
    compose retried on an unchanged inventory, sees it.
``compose stream``
    every call on a new snapshot, as the broker's placement index hands them out while
    nodes come and go: each placement is applied (its GPUs taken, its host slots used)
    and, once KEEP_LIVE nodes are live, the oldest is released. Only the records that
    changed are new objects, as in the index. This is what ComposeNode pays. It is
    timed again for requests with a latency bound (``max_latency_ns``).

It also times the latency model alone for one (host, box) pair, warm: what placement pays
per pair when it must ask pair by pair (a request with a latency bound, or a model that
cannot rank boxes in bulk). With the tree model and no bound, placement ranks boxes per
rack instead and asks for no pair at all.

With ``--affinity switch`` every request asks for its GPUs under one top-of-rack switch
(``PlacementRequest.same_switch``; the pools hold about 1, 1 and 16 boxes per rack), to
compare with a run without it.

The latency model is warmed before timing, as in a long-running broker. Nothing is
asserted: these machines are shared and noisy, so compare runs taken on one machine.

Usage: python bench/placement_bench.py [--runs 200] [--large-runs 5] [--skip-large]
       [--affinity switch]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable

from dxpool.broker.placement import (
    BoxInfo,
    GpuInfo,
    HostInfo,
    Placement,
    PlacementRequest,
    Snapshot,
    place,
)
from dxpool.fabric.latency import LatencyModel, Place, TopologyLatencyModel
from dxpool.fabric.topology import Topology

GPUS_PER_BOX = 8
RACKS_PER_POD = 8
PODS_PER_SITE = 4
SEED = 7
KEEP_LIVE = 8  # nodes live at once in the compose stream
BOUND_NS = 10_000  # max_latency of the bounded compose stream: within a site
PAIR_HOSTS = 32  # the latency model alone is timed on this many hosts
PAIR_BOXES = 64  # by this many boxes


def location(index: int) -> tuple[str, str, str]:
    """(site, pod, rack) of the index-th endpoint, filling racks in turn."""
    rack = index % (RACKS_PER_POD * PODS_PER_SITE * 2)
    pod, rack_in_pod = divmod(rack, RACKS_PER_POD)
    site, pod_in_site = divmod(pod, PODS_PER_SITE)
    return f"dc{site}", f"p{pod_in_site}", f"r{rack_in_pod}"


def build_snapshot(boxes: int, hosts: int, rng: random.Random) -> Snapshot:
    box_infos: dict[str, BoxInfo] = {}
    gpus: dict[str, tuple[GpuInfo, ...]] = {}
    for index in range(boxes):
        box = f"b{index:05d}"
        box_infos[box] = BoxInfo(box, Place(f"boxes/{box}", *location(index)), True)
        gpus[box] = tuple(
            GpuInfo(
                name=f"boxes/{box}/gpus/{slot}",
                box=box,
                slot=slot,
                model="H100",
                memory_mib=81920,
                free=rng.random() > 0.35,
                healthy=True,
            )
            for slot in range(GPUS_PER_BOX)
        )
    host_infos: dict[str, HostInfo] = {}
    for index in range(hosts):
        host = f"h{index:05d}"
        used = frozenset(slot for slot in range(8) if rng.random() < 0.25)
        place_ = Place(f"hosts/{host}", *location(index * 7))
        host_infos[host] = HostInfo(host, place_, 8, used, True)
    return Snapshot(box_infos, host_infos, gpus)


class ComposeStream:
    """Snapshots of a pool whose nodes come and go, made the way the placement index
    makes them: a new snapshot per call, sharing every record that did not change."""

    def __init__(self, snapshot: Snapshot, keep_live: int = KEEP_LIVE) -> None:
        self._boxes = dict(snapshot.boxes)
        self._hosts = dict(snapshot.hosts)
        self._gpus = {box: tuple(gpus) for box, gpus in snapshot.gpus_by_box.items()}
        self._live: deque[Placement] = deque()
        self._keep_live = keep_live

    def snapshot(self) -> Snapshot:
        return Snapshot(dict(self._boxes), dict(self._hosts), dict(self._gpus))

    def apply(self, placement: Placement) -> None:
        """Takes the placement's GPUs and host slots; releases the oldest node if needed."""
        self._change(placement, taken=True)
        self._live.append(placement)
        if len(self._live) > self._keep_live:
            self._change(self._live.popleft(), taken=False)

    def _change(self, placement: Placement, *, taken: bool) -> None:
        slots_by_box: dict[str, set[int]] = {}
        for binding in placement.bindings:
            slots_by_box.setdefault(binding.box, set()).add(binding.slot)
        for box, slots in slots_by_box.items():
            self._gpus[box] = tuple(
                dataclasses.replace(gpu, free=not taken) if gpu.slot in slots else gpu
                for gpu in self._gpus[box]
            )
        host = self._hosts[placement.host]
        host_slots = {binding.host_slot for binding in placement.bindings}
        used = host.used_slots | host_slots if taken else host.used_slots - host_slots
        self._hosts[placement.host] = dataclasses.replace(host, used_slots=frozenset(used))


def timed(call: Callable[[], object], runs: int) -> list[float]:
    """Seconds per call, ``runs`` times."""
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def timed_stream(
    stream: ComposeStream, request: PlacementRequest, latency: LatencyModel, runs: int
) -> list[float]:
    """Seconds per place() on the stream's next snapshot; the snapshot is made untimed."""
    samples = []
    for _ in range(runs):
        snapshot = stream.snapshot()
        start = time.perf_counter()
        result = place(request, snapshot, latency)
        samples.append(time.perf_counter() - start)
        assert result.placement is not None, result.unsatisfied
        stream.apply(result.placement)
    return samples


def pairs_of(snapshot: Snapshot) -> list[tuple[Place, Place]]:
    """(host, box) places of up to PAIR_HOSTS hosts by PAIR_BOXES boxes."""
    hosts = [host.place for host in list(snapshot.hosts.values())[:PAIR_HOSTS]]
    boxes = [box.place for box in list(snapshot.boxes.values())[:PAIR_BOXES]]
    return [(host, box) for host in hosts for box in boxes]


def ask_pairs(pairs: list[tuple[Place, Place]], latency: LatencyModel) -> None:
    round_trip = latency.round_trip
    for host, box in pairs:
        round_trip(host, box)


def summary(samples: Iterable[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return f"median {statistics.median(ordered) * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms"


def bench(boxes: int, hosts: int, count: int, runs: int, same_switch: bool = False) -> None:
    snapshot = build_snapshot(boxes, hosts, random.Random(SEED))
    latency = TopologyLatencyModel(Topology.default())
    request = PlacementRequest("H100", count, same_switch=same_switch)
    result = place(request, snapshot, latency)  # warms the latency model
    assert result.placement is not None, result.unsatisfied
    same = timed(lambda: place(request, snapshot, latency), runs)
    stream = ComposeStream(snapshot)
    timed_stream(stream, request, latency, 2)  # the stream's own first calls are cold
    composed = timed_stream(stream, request, latency, runs)
    bounded_request = dataclasses.replace(request, max_latency_ns=BOUND_NS)
    bounded_stream = ComposeStream(snapshot)
    timed_stream(bounded_stream, bounded_request, latency, 2)
    bounded = timed_stream(bounded_stream, bounded_request, latency, runs)
    pairs = pairs_of(snapshot)
    ask_pairs(pairs, latency)  # warm
    per_pair = statistics.median(timed(lambda: ask_pairs(pairs, latency), 10)) / len(pairs)
    affinity = ", affinity switch" if same_switch else ""
    print(
        f"{boxes} boxes x {GPUS_PER_BOX} GPUs x {hosts} hosts, {count}-GPU request{affinity} "
        f"({runs} runs):"
    )
    print(f"  {'place() on one snapshot':34} {summary(same)}")
    print(f"  {'compose stream':34} {summary(composed)}")
    print(f"  {f'compose stream, max_latency {BOUND_NS // 1000}us':34} {summary(bounded)}")
    print(f"  {'latency model alone, one pair':34} {per_pair * 1e9:.0f} ns (warm)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs for the small pools")
    parser.add_argument("--large-runs", type=int, default=5, help="runs for the 1,000-box pool")
    parser.add_argument("--skip-large", action="store_true", help="skip the 1,000-box pool")
    parser.add_argument(
        "--affinity", choices=("switch",), default=None, help="ask for switch affinity"
    )
    args = parser.parse_args()
    switch = args.affinity == "switch"
    bench(16, 4, 1, args.runs, switch)
    bench(64, 64, 4, args.runs, switch)
    if not args.skip_large:
        bench(1000, 1000, 4, args.large_runs, switch)


if __name__ == "__main__":
    main()
