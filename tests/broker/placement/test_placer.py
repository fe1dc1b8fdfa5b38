"""place(): the whole pipeline on small pools — what it chooses, and how it explains."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dxpool.broker.placement import (
    Binding,
    PlacementRequest,
    PlacementResult,
    Snapshot,
    place,
)
from dxpool.broker.placement.placer import most_free_mixes
from dxpool.errors import InvalidArgument, NotFound
from dxpool.fabric.latency import TopologyLatencyModel
from dxpool.fabric.topology import Topology

from .pools import Pool, TableLatency


def request(
    count: int,
    model: str = "H100",
    *,
    min_memory_mib: int = 0,
    host: str | None = None,
    max_latency_ns: int = 0,
    exclude_gpus: frozenset[str] = frozenset(),
) -> PlacementRequest:
    return PlacementRequest(model, count, min_memory_mib, host, max_latency_ns, exclude_gpus)


def boxes_of(result: PlacementResult) -> list[str]:
    assert result.placement is not None, result.unsatisfied
    return [binding.box for binding in result.placement.bindings]


def report(result: PlacementResult, host: str) -> tuple[bool, tuple[str, ...]]:
    (found,) = [c for c in result.candidates if c.host == host]
    return found.feasible, found.reasons


# -- what it chooses ---------------------------------------------------------------------


def test_fits_in_one_box_when_one_can_hold_every_gpu() -> None:
    snapshot = Pool().box("a", 2).box("b", 3).box("c", 8).host("h1").snapshot()
    result = place(request(4), snapshot, TableLatency())
    assert boxes_of(result) == ["c"] * 4


def test_takes_the_box_that_fits_most_tightly_so_whole_boxes_stay_free() -> None:
    snapshot = Pool().box("a", 8).box("b", 4).box("c", 6).host("h1").snapshot()
    result = place(request(4), snapshot, TableLatency())
    assert boxes_of(result) == ["b"] * 4


def test_splits_over_the_fewest_boxes_when_no_box_holds_every_gpu() -> None:
    snapshot = Pool().box("a", 2).box("b", 3).box("c", 1).box("d", 3).host("h1").snapshot()
    result = place(request(5), snapshot, TableLatency())
    assert sorted(boxes_of(result)) == ["a", "a", "b", "b", "b"]


def test_prefers_nearer_boxes() -> None:
    snapshot = Pool().box("far", 4).box("near", 4).host("h1").snapshot()
    latency = TableLatency({("h1", "far"): 3_000, ("h1", "near"): 1_000})
    result = place(request(4), snapshot, latency)
    assert boxes_of(result) == ["near"] * 4
    assert result.placement is not None
    assert {b.latency_ns for b in result.placement.bindings} == {1_000}


def test_prefers_the_host_nearer_to_the_gpus() -> None:
    snapshot = Pool().box("b1", 4).host("h1").host("h2").snapshot()
    latency = TableLatency({("h1", "b1"): 3_000, ("h2", "b1"): 1_500})
    result = place(request(2), snapshot, latency)
    assert result.placement is not None and result.placement.host == "h2"


def test_prefers_a_host_whose_free_slots_fit_tightly() -> None:
    snapshot = Pool().box("b1", 8).host("roomy", 8).host("snug", 4, used=[0, 1]).snapshot()
    result = place(request(2), snapshot, TableLatency())
    assert result.placement is not None and result.placement.host == "snug"


def test_respects_max_latency() -> None:
    snapshot = Pool().box("near", 2).box("far", 8).host("h1").snapshot()
    latency = TableLatency({("h1", "near"): 1_000, ("h1", "far"): 5_000})
    within = place(request(2, max_latency_ns=2_000), snapshot, latency)
    assert boxes_of(within) == ["near", "near"]
    too_many = place(request(3, max_latency_ns=2_000), snapshot, latency)
    assert too_many.placement is None


def test_respects_a_pinned_host_even_when_another_is_better() -> None:
    snapshot = Pool().box("b1", 8).host("best").host("pinned", 16).snapshot()
    latency = TableLatency({("best", "b1"): 1_000, ("pinned", "b1"): 4_000})
    result = place(request(2, host="pinned"), snapshot, latency)
    assert result.placement is not None and result.placement.host == "pinned"
    feasible, reasons = report(result, "best")
    assert not feasible
    assert reasons == ("not the pinned host hosts/pinned",)


def test_a_pin_to_an_unregistered_host_is_not_found() -> None:
    snapshot = Pool().box("b1").host("h1").snapshot()
    with pytest.raises(NotFound, match="hosts/nope is not registered"):
        place(request(1, host="nope"), snapshot, TableLatency())


def test_never_assigns_a_used_host_slot() -> None:
    snapshot = Pool().box("b1", 8).host("h1", 6, used=[0, 2, 9]).snapshot()
    result = place(request(3), snapshot, TableLatency())
    assert result.placement is not None
    assert [b.host_slot for b in result.placement.bindings] == [1, 3, 4]


def test_bindings_name_the_lowest_free_gpus_of_each_box() -> None:
    snapshot = Pool().box("b1", 4, busy=2).host("h1").snapshot()
    result = place(request(2), snapshot, TableLatency({("h1", "b1"): 1_234}))
    assert result.placement is not None
    assert result.placement.bindings == (
        Binding("boxes/b1/gpus/2", "b1", 2, "H100", 0, 1_234),
        Binding("boxes/b1/gpus/3", "b1", 3, "H100", 1, 1_234),
    )


def test_never_returns_a_gpu_that_is_busy_unhealthy_excluded_or_of_another_model() -> None:
    # mixed: slots 0-1 busy, 2 unhealthy, 3 excluded; only slots 4 and 5 may be taken.
    pool = Pool().box("mixed", 4, busy=2, unhealthy=[2]).host("h1")
    pool.box("a100", 8, model="A100").box("small", 8, memory_mib=40960)
    excluded = frozenset({"boxes/mixed/gpus/3"})
    result = place(
        request(2, min_memory_mib=81920, exclude_gpus=excluded), pool.snapshot(), TableLatency()
    )
    assert result.placement is not None
    assert [b.gpu for b in result.placement.bindings] == [
        "boxes/mixed/gpus/4",
        "boxes/mixed/gpus/5",
    ]
    more = place(
        request(3, min_memory_mib=81920, exclude_gpus=excluded), pool.snapshot(), TableLatency()
    )
    assert more.placement is None


def test_model_compares_case_insensitively() -> None:
    snapshot = Pool().box("b1", 2, model="H100").host("h1").snapshot()
    result = place(request(2, model="h100"), snapshot, TableLatency())
    assert result.placement is not None
    assert {b.model for b in result.placement.bindings} == {"H100"}


def test_any_model_takes_gpus_of_every_model() -> None:
    snapshot = Pool().box("a", 1, model="A100").box("h", 1, model="H100").host("h1").snapshot()
    result = place(request(2, model=""), snapshot, TableLatency())
    assert result.placement is not None
    assert sorted(b.model for b in result.placement.bindings) == ["A100", "H100"]


def test_skips_cordoned_boxes_dead_hosts_and_full_hosts() -> None:
    pool = Pool().box("cordoned", 8, schedulable=False).box("ok", 2)
    pool.host("dead", alive=False).host("full", 4, used=[0, 1, 2]).host("fine")
    result = place(request(2), pool.snapshot(), TableLatency())
    assert result.placement is not None and result.placement.host == "fine"
    assert boxes_of(result) == ["ok", "ok"]


def test_ties_are_broken_by_host_name() -> None:
    snapshot = Pool().box("b1", 8).host("h2").host("h1").host("h3").snapshot()
    result = place(request(2), snapshot, TableLatency())
    assert result.placement is not None and result.placement.host == "h1"


def sized(pool: Pool, host: str, cpus: int, memory_mib: int, held: int = 0) -> Pool:
    """Declares ``host``'s CPU cores and memory; its nodes hold ``held`` cores."""
    pool.hosts[host] = replace(
        pool.hosts[host], cpu_cores=cpus, memory_mib=memory_mib, used_cpu_cores=held
    )
    return pool


