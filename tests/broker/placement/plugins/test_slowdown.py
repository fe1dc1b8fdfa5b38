"""The slowdown bound: a workload's max_slowdown as a round-trip bound on every GPU."""

from __future__ import annotations

import pytest

from dxpool.broker.placement.framework import DroppedLink
from dxpool.broker.placement.model import (
    BoxInfo,
    HostInfo,
    LatencyEstimate,
    Place,
    PlacementRequest,
)
from dxpool.broker.placement.placer import place
from dxpool.broker.placement.plugins.boxes import LatencyBound
from dxpool.broker.placement.plugins.slowdown import SlowdownBound
from dxpool.broker.placement.status import Code
from dxpool.errors import InvalidArgument
from dxpool.fabric.latency import TopologyLatencyModel
from dxpool.fabric.topology import Topology
from tests.broker.placement.pools import Pool, TableLatency

BOX = BoxInfo("b1", Place("boxes/b1"), True)
HOST = HostInfo("h1", Place("hosts/h1"), 8, frozenset(), True)
# 100 round trips per 5ms step: 1.05 allows 2.5us, 1.10 allows 5us
WORKLOAD = "100@5ms"


def estimate(ns: int) -> LatencyEstimate:
    return LatencyEstimate(ns, ("proxy:hosts/h1", "proxy:boxes/b1"))


def test_the_bound_is_the_round_trip_the_slowdown_allows() -> None:
    plugin = SlowdownBound()
    request = PlacementRequest("H100", 1, max_slowdown=1.05, workload=WORKLOAD)
    assert plugin.applies(request)
    assert plugin.round_trip_bound(request) == 2_500
    assert plugin.filter_link(request, HOST, BOX, estimate(2_500)).ok
    status = plugin.filter_link(request, HOST, BOX, estimate(3_000))
    assert status.code is Code.UNSCHEDULABLE
    assert status.reasons == (
        "boxes/b1 is 3us away: predicted slowdown 1.060 of 100@5ms exceeds max_slowdown 1.05",
    )
    assert not plugin.applies(PlacementRequest("H100", 1, max_latency_ns=2_000))


def test_with_both_bounds_the_tighter_applies_and_latency_bound_steps_aside() -> None:
    plugin = SlowdownBound()
    both = PlacementRequest("H100", 1, max_latency_ns=2_000, max_slowdown=1.05, workload=WORKLOAD)
    assert not LatencyBound().applies(both)
    assert plugin.round_trip_bound(both) == 2_000
    status = plugin.filter_link(both, HOST, BOX, estimate(2_200))
    assert status.reasons == ("boxes/b1 is 2.2us away: max_latency 2us",)
    looser = PlacementRequest("H100", 1, max_latency_ns=9_000, max_slowdown=1.05, workload=WORKLOAD)
    assert plugin.round_trip_bound(looser) == 2_500


def test_explain_names_the_bound_and_the_slowdown_at_the_nearest_gpu_beyond_it() -> None:
    plugin = SlowdownBound()
    request = PlacementRequest("H100", 4, max_slowdown=1.05, workload="inference-online")
    other = HostInfo("h2", Place("hosts/h2"), 8, frozenset(), True)
    b3 = BoxInfo("b3", Place("boxes/b3"), True)
    nearest = [
        DroppedLink(HOST, BOX, estimate(7_400), 8),
        DroppedLink(other, b3, estimate(4_400), 2),
    ]
    assert plugin.explain(request, nearest) == (
        "max_slowdown 1.05 for workload inference-online (100 round trips per 5ms step) "
        "allows at most 2.5us round trip: the nearest free H100 beyond it is 4.4us from "
        "hosts/h2 (boxes/b3), predicted slowdown 1.088; relax max_slowdown or compose from "
        "a host nearer the free GPUs"
    )
    assert plugin.explain(request, []) is None


