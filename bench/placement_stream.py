"""Placement at 100,000 GPUs in a steady state, for a stream of sizes and a stream of
many request shapes, beside the settled figure measured in the same run.

The pool is the embedding API's (:class:`~dxpool.broker.nodes.memory_pool.InMemoryPool`:
the broker's cache, placement index, default pipeline and records, no etcd): BOXES
boxes of 8 H100s and as many hosts with 8 proxy slots, racks of 16 boxes and 16 hosts,
pods of 16 racks (``bench/scale.py``'s layout), the tree latency model. Hosts declare
CPU cores and memory, in three sizes (64 cores and 512 GiB, 96 and 768, 128 and 1 TiB,
dealt in turn), so requests that ask for them are placed by them.

After the load the garbage collector is set up as ``--gc`` says, and every figure
includes the collections that then run:

* ``default``: the inventory is frozen out of the collector's generations
  (``gc.collect(); gc.freeze()``) and Python's thresholds stay: collections run where
  they fall, inside decisions too (the broker with ``--gc default``);
* ``policy``: the broker's :class:`~dxpool.gc_policy.CollectorPolicy`, started after the
  load and given to the pool, which runs it after each commit and release: young
  collections and full reclaims between decisions (the broker's default).

``--gc default,policy`` builds the pool once and forks one process per mode, one after
the other, so both run the same stream from the same state. Beside the decision
figures each mode reports the collector's time inside decisions and outside them (in
commits, releases and the policy's turns), so no pause is hidden. Then, for each
stream:

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

``--models M`` deals the boxes M GPU models in turn (H100, A100, L40S, H200; 1, H100
alone, by default) and has each request of both streams ask one of them, drawn at random:
M times the box keys (the size stream's 8 become 8 x M, each with its own chooser and
class table), the pool of many models a cluster usually is.

Nothing is asserted: the machine is shared and noisy; compare figures of one run.

Usage: python bench/placement_stream.py [--boxes 12500] [--decisions 2000]
       [--streams sizes,shapes] [--seed 7] [--gc default,policy] [--models 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from dxpool.broker.nodes.memory_pool import InMemoryPool
from dxpool.broker.placement import PlacementRequest, PlacementResult, place
from dxpool.broker.placement.pipeline import Pipeline
from dxpool.gc_policy import FULL_RECLAIM, CollectorPolicy

GPUS_PER_BOX = 8
RACK_SIZE = 16  # hosts (and boxes) per rack
RACKS_PER_POD = 16
HOST_SIZES = ((64, 512 * 1024), (96, 768 * 1024), (128, 1024 * 1024))
FILL = 1 / 3
CPU_PER_GPU = 8
MEMORY_PER_GPU = 64 * 1024
SHAPE_CPUS = (0, 4, 16, 48)
SHAPE_MEMORY = (0, 32 * 1024, 128 * 1024, 384 * 1024)
MODELS = ("H100", "A100", "L40S", "H200")


def location(index: int) -> tuple[str, str, str]:
    rack = index // RACK_SIZE
    pod, rack_in_pod = divmod(rack, RACKS_PER_POD)
    return "dc0", f"p{pod}", f"r{rack_in_pod}"


def model_of(rng: random.Random, models: int) -> str:
    """One of the pool's first ``models`` GPU models (no draw when there is one, so the
    one-model streams stay what they were)."""
    return MODELS[rng.randrange(models)] if models > 1 else MODELS[0]


def sizes(rng: random.Random, models: int = 1) -> PlacementRequest:
    count = rng.randint(1, 8)
    return PlacementRequest(
        model_of(rng, models),
        count,
        cpu_cores=CPU_PER_GPU * count,
        host_memory_mib=MEMORY_PER_GPU * count,
    )


def shapes(rng: random.Random, models: int = 1) -> PlacementRequest:
    return PlacementRequest(
        model_of(rng, models),
        rng.randint(1, 8),
        cpu_cores=rng.choice(SHAPE_CPUS),
        host_memory_mib=rng.choice(SHAPE_MEMORY),
    )


STREAMS: dict[str, Callable[[random.Random, int], PlacementRequest]] = {
    "sizes": sizes,
    "shapes": shapes,
}


def build(boxes: int, pipeline: Pipeline | None = None, models: int = 1) -> InMemoryPool:
    """The pool: ``boxes`` boxes (dealt the first ``models`` of :data:`MODELS` in turn) and
    as many hosts; placed by ``pipeline`` (the default pipeline when None)."""
    pool = InMemoryPool(pipeline=pipeline)
    for index in range(boxes):
        model = MODELS[index % models]
        pool.add_box(f"b{index:05d}", model, GPUS_PER_BOX, location=location(index))
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
    gc_inside: list[float] = field(default_factory=list)  # collections inside decisions, s
    gc_outside: list[float] = field(default_factory=list)  # collections between them, s
    between_s: float = 0.0  # time in the policy's turns (collections, freezes, counts)
    reclaims: int = 0  # the policy's full reclaims

    def ms(self, fraction: float, *, cpu: bool = False) -> float:
        return percentile_ms(self.cpu if cpu else self.samples, fraction)


def percentile_ms(samples: list[float], fraction: float) -> float:
    """The ``fraction`` percentile of ``samples`` (seconds), in milliseconds."""
    ordered = sorted(samples)
    return 1e3 * ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class CollectionClock:
    """Times every collection (a ``gc.callbacks`` entry), filing each as inside a decision
    or outside, by ``inside``; counts the full (generation 2) ones inside."""

    def __init__(self) -> None:
        self.inside = False
        self.full_inside = 0
        self.gc_inside: list[float] = []
        self.gc_outside: list[float] = []
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            if self.inside and info["generation"] == 2:
                self.full_inside += 1
            return
        took = time.perf_counter() - self._began
        (self.gc_inside if self.inside else self.gc_outside).append(took)


class TimedPolicy(CollectorPolicy):
    """The broker's policy, with the time its turns take (collections and freezes) and its
    full reclaims counted."""

    def __init__(self) -> None:
        super().__init__()
        self.spent = 0.0
        self.reclaims = 0
        self.longest: dict[str | None, float] = {}

    def between(self) -> str | None:
        began = time.perf_counter()
        kind = super().between()
        took = time.perf_counter() - began
        self.spent += took
        self.reclaims += kind == FULL_RECLAIM
        self.longest[kind] = max(took, self.longest.get(kind, 0.0))
        return kind


def policy_turns(pool: InMemoryPool) -> tuple[float, int]:
    """Seconds the pool's policy spent in its turns so far, and its full reclaims."""
    policy = pool.collector
    return (policy.spent, policy.reclaims) if isinstance(policy, TimedPolicy) else (0.0, 0)