def test_among_equal_hosts_the_one_with_the_least_cpu_and_memory_free_wins() -> None:
    """A node goes where its CPU and memory fit most tightly, so the roomiest hosts stay
    roomy for the nodes that need them; asking for none changes nothing."""
    pool = Pool().box("b1", 8).host("h1").host("h2").host("h3")
    sized(pool, "h1", 96, 393216)
    sized(pool, "h2", 64, 262144)
    sized(pool, "h3", 128, 786432, held=80)  # 48 cores free, the most memory
    snapshot = pool.snapshot()
    for wanted in (request(1), PlacementRequest("H100", 1, cpu_cores=8, host_memory_mib=1024)):
        result = place(wanted, snapshot, TableLatency())
        assert result.placement is not None and result.placement.host == "h2"
    big = place(PlacementRequest("H100", 1, host_memory_mib=300_000), snapshot, TableLatency())
    assert big.placement is not None and big.placement.host == "h1"  # h2 lacks the memory
    # explained in the same order: the chosen host first among equal scores
    assert [c.host for c in big.candidates if c.feasible] == ["h1", "h3"]


def test_free_slots_still_come_first_then_the_room_decides() -> None:
    pool = Pool().box("b1", 8).host("roomy", used=[0]).host("small")
    sized(pool, "roomy", 128, 786432)
    sized(pool, "small", 16, 65536)
    result = place(request(1), pool.snapshot(), TableLatency())
    assert result.placement is not None and result.placement.host == "roomy"  # 7 slots free