def test_a_request_with_a_slowdown_needs_a_known_workload() -> None:
    with pytest.raises(InvalidArgument, match="needs a workload"):
        PlacementRequest("H100", 1, max_slowdown=1.05)
    with pytest.raises(InvalidArgument, match="known profiles"):
        PlacementRequest("H100", 1, max_slowdown=1.05, workload="mystery")


def test_placement_takes_only_boxes_within_the_slowdown_and_plan_says_why() -> None:
    snapshot = Pool().box("near", 2).box("far", 8).host("h1").snapshot()
    latency = TableLatency({("h1", "near"): 2_000, ("h1", "far"): 6_000})
    within = place(
        PlacementRequest("H100", 2, max_slowdown=1.05, workload=WORKLOAD), snapshot, latency
    )
    assert within.placement is not None
    assert [b.box for b in within.placement.bindings] == ["near", "near"]
    too_many = place(
        PlacementRequest("H100", 3, max_slowdown=1.05, workload=WORKLOAD), snapshot, latency
    )
    assert too_many.placement is None
    (candidate,) = too_many.candidates
    assert candidate.reasons == (
        "only 2 free H100 within reach, 3 needed; nearest left out: boxes/far (8 GPUs) at 6us",
    )
    assert any(
        line.startswith("max_slowdown 1.05 for workload 100@5ms")
        and "predicted slowdown 1.120" in line
        for line in too_many.unsatisfied
    ), too_many.unsatisfied


def test_tiered_and_pair_by_pair_placement_agree_on_a_rack_topology() -> None:
    """With the tree model (tiered), the bound cuts whole racks: far racks are out."""
    model = TopologyLatencyModel(Topology.default())
    pool = Pool().host("h1", rack="r1")
    pool.box("same-rack", 1, rack="r1").box("other-rack", 8, rack="r2")
    snapshot = pool.snapshot()
    # same rack 2.9us, same pod 4.4us; inference-online at 1.10 allows 5us, at 1.07 3.5us
    loose = PlacementRequest("H100", 4, max_slowdown=1.10, workload="inference-online")
    tight = PlacementRequest("H100", 4, max_slowdown=1.07, workload="inference-online")
    fitted = place(loose, snapshot, model)
    assert fitted.placement is not None
    assert {b.box for b in fitted.placement.bindings} == {"other-rack"}
    refused = place(tight, snapshot, model)
    assert refused.placement is None
    pairwise = place(tight, snapshot, TableLatency({("h1", "same-rack"): 2_900}, 4_400))
    assert pairwise.placement is None
    assert refused.unsatisfied == pairwise.unsatisfied


class CountingTreeModel(TopologyLatencyModel):
    """The tree model, counting the (host, box) pairs placement asks about."""

    def __init__(self) -> None:
        super().__init__(Topology.default())
        self.pairs = 0

    def round_trip(self, host: Place, box: Place) -> LatencyEstimate:
        self.pairs += 1
        return super().round_trip(host, box)


@pytest.mark.parametrize("max_latency_ns", [0, 4_000])
def test_a_slowdown_bound_keeps_placement_on_the_tiered_path(max_latency_ns: int) -> None:
    """The bound is a round trip, so placement cuts whole racks: it asks about a handful of
    pairs, not one per (host, box) (with max_latency too, one link filter still applies)."""
    pool = Pool()
    for rack in range(8):
        for k in range(5):
            pool.host(f"h{rack}-{k}", rack=f"r{rack}")
            pool.box(f"b{rack}-{k}", 2, rack=f"r{rack}")
    snapshot = pool.snapshot()
    model = CountingTreeModel()
    request = PlacementRequest(
        "H100",
        4,
        max_latency_ns=max_latency_ns,
        max_slowdown=1.07,
        workload="inference-online",
    )
    result = place(request, snapshot, model)
    assert result.placement is not None
    assert {b.latency_ns for b in result.placement.bindings} == {2_900}  # same rack only
    assert model.pairs < len(snapshot.hosts) * len(snapshot.boxes) // 10, model.pairs
