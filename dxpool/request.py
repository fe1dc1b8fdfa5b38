"""One request grammar for GPUs, latencies and memory sizes.

The CLI, the Python client and configuration files all go through here, so ``"H100:4"``,
``{"model": "H100", "count": 4}`` and ``GpuSpec("H100", 4)`` mean the same thing.

GPU grammar (case of the model is kept; models compare case-insensitively, the pool keeps
one spelling of each, the first registered, and listings print that one)::

    MODEL:COUNT   "H100:4"       four H100s
    MODEL         "A100"         one A100
    COUNT         "8"            eight GPUs of any model
    *:COUNT       "*:2"          two GPUs of any model
    SET:COUNT     "H100|A100:4"  four GPUs, all H100 or all A100

A dash is part of many model names (``A100-80GB``), so ``H100-4`` is a model name; the
broker's "no such model" answer then suggests ``H100:4``. A MODEL without a COUNT is one
GPU, and the CLI says so on stderr: a shell cuts an unquoted set at ``|``.

A model set (``MODEL|MODEL...``, up to :data:`MAX_MODELS_IN_SET` names) asks for
any of its models; a model named twice counts once. All GPUs of the node are then of
one model (placement tries the set's models with the most free GPUs first, so the models
that few requests can use are taken last), unless the request also says
``mixed_models``: any mix of the set's models is then fine. The set travels as written in
the ``model`` field of every form.

Affinity and spread (where a node's GPUs come from together)::

    --affinity box     every GPU from one box (a requirement; fewer boxes is otherwise
                       only preferred)
    --affinity switch  every GPU from boxes under one top-of-rack switch (one
                       site/pod/rack; the host may be in another rack); combines
                       with --spread
    --spread boxes     every GPU from a different box (at most 1 per box)
    --spread boxes:M   at most M GPUs from any one box

Durations: an integer or decimal followed by ``ns``, ``us`` (or ``µs``), ``ms``, ``s``,
``m`` or ``h``, or several such parts largest unit first, as Go writes them (``1m30s``).
Memory sizes: a number followed by ``MiB``, ``GiB`` (or ``M``/``G``, read as binary).
Slowdown bounds (``1.05``) and workloads (a profile name, or ``ROUND_TRIPS@STEP_TIME``
such as ``400@5ms``) are read by :mod:`dxpool.fabric.overhead`, next to the model that
gives them their meaning.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dxpool.errors import InvalidArgument
from dxpool.limits import (
    MAX_DURATION_NS,
    MAX_GPU_MEMORY_MIB,
    MAX_GPUS_PER_BOX,
    MAX_GPUS_PER_NODE,
    MAX_HOST_CPUS,
    MAX_HOST_MEMORY_MIB,
    MAX_MODEL_LENGTH,
)

GPU_GRAMMAR = (
    "MODEL:COUNT (e.g. H100:4), MODEL (one GPU), COUNT (any model), or MODEL|MODEL:COUNT "
    "(any of those models, e.g. H100|A100:4)"
)
MAX_MODELS_IN_SET = 8
"""The most models one request's model set may name."""
# Every pattern is ASCII-only and matched whole (fullmatch, \Z): ``\d`` would also take
# other scripts' digits, and ``$`` would let a trailing newline through.
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*", re.ASCII)
_SET = r"[A-Za-z0-9][A-Za-z0-9._-]*(?:\|[A-Za-z0-9][A-Za-z0-9._-]*)*"
_GPU_STRING = re.compile(
    r"\s*(?:(?P<model>\*|" + _SET + r"):(?P<count>-?[0-9]+)|(?P<bare>" + _SET + r"))\s*",
    re.ASCII,
)
# Bounded digits, so float() never overflows and int() never meets a 5,000-digit string.
_NUMBER = r"([0-9]{1,15}(?:\.[0-9]{1,9})?)"
_UNIT = r"(ns|us|µs|ms|s|m|h)"
_DURATION_PART = re.compile(_NUMBER + r"\s*" + _UNIT)
# One part ("90s"), or Go's form of several, largest unit first ("1m30s", "1h15m").
_DURATION = re.compile(r"\s*(?:" + _NUMBER + r"\s*" + _UNIT + r"){1,7}\s*")
_MEMORY = re.compile(r"\s*" + _NUMBER + r"\s*(MiB|GiB|TiB|M|G|T)\s*", re.IGNORECASE)
_INTEGER = re.compile(r"\s*-?[0-9]{1,18}\s*", re.ASCII)
_DIGITS = re.compile(r"[0-9]+")
_NS_PER_UNIT = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_MIB_PER_UNIT = {"mib": 1, "m": 1, "gib": 1024, "g": 1024, "tib": 1024 * 1024, "t": 1024 * 1024}