def test_excluded_hosts_are_never_chosen_and_say_why() -> None:
    snapshot = Pool().box("b1", 8).host("h1").host("h2").host("h3").snapshot()
    wanted = PlacementRequest("H100", 2, exclude_hosts=frozenset({"h1", "h2"}))
    result = place(wanted, snapshot, TableLatency())
    assert result.placement is not None and result.placement.host == "h3"
    assert report(result, "h1") == (False, ("excluded by the request",))
    every = PlacementRequest("H100", 2, exclude_hosts=frozenset({"h1", "h2", "h3"}))
    none = place(every, snapshot, TableLatency())
    assert none.placement is None
    assert none.unsatisfied == (
        "hosts: 3 of 3 excluded by the request (hosts/h1, hosts/h2, hosts/h3)",
    )


def test_output_is_deterministic_whatever_the_order_of_the_snapshot() -> None:
    pool = Pool()
    for index in range(6):
        pool.box(f"b{index}", index % 4 + 1, rack=f"r{index % 2}")
        pool.host(f"h{index}", 4 + index % 3, used=range(index % 3), rack=f"r{index % 3}")
    snapshot = pool.snapshot()
    shuffled = Snapshot(
        boxes=dict(reversed(list(snapshot.boxes.items()))),
        hosts=dict(reversed(list(snapshot.hosts.items()))),
        gpus_by_box={
            b: tuple(reversed(g)) for b, g in reversed(list(snapshot.gpus_by_box.items()))
        },
    )
    model = TopologyLatencyModel(Topology.default())
    first = place(request(3), snapshot, model)
    assert first.placement is not None
    assert place(request(3), snapshot, model) == first
    assert place(request(3), shuffled, model) == first


def test_with_the_tree_latency_model_gpus_come_from_the_hosts_rack() -> None:
    pool = Pool().box("other-rack", 4, rack="r2").box("same-rack", 4, rack="r1")
    snapshot = pool.host("h1", rack="r1").snapshot()
    result = place(request(4), snapshot, TopologyLatencyModel(Topology.default()))
    assert boxes_of(result) == ["same-rack"] * 4


