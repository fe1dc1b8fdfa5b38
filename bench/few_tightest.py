"""The cap of few classes holding the tightest box (``tiered.FEW_TIGHTEST``), compared
value against value in one process, decision by decision.

Placement answers the tightest-single-box rule apart, from the few classes holding a box
of the fewest usable GPUs, while they are at most ``FEW_TIGHTEST``; above it every walk
finds that box itself. The cap changes no decision, only what each costs, so it is
chosen by timing. Runs of one value after another on a shared machine drift by more than
the difference (see ``bench/RESULTS.md``), so this benchmark builds one pool per value
(``bench/placement_stream.py``'s layout and streams, each pool with its own pipeline),
fills each to a third, and then times one decision of each pool in turn: a slow moment
of the machine falls on every value alike. Each decision is ``snapshot()`` +
``place()``, committed, the oldest node released, as in the steady-state stream.

The collector is frozen after the fill and off while the decisions are timed (every
value alike: a collection would bill one value for the garbage of all). Every value
must make the same decisions; the benchmark says whether they did.

Usage: python bench/few_tightest.py [--caps 32,128] [--boxes 12500] [--decisions 1000]
       [--streams sizes,shapes] [--seed 7]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too
sys.path.insert(0, str(Path(__file__).resolve().parent))

from placement_stream import FILL, STREAMS, build, percentile_ms

from dxpool.broker.placement import PlacementRequest, tiered
from dxpool.broker.placement.registry import default_pipeline


class Arm:
    """One value of the cap: its own pool, pipeline and stream, in the steady state."""

    def __init__(
        self,
        cap: int,
        boxes: int,
        make: Callable[[random.Random, int], PlacementRequest],
        seed: int,
    ) -> None:
        self.cap = cap
        self.pool = build(boxes, default_pipeline())
        self.make = make
        self.rng = random.Random(seed)
        self.live: deque[tuple[str, int]] = deque()
        self.held = 0
        self.target = int(FILL * self.pool.counts().gpus)
        self.number = 0
        self.cpu: list[float] = []
        self.decided: list[object] = []

    def step(self, timed: bool) -> None:
        """Places the next request (timed, when ``timed``), commits it and, once a third
        of the GPUs is held, releases the oldest nodes."""
        tiered.FEW_TIGHTEST = self.cap
        request = self.make(self.rng, 1)
        began = time.process_time()
        result = self.pool.place(request)
        took = time.process_time() - began
        if timed:
            self.cpu.append(took)
            self.decided.append(result.placement)
        if result.placement is not None:
            self.number += 1
            node = f"n{self.number}"
            self.pool.commit(node, request, result.placement)
            self.live.append((node, request.count))
            self.held += request.count
        while timed and self.held > self.target and self.live:
            node, count = self.live.popleft()
            self.pool.release(node)
            self.held -= count


def compare(caps: list[int], boxes: int, stream: str, decisions: int, seed: int) -> bool:
    """Runs one stream for every cap, interleaved; prints a row per cap. True when every
    cap made the same decisions."""
    default = tiered.FEW_TIGHTEST
    try:
        arms = [Arm(cap, boxes, STREAMS[stream], seed) for cap in caps]
        for arm in arms:
            while arm.held < arm.target:
                arm.step(timed=False)
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            for _ in range(decisions):
                for arm in arms:
                    arm.step(timed=True)
        finally:
            gc.enable()
    finally:
        tiered.FEW_TIGHTEST = default
    first = arms[0]
    first_p99 = max(percentile_ms(first.cpu, 0.99), 1e-9)
    for arm in arms:
        p50, p90, p99 = (percentile_ms(arm.cpu, fraction) for fraction in (0.5, 0.9, 0.99))
        print(
            f"| {stream} | {arm.cap} | {len(arm.cpu)} | {1e3 * statistics.mean(arm.cpu):.3f} | "
            f"{p50:.3f} | {p90:.3f} | {p99:.3f} | {p99 / first_p99:.2f}x |",
            flush=True,
        )
    return all(arm.decided == first.decided for arm in arms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", default="32,128", help="comma list of values to compare")
    parser.add_argument("--boxes", type=int, default=12_500, help="boxes of 8 GPUs (and hosts)")
    parser.add_argument("--decisions", type=int, default=1000, help="timed decisions per cap")
    parser.add_argument("--streams", default="sizes,shapes", help="comma list: sizes, shapes")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    try:
        caps = [int(value) for value in args.caps.split(",") if value.strip()]
    except ValueError:
        caps = []
    streams = [name.strip() for name in args.streams.split(",") if name.strip()]
    if (
        len(caps) < 2
        or min(caps) < 0
        or set(streams) - set(STREAMS)
        or not streams
        or args.boxes < 16
        or args.decisions < 1
    ):
        parser.error(
            "--caps takes two or more whole numbers, 0 or more (e.g. 32,128); "
            f"--streams takes {', '.join(STREAMS)}; --boxes at least 16; --decisions at least 1"
        )
    print(
        f"{args.boxes:,} boxes and hosts, a third held; caps {', '.join(map(str, caps))} "
        f"interleaved decision by decision; CPU time of each snapshot() + place()",
        flush=True,
    )
    print("| stream | cap | n | mean ms | p50 ms | p90 ms | p99 ms | p99 / first cap |")
    print("|---|---|---|---|---|---|---|---|")
    same = True
    for stream in streams:
        same = compare(caps, args.boxes, stream, args.decisions, args.seed) and same
    print(f"same decisions with every cap: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