@dataclass(frozen=True)
class GpuSpec:
    """An immutable GPU request: ``count`` GPUs of ``model`` ("" = any model; a set
    ``"H100|A100"`` = any of those, one model per node unless ``mixed_models``)."""

    model: str
    count: int
    min_memory_mib: int = 0
    mixed_models: bool = False

    def __post_init__(self) -> None:
        validate_gpu_request(self.model, self.count, self.min_memory_mib, self.mixed_models)

    def __str__(self) -> str:
        return f"{self.model or '*'}:{self.count}"

    @property
    def models(self) -> tuple[str, ...]:
        """The models asked for, in the order written; () for any model."""
        return model_set(self.model)


def validate_gpu_request(
    model: str, count: int, min_memory_mib: int = 0, mixed_models: bool = False
) -> None:
    """Raise :class:`InvalidArgument` unless the typed fields form a valid request."""
    check_model(model)
    if mixed_models and len(model_set(model)) < 2:
        raise InvalidArgument(
            f"mixed_models needs a model set such as H100|A100:4, got model {model or '*'!r}; "
            "name two or more models or leave mixed_models off",
            reason="INVALID_GPU_MODEL",
        )
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise InvalidArgument(
            f"invalid GPU count {count}: a node takes 1 to {MAX_GPUS_PER_NODE} GPUs; ask for "
            "that many",
            reason="INVALID_GPU_COUNT",
        )
    if not 0 <= min_memory_mib <= MAX_GPU_MEMORY_MIB:
        raise InvalidArgument(
            f"invalid minimum GPU memory {min_memory_mib} MiB: use 0 (no minimum) up to "
            f"{MAX_GPU_MEMORY_MIB} (16 TiB)",
            reason="INVALID_GPU_MEMORY",
        )


def check_model(model: str) -> str:
    """Return ``model`` if it is empty (any model), a valid GPU model name, or a set of
    up to :data:`MAX_MODELS_IN_SET` such names joined by ``|`` (a name repeated counts
    once)."""
    model_set(model)
    return model


def model_set(model: str) -> tuple[str, ...]:
    """The models of a request's ``model`` field, in the order written: ``()`` for ""
    (any model), ``("H100",)``, ``("H100", "A100")`` for ``"H100|A100"``; a model named
    again (compared case-insensitively) counts once, where first written. Raises
    :class:`InvalidArgument` for a malformed name or more than :data:`MAX_MODELS_IN_SET`
    names."""
    if not model:
        return ()
    return _model_set(model)


@functools.lru_cache(maxsize=1024)
def _model_set(model: str) -> tuple[str, ...]:
    limit = MAX_MODELS_IN_SET * (MAX_MODEL_LENGTH + 1)
    parts = model[: limit + 1].split("|")
    if len(model) > limit or len(parts) > MAX_MODELS_IN_SET:
        raise InvalidArgument(
            f"invalid GPU model set {_shown(model)}: name at most {MAX_MODELS_IN_SET} models, "
            "e.g. H100|A100",
            reason="INVALID_GPU_MODEL",
        )
    for part in parts:
        if len(part) > MAX_MODEL_LENGTH or not _MODEL.fullmatch(part):
            shown = part if len(part) <= MAX_MODEL_LENGTH else part[:MAX_MODEL_LENGTH] + "..."
            raise InvalidArgument(
                f"invalid GPU model {shown!r}: use up to {MAX_MODEL_LENGTH} characters of "
                "letters, digits, '.', '_' and '-', starting with a letter or digit; join "
                "several models with '|' (H100|A100)",
                reason="INVALID_GPU_MODEL",
            )
    return _distinct_models(parts)


def _distinct_models(parts: list[str]) -> tuple[str, ...]:
    """``parts`` with a model named again (compared case-insensitively) dropped: the set
    means the same with it named once, and schedulers that write sets out of lists (one
    entry per allowed device, say) repeat models."""
    seen: set[str] = set()
    distinct: list[str] = []
    for part in parts:
        folded = part.casefold()
        if folded not in seen:
            seen.add(folded)
            distinct.append(part)
    return tuple(distinct)


def normalize_model_set(model: str) -> str:
    """``model`` as placement compares it: each model of a set named once, in the order
    first written (``"A|B|a"`` -> ``"A|B"``); raises as :func:`model_set` does."""
    return "|".join(model_set(model))