def test_invalid_requests_name_the_field_to_fix() -> None:
    with pytest.raises(InvalidArgument, match="GPU count 0"):
        request(0)


# -- how it explains ---------------------------------------------------------------------


def test_every_host_is_reported_once_with_reasons() -> None:
    pool = Pool().box("b1", 8).host("dead", alive=False).host("full", 2, used=[0])
    pool.host("ok1").host("ok2", 4)
    result = place(request(2), pool.snapshot(), TableLatency())
    assert sorted(c.host for c in result.candidates) == ["dead", "full", "ok1", "ok2"]
    assert all(c.reasons for c in result.candidates)
    assert [c.host for c in result.candidates[:2]] == ["ok2", "ok1"]  # best first
    assert report(result, "dead") == (False, ("not alive: its agent holds no session",))
    assert report(result, "full") == (False, ("1 free proxy slot, 2 needed",))
    feasible, reasons = report(result, "ok2")
    assert feasible
    assert reasons[0] == "gpus boxes/b1 x2 @2us (nearest-first)"
    assert "host_fit 100 x1" in reasons


def test_a_host_too_far_from_every_box_says_what_it_could_reach() -> None:
    snapshot = Pool().box("b1", 2).box("b2", 4).host("h1").snapshot()
    latency = TableLatency({("h1", "b1"): 1_000, ("h1", "b2"): 4_000})
    result = place(request(3, max_latency_ns=2_000), snapshot, latency)
    assert report(result, "h1") == (
        False,
        ("only 2 free H100 within reach, 3 needed; nearest left out: boxes/b2 (4 GPUs) at 4us",),
    )


def test_unsatisfied_names_the_model_the_pool_lacks_and_what_it_has() -> None:
    snapshot = Pool().box("b1", 8).box("b2", 4, model="A100").host("h1").snapshot()
    result = place(request(2, model="B200"), snapshot, TableLatency())
    assert result.placement is None
    assert result.unsatisfied == (
        "model B200: the pool holds 0 in all, 2 requested; models in the pool: H100 8, A100 4",
    )
    assert report(result, "h1") == (False, result.unsatisfied)


def test_unsatisfied_counts_the_supply_stage_by_stage() -> None:
    pool = Pool().box("b1", 1, busy=7).box("b2", 2, busy=2, unhealthy=[2]).host("h1")
    pool.box("a", 8, model="A100")
    result = place(request(4), pool.snapshot(), TableLatency())
    assert result.unsatisfied == (
        "gpus: 20 in the pool, 12 H100, 3 free, 2 healthy; 4 H100 requested; "
        "free GPUs of other models: A100 8",
    )


def test_unsatisfied_names_the_largest_memory_available() -> None:
    pool = Pool().box("b1", 4, memory_mib=40960).box("b2", 1, busy=3).host("h1")
    pool.box("b0", 2, memory_mib=24576)
    result = place(request(2, min_memory_mib=81920), pool.snapshot(), TableLatency())
    assert result.unsatisfied == (
        "gpus: 10 in the pool, 4 with >= 80GiB, 1 free; 2 H100 requested; "
        "the largest free GPU below 80GiB has 40GiB (boxes/b1/gpus/0)",
    )


def test_unsatisfied_counts_cordoned_boxes() -> None:
    snapshot = Pool().box("b1", 8, schedulable=False).box("b2", 2).host("h1").snapshot()
    result = place(request(4), snapshot, TableLatency())
    assert result.unsatisfied == ("gpus: 10 in the pool, 2 in schedulable boxes; 4 H100 requested",)


