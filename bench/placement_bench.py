"""How long one placement takes on pools of a given size.

Builds a snapshot of BOXES boxes of 8 GPUs and HOSTS hosts spread over racks, pods and
sites (about a third of the GPUs busy, some host slots in use), then times place() for a
4-GPU request with the default pipeline and the tree latency model, and prints the median
and 90th percentile over the runs. It also times the latency model alone over every
(host, box) pair, the part of placement that belongs to the fabric model.

The latency model's cache is sized to hold every pair and is warmed before timing, as in
a long-running broker. Nothing is asserted: these machines are shared and noisy, so
compare runs taken on one machine.

Usage: python bench/placement_bench.py [--runs 50] [--large-runs 3] [--skip-large]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from dxpool.broker.placement import (
    BoxInfo,
    GpuInfo,
    HostInfo,
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


def timed(call: Callable[[], object], runs: int) -> list[float]:
    """Seconds per call, ``runs`` times."""
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def all_pairs(snapshot: Snapshot, latency: LatencyModel) -> None:
    round_trip = latency.round_trip
    boxes = [box.place for box in snapshot.boxes.values()]
    for host in snapshot.hosts.values():
        for box in boxes:
            round_trip(host.place, box)


def bench(boxes: int, hosts: int, runs: int) -> None:
    snapshot = build_snapshot(boxes, hosts, random.Random(SEED))
    latency = TopologyLatencyModel(Topology.default(), cache_size=2 * boxes * hosts)
    request = PlacementRequest("H100", 4)
    result = place(request, snapshot, latency)  # warms the latency cache
    assert result.placement is not None, result.unsatisfied
    samples = timed(lambda: place(request, snapshot, latency), runs)
    pairs = timed(lambda: all_pairs(snapshot, latency), max(1, runs // 2))
    p90 = sorted(samples)[int(0.9 * (len(samples) - 1))]
    print(
        f"{boxes} boxes x {GPUS_PER_BOX} GPUs x {hosts} hosts: place() median "
        f"{statistics.median(samples) * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms over {runs} runs; "
        f"latency model alone, every pair: {statistics.median(pairs) * 1e3:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs for the 64-box pool")
    parser.add_argument("--large-runs", type=int, default=3, help="runs for the 1,000-box pool")
    parser.add_argument("--skip-large", action="store_true", help="skip the 1,000-box pool")
    args = parser.parse_args()
    bench(64, 64, args.runs)
    if not args.skip_large:
        bench(1000, 1000, args.large_runs)


if __name__ == "__main__":
    main()