def check_gpu_memory_mib(value: int, field: str) -> int:
    """Return ``value`` if it is a GPU memory size 0..MAX_GPU_MEMORY_MIB MiB (0: unknown)."""
    if not 0 <= value <= MAX_GPU_MEMORY_MIB:
        raise InvalidArgument(
            f"{field} {value} MiB is out of range: use 0 (unknown) up to "
            f"{MAX_GPU_MEMORY_MIB} (16 TiB)",
            reason="INVALID_GPU_MEMORY",
        )
    return value


def parse_gpus(value: str | Mapping[str, Any] | GpuSpec) -> GpuSpec:
    """Parse a GPU request given as a string, a mapping, or a :class:`GpuSpec`."""
    if isinstance(value, GpuSpec):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {"model", "count", "min_memory_mib", "mixed_models"}
        if unknown:
            raise InvalidArgument(
                f"unknown GPU request field(s) {sorted(unknown)}: use model, count, "
                "min_memory_mib, mixed_models"
            )
        model = value.get("model", "") or ""
        if isinstance(model, (list, tuple)):  # a set given as a list of models
            model = "|".join(str(item) for item in model)
        mixed = value.get("mixed_models", False)
        if not isinstance(mixed, bool):
            raise InvalidArgument(
                f"GPU request field mixed_models must be true or false, got {mixed!r}"
            )
        return GpuSpec(
            str(model),
            _as_int(value.get("count", 1), "count"),
            _as_int(value.get("min_memory_mib", 0), "min_memory_mib"),
            mixed,
        )
    match = _GPU_STRING.fullmatch(value)
    if not match:
        raise InvalidArgument(
            f"cannot parse GPU request {value!r}: expected {GPU_GRAMMAR}",
            reason="INVALID_GPU_REQUEST",
        )
    model, count = match.group("model"), match.group("count")
    if model is None:  # a bare COUNT, or a bare MODEL
        bare = match.group("bare")
        model, count = ("", bare) if _DIGITS.fullmatch(bare) else (bare, "1")
    return GpuSpec("" if model == "*" else model, _count(count, value))


def _count(text: str, value: str) -> int:
    """The COUNT of a GPU string; a number too long to be a count is out of range."""
    if not _INTEGER.fullmatch(text):  # more digits than any count: never call int() on it
        raise InvalidArgument(
            f"invalid GPU count in {_shown(value)}: a node takes 1 to {MAX_GPUS_PER_NODE} "
            "GPUs; ask for that many",
            reason="INVALID_GPU_COUNT",
        )
    return int(text)


def _as_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"GPU request field {field} must be an integer, got {value!r}")
    if isinstance(value, str) and not _INTEGER.fullmatch(value):
        raise InvalidArgument(
            f"GPU request field {field} must be an integer written with the digits 0-9, "
            f"got {_shown(value)}"
        )
    return int(value)


def _shown(value: str) -> str:
    """``value`` for an error message: repr'd, and cut short when long."""
    return repr(value if len(value) <= 80 else value[:80] + "...")


def parse_duration_ns(value: str) -> int:
    """``"4us"`` -> 4000, ``"1m30s"`` -> 90_000_000_000 (Go's form: parts largest unit
    first). Raises :class:`InvalidArgument` on anything else."""
    match = _DURATION.fullmatch(value)
    parts = _DURATION_PART.findall(value) if match else []
    scales = [_NS_PER_UNIT[unit] for _, unit in parts]
    if not match or scales != sorted(set(scales), reverse=True):
        raise InvalidArgument(
            f"cannot parse duration {_shown(value)}: expected a number and a unit, "
            "one of ns, us, ms, s, m, h, or several largest first (e.g. 4us, 5m, 1m30s)",
            reason="INVALID_DURATION",
        )
    ns = round(sum(float(number) * _NS_PER_UNIT[unit] for number, unit in parts))
    if ns > MAX_DURATION_NS:
        raise InvalidArgument(
            f"duration {_shown(value)} is too long: use at most {MAX_DURATION_NS // 10**9}s "
            "(a year)",
            reason="INVALID_DURATION",
        )
    return ns


def format_duration_ns(ns: int) -> str:
    """4000 -> ``"4us"``; 1500 -> ``"1.5us"``; 2_592_000 s -> ``"720h"``; picks the
    largest unit that reads well."""
    for unit, scale in (("h", 3_600_000_000_000), ("m", 60_000_000_000)):
        if ns >= scale and ns % scale == 0:
            return f"{ns // scale}{unit}"
    for unit, scale in (("s", 1_000_000_000), ("ms", 1_000_000), ("us", 1_000)):
        if ns >= scale:
            return f"{ns / scale:.3g}{unit}"
    return f"{ns}ns"