def test_unsatisfied_names_the_nearest_gpu_beyond_max_latency() -> None:
    snapshot = Pool().box("b1", 4).box("b3", 4).host("h1").host("h2").snapshot()
    latency = TableLatency(
        {("h1", "b1"): 4_000, ("h1", "b3"): 5_000, ("h2", "b1"): 3_500, ("h2", "b3"): 3_100}
    )
    result = place(request(4, max_latency_ns=2_000), snapshot, latency)
    assert result.unsatisfied == (
        "max_latency 2us: the nearest free H100 beyond it is 3.1us from hosts/h2 (boxes/b3)",
        "reach: at most 0 free H100 usable from one host (hosts/h1), 4 requested",
    )


def test_unsatisfied_names_the_pinned_hosts_free_slots() -> None:
    snapshot = Pool().box("b1", 8).host("h1", 8, used=range(6)).host("h2").snapshot()
    result = place(request(4, host="h1"), snapshot, TableLatency())
    assert result.unsatisfied == ("host capacity: hosts/h1 has 2 free proxy slots, 4 needed",)


def test_unsatisfied_says_no_alive_host_has_a_free_slot() -> None:
    snapshot = Pool().box("b1", 8).host("h1", 2, used=[0, 1]).host("h2", 1, used=[0]).snapshot()
    result = place(request(1), snapshot, TableLatency())
    assert result.unsatisfied == ("hosts: no alive host has a free slot",)


def test_unsatisfied_names_the_roomiest_host_when_none_has_enough_slots() -> None:
    pool = Pool().box("b1", 8).host("h1", 8, used=range(5)).host("h2", 8, used=range(7))
    result = place(request(4), pool.snapshot(), TableLatency())
    assert result.unsatisfied == (
        "host capacity: 2 of 2 hosts have fewer than 4 free proxy slots; the most is 3 on hosts/h1",
    )


def test_unsatisfied_names_each_failing_constraint() -> None:
    pool = Pool().box("b1", 1, busy=3).host("h1", alive=False).host("h2", alive=False)
    result = place(request(2), pool.snapshot(), TableLatency())
    assert result.unsatisfied == (
        "gpus: 4 in the pool, 1 free; 2 H100 requested",
        "hosts: none of the 2 hosts is alive",
    )


def test_unsatisfied_says_when_the_largest_host_is_too_small() -> None:
    snapshot = Pool().box("b1", 8).box("b2", 8).host("h1", 8).host("h2", 4).snapshot()
    result = place(request(12), snapshot, TableLatency())
    assert result.unsatisfied == (
        "host capacity: the largest host, hosts/h1, has 8 proxy slots, 12 needed",
    )


def test_unsatisfied_says_when_no_host_is_registered() -> None:
    result = place(request(1), Pool().box("b1").snapshot(), TableLatency())
    assert result.placement is None
    assert result.candidates == ()
    assert result.unsatisfied == ("hosts: no host is registered",)


# -- model sets --------------------------------------------------------------------------


def mixed_pool() -> Pool:
    return Pool().box("h", 2).box("a", 3, model="A100").host("h1")


def test_a_model_set_gives_one_model_in_the_order_written_when_as_many_are_free() -> None:
    snapshot = Pool().box("h", 4).box("a", 4, model="A100").host("h1").snapshot()
    first = place(PlacementRequest("H100|A100", 4), snapshot, TableLatency())
    assert boxes_of(first) == ["h"] * 4
    (kept,) = [c for c in first.candidates if c.feasible]
    assert kept.reasons[0] == "model H100"
    other = place(PlacementRequest("A100|H100", 4), snapshot, TableLatency())
    assert boxes_of(other) == ["a"] * 4


def test_a_model_set_takes_the_model_with_the_most_free_gpus_first() -> None:
    """The scarcer model is left to the requests that can use only it."""
    pool = Pool().box("h", 2).box("a1", 8, model="A100").box("a2", 3, model="a100")
    snapshot = pool.host("h1").snapshot()
    for written in ("H100|A100", "A100|H100"):
        result = place(PlacementRequest(written, 2), snapshot, TableLatency())
        assert {b.model.casefold() for b in result.placement.bindings} == {"a100"}  # type: ignore[union-attr]
    (kept,) = [c for c in result.candidates if c.feasible]
    assert kept.reasons[0] == "model A100"


