"""SlotFragmentation prefers the host whose free slots the node fragments least."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dxpool.broker.placement import Pipeline, WeightedScore, default_pipeline, place
from dxpool.broker.placement.framework import BoxSupply, Proposal, Take
from dxpool.broker.placement.model import BoxInfo, GpuInfo, HostInfo, Place, PlacementRequest
from dxpool.broker.placement.plugins.fragmentation import SlotFragmentation
from dxpool.fabric.latency import TopologyLatencyModel
from dxpool.fabric.topology import Topology
from dxpool.limits import MAX_HOST_SLOTS
from tests.broker.placement.pools import Pool, TableLatency


def proposal(count: int, free_slots: int) -> Proposal:
    """``count`` GPUs from one box for a host with ``free_slots`` free slots."""
    gpus = tuple(GpuInfo(f"boxes/b1/gpus/{s}", "b1", s, "H100", 1, True, True) for s in range(8))
    supply = BoxSupply(BoxInfo("b1", Place("boxes/b1"), True), gpus)
    host = HostInfo("h1", Place("hosts/h1"), 16, frozenset(), True)
    return Proposal(host, free_slots, (Take(supply, count, 1_000),), "test")


def raw(plugin: SlotFragmentation, count: int, free_slots: int) -> float:
    return plugin.score(PlacementRequest("", count), proposal(count, free_slots))


def test_fragmentation_is_the_free_slots_a_node_of_the_mix_cannot_use() -> None:
    plugin = SlotFragmentation({1: 1, 2: 1, 4: 1, 8: 1})
    assert plugin.fragmentation(0) == 0.0
    assert plugin.fragmentation(1) == pytest.approx(1 * 0.75)  # 2, 4 and 8 cannot use it
    assert plugin.fragmentation(3) == pytest.approx(3 * 0.5)  # 4 and 8 cannot
    assert plugin.fragmentation(7) == pytest.approx(7 * 0.25)  # only 8 cannot
    assert plugin.fragmentation(8) == 0.0  # every size fits
    assert plugin.fragmentation(MAX_HOST_SLOTS + 5) == 0.0  # clamped, not an IndexError


def test_the_raw_score_is_the_change_of_fragmentation_the_node_makes() -> None:
    plugin = SlotFragmentation({1: 1, 4: 1, 8: 1})
    # One GPU on a host with 4 free leaves 3: 4-GPU nodes no longer fit there.
    assert raw(plugin, 1, 4) == pytest.approx(3 * (2 / 3) - 4 * (1 / 3))
    # One GPU on a host with 5 free leaves 4: still room for a 4-GPU node.
    assert raw(plugin, 1, 5) == pytest.approx(4 * (1 / 3) - 5 * (1 / 3))
    assert raw(plugin, 1, 5) < raw(plugin, 1, 4)
    # Filling a host to the last slot removes its fragmentation.
    assert raw(plugin, 3, 3) == pytest.approx(-3 * (2 / 3))


def test_normalize_gives_the_best_100_and_depends_only_on_the_best() -> None:
    plugin = SlotFragmentation(spread_slots=4.0)
    assert plugin.normalize([-1.0, 0.0, 1.0, 5.0]) == [100.0, 75.0, 50.0, 0.0]
    # Placement scores one host per class: a proposal's score must not change when
    # worse proposals are added or removed.
    assert plugin.normalize([-1.0, 0.0]) == [100.0, 75.0]
    assert plugin.normalize([]) == []


def test_only_the_proportions_of_the_mix_count() -> None:
    assert SlotFragmentation({1: 2, 8: 2}).sizes == SlotFragmentation({1: 0.5, 8: 0.5}).sizes


@pytest.mark.parametrize(
    ("sizes", "spread", "message"),
    [
        ({}, 4.0, "at least one node size"),
        ({0: 1.0}, 4.0, "node size 0 is outside 1-256"),
        ({MAX_HOST_SLOTS + 1: 1.0}, 4.0, "outside 1-256"),
        ({2.5: 1.0}, 4.0, "node sizes are integers"),
        ({True: 1.0}, 4.0, "node sizes are integers"),
        ({4: 0.0}, 4.0, "size 4 needs a positive weight"),
        ({4: math.nan}, 4.0, "size 4 needs a positive weight"),
        ({4: 1.0}, 0.0, "spread_slots must be positive"),
        ({4: 1.0}, math.inf, "spread_slots must be positive"),
    ],
)
def test_bad_configuration_says_what_to_fix(
    sizes: dict[int, float], spread: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SlotFragmentation(sizes, spread_slots=spread)


def with_fragmentation(sizes: dict[int, float]) -> Pipeline:
    base = default_pipeline()
    extra = WeightedScore(SlotFragmentation(sizes), 2.0)
    return dataclasses.replace(base, scores=(*base.scores, extra))


def test_in_the_pipeline_it_keeps_a_host_able_to_take_a_4_gpu_node() -> None:
    # h1 has 4 free slots, h2 has 5. Best fit alone fills h1, which then can no longer
    # take a 4-GPU node; with 4-GPU nodes in the mix, one GPU goes to h2 instead.
    snapshot = (
        Pool().box("b1", 8).host("h1", 8, used=range(4)).host("h2", 8, used=range(3)).snapshot()
    )
    request = PlacementRequest("", 1)
    best_fit = place(request, snapshot, TableLatency())
    assert best_fit.placement is not None and best_fit.placement.host == "h1"
    pipeline = with_fragmentation({1: 1, 4: 1})
    chosen = place(request, snapshot, TableLatency(), pipeline)
    assert chosen.placement is not None and chosen.placement.host == "h2"
    # The explanation (a run over every host, not one per class) agrees.
    kept = [report for report in chosen.candidates if report.feasible]
    assert kept[0].host == "h2"
    assert any("slot_fragmentation 100 x2" in reason for reason in kept[0].reasons)


def test_by_host_class_placement_agrees_with_scoring_every_host() -> None:
    # Many hosts in one rack with assorted free slots: the by-class shortcut must pick
    # the host a run over every host picks, for every node size.
    pool = Pool().box("b1", 8).box("b2", 8)
    for index, used in enumerate((0, 1, 2, 3, 4, 5, 6, 7, 3, 5, 1)):
        pool.host(f"h{index:02d}", 8, used=range(used))
    snapshot = pool.snapshot()
    pipeline = with_fragmentation({1: 6, 2: 1, 4: 2, 8: 1})
    tiered = TopologyLatencyModel(Topology.default())
    for count in (1, 2, 3, 4, 8):
        request = PlacementRequest("", count)
        result = place(request, snapshot, tiered, pipeline)
        assert result.placement is not None
        kept = [report for report in result.candidates if report.feasible]  # best first
        assert result.placement.host == kept[0].host, count
