"""Placement with and without switch affinity on a live pool, as a compose pays it.

A pool of BOXES boxes of 8 GPUs and as many hosts of 8 proxy slots, dealt over racks of
16 boxes and 16 hosts (one pod), is loaded into the broker's own cache and placement
index (no etcd: ``bench.traces.pool``). Then, again and again: a 1-GPU node is placed and
committed (the state moves, as composes move it), and on the next snapshot one request
is timed, alternating between a 4-GPU request and the same request with switch
affinity, and between 8-GPU ones. Each timed request starts from what placement
prepared for it on an earlier version (the journal), as the broker's composes do.

Usage: python -m bench.switch_placement [--gpus 10000] [--rounds 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.traces.pool import DxpoolPool, PoolLayout, boxes_of
from dxpool.broker.placement import PlacementRequest, place

PER_RACK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=10_000, help="pool size in GPUs")
    parser.add_argument("--rounds", type=int, default=100, help="timed requests of each kind")
    args = parser.parse_args()
    boxes = boxes_of({"H100": args.gpus})
    racks = max(1, len(boxes) // PER_RACK)
    began = time.perf_counter()
    pool = DxpoolPool("switch", PoolLayout(boxes, [8] * len(boxes), racks=racks))
    print(
        f"{args.gpus} GPUs, {len(boxes)} boxes and hosts over {racks} racks; "
        f"loaded in {time.perf_counter() - began:.1f} s"
    )
    latency = pool._latency  # the pool's tree model, as the broker's
    requests = {
        f"{count} GPUs{', affinity switch' if switch else ''}": PlacementRequest(
            "H100", count, same_switch=switch
        )
        for count in (4, 8)
        for switch in (False, True)
    }
    samples: dict[str, list[float]] = {name: [] for name in requests}
    for request in requests.values():  # first placements prepare from scratch
        place(request, pool._index.snapshot(), latency)
    for _ in range(args.rounds):
        for name, request in requests.items():
            pool.allocate(1)
            snapshot = pool._index.snapshot()
            start = time.perf_counter()
            result = place(request, snapshot, latency)
            samples[name].append(time.perf_counter() - start)
            assert result.placement is not None, result.unsatisfied
    for name, values in samples.items():
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        print(
            f"  {name:24} p50 {statistics.median(ordered) * 1e3:.2f} ms, "
            f"p99 {p99 * 1e3:.2f} ms ({len(ordered)} after a 1-GPU commit each)"
        )


if __name__ == "__main__":
    main()