def test_a_request_for_any_model_takes_one_model_the_most_free_first() -> None:
    pool = Pool().box("h1", 3).box("h2", 3).box("a", 4, model="A100").host("h1")
    result = place(PlacementRequest("", 4), pool.snapshot(), TableLatency())
    assert boxes_of(result) == ["h1", "h1", "h1", "h2"]  # 6 H100 free against 4 A100
    one = place(
        PlacementRequest("", 4),
        Pool().box("h1", 3).box("a", 4, model="A100").host("h1").snapshot(),
        TableLatency(),
    )
    assert boxes_of(one) == ["a"] * 4  # 4 A100 free against 3 H100


def test_a_request_for_any_model_mixes_models_only_when_no_model_alone_fits() -> None:
    pool = Pool().box("h", 3).box("a", 2, model="A100").host("h1")
    result = place(PlacementRequest("", 5), pool.snapshot(), TableLatency())
    assert sorted(boxes_of(result)) == ["a", "a", "h", "h", "h"]
    reasons = next(c for c in result.candidates if c.feasible).reasons
    assert not reasons[0].startswith("model ")  # the mixed run, as a run of any model


def test_a_mix_for_any_model_takes_the_most_free_models_and_leaves_the_scarce_one() -> None:
    """No model alone holds 8: the mix comes from the two most free models (5 + 3),
    not from the tightest boxes (5 A100 + the last 3 L40S)."""
    pool = Pool().box("a", 5, model="A100").box("b", 5, model="B200").box("c", 3, model="L40S")
    result = place(PlacementRequest("", 8), pool.host("h1").snapshot(), TableLatency())
    assert sorted(boxes_of(result)) == ["a"] * 5 + ["b"] * 3
    feasible, reasons = report(result, "h1")
    assert feasible
    assert reasons[0] == "model A100|B200"  # no model alone had 8 free: none was tried


def test_a_mix_for_any_model_widens_to_the_next_most_free_model() -> None:
    """The two most free models hold 7 of 9: the three most free are mixed, and the
    least free model (2 left, the tightest fit for the last 2) is untouched."""
    pool = Pool().box("a", 4, model="A100").box("b", 3, model="B200")
    pool = pool.box("c", 3, model="L40S").box("h", 2).host("h1", 16)
    result = place(PlacementRequest("", 9), pool.snapshot(), TableLatency())
    assert sorted(boxes_of(result)) == ["a"] * 4 + ["b"] * 3 + ["c"] * 2


def test_a_mix_for_any_model_takes_any_mix_when_the_most_free_cannot_serve_it() -> None:
    pool = Pool().box("a", 4, model="A100").box("b", 3, model="B200").box("c", 2, model="L40S")
    result = place(PlacementRequest("", 9), pool.host("h1", 16).snapshot(), TableLatency())
    assert sorted(boxes_of(result)) == ["a"] * 4 + ["b"] * 3 + ["c"] * 2
    refused = place(PlacementRequest("", 10), pool.host("h1", 16).snapshot(), TableLatency())
    assert refused.placement is None and refused.unsatisfied


def test_most_free_mixes_are_the_most_free_models_that_hold_the_gpus() -> None:
    free = {"a100": (5, "A100"), "b200": (5, "B200"), "l40s": (3, "L40S"), "h100": (0, "H100")}
    assert most_free_mixes(free, 8) == [("A100", "B200")]
    assert most_free_mixes(free, 11) == []  # only all of them hold 11: any mix decides
    free["h100"] = (1, "H100")
    assert most_free_mixes(free, 8) == [("A100", "B200"), ("A100", "B200", "L40S")]
    assert most_free_mixes(free, 12) == [("A100", "B200", "L40S")]
    assert most_free_mixes(free, 14) == []
    assert most_free_mixes({"a100": (5, "A100"), "b200": (5, "B200")}, 8) == []


