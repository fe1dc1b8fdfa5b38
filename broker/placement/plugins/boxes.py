"""Box filters: which boxes a request may draw from, at all and from a given host."""

from __future__ import annotations

from collections.abc import Sequence

from dxpool.broker.placement.framework import DroppedLink
from dxpool.broker.placement.model import BoxInfo, HostInfo, LatencyEstimate, PlacementRequest
from dxpool.broker.placement.status import SUCCESS, Status
from dxpool.broker.placement.text import format_duration_ns, gpu_noun


class BoxSchedulable:
    """Keeps boxes that are ACTIVE; a cordoned box gives no GPU to a new node."""

    name = "box_schedulable"
    reads: frozenset[str] = frozenset()
    _CORDONED = Status.unschedulable("box is cordoned or not active", plugin=name)

    def applies(self, request: PlacementRequest) -> bool:
        return True

    def filter_box(self, request: PlacementRequest, box: BoxInfo) -> Status:
        return SUCCESS if box.schedulable else self._CORDONED

    def label(self, request: PlacementRequest) -> str:
        return "in schedulable boxes"


class LatencyBound:
    """Keeps, for each host, the boxes within the request's ``max_latency_ns`` round trip.

    It says which bound it applies (``round_trip_bound``), so with a latency model that
    ranks boxes in tiers the pipeline cuts whole tiers instead of asking it per pair. A
    request that also bounds its slowdown is left to
    :class:`~.slowdown.SlowdownBound`, which applies the tighter of both bounds (one link
    filter keeps placement on the tiered path).
    """

    name = "latency_bound"

    def applies(self, request: PlacementRequest) -> bool:
        return request.max_latency_ns > 0 and request.max_slowdown <= 0

    def round_trip_bound(self, request: PlacementRequest) -> int:
        return request.max_latency_ns

    def filter_link(
        self,
        request: PlacementRequest,
        host: HostInfo,
        box: BoxInfo,
        estimate: LatencyEstimate,
    ) -> Status:
        if estimate.round_trip_ns <= request.max_latency_ns:
            return SUCCESS
        return Status.unschedulable(
            f"boxes/{box.box} is {format_duration_ns(estimate.round_trip_ns)} away, "
            f"max_latency {format_duration_ns(request.max_latency_ns)}",
            plugin=self.name,
        )

    def explain(self, request: PlacementRequest, nearest: Sequence[DroppedLink]) -> str | None:
        """Names the nearest free matching GPU beyond the bound and where it is."""
        if not nearest:
            return None
        best = min(nearest, key=lambda link: (link.estimate.round_trip_ns, link.host.host))
        return (
            f"max_latency {format_duration_ns(request.max_latency_ns)}: the nearest free "
            f"{gpu_noun(request)} beyond it is "
            f"{format_duration_ns(best.estimate.round_trip_ns)} from hosts/{best.host.host} "
            f"(boxes/{best.box.box})"
        )
