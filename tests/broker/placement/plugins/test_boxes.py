"""Box filters: schedulable boxes, and boxes within the latency bound of a host."""

from __future__ import annotations

from dxpool.broker.placement.framework import DroppedLink
from dxpool.broker.placement.model import (
    BoxInfo,
    HostInfo,
    LatencyEstimate,
    Place,
    PlacementRequest,
)
from dxpool.broker.placement.plugins.boxes import BoxSchedulable, LatencyBound
from dxpool.broker.placement.status import Code

BOX = BoxInfo("b1", Place("boxes/b1"), True)
HOST = HostInfo("h1", Place("hosts/h1"), 8, frozenset(), True)


def estimate(ns: int) -> LatencyEstimate:
    return LatencyEstimate(ns, ("proxy:hosts/h1", "proxy:boxes/b1"))


def test_schedulable() -> None:
    plugin = BoxSchedulable()
    request = PlacementRequest("", 1)
    assert plugin.filter_box(request, BOX).ok
    cordoned = plugin.filter_box(request, BoxInfo("b2", Place("boxes/b2"), False))
    assert cordoned.code is Code.UNSCHEDULABLE
    assert plugin.label(request) == "in schedulable boxes"


def test_latency_bound_keeps_boxes_at_or_within_the_bound() -> None:
    plugin = LatencyBound()
    request = PlacementRequest("H100", 1, max_latency_ns=2_000)
    assert plugin.applies(request)
    assert plugin.filter_link(request, HOST, BOX, estimate(2_000)).ok
    status = plugin.filter_link(request, HOST, BOX, estimate(3_100))
    assert status.code is Code.UNSCHEDULABLE
    assert status.reasons == ("boxes/b1 is 3.1us away, max_latency 2us",)
    assert not plugin.applies(PlacementRequest("H100", 1))


def test_latency_bound_explains_the_nearest_gpu_beyond_it() -> None:
    plugin = LatencyBound()
    request = PlacementRequest("H100", 4, max_latency_ns=2_000)
    other = HostInfo("h2", Place("hosts/h2"), 8, frozenset(), True)
    b3 = BoxInfo("b3", Place("boxes/b3"), True)
    nearest = [
        DroppedLink(HOST, BOX, estimate(4_000), 8),
        DroppedLink(other, b3, estimate(3_100), 2),
    ]
    assert plugin.explain(request, nearest) == (
        "max_latency 2us: the nearest free H100 beyond it is 3.1us from hosts/h2 (boxes/b3)"
    )
    assert plugin.explain(request, []) is None