def test_a_request_for_any_model_in_a_pool_of_one_model_runs_as_written() -> None:
    snapshot = Pool().box("h", 4).host("h1").snapshot()
    result = place(PlacementRequest("", 2), snapshot, TableLatency())
    (kept,) = [c for c in result.candidates if c.feasible]
    assert not kept.reasons[0].startswith("model ")


def test_a_model_set_falls_back_to_a_later_model_and_says_why() -> None:
    # more H100 free than A100, but no box holds 3 of them
    snapshot = Pool().box("h1", 2).box("h2", 2).box("a", 3, model="A100").host("h1").snapshot()
    result = place(PlacementRequest("H100|A100", 3, same_box=True), snapshot, TableLatency())
    assert result.placement is not None
    assert {b.model for b in result.placement.bindings} == {"A100"}
    feasible, reasons = report(result, "h1")
    assert feasible
    assert reasons[0] == "model A100 (no placement of H100)"


def test_a_model_set_never_mixes_models_unless_asked() -> None:
    snapshot = mixed_pool().snapshot()
    result = place(PlacementRequest("H100|A100", 5), snapshot, TableLatency())
    assert result.placement is None
    assert result.unsatisfied == (
        "model H100: the pool holds 2 in all, 5 requested",
        "model A100: the pool holds 3 in all, 5 requested",
    )
    feasible, reasons = report(result, "h1")
    assert not feasible
    assert [reason.split(":")[0] for reason in reasons] == ["model H100", "model A100"]
    mixed = place(PlacementRequest("H100|A100", 5, mixed_models=True), snapshot, TableLatency())
    assert mixed.placement is not None
    assert sorted(b.model for b in mixed.placement.bindings) == ["A100"] * 3 + ["H100"] * 2


def test_a_model_set_pinned_to_a_host_keeps_the_pin() -> None:
    snapshot = mixed_pool().host("h2").snapshot()
    result = place(PlacementRequest("H100|A100", 2, host="h2"), snapshot, TableLatency())
    assert result.placement is not None and result.placement.host == "h2"


# -- affinity and spread -----------------------------------------------------------------


def test_affinity_box_takes_one_box_even_when_a_split_is_nearer() -> None:
    snapshot = Pool().box("n1", 2).box("n2", 2).box("far", 4).host("h1").snapshot()
    latency = TableLatency({("h1", "n1"): 1_000, ("h1", "n2"): 1_000, ("h1", "far"): 5_000})
    assert sorted(boxes_of(place(PlacementRequest("H100", 4), snapshot, latency))) == [
        "n1",
        "n1",
        "n2",
        "n2",
    ]
    together = place(PlacementRequest("H100", 4, same_box=True), snapshot, latency)
    assert boxes_of(together) == ["far"] * 4


def test_affinity_box_that_no_box_can_hold_says_so() -> None:
    snapshot = Pool().box("a", 3).box("b", 3).host("h1").snapshot()
    result = place(PlacementRequest("H100", 4, same_box=True), snapshot, TableLatency())
    assert result.placement is None
    assert result.unsatisfied == (
        "gpus: 6 in the pool, 0 in a box holding 4 of them (affinity box); 4 H100 requested",
    )


def test_spread_boxes_takes_every_gpu_from_a_different_box() -> None:
    snapshot = Pool().box("a", 8).box("b", 2).box("c", 1).host("h1").snapshot()
    spread = place(PlacementRequest("H100", 3, max_gpus_per_box=1), snapshot, TableLatency())
    assert sorted(boxes_of(spread)) == ["a", "b", "c"]
    two = place(PlacementRequest("H100", 4, max_gpus_per_box=2), snapshot, TableLatency())
    assert sorted(boxes_of(two)) == ["a", "a", "b", "b"]
    short = place(PlacementRequest("H100", 4, max_gpus_per_box=1), snapshot, TableLatency())
    assert short.unsatisfied == (
        "gpus: 11 in the pool, 3 usable at 1 per box (spread boxes:1); 4 H100 requested",
    )


