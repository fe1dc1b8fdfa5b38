"""Philly against one pool with a small-job reserve: whether admission reaches what
placement cannot.

An allocator that places every job that fits when it arrives refuses exactly the jobs
the one-pool bound refuses (:mod:`bench.traces.onepool`), so no placement rule refuses
fewer 1- or 2-GPU jobs than the bound does. Fixed servers refuse fewer of them because
their fragmentation refuses large jobs that fit. This replay asks whether doing that on
purpose gets every size class below fixed servers: a one pool that holds back ``R``
GPUs from nodes of at least ``S`` GPUs (:class:`~bench.traces.onepool.ReservedPool`),
for each (S, R) of a grid.

The replay is :mod:`bench.traces.philly`'s: the same job list, no queue, jobs over 8
GPUs as gangs of 8-GPU nodes. It prints refused GPU-hours (% of submitted) by size
class for fixed 8-GPU servers with best fit, the bound, and each setting. A last column
says whether every class is below fixed servers, and the run ends with how many settings
were.

Usage: python -m bench.traces.admission [--quick] [--size 768] [--min-gpus 2,4,8]
       [--reserves 1,2,4,8,12,16,24,32,48] [--traces DIR]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench.traces.data import TraceError, philly_jobs, traces_dir
from bench.traces.onepool import OnePool, ReservedPool
from bench.traces.philly import FIXED_SERVERS, LABELS, ONE_POOL, QUICK_JOBS, Replay, replay
from bench.traces.report import positive_int, positive_ints, table
from bench.traces.servers import FixedServers

DEFAULT_MIN_GPUS = (2, 4, 8)
DEFAULT_RESERVES = (1, 2, 4, 8, 12, 16, 24, 32, 48)


def below_in_every_class(done: Replay, baseline: Replay) -> bool:
    """Whether ``done`` refused a smaller share of GPU-hours than ``baseline`` in every
    size class that submitted any."""
    return all(
        done.refused_share(label) < baseline.refused_share(label)
        for label in LABELS
        if baseline.gpu_hours[label]
    )


def row(done: Replay, verdict: str) -> tuple[str, ...]:
    """One table row: refused GPU-hours by size class, in all, and ``verdict``."""
    shares = (f"{100 * done.refused_share(label):.2f}%" for label in LABELS)
    return (done.cluster, *shares, f"{100 * done.refused_share():.2f}%", verdict)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", help="folder of the trace folders")
    parser.add_argument("--size", type=positive_int, default=768, help="GPUs in the cluster")
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK_JOBS} jobs only")
    parser.add_argument(
        "--min-gpus",
        type=positive_ints,
        default=list(DEFAULT_MIN_GPUS),
        help="smallest node the reserve holds back, a comma list",
    )
    parser.add_argument(
        "--reserves",
        type=positive_ints,
        default=list(DEFAULT_RESERVES),
        help="GPUs kept for smaller nodes, a comma list",
    )
    args = parser.parse_args(argv)
    if args.size % 8:
        parser.error(f"--size: a multiple of 8 GPUs (8-GPU servers), got {args.size}")
    if max(args.reserves) >= args.size:
        parser.error(f"--reserves: fewer than the cluster's {args.size} GPUs")
    try:
        jobs = philly_jobs(traces_dir(args.traces))
    except TraceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.quick:
        jobs = jobs[:QUICK_JOBS]
    print(f"Philly replay: {len(jobs)} jobs, {args.size} GPUs, refused GPU-hours by size class")
    servers = replay(FixedServers(FIXED_SERVERS, [8] * (args.size // 8)), jobs)
    rows = [row(servers, "(baseline)")]
    bound = replay(OnePool(ONE_POOL, args.size), jobs)
    rows.append(row(bound, "yes" if below_in_every_class(bound, servers) else "no"))
    below = 0
    settings = [(least, kept) for least in args.min_gpus for kept in args.reserves]
    for least, kept in settings:
        name = f"one pool, nodes of {least}+ GPUs leave {kept} free"
        done = replay(ReservedPool(name, args.size, least, kept), jobs)
        met = below_in_every_class(done, servers)
        below += met
        rows.append(row(done, "yes" if met else "no"))
    header = ("cluster", *(f"{label} GPU" for label in LABELS), "all", "every class below")
    print(table(header, rows))
    print(f"\nsettings below fixed servers in every class: {below} of {len(settings)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
