"""The DxPU-style overhead model: slowdown from added round trips, and its inverse."""

from __future__ import annotations

import pytest

from dxpool.errors import InvalidArgument
from dxpool.fabric.overhead import (
    MAX_SLOWDOWN,
    PROFILES,
    WorkloadProfile,
    check_slowdown,
    parse_slowdown,
    parse_workload,
)
from dxpool.limits import MAX_LATENCY_NS


def test_slowdown_is_one_plus_round_trips_times_added_latency_over_step_time() -> None:
    profile = WorkloadProfile("p", round_trips_per_step=100, step_time_ns=5_000_000)
    assert profile.slowdown(0) == 1.0
    assert profile.slowdown(4_400) == pytest.approx(1.088)
    assert profile.slowdown(-5) == 1.0  # nothing is faster than local


@pytest.mark.parametrize("max_slowdown", [1.0001, 1.01, 1.05, 1.088, 2.0, 37.3])
def test_the_round_trip_bound_is_the_largest_round_trip_within_the_slowdown(
    max_slowdown: float,
) -> None:
    profile = WorkloadProfile("p", round_trips_per_step=100, step_time_ns=5_000_000)
    bound = profile.max_round_trip_ns(max_slowdown)
    assert profile.slowdown(bound) <= max_slowdown
    assert profile.slowdown(bound + 1) > max_slowdown


def test_a_workload_without_blocking_round_trips_tolerates_any_fabric() -> None:
    profile = WorkloadProfile("posted-only", round_trips_per_step=0, step_time_ns=1_000)
    assert profile.max_round_trip_ns(1.01) == MAX_LATENCY_NS
    assert profile.slowdown(10**9) == 1.0


def test_named_profiles_stay_under_ten_percent_at_a_same_pod_round_trip_but_one() -> None:
    same_pod = 4_400  # the default topology's same-pod round trip
    slowdowns = {name: profile.slowdown(same_pod) for name, profile in PROFILES.items()}
    assert all(value < 1.10 for value in slowdowns.values()), slowdowns
    assert max(slowdowns, key=slowdowns.__getitem__) == "inference-online"


def test_parse_workload_takes_a_name_or_round_trips_at_step_time() -> None:
    assert parse_workload("training") is PROFILES["training"]
    inline = parse_workload("400@5ms")
    assert (inline.round_trips_per_step, inline.step_time_ns) == (400.0, 5_000_000)
    assert parse_workload(" 2.5 @ 1.5us ").step_time_ns == 1_500


@pytest.mark.parametrize("text", ["", "trainin", "400", "@5ms", "400@", "400@5parsecs", "x@1ms"])
def test_an_unknown_workload_lists_the_known_profiles(text: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        parse_workload(text)
    message = str(raised.value)
    assert raised.value.reason in ("UNKNOWN_WORKLOAD", "INVALID_DURATION")
    if raised.value.reason == "UNKNOWN_WORKLOAD":
        assert "compute-bound, inference-batch, inference-online, training" in message
        assert "ROUND_TRIPS@STEP_TIME" in message


def test_a_step_time_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="step time"):
        parse_workload("10@11s")
    with pytest.raises(InvalidArgument, match="step time"):
        WorkloadProfile("zero", 1, 0)
    with pytest.raises(InvalidArgument, match="round trips"):
        WorkloadProfile("nan", float("nan"), 1_000)


def test_check_slowdown_wants_a_ratio_above_one_and_a_workload() -> None:
    check_slowdown(0, "")
    check_slowdown(1.05, "training")
    for bad in (1.0, 0.5, -1.0, float("inf"), float("nan"), MAX_SLOWDOWN + 1):
        with pytest.raises(InvalidArgument, match="out of range") as raised:
            check_slowdown(bad, "training")
        assert raised.value.reason == "INVALID_SLOWDOWN"
    with pytest.raises(InvalidArgument, match="needs a workload"):
        check_slowdown(1.05, "")
    with pytest.raises(InvalidArgument, match="known profiles"):
        check_slowdown(0, "nonsense")


def test_parse_slowdown() -> None:
    assert parse_slowdown("1.05") == 1.05
    assert parse_slowdown("0") == 0
    for bad in ("1", "0.9", "1e3", "fast", "101", "1.05x"):
        with pytest.raises(InvalidArgument, match="slowdown"):
            parse_slowdown(bad)