# -- host labels -------------------------------------------------------------------------


def test_host_selector_keeps_labelled_hosts_and_explains_the_others() -> None:
    pool = Pool().box("b1", 4).host("h1").host("h2")
    pool.hosts["h2"] = replace(pool.hosts["h2"], labels=frozenset({("env", "prod")}))
    snapshot = pool.snapshot()
    selector = frozenset({("env", "prod")})
    result = place(PlacementRequest("H100", 2, host_selector=selector), snapshot, TableLatency())
    assert result.placement is not None and result.placement.host == "h2"
    assert report(result, "h1") == (False, ("labels lack env=prod",))
    none = place(
        PlacementRequest("H100", 2, host_selector=frozenset({("env", "dev")})),
        snapshot,
        TableLatency(),
    )
    assert none.placement is None
    assert none.unsatisfied == (
        "host labels: 2 of 2 hosts do not have env=dev; the closest, hosts/h1, lacks env=dev; "
        "label hosts with the agent's --label or change --host-selector",
    )


def test_affinity_switch_takes_boxes_of_one_rack_even_when_a_split_is_nearer() -> None:
    pool = Pool().box("a1", 3, rack="ra").box("b1", 3, rack="rb").box("b2", 2, rack="rb")
    snapshot = pool.box("c1", 4, rack="rc").host("h1").snapshot()
    latency = TableLatency(
        {("h1", "a1"): 1_000, ("h1", "b1"): 1_000, ("h1", "b2"): 2_000, ("h1", "c1"): 1_000}
    )
    anywhere = place(PlacementRequest("H100", 5), snapshot, latency)
    assert sorted(boxes_of(anywhere)) == ["a1", "c1", "c1", "c1", "c1"]  # two racks, 1us
    one_switch = place(PlacementRequest("H100", 5, same_switch=True), snapshot, latency)
    assert sorted(boxes_of(one_switch)) == ["b1", "b1", "b1", "b2", "b2"]
    assert one_switch.candidates[0].reasons[0].endswith("(nearest-switch dc1/p1/rb)")


def test_affinity_switch_with_spread_takes_different_boxes_of_one_rack() -> None:
    pool = Pool().box("a1", 4, rack="ra").box("a2", 4, rack="ra").box("b1", 8, rack="rb")
    result = place(
        PlacementRequest("H100", 2, same_switch=True, max_gpus_per_box=1),
        pool.host("h1").snapshot(),
        TableLatency(),
    )
    assert sorted(boxes_of(result)) == ["a1", "a2"]


def test_affinity_switch_that_no_switch_can_hold_says_so() -> None:
    pool = Pool().box("a1", 3, rack="ra").box("a2", 1, rack="ra").box("b1", 3, rack="rb")
    snapshot = pool.host("h1").host("h2").snapshot()
    result = place(PlacementRequest("H100", 5, same_switch=True), snapshot, TableLatency())
    assert result.placement is None
    assert result.unsatisfied == (
        "switch: at most 4 free H100 under one rack switch (dc1/p1/ra, usable from "
        "hosts/h1), 5 requested with affinity switch; ask without it, or for fewer GPUs",
    )
    assert [c.reasons for c in result.candidates] == [
        (
            "no rack switch holds 5 free H100 within reach (affinity switch); the most "
            "under one is 4 (dc1/p1/ra)",
        )
    ] * 2


def test_affinity_box_and_switch_together_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="one box is already under one switch"):
        PlacementRequest("H100", 2, same_box=True, same_switch=True)
