"""Placement at 100,000 GPUs in a steady state, for a stream of sizes and a stream of
many request shapes, beside the settled figure measured in the same run.

The pool is the embedding API's (:class:`~dxpool.broker.nodes.memory_pool.InMemoryPool`:
the broker's cache, placement index, default pipeline and records, no etcd): BOXES
boxes of 8 H100s and as many hosts with 8 proxy slots, racks of 16 boxes and 16 hosts,
pods of 16 racks (``bench/scale.py``'s layout), the tree latency model. Hosts declare
CPU cores and memory, in three sizes (64 cores and 512 GiB, 96 and 768, 128 and 1 TiB,
dealt in turn), so requests that ask for them are placed by them.

After the load the inventory is frozen out of the garbage collector's generations, as
the broker does (``gc.freeze()``); collections still run, and every figure includes
them. Then, for each stream:

1. **fill**: placements committed one after another until a third of the GPUs are held
   (not timed: the first placement of each part is a placement from scratch);
2. **steady state**: each request is placed on the index's snapshot (``snapshot()`` +
   ``place()``, timed: what ComposeNode pays for placement) and committed, and the
   oldest node is released, so a third of the pool stays held; ``--decisions`` of them
   are timed. A decision during which a full (generation 2) collection ran is counted.

The streams:

* ``sizes``: 1 to 8 GPUs, uniformly, each size with its own CPU and memory (8 cores and
  64 GiB per GPU);
* ``shapes``: 1 to 8 GPUs with 4 CPU and 4 memory figures each (0-48 cores, 0-384 GiB),
  drawn at random: 128 distinct shapes, the request stream of a cluster whose pods ask
  for what they need.

The **settled** figure is the same decision again and again on an unchanged snapshot
(nothing to bring forward: the decision alone), timed in the same run for a 1-GPU and
an 8-GPU request, so a stream's figure can be read as a ratio to it on this machine.
Each decision is timed twice: wall clock, and the CPU time of this process (what the
decision costs, without the time other processes on a shared machine took from it).

Nothing is asserted: the machine is shared and noisy; compare figures of one run.

Usage: python bench/placement_stream.py [--boxes 12500] [--decisions 2000]
       [--streams sizes,shapes] [--seed 7]
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from dxpool.broker.nodes.memory_pool import InMemoryPool
from dxpool.broker.placement import PlacementRequest, place

GPUS_PER_BOX = 8
RACK_SIZE = 16  # hosts (and boxes) per rack
RACKS_PER_POD = 16
HOST_SIZES = ((64, 512 * 1024), (96, 768 * 1024), (128, 1024 * 1024))
FILL = 1 / 3
CPU_PER_GPU = 8
MEMORY_PER_GPU = 64 * 1024
SHAPE_CPUS = (0, 4, 16, 48)
SHAPE_MEMORY = (0, 32 * 1024, 128 * 1024, 384 * 1024)


def location(index: int) -> tuple[str, str, str]:
    rack = index // RACK_SIZE
    pod, rack_in_pod = divmod(rack, RACKS_PER_POD)
    return "dc0", f"p{pod}", f"r{rack_in_pod}"


def sizes(rng: random.Random) -> PlacementRequest:
    count = rng.randint(1, 8)
    return PlacementRequest(
        "H100", count, cpu_cores=CPU_PER_GPU * count, host_memory_mib=MEMORY_PER_GPU * count
    )


def shapes(rng: random.Random) -> PlacementRequest:
    return PlacementRequest(
        "H100",
        rng.randint(1, 8),
        cpu_cores=rng.choice(SHAPE_CPUS),
        host_memory_mib=rng.choice(SHAPE_MEMORY),
    )


STREAMS: dict[str, Callable[[random.Random], PlacementRequest]] = {
    "sizes": sizes,
    "shapes": shapes,
}


def build(boxes: int) -> InMemoryPool:
    pool = InMemoryPool()
    for index in range(boxes):
        pool.add_box(f"b{index:05d}", "H100", GPUS_PER_BOX, location=location(index))
    for index in range(boxes):
        cpus, memory = HOST_SIZES[index % len(HOST_SIZES)]
        pool.add_host(
            f"h{index:05d}", 8, cpu_cores=cpus, memory_mib=memory, location=location(index)
        )
    return pool


@dataclass
class Figures:
    samples: list[float]  # wall-clock seconds per decision
    cpu: list[float]  # this process's CPU seconds per decision
    full_collections: int
    shapes: int

    def ms(self, fraction: float, *, cpu: bool = False) -> float:
        ordered = sorted(self.cpu if cpu else self.samples)
        return 1e3 * ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class FullCollections:
    """Counts generation-2 collections that start while it is on."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            self.count += 1