def timed_decision(
    pool: InMemoryPool,
    request: PlacementRequest,
    clock: CollectionClock,
    samples: list[float],
    cpu: list[float],
) -> PlacementResult:
    """``snapshot()`` + ``place()``, timed (wall and CPU) with collections filed inside."""
    clock.inside = True
    began, began_cpu = time.perf_counter(), time.process_time()
    result = place(request, pool.snapshot(), pool.latency)
    cpu.append(time.process_time() - began_cpu)
    samples.append(time.perf_counter() - began)
    clock.inside = False
    return result


def run_stream(
    pool: InMemoryPool,
    make: Callable[[random.Random, int], PlacementRequest],
    decisions: int,
    seed: int,
    models: int = 1,
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
        if not commit(make(rng, models)):
            raise RuntimeError("the pool refused a request while a third of it was free")
    clock = CollectionClock()
    samples: list[float] = []
    cpu: list[float] = []
    seen: set[PlacementRequest] = set()
    collections = 0
    turns_before = policy_turns(pool)
    gc.callbacks.append(clock)
    for _ in range(decisions):
        request = make(rng, models)
        seen.add(request)
        before = clock.full_inside
        result = timed_decision(pool, request, clock, samples, cpu)
        collections += clock.full_inside > before
        if result.placement is not None:
            number += 1
            node = f"n{number}"
            pool.commit(node, request, result.placement)
            live.append(node)
            held += request.count
        while held > target and live:
            release_oldest()
    gc.callbacks.remove(clock)
    figures = Figures(samples, cpu, collections, len(seen), clock.gc_inside, clock.gc_outside)
    turns = policy_turns(pool)
    figures.between_s, figures.reclaims = turns[0] - turns_before[0], turns[1] - turns_before[1]
    while live:
        release_oldest()
    return figures


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
    parser.add_argument(
        "--models",
        type=int,
        default=1,
        help=f"GPU models dealt to the boxes in turn, each request asking one (1-{len(MODELS)})",
    )
    parser.add_argument(
        "--gc",
        default="policy",
        help="comma list: default (freeze after the load, Python's thresholds), policy "
        "(the broker's collector policy); two run one after the other from one build",
    )
    args = parser.parse_args(argv)
    streams = [name.strip() for name in args.streams.split(",") if name.strip()]
    unknown = [name for name in streams if name not in STREAMS]
    modes = [name.strip() for name in args.gc.split(",") if name.strip()]
    if (
        unknown
        or not modes
        or set(modes) - set(GC_MODES)
        or args.boxes < RACK_SIZE
        or args.decisions < 1
        or not 1 <= args.models <= len(MODELS)
    ):
        parser.error(
            f"--streams takes {', '.join(STREAMS)}; --gc takes {', '.join(GC_MODES)}; "
            f"--boxes at least {RACK_SIZE}; --decisions at least 1; --models 1 to {len(MODELS)}"
        )
    began = time.monotonic()
    pool = build(args.boxes, models=args.models)
    print(
        f"pool: {args.boxes:,} boxes x {GPUS_PER_BOX} GPUs of {', '.join(MODELS[: args.models])}, "
        f"{args.boxes:,} hosts, built in "
        f"{time.monotonic() - began:.0f} s; a third of the GPUs held in the steady state",
        flush=True,
    )
    if len(modes) == 1:
        return measure(pool, modes[0], streams, args)
    for mode in modes:
        sys.stdout.flush()
        child = os.fork()
        if child == 0:
            os._exit(measure(pool, mode, streams, args))
        _, status = os.waitpid(child, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            return 1
    return 0


GC_MODES = ("default", "policy")


def measure(pool: InMemoryPool, mode: str, streams: list[str], args: argparse.Namespace) -> int:
    """Sets the collector up as ``mode`` says, runs the streams and prints the table."""
    began = time.monotonic()
    if mode == "policy":
        pool.collector = TimedPolicy()
        pool.collector.start()
    else:
        gc.collect()
        gc.freeze()
    print(
        f"gc {mode}: set up in {time.monotonic() - began:.2f} s, thresholds "
        f"{gc.get_threshold()}, {gc.get_freeze_count():,} objects frozen",
        flush=True,
    )
    rows = []
    for name in streams:
        began = time.monotonic()
        figures = run_stream(pool, STREAMS[name], args.decisions, args.seed, args.models)
        rows.append((name, figures))
        print(f"  {name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS after the streams: {rss:,.0f} MiB", flush=True)
    if isinstance(pool.collector, TimedPolicy):
        began = time.perf_counter()
        pool.collector.reclaim()
        print(
            f"one full reclaim (unfreeze, collect, freeze) now: "
            f"{1e3 * (time.perf_counter() - began):.0f} ms, "
            f"{gc.get_freeze_count():,} objects frozen",
            flush=True,
        )
    runs = max(200, args.decisions // 5)
    calm = [(f"settled {count}-GPU", settled(pool, count, runs)) for count in (1, 8)]
    base = statistics.median(calm[0][1].samples) * 1e3
    base_cpu = statistics.median(calm[0][1].cpu) * 1e3
    print(
        f"| gc {mode}: decisions | n | distinct shapes | p50 ms | p99 ms | p50 / settled | "
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
    print(
        f"| gc {mode}: collector | inside decisions: n | total s | max ms | "
        "outside: n | total s | max ms | policy's turns s | full reclaims |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, figures in rows:
        inside, outside = figures.gc_inside, figures.gc_outside
        print(
            f"| {name} | {len(inside)} | {sum(inside):.3f} | {1e3 * max(inside, default=0):.1f} | "
            f"{len(outside)} | {sum(outside):.3f} | {1e3 * max(outside, default=0):.1f} | "
            f"{figures.between_s:.3f} | {figures.reclaims} |"
        )
    if isinstance(pool.collector, TimedPolicy):
        longest = ", ".join(
            f"{kind or 'nothing to do'} {1e3 * took:.1f} ms"
            for kind, took in sorted(pool.collector.longest.items(), key=lambda item: -item[1])
        )
        print(f"longest policy turn by what it did (fill included): {longest}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
