"""The greedy rules that propose which boxes one host takes its GPUs from."""

from __future__ import annotations

from dxpool.broker.placement.framework import BoxSupply, Take
from dxpool.broker.placement.model import BoxInfo, GpuInfo, HostInfo, Place
from dxpool.broker.placement.selection import (
    NEAREST_FIRST,
    NEAREST_SINGLE_BOX,
    NEAREST_SWITCH,
    TIGHTEST_SINGLE_BOX,
    Link,
    most_in_one_switch,
    nearest_first,
    nearest_single_box,
    nearest_switch,
    propose,
    tightest_single_box,
)

HOST = HostInfo("h1", Place("hosts/h1"), 16, frozenset(), True)


def supply(box: str, usable: int) -> BoxSupply:
    gpus = tuple(
        GpuInfo(f"boxes/{box}/gpus/{slot}", box, slot, "H100", 81920, True, True)
        for slot in range(usable)
    )
    return BoxSupply(BoxInfo(box, Place(f"boxes/{box}"), True), gpus)


def links(*boxes: tuple[str, int, int]) -> list[Link]:
    """(box, usable, latency) -> links in the order propose expects: (usable, box id)."""
    made = [(latency, supply(box, usable)) for box, usable, latency in boxes]
    return sorted(made, key=lambda link: (link[1].available, link[1].box.box))


def shape(takes: tuple[Take, ...] | None) -> list[tuple[str, int, int]] | None:
    if takes is None:
        return None
    return [(t.supply.box.box, t.count, t.latency_ns) for t in takes]


def by_latency(made: list[Link]) -> list[Link]:
    return sorted(made, key=lambda link: link[0])


def test_nearest_first_takes_the_tightest_box_of_the_nearest_tier() -> None:
    made = by_latency(links(("a", 8, 1000), ("b", 4, 1000), ("c", 5, 1000), ("d", 4, 500)))
    assert shape(nearest_first(5, made)) == [("d", 4, 500), ("b", 1, 1000)]


def test_nearest_first_empties_the_largest_box_when_none_fits() -> None:
    made = by_latency(links(("a", 2, 1000), ("b", 3, 1000), ("c", 3, 1000), ("d", 1, 1000)))
    assert shape(nearest_first(7, made)) == [("b", 3, 1000), ("c", 3, 1000), ("d", 1, 1000)]


def test_nearest_first_uses_the_next_tier_only_when_the_first_runs_out() -> None:
    made = by_latency(links(("near", 2, 1000), ("far", 8, 3000), ("mid", 1, 2000)))
    assert shape(nearest_first(4, made)) == [("near", 2, 1000), ("mid", 1, 2000), ("far", 1, 3000)]


def test_nearest_first_is_none_when_the_links_hold_too_few() -> None:
    assert nearest_first(5, by_latency(links(("a", 2, 1000), ("b", 2, 900)))) is None


def test_nearest_single_box_is_the_nearest_box_that_holds_all() -> None:
    made = links(("small", 2, 100), ("big", 8, 3000), ("mid", 4, 2000), ("mid2", 4, 2000))
    found = nearest_single_box(4, made)
    assert found is not None and found[1].box.box == "mid"


def test_tightest_single_box_is_the_smallest_box_that_holds_all_nearest_on_ties() -> None:
    made = links(("big", 8, 100), ("b", 5, 3000), ("a", 5, 2000), ("tiny", 1, 50))
    found = tightest_single_box(4, made)
    assert found is not None and found[1].box.box == "a"
    assert tightest_single_box(9, made) is None
    assert nearest_single_box(9, made) is None


def test_propose_offers_each_distinct_rule_once() -> None:
    made = links(("n1", 2, 1000), ("n2", 2, 1000), ("far", 4, 3000), ("farther", 8, 4000))
    proposals = propose(HOST, 16, 4, made)
    assert [(p.rule, [t.supply.box.box for t in p.takes]) for p in proposals] == [
        (NEAREST_FIRST, ["n1", "n2"]),
        (NEAREST_SINGLE_BOX, ["far"]),
    ]  # the tightest single box is also "far", so it is not offered twice


def test_propose_offers_the_tightest_box_when_it_differs() -> None:
    made = links(("near", 8, 1000), ("tight", 4, 3000))
    proposals = propose(HOST, 16, 4, made)
    assert [(p.rule, p.takes[0].supply.box.box) for p in proposals] == [
        (NEAREST_FIRST, "near"),
        (TIGHTEST_SINGLE_BOX, "tight"),
    ]
    assert proposals[0].free_slots == 16 and proposals[0].host is HOST


def test_propose_is_empty_when_the_host_cannot_reach_enough() -> None:
    assert propose(HOST, 16, 9, links(("a", 4, 1000), ("b", 4, 1000))) == []


def test_proposal_figures() -> None:
    (proposal,) = propose(HOST, 8, 6, links(("a", 4, 1000), ("b", 4, 4000)))
    assert proposal.gpu_count == 6
    assert proposal.box_count == 2
    assert proposal.mean_latency_ns == (4 * 1000 + 2 * 4000) / 6
    assert proposal.available_in_boxes == 8
    assert proposal.describe() == "boxes/a x4 @1us, boxes/b x2 @4us"


def racked(box: str, usable: int, rack: str) -> BoxSupply:
    gpus = supply(box, usable).gpus
    return BoxSupply(BoxInfo(box, Place(f"boxes/{box}", "s", "p", rack), True), gpus)


def test_nearest_switch_takes_the_tightest_switch_of_the_first_tier_that_holds_the_node() -> None:
    links = [
        (1_000, racked("a1", 3, "ra")),
        (1_000, racked("b1", 2, "rb")),
        (1_000, racked("a2", 3, "ra")),
        (1_000, racked("b2", 3, "rb")),
    ]
    links.sort(key=lambda link: (link[1].available, link[1].box.box))
    # both racks hold 5 at 1us; rb holds fewer in all (5 against 6)
    assert shape(nearest_switch(5, links)) == [("b2", 3, 1_000), ("b1", 2, 1_000)]
    assert nearest_switch(7, links) is None
    assert most_in_one_switch(links) == (6, "s/p/ra")


def test_nearest_switch_fills_a_switch_across_tiers_and_ties_by_switch_name() -> None:
    links = [
        (1_000, racked("a1", 2, "ra")),
        (2_000, racked("a2", 2, "ra")),
        (2_000, racked("b1", 4, "rb")),
    ]
    # at 2us both racks hold 4: ra comes first by name, its nearer box first
    assert shape(nearest_switch(4, links)) == [("a1", 2, 1_000), ("a2", 2, 2_000)]
    found = propose(HOST, 16, 4, list(links), same_switch=True)
    assert [(p.rule, shape(p.takes)) for p in found] == [
        (NEAREST_SWITCH, [("a1", 2, 1_000), ("a2", 2, 2_000)]),
        (NEAREST_SINGLE_BOX, [("b1", 4, 2_000)]),
    ]


def test_a_box_without_a_rack_is_a_switch_of_its_own() -> None:
    links = [(1_000, supply("x1", 2)), (1_000, supply("x2", 2))]  # placed nowhere
    assert nearest_switch(3, links) is None
    assert most_in_one_switch(links) == (2, "boxes/x1 (no rack given)")
