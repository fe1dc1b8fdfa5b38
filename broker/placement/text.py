"""How placement writes quantities in its reasons, so every message reads the same."""

from __future__ import annotations

from collections.abc import Sequence

from dxpool.broker.placement.model import PlacementRequest
from dxpool.request import format_duration_ns

__all__ = ["format_duration_ns", "format_memory", "gpu_noun", "plural", "sample_names"]

_SAMPLE = 3  # names listed before "and N more"


def format_memory(mib: int) -> str:
    """81920 -> ``"80GiB"``; 1536 -> ``"1536MiB"``."""
    return f"{mib // 1024}GiB" if mib and mib % 1024 == 0 else f"{mib}MiB"


def gpu_noun(request: PlacementRequest, count: int = 1) -> str:
    """What the request asks for, as a noun for ``count`` of them: the model, or
    ``"GPU"``/``"GPUs"`` for any model."""
    if request.model:
        return request.model
    return "GPU" if count == 1 else "GPUs"


def plural(count: int, noun: str) -> str:
    """``plural(1, "host")`` -> ``"1 host"``; ``plural(3, "host")`` -> ``"3 hosts"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def sample_names(names: Sequence[str]) -> str:
    """``"hosts/a, hosts/b, hosts/c and 4 more"``, in the order given."""
    shown = ", ".join(names[:_SAMPLE])
    rest = len(names) - _SAMPLE
    return f"{shown} and {rest} more" if rest > 0 else shown
