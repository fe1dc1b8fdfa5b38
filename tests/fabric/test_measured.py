"""The measured model: EWMA smoothing, per-rack aggregation, staleness fallback, tiers."""

from __future__ import annotations

import random

import pytest

from dxpool.errors import InvalidArgument
from dxpool.fabric.latency import LatencySource, Place, TieredLatencyModel, TopologyLatencyModel
from dxpool.fabric.measured import (
    MeasuredLatency,
    MeasuredLatencyModel,
    Measurement,
    RoundTripSmoother,
)
from dxpool.fabric.topology import Location, Topology
from tests.fabric.tier_contract import assert_tier_contract, random_place

TOPOLOGY = Topology.default()
TREE = TopologyLatencyModel(TOPOLOGY)
HOSTS = {
    "h1": Place("hosts/h1", "dc1", "p1", "r1"),
    "h2": Place("hosts/h2", "dc1", "p1", "r1"),
    "h3": Place("hosts/h3", "dc1", "p1", "r2"),
}
BOXES = {
    "b1": Place("boxes/b1", "dc1", "p1", "r2"),
    "b2": Place("boxes/b2", "dc1", "p1", "r2"),
    "b3": Place("boxes/b3", "dc1", "p2", "r1"),
}


class Clock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def source(clock: Clock, staleness_s: float = 60.0) -> MeasuredLatency:
    return MeasuredLatency(
        TOPOLOGY,
        host_place=HOSTS.get,
        box_place=BOXES.get,
        staleness_s=staleness_s,
        clock=clock,
    )


def test_the_smoother_is_an_ewma_that_starts_at_the_first_probe() -> None:
    smoother = RoundTripSmoother(alpha=0.25)
    assert smoother.observe("b1", 4_000, 1.0) == 4_000
    assert smoother.observe("b1", 8_000, 2.0) == 5_000  # 4000 + 0.25 x 4000
    assert smoother.observe("b1", 8_000, 3.0) == 5_750
    assert smoother.observe("b1", 0, 4.0) is None  # not a round trip: ignored
    assert smoother.observe("b2", 3_000, 5.0) == 3_000
    assert smoother.measurements() == [
        Measurement("b1", 5_750, 3.0),
        Measurement("b2", 3_000, 5.0),
    ]
    smoother.forget("b1")
    assert [m.box for m in smoother.measurements()] == ["b2"]


def test_one_slow_probe_moves_the_figure_by_alpha_of_the_difference() -> None:
    smoother = RoundTripSmoother()  # alpha 0.2
    for at in range(20):
        smoother.observe("b1", 3_000, float(at))
    assert smoother.observe("b1", 103_000, 21.0) == 23_000
    for at in range(22, 33):  # 11 probes: 0.8^11 of the excess is left
        smoothed = smoother.observe("b1", 3_000, float(at))
    assert smoothed == round(3_000 + 20_000 * 0.8**11)


def test_a_step_change_is_within_ten_percent_after_eleven_probes() -> None:
    smoother = RoundTripSmoother()
    smoother.observe("b1", 3_000, 0.0)
    values = [smoother.observe("b1", 6_000, float(at)) for at in range(1, 12)]
    assert values[-2] is not None and 6_000 - values[-2] > 300
    assert values[-1] is not None and 6_000 - values[-1] <= 300


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, float("nan")])
def test_alpha_must_be_in_zero_one(alpha: float) -> None:
    with pytest.raises(InvalidArgument, match="alpha"):
        RoundTripSmoother(alpha)


def test_measured_rack_pairs_answer_the_mean_of_their_hosts_and_boxes() -> None:
    clock = Clock()
    measured = source(clock)
    assert isinstance(measured, LatencySource)
    measured.report(
        "h1", [Measurement("b1", 6_000, clock.now), Measurement("b3", 9_000, clock.now)]
    )
    measured.report("h2", [Measurement("b2", 8_000, clock.now)])
    model = measured.current()
    # h1 and h2 share rack r1; b1 and b2 share rack r2: every such pair is the mean
    for host in ("h1", "h2"):
        for box in ("b1", "b2"):
            estimate = model.round_trip(HOSTS[host], BOXES[box])
            assert estimate.round_trip_ns == 7_000
            assert estimate.path[1] == "measured:dc1/p1/r1->dc1/p1/r2"
    assert model.round_trip(HOSTS["h1"], BOXES["b3"]).round_trip_ns == 9_000
    # no measurement from rack r2 hosts: the tree answers
    assert model.round_trip(HOSTS["h3"], BOXES["b1"]) == TREE.round_trip(HOSTS["h3"], BOXES["b1"])


def test_the_same_model_is_handed_out_until_something_changes() -> None:
    clock = Clock()
    measured = source(clock)
    measured.report("h1", [Measurement("b1", 6_000, clock.now)])
    first = measured.current()
    clock.now += 1
    assert measured.current() is first
    measured.report("h1", [Measurement("b1", 6_000, clock.now - 1)])  # the same report
    assert measured.current() is first
    measured.report("h1", [Measurement("b1", 7_000, clock.now)])
    second = measured.current()
    assert second is not first
    assert second.round_trip(HOSTS["h1"], BOXES["b1"]).round_trip_ns == 7_000
    assert first.round_trip(HOSTS["h1"], BOXES["b1"]).round_trip_ns == 6_000  # immutable