def run_stream(
    pool: InMemoryPool, make: Callable[[random.Random], PlacementRequest], decisions: int, seed: int
) -> Figures:
    rng = random.Random(seed)
    live: deque[str] = deque()
    held = 0
    target = int(FILL * pool.counts().gpus)
    number = 0

    def commit(request: PlacementRequest) -> bool:
        nonlocal number, held
        result = place(request, pool.snapshot(), pool.latency)
        if result.placement is None:
            return False
        number += 1
        node = f"n{number}"
        pool.commit(node, request, result.placement)
        live.append(node)
        held += request.count
        return True

    def release_oldest() -> None:
        nonlocal held
        node = live.popleft()
        record = pool.node(node)
        assert record is not None
        held -= record.spec.gpus.count
        pool.release(node)

    while held < target:
        if not commit(make(rng)):
            raise RuntimeError("the pool refused a request while a third of it was free")
    counter = FullCollections()
    samples: list[float] = []
    cpu: list[float] = []
    seen: set[PlacementRequest] = set()
    collections = 0
    for _ in range(decisions):
        request = make(rng)
        seen.add(request)
        before = counter.count
        gc.callbacks.append(counter)
        began, began_cpu = time.perf_counter(), time.process_time()
        result = place(request, pool.snapshot(), pool.latency)
        cpu.append(time.process_time() - began_cpu)
        samples.append(time.perf_counter() - began)
        gc.callbacks.remove(counter)
        collections += counter.count > before
        if result.placement is not None:
            number += 1
            node = f"n{number}"
            pool.commit(node, request, result.placement)
            live.append(node)
            held += request.count
        while held > target and live:
            release_oldest()
    while live:
        release_oldest()
    return Figures(samples, cpu, collections, len(seen))


def settled(pool: InMemoryPool, count: int, runs: int) -> Figures:
    request = PlacementRequest("H100", count, cpu_cores=8 * count)
    snapshot = pool.snapshot()
    place(request, snapshot, pool.latency)
    samples, cpu = [], []
    for _ in range(runs):
        began, began_cpu = time.perf_counter(), time.process_time()
        place(request, snapshot, pool.latency)
        cpu.append(time.process_time() - began_cpu)
        samples.append(time.perf_counter() - began)
    return Figures(samples, cpu, 0, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--boxes", type=int, default=12_500, help="boxes of 8 GPUs (and hosts)")
    parser.add_argument("--decisions", type=int, default=2000, help="timed decisions per stream")
    parser.add_argument("--streams", default="sizes,shapes", help="comma list: sizes, shapes")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    streams = [name.strip() for name in args.streams.split(",") if name.strip()]
    unknown = [name for name in streams if name not in STREAMS]
    if unknown or args.boxes < RACK_SIZE or args.decisions < 1:
        parser.error(
            f"--streams takes {', '.join(STREAMS)}; --boxes at least {RACK_SIZE}; "
            "--decisions at least 1"
        )
    began = time.monotonic()
    pool = build(args.boxes)
    gc.collect()
    gc.freeze()  # as the broker does once its inventory is loaded
    print(
        f"pool: {args.boxes:,} boxes x {GPUS_PER_BOX} GPUs, {args.boxes:,} hosts, built in "
        f"{time.monotonic() - began:.0f} s; a third of the GPUs held in the steady state",
        flush=True,
    )
    rows = []
    for name in streams:
        began = time.monotonic()
        figures = run_stream(pool, STREAMS[name], args.decisions, args.seed)
        rows.append((name, figures))
        print(f"  {name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS after the streams: {rss:,.0f} MiB", flush=True)
    runs = max(200, args.decisions // 5)
    calm = [(f"settled {count}-GPU", settled(pool, count, runs)) for count in (1, 8)]
    base = statistics.median(calm[0][1].samples) * 1e3
    base_cpu = statistics.median(calm[0][1].cpu) * 1e3
    print(
        "| decisions | n | distinct shapes | p50 ms | p99 ms | p50 / settled | "
        "CPU p50 ms | CPU p99 ms | CPU p50 / settled | with a full GC |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, figures in [*rows, *calm]:
        print(
            f"| {name} | {len(figures.samples)} | {figures.shapes} | {figures.ms(0.5):.3f} | "
            f"{figures.ms(0.99):.3f} | {figures.ms(0.5) / base:.1f}x | "
            f"{figures.ms(0.5, cpu=True):.3f} | {figures.ms(0.99, cpu=True):.3f} | "
            f"{figures.ms(0.5, cpu=True) / max(base_cpu, 1e-6):.1f}x | "
            f"{figures.full_collections} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
