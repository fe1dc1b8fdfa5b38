"""One request grammar for GPUs, latencies and memory sizes.

The CLI, the Python client and configuration files all go through here, so ``"H100:4"``,
``{"model": "H100", "count": 4}`` and ``GpuSpec("H100", 4)`` mean the same thing.

GPU grammar (case of the model is kept; models compare case-insensitively)::

    MODEL:COUNT   "H100:4"    four H100s
    MODEL         "A100"      one A100
    COUNT         "8"         eight GPUs of any model
    *:COUNT       "*:2"       two GPUs of any model

Durations: an integer or decimal followed by ``ns``, ``us`` (or ``µs``), ``ms`` or ``s``.
Memory sizes: a number followed by ``MiB``, ``GiB`` (or ``M``/``G``, read as binary).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dxpool.errors import InvalidArgument

MAX_GPUS_PER_NODE = 64
MAX_MODEL_LENGTH = 64
GPU_GRAMMAR = "MODEL:COUNT (e.g. H100:4), MODEL (one GPU), or COUNT (any model)"
_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_GPU_STRING = re.compile(
    r"^\s*(?:(?P<model>\*|[A-Za-z0-9][A-Za-z0-9._-]*):(?P<count>-?\d+)|(?P<bare>[A-Za-z0-9][A-Za-z0-9._-]*))\s*$"
)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s)\s*$")
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(MiB|GiB|TiB|M|G|T)\s*$", re.IGNORECASE)
_NS_PER_UNIT = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000}
_MIB_PER_UNIT = {"mib": 1, "m": 1, "gib": 1024, "g": 1024, "tib": 1024 * 1024, "t": 1024 * 1024}


@dataclass(frozen=True)
class GpuSpec:
    """An immutable GPU request: ``count`` GPUs of ``model`` ("" = any model)."""

    model: str
    count: int
    min_memory_mib: int = 0

    def __post_init__(self) -> None:
        validate_gpu_request(self.model, self.count, self.min_memory_mib)

    def __str__(self) -> str:
        return f"{self.model or '*'}:{self.count}"


def validate_gpu_request(model: str, count: int, min_memory_mib: int = 0) -> None:
    """Raise :class:`InvalidArgument` unless the typed fields form a valid request."""
    if model and (len(model) > MAX_MODEL_LENGTH or not _MODEL.match(model)):
        shown = model if len(model) <= MAX_MODEL_LENGTH else model[:MAX_MODEL_LENGTH] + "..."
        raise InvalidArgument(
            f"invalid GPU model {shown!r}: use up to {MAX_MODEL_LENGTH} characters of "
            "letters, digits, '.', '_' and '-'",
            reason="INVALID_GPU_MODEL",
        )
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise InvalidArgument(
            f"invalid GPU count {count}: a node takes 1 to {MAX_GPUS_PER_NODE} GPUs",
            reason="INVALID_GPU_COUNT",
        )
    if min_memory_mib < 0:
        raise InvalidArgument(
            f"invalid minimum GPU memory {min_memory_mib} MiB: must be 0 or more",
            reason="INVALID_GPU_MEMORY",
        )


def parse_gpus(value: str | Mapping[str, Any] | GpuSpec) -> GpuSpec:
    """Parse a GPU request given as a string, a mapping, or a :class:`GpuSpec`."""
    if isinstance(value, GpuSpec):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {"model", "count", "min_memory_mib"}
        if unknown:
            raise InvalidArgument(
                f"unknown GPU request field(s) {sorted(unknown)}: use model, count, min_memory_mib"
            )
        return GpuSpec(
            str(value.get("model", "") or ""),
            _as_int(value.get("count", 1), "count"),
            _as_int(value.get("min_memory_mib", 0), "min_memory_mib"),
        )
    match = _GPU_STRING.match(value)
    if not match:
        raise InvalidArgument(
            f"cannot parse GPU request {value!r}: expected {GPU_GRAMMAR}",
            reason="INVALID_GPU_REQUEST",
        )
    model, count = match.group("model"), match.group("count")
    if model is None:  # a bare COUNT, or a bare MODEL
        bare = match.group("bare")
        model, count = ("", bare) if bare.isdigit() else (bare, "1")
    return GpuSpec("" if model == "*" else model, int(count))


def _as_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"GPU request field {field} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(
            f"GPU request field {field} must be an integer, got {value!r}"
        ) from None


def parse_duration_ns(value: str) -> int:
    """``"4us"`` -> 4000. Raises :class:`InvalidArgument` on anything else."""
    match = _DURATION.match(value)
    if not match:
        raise InvalidArgument(
            f"cannot parse duration {value!r}: expected a number and a unit, "
            "one of ns, us, ms, s (e.g. 4us)",
            reason="INVALID_DURATION",
        )
    return round(float(match.group(1)) * _NS_PER_UNIT[match.group(2)])


def format_duration_ns(ns: int) -> str:
    """4000 -> ``"4us"``; 1500 -> ``"1.5us"``; picks the largest unit that reads well."""
    for unit, scale in (("s", 1_000_000_000), ("ms", 1_000_000), ("us", 1_000)):
        if ns >= scale:
            return f"{ns / scale:.3g}{unit}"
    return f"{ns}ns"


def parse_memory_mib(value: str) -> int:
    """``"80GiB"`` -> 81920. Raises :class:`InvalidArgument` on anything else."""
    match = _MEMORY.match(value)
    if not match:
        raise InvalidArgument(
            f"cannot parse memory size {value!r}: expected a number and MiB, GiB or TiB "
            "(e.g. 80GiB)",
            reason="INVALID_MEMORY",
        )
    return round(float(match.group(1)) * _MIB_PER_UNIT[match.group(2).lower()])
