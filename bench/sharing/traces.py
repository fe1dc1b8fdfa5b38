"""The job lists the replay reads: Microsoft Philly (as the Pollux artifact preprocessed
it) and Alibaba's 2023 openb pod list. Each folder's README has the schema.

The trace folder is ``--traces DIR``, else ``$DXPOOL_TRACES``, else the first
``shared/data/traces`` found at or above the repository root.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.traces.data import TraceError, read_rows, traces_dir


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job: submitted ``arrival_s`` after the trace's first, ``gpus`` GPUs for
    ``duration_s`` seconds."""

    arrival_s: float
    duration_s: float
    gpus: int


def philly(traces: Path) -> list[TraceJob]:
    """Every job of ``philly-pollux/philly.csv``, by arrival."""
    path = traces / "philly-pollux" / "philly.csv"
    try:
        rows = [
            (datetime.fromisoformat(r["timestamp"]), float(r["duration"]), int(r["num_gpus"]))
            for r in read_rows(path)
        ]
    except (KeyError, ValueError) as error:
        raise TraceError(f"{path}: not the Philly job schema ({error})") from None
    if not rows:
        raise TraceError(f"{path}: no jobs")
    start = min(when for when, _, _ in rows)
    jobs = [TraceJob((when - start).total_seconds(), d, g) for when, d, g in rows]
    jobs.sort(key=lambda job: job.arrival_s)
    return jobs


def openb(traces: Path, compress: float, copies: int = 1) -> list[TraceJob]:
    """The GPU pods of ``alibaba-gpu-v2023/openb_pod_list_default.csv`` as jobs (a
    fractional pod takes one whole GPU), arrivals ``compress`` times closer together.
    The trace alone keeps at most 71 GPUs busy at once, so ``copies`` copies of it may be
    laid over each other, copy ``i`` shifted by ``i / copies`` of the trace's span (the
    job mix and durations are the trace's; only arrivals are denser)."""
    path = traces / "alibaba-gpu-v2023" / "openb_pod_list_default.csv"
    try:
        rows = [
            (int(r["creation_time"]), int(r["deletion_time"]), int(r["num_gpu"]))
            for r in read_rows(path)
        ]
    except (KeyError, ValueError) as error:
        raise TraceError(f"{path}: not the openb pod schema ({error})") from None
    span = max((created for created, _, _ in rows), default=0)
    jobs = [
        TraceJob(
            (created + copy * span / copies) % max(span, 1) / compress,
            float(max(deleted - created, 1)),
            gpus,
        )
        for copy in range(copies)
        for created, deleted, gpus in rows
        if gpus > 0
    ]
    jobs.sort(key=lambda job: job.arrival_s)
    return jobs


__all__ = ["TraceError", "TraceJob", "openb", "philly", "traces_dir"]