def parse_memory_mib(value: str) -> int:
    """``"80GiB"`` -> 81920. Raises :class:`InvalidArgument` on anything else."""
    match = _MEMORY.fullmatch(value)
    if not match:
        raise InvalidArgument(
            f"cannot parse memory size {_shown(value)}: expected a number and MiB, GiB or "
            "TiB (e.g. 80GiB)",
            reason="INVALID_MEMORY",
        )
    mib = round(float(match.group(1)) * _MIB_PER_UNIT[match.group(2).lower()])
    if mib > MAX_GPU_MEMORY_MIB:
        raise InvalidArgument(
            f"memory size {_shown(value)} is larger than any GPU: use at most 16TiB",
            reason="INVALID_MEMORY",
        )
    return mib


SPREAD_GRAMMAR = "boxes (at most 1 GPU per box) or boxes:M (at most M GPUs per box)"
_SPREAD = re.compile(r"\s*boxes(?::([0-9]{1,4}))?\s*", re.ASCII)


def parse_spread(value: str) -> int:
    """``"boxes"`` -> 1, ``"boxes:2"`` -> 2: the most GPUs a node may take from one box.
    Raises :class:`InvalidArgument` on anything else."""
    match = _SPREAD.fullmatch(value)
    if not match:
        raise InvalidArgument(
            f"cannot parse spread {_shown(value)}: expected {SPREAD_GRAMMAR}",
            reason="INVALID_SPREAD",
        )
    limit = int(match.group(1) or 1)
    if limit < 1:
        raise InvalidArgument(
            f"spread {_shown(value)} is out of range: use boxes (1 per box) or boxes:M with "
            f"M from 1 to {MAX_GPUS_PER_BOX}",
            reason="INVALID_SPREAD",
        )
    return check_box_spread(limit, same_box=False)


def check_box_spread(max_gpus_per_box: int, *, same_box: bool, field: str = "") -> int:
    """Return ``max_gpus_per_box`` if it is 0 (no limit) or 1..MAX_GPUS_PER_BOX and does
    not contradict ``same_box`` (every GPU from one box)."""
    name = field or "max_gpus_per_box"
    if not 0 <= max_gpus_per_box <= MAX_GPUS_PER_BOX:
        raise InvalidArgument(
            f"{name} {max_gpus_per_box} is out of range: use 0 (no limit) or 1 to "
            f"{MAX_GPUS_PER_BOX} (--spread boxes or boxes:M)",
            reason="INVALID_SPREAD",
        )
    if same_box and max_gpus_per_box:
        raise InvalidArgument(
            f"{name} {max_gpus_per_box} contradicts affinity box (every GPU from one box): "
            "ask for one or the other",
            reason="INVALID_SPREAD",
        )
    return max_gpus_per_box


def check_host_resources(
    cpu_cores: int,
    memory_mib: int,
    cpu_field: str = "cpu_cores",
    memory_field: str = "memory_mib",
) -> None:
    """Raise :class:`InvalidArgument` unless ``cpu_cores`` (0..MAX_HOST_CPUS) and
    ``memory_mib`` (0..MAX_HOST_MEMORY_MIB) are a host's size or a node's need of it;
    the message names the field as given."""
    if not 0 <= cpu_cores <= MAX_HOST_CPUS:
        raise InvalidArgument(
            f"{cpu_field} {cpu_cores} is out of range: use 0 (none) up to {MAX_HOST_CPUS}",
            reason="INVALID_HOST_RESOURCES",
        )
    if not 0 <= memory_mib <= MAX_HOST_MEMORY_MIB:
        raise InvalidArgument(
            f"{memory_field} {memory_mib} is out of range: use 0 (none) up to "
            f"{MAX_HOST_MEMORY_MIB} (1 PiB)",
            reason="INVALID_HOST_RESOURCES",
        )


def parse_host_memory_mib(value: str) -> int:
    """``"512GiB"`` -> 524288: a host's memory, or a node's need of it."""
    match = _MEMORY.fullmatch(value)
    if not match:
        raise InvalidArgument(
            f"cannot parse memory size {_shown(value)}: expected a number and MiB, GiB or "
            "TiB (e.g. 256GiB)",
            reason="INVALID_MEMORY",
        )
    mib = round(float(match.group(1)) * _MIB_PER_UNIT[match.group(2).lower()])
    if mib > MAX_HOST_MEMORY_MIB:
        raise InvalidArgument(
            f"memory size {_shown(value)} is larger than any host: use at most 1024TiB",
            reason="INVALID_MEMORY",
        )
    return mib
