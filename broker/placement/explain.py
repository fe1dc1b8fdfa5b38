"""The lines a failed placement answers with, for what no single plugin can explain alone.

Each line names one constraint, what exists, what was asked, and the closest thing
available, e.g. ``"gpus: 512 in the pool, 12 H100, 3 free; 4 H100 requested"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dxpool.broker.placement.framework import DroppedLink
from dxpool.broker.placement.model import PlacementRequest
from dxpool.broker.placement.text import format_duration_ns, gpu_noun, plural

_ERRORS_SHOWN = 1


@dataclass(frozen=True, slots=True)
class FunnelStage:
    """``count`` GPUs were left after a filter whose survivors are ``label``; ``closest``
    is that filter's hint about what it dropped (when the supply fell short)."""

    label: str
    count: int
    closest: str | None


def supply_line(request: PlacementRequest, funnel: Sequence[FunnelStage]) -> str:
    """The GPU supply, stage by stage (only stages that dropped something are shown).

    ``funnel[0]`` is the whole pool; each later stage is what a filter left.
    """
    if not funnel:
        return (
            f"gpus: the pool is empty; {request.count} {gpu_noun(request, request.count)} requested"
        )
    parts = [f"{funnel[0].count} {funnel[0].label}"]
    previous = funnel[0].count
    hints: list[str] = []
    for stage in funnel[1:]:
        if stage.count < previous:
            parts.append(f"{stage.count} {stage.label}")
            if stage.closest:
                hints.append(stage.closest)
        previous = stage.count
    wanted = f"{request.count} {gpu_noun(request, request.count)} requested"
    line = f"gpus: {', '.join(parts)}; {wanted}"
    return "; ".join([line, *hints])


def unreached_host_reason(
    request: PlacementRequest, reach: int, nearest: DroppedLink | None, errors: Sequence[str]
) -> str:
    """Why a host that passed every host filter still got no proposal."""
    reason = f"only {reach} free {gpu_noun(request, reach)} within reach, {request.count} needed"
    if nearest is not None:
        away = format_duration_ns(nearest.estimate.round_trip_ns)
        reason += (
            f"; nearest left out: boxes/{nearest.box.box} ({plural(nearest.gpus, 'GPU')}) at {away}"
        )
    if errors:
        reason += f"; {plural(len(errors), 'latency error')}, e.g. {errors[0]}"
    return reason


def reach_line(request: PlacementRequest, reach: int, host: str) -> str:
    """The most GPUs any one candidate host could reach."""
    return (
        f"reach: at most {reach} free {gpu_noun(request, reach)} usable from one host "
        f"(hosts/{host}), {request.count} requested"
    )


def switch_reason(request: PlacementRequest, held: int, switch: str) -> str:
    """Why a host that reaches enough GPUs got no proposal under switch affinity."""
    return (
        f"no rack switch holds {request.count} free {gpu_noun(request, request.count)} "
        f"within reach (affinity switch); the most under one is {held} ({switch})"
    )


def switch_line(request: PlacementRequest, held: int, switch: str, host: str) -> str:
    """The most GPUs under one switch any candidate host could reach (switch affinity)."""
    return (
        f"switch: at most {held} free {gpu_noun(request, held)} under one rack switch "
        f"({switch}, usable from hosts/{host}), {request.count} requested with affinity "
        "switch; ask without it, or for fewer GPUs"
    )


def link_error_line(errors: Sequence[str]) -> str:
    """How many (host, box) pairs the fabric model failed for, with the first error."""
    shown = "; ".join(errors[:_ERRORS_SHOWN])
    return (
        f"latency: the fabric model failed for {plural(len(errors), '(host, box) pair')}: {shown}"
    )
