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


BUSY_QUANTILE = 0.01
"""The openb trace's busy part starts at this quantile of its GPU pods' creation times."""


def openb(traces: Path, compress: float, copies: int = 1) -> list[TraceJob]:
    """The GPU pods of ``alibaba-gpu-v2023/openb_pod_list_default.csv`` as jobs (a
    fractional pod takes one whole GPU), arrivals ``compress`` times closer together.

    Only the trace's busy part is replayed: its pods' creation times span 149 days, but
    the first 115 days hold 25 of its 7,064 GPU pods (pods created long before the
    list was taken and still alive then) and the last 34 days the rest, at a steady 200
    or so a day. Compressing the whole span would put almost every arrival into the
    window's last quarter. So the replay starts where the busy part starts (the
    ``BUSY_QUANTILE`` of creation times); a pod created before then arrives at the
    start with the time it had left.

    The trace alone keeps at most 71 GPUs busy at once, so ``copies`` copies of it may be
    laid over each other, copy ``i`` shifted by ``i / copies`` of the busy span (the
    job mix and durations are the trace's; only arrivals are denser)."""
    path = traces / "alibaba-gpu-v2023" / "openb_pod_list_default.csv"
    try:
        rows = [
            (int(r["creation_time"]), int(r["deletion_time"]), int(r["num_gpu"]))
            for r in read_rows(path)
        ]
    except (KeyError, ValueError) as error:
        raise TraceError(f"{path}: not the openb pod schema ({error})") from None
    rows = [row for row in rows if row[2] > 0]
    if not rows:
        raise TraceError(f"{path}: no GPU pods")
    created = sorted(when for when, _, _ in rows)
    busy = created[int(BUSY_QUANTILE * (len(created) - 1))]
    span = max(created[-1] - busy, 1)
    jobs = [
        TraceJob(
            _shifted(max(start - busy, 0), copy * span / copies, span) / compress,
            float(max(deleted - max(start, busy), 1)),
            gpus,
        )
        for copy in range(copies)
        for start, deleted, gpus in rows
        if deleted > busy
    ]
    jobs.sort(key=lambda job: job.arrival_s)
    return jobs


def _shifted(arrival: float, shift: float, span: float) -> float:
    """``arrival`` moved ``shift`` later, wrapped around to stay within ``span``."""
    moved = arrival + shift
    return moved - span if moved > span else moved


__all__ = ["TraceError", "TraceJob", "openb", "philly", "traces_dir"]