def test_stale_measurements_fall_back_to_the_topology_model() -> None:
    clock = Clock()
    measured = source(clock, staleness_s=60)
    measured.report("h1", [Measurement("b1", 6_000, clock.now)])
    measured.report("h3", [Measurement("b3", 50_000, clock.now - 30)])
    assert measured.current().round_trip(HOSTS["h3"], BOXES["b3"]).round_trip_ns == 50_000
    clock.now += 30  # h3's report is now 60 s old: stale
    model = measured.current()
    assert model.round_trip(HOSTS["h3"], BOXES["b3"]) == TREE.round_trip(HOSTS["h3"], BOXES["b3"])
    assert model.round_trip(HOSTS["h1"], BOXES["b1"]).round_trip_ns == 6_000
    clock.now += 30
    assert measured.current().round_trip(HOSTS["h1"], BOXES["b1"]) == TREE.round_trip(
        HOSTS["h1"], BOXES["b1"]
    )
    assert measured.current().measured_pairs == {}


def test_a_report_from_the_future_counts_as_now() -> None:
    clock = Clock()
    measured = source(clock, staleness_s=60)
    measured.report("h1", [Measurement("b1", 6_000, clock.now + 3_600)])  # host clock ahead
    assert measured.current().round_trip(HOSTS["h1"], BOXES["b1"]).round_trip_ns == 6_000
    clock.now += 61
    assert measured.current().measured_pairs == {}


def test_forgotten_hosts_and_unknown_endpoints_do_not_count() -> None:
    clock = Clock()
    measured = source(clock)
    measured.report("h1", [Measurement("b1", 6_000, clock.now), Measurement("ghost", 1, clock.now)])
    measured.report("nobody", [Measurement("b1", 1_000, clock.now)])
    assert measured.current().measured_pairs == {
        (Location("dc1", "p1", "r1"), Location("dc1", "p1", "r2")): 6_000
    }
    measured.forget("h1")
    assert measured.current().measured_pairs == {}


def test_a_report_between_reading_and_building_is_not_lost() -> None:
    """A report that lands while current() builds a model from older reports makes the
    next current() build again (the version it built from is older)."""
    clock = Clock()
    measured = source(clock)
    measured.report("h1", [Measurement("b1", 6_000, clock.now)])
    real_build = measured._build

    def build_then_report(*args, **kwargs):  # type: ignore[no-untyped-def]
        model = real_build(*args, **kwargs)
        measured.report("h1", [Measurement("b1", 9_000, clock.now)])
        return model

    measured._build = build_then_report  # type: ignore[method-assign]
    stale = measured.current()
    measured._build = real_build  # type: ignore[method-assign]
    assert stale.round_trip(HOSTS["h1"], BOXES["b1"]).round_trip_ns == 6_000
    assert measured.current().round_trip(HOSTS["h1"], BOXES["b1"]).round_trip_ns == 9_000


def test_classes_stay_racks_and_the_tier_contract_holds() -> None:
    rng = random.Random(11)
    hosts = [random_place(rng, f"hosts/h{i}") for i in range(40)]
    boxes = [random_place(rng, f"boxes/b{i}") for i in range(40)]
    samples = [
        (rng.choice(hosts), rng.choice(boxes), rng.randrange(2_000, 90_000)) for _ in range(60)
    ]
    model = MeasuredLatencyModel(TOPOLOGY, samples)
    assert isinstance(model, TieredLatencyModel)
    assert model.measured_pairs  # some pairs are measured, others fall back
    assert_tier_contract(model, hosts, boxes)
    racks = {model.host_class(h) for h in hosts}
    assert len(racks) <= 2 * 2 * 3 + 1  # racks of the tree, plus one for unplaced


def test_staleness_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="staleness"):
        source(Clock(), staleness_s=0)


def test_placement_follows_the_measurements_and_a_slowdown_bound_uses_them() -> None:
    """A same-rack box measured slow loses to a box one rack over; once the measurement
    is stale, the tree's estimate (same rack is nearest) wins again."""
    from dxpool.broker.placement.model import PlacementRequest
    from dxpool.broker.placement.placer import place
    from tests.broker.placement.pools import Pool

    snapshot = Pool().host("h1", rack="r1").box("near", 4, rack="r1").box("far", 4, rack="r2")
    snapshot = snapshot.snapshot()
    clock = Clock()
    host, near = snapshot.hosts["h1"].place, snapshot.boxes["near"].place
    measured = MeasuredLatency(
        TOPOLOGY,
        host_place=lambda h: host if h == "h1" else None,
        box_place=lambda b: near if b == "near" else None,
        staleness_s=60,
        clock=clock,
    )
    measured.report("h1", [Measurement("near", 50_000, clock.now)])
    request = PlacementRequest("H100", 2, max_slowdown=1.1, workload="inference-online")
    chosen = place(request, snapshot, measured.current())
    assert chosen.placement is not None
    assert {b.box for b in chosen.placement.bindings} == {"far"}
    clock.now += 61
    chosen = place(request, snapshot, measured.current())
    assert chosen.placement is not None
    assert {b.box for b in chosen.placement.bindings} == {"near"}
