"""The slowdown bound: keeps, for each host, the boxes near enough for the request's
workload to run at most ``max_slowdown`` times slower than on a local GPU.

The overhead model (:mod:`dxpool.fabric.overhead`) turns the bound into a round trip:
``(max_slowdown - 1) x step time / round trips per step``. The filter is therefore a
round-trip bound like ``max_latency``, and placement cuts whole tiers of boxes with it
instead of judging each (host, box) pair. When a request carries both bounds this filter
applies the tighter of the two and :class:`~.boxes.LatencyBound` steps aside (two link
filters would force the pair-by-pair path); its reasons say which bound dropped a box.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from dxpool.broker.placement.framework import DroppedLink
from dxpool.broker.placement.model import BoxInfo, HostInfo, LatencyEstimate, PlacementRequest
from dxpool.broker.placement.status import SUCCESS, Status
from dxpool.broker.placement.text import format_duration_ns, gpu_noun
from dxpool.fabric.overhead import WorkloadProfile, parse_workload


@functools.lru_cache(maxsize=256)
def _profile(workload: str) -> WorkloadProfile:
    return parse_workload(workload)


def slowdown_round_trip_bound(request: PlacementRequest) -> int:
    """The largest round trip (ns) that keeps ``request``'s workload within its
    ``max_slowdown``, tightened by ``max_latency_ns`` when that is set too."""
    bound = _profile(request.workload).max_round_trip_ns(request.max_slowdown)
    if request.max_latency_ns > 0:
        bound = min(bound, request.max_latency_ns)
    return bound


class SlowdownBound:
    """Keeps the boxes within the round trip ``max_slowdown`` allows (and ``max_latency``,
    when given as well). Applies only to requests with ``max_slowdown`` set."""

    name = "slowdown_bound"

    def applies(self, request: PlacementRequest) -> bool:
        return request.max_slowdown > 0

    def round_trip_bound(self, request: PlacementRequest) -> int:
        return slowdown_round_trip_bound(request)

    def filter_link(
        self,
        request: PlacementRequest,
        host: HostInfo,
        box: BoxInfo,
        estimate: LatencyEstimate,
    ) -> Status:
        round_trip = estimate.round_trip_ns
        if round_trip <= slowdown_round_trip_bound(request):
            return SUCCESS
        away = format_duration_ns(round_trip)
        return Status.unschedulable(
            f"boxes/{box.box} is {away} away: {_why(request, round_trip)}",
            plugin=self.name,
        )

    def explain(self, request: PlacementRequest, nearest: Sequence[DroppedLink]) -> str | None:
        """The bound in round-trip terms, and the nearest free matching GPU beyond it with
        the slowdown predicted there."""
        if not nearest:
            return None
        best = min(nearest, key=lambda link: (link.estimate.round_trip_ns, link.host.host))
        profile = _profile(request.workload)
        bound = slowdown_round_trip_bound(request)
        round_trip = best.estimate.round_trip_ns
        return (
            f"max_slowdown {request.max_slowdown:g} for workload {request.workload} "
            f"({profile.describe()}) allows at most {format_duration_ns(bound)} round trip"
            f"{_latency_note(request, profile)}: the nearest free {gpu_noun(request)} beyond "
            f"it is {format_duration_ns(round_trip)} from hosts/{best.host.host} "
            f"(boxes/{best.box.box}), predicted slowdown {profile.slowdown(round_trip):.3f}; "
            "relax max_slowdown or compose from a host nearer the free GPUs"
        )


def _why(request: PlacementRequest, round_trip: int) -> str:
    profile = _profile(request.workload)
    predicted = profile.slowdown(round_trip)
    if predicted > request.max_slowdown:
        return (
            f"predicted slowdown {predicted:.3f} of {request.workload} exceeds "
            f"max_slowdown {request.max_slowdown:g}"
        )
    return f"max_latency {format_duration_ns(request.max_latency_ns)}"


def _latency_note(request: PlacementRequest, profile: WorkloadProfile) -> str:
    if request.max_latency_ns <= 0:
        return ""
    if request.max_latency_ns < profile.max_round_trip_ns(request.max_slowdown):
        return f" (max_latency {format_duration_ns(request.max_latency_ns)} is tighter)"
    return ""
