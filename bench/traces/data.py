"""Reading the public traces the benchmarks replay (each folder's README has the schema).

The trace folder is ``--traces DIR``, else ``$DXPOOL_TRACES``, else the first
``shared/data/traces`` found at or above the repository root.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


class TraceError(Exception):
    """A trace file is missing or does not hold what its README describes."""


def traces_dir(given: str | None) -> Path:
    """The folder holding the trace folders; ``TraceError`` says how to point at it."""
    if given:
        candidates = [Path(given)]
    elif os.environ.get("DXPOOL_TRACES"):
        candidates = [Path(os.environ["DXPOOL_TRACES"])]
    else:
        candidates = [parent / "shared" / "data" / "traces" for parent in (_REPO, *_REPO.parents)]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise TraceError(
        f"no trace folder at {', '.join(str(c) for c in candidates[:3])}: "
        "pass --traces DIR or set DXPOOL_TRACES"
    )


def read_rows(path: Path) -> list[dict[str, str]]:
    """The non-empty rows of the CSV file ``path``; ``TraceError`` when it cannot be read."""
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            return [row for row in csv.DictReader(handle) if any(row.values())]
    except OSError as error:
        raise TraceError(f"cannot read {path}: {error.strerror}") from None


CPU_UNIT_MILLI = 2
"""The harness's CPU unit, in milli-cores. dxpool counts a host's CPU in whole units
(``Host.cpu_cores``, at most ``MAX_HOST_CPUS``); the trace counts milli-cores, and every
value in the openb lists is even, so hosts declare and pods ask in units of 2 milli-cores:
placement and the fixed servers then compare the trace's own numbers, and the largest
node (128 cores) is 64,000 units. A value that is not a multiple is rounded up."""


def cpu_units(milli: int) -> int:
    """``milli`` milli-cores in the harness's CPU unit (rounded up)."""
    return -(-milli // CPU_UNIT_MILLI)


@dataclass(frozen=True, slots=True)
class Server:
    """One GPU node of the openb cluster; CPU in the harness's unit (:data:`CPU_UNIT_MILLI`)."""

    name: str
    gpus: int
    model: str
    cpu: int = 0
    memory_mib: int = 0


@dataclass(frozen=True, slots=True)
class Pod:
    """One pod of an openb pod list, in whole GPUs (a fractional pod takes one; 0: a
    CPU-only pod), with the CPU (harness unit) and memory (MiB) it asks for and the GPU
    models it may use (its ``gpu_spec``, each model once; () for any model)."""

    name: str
    gpus: int
    gpu_milli: int  # per GPU, as in the trace
    cpu: int = 0
    memory_mib: int = 0
    models: tuple[str, ...] = ()


def openb_servers(traces: Path) -> list[Server]:
    """The 1,213 GPU nodes (6,212 GPUs) of ``openb_node_list_gpu_node.csv``."""
    path = traces / "alibaba-gpu-v2023" / "openb_node_list_gpu_node.csv"
    try:
        servers = [
            Server(
                r["sn"],
                int(r["gpu"]),
                r["model"],
                cpu_units(int(r["cpu_milli"])),
                int(r["memory_mib"]),
            )
            for r in read_rows(path)
        ]
    except (KeyError, ValueError) as error:
        raise TraceError(f"{path}: not the openb node schema ({error})") from None
    return [server for server in servers if server.gpus > 0]


OPENB_POD_LIST = "openb_pod_list_"


def openb_workloads(traces: Path) -> list[str]:
    """The openb workloads whose pod lists the trace folder holds (``default`` first,
    then by name): ``default``, ``cpu050``, ``gpuspec33``, ``multigpu50``..."""
    folder = traces / "alibaba-gpu-v2023"
    found = sorted(
        path.name.removeprefix(OPENB_POD_LIST).removesuffix(".csv")
        for path in folder.glob(f"{OPENB_POD_LIST}*.csv")
    )
    if not found:
        raise TraceError(f"no {OPENB_POD_LIST}*.csv in {folder}")
    return sorted(found, key=lambda name: (name != "default", name))


def openb_pods(traces: Path, workload: str = "default", *, cpu_only: bool = False) -> list[Pod]:
    """The pods of ``openb_pod_list_<workload>.csv``, in file order: the GPU pods, and
    with ``cpu_only`` the CPU-only pods too. Lists without a ``gpu_spec`` column (the
    multigpu ones) let every pod use any model."""
    path = traces / "alibaba-gpu-v2023" / f"{OPENB_POD_LIST}{workload}.csv"
    try:
        pods = [
            Pod(
                r["name"],
                int(r["num_gpu"]),
                int(r["gpu_milli"]),
                cpu_units(int(r["cpu_milli"])),
                int(r["memory_mib"]),
                _models(r.get("gpu_spec") or ""),
            )
            for r in read_rows(path)
        ]
    except (KeyError, ValueError) as error:
        raise TraceError(f"{path}: not the openb pod schema ({error})") from None
    return [pod for pod in pods if pod.gpus > 0 or cpu_only]


def _models(spec: str) -> tuple[str, ...]:
    """A ``gpu_spec`` (``V100M16|V100M32|V100M32``) as the models it allows, each once."""
    return tuple(dict.fromkeys(part for part in spec.split("|") if part))


@dataclass(frozen=True, slots=True)
class Job:
    """One Philly job: submitted ``arrival_s`` after the trace's first, for ``duration_s``."""

    arrival_s: float
    duration_s: float
    gpus: int


def philly_jobs(traces: Path) -> list[Job]:
    """Every job of ``philly-pollux/philly.csv``, by arrival (ties in file order)."""
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
    jobs = [Job((when - start).total_seconds(), d, gpus) for when, d, gpus in rows]
    jobs.sort(key=lambda job: job.arrival_s)
    return jobs
