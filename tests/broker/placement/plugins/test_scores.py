"""Score plugins rate proposals from one point of view each; normalized, best is 100."""

from __future__ import annotations

import pytest

from dxpool.broker.placement.framework import BoxSupply, Proposal, Take
from dxpool.broker.placement.model import BoxInfo, GpuInfo, HostInfo, Place, PlacementRequest
from dxpool.broker.placement.plugins.fragmentation import SlotFragmentation
from dxpool.broker.placement.plugins.scores import BoxAffinity, BoxFit, HostFit, LatencyScore

HOST = HostInfo("h1", Place("hosts/h1"), 8, frozenset(), True)
REQUEST = PlacementRequest("", 4)


def take(box: str, usable: int, count: int, latency_ns: int) -> Take:
    gpus = tuple(
        GpuInfo(f"boxes/{box}/gpus/{s}", box, s, "H100", 1, True, True) for s in range(usable)
    )
    return Take(BoxSupply(BoxInfo(box, Place(f"boxes/{box}"), True), gpus), count, latency_ns)


def proposal(*takes: Take, free_slots: int = 8) -> Proposal:
    return Proposal(HOST, free_slots, takes, "test")


ONE_TIGHT_NEAR = proposal(take("a", 4, 4, 1_000), free_slots=4)
TWO_FAR_LOOSE = proposal(take("b", 8, 2, 2_000), take("c", 8, 2, 4_000), free_slots=8)


def scores(plugin: LatencyScore | BoxAffinity | BoxFit | HostFit) -> list[float]:
    raw = [plugin.score(REQUEST, p) for p in (ONE_TIGHT_NEAR, TWO_FAR_LOOSE)]
    return plugin.normalize(raw)


def test_latency_prefers_the_lower_mean_round_trip() -> None:
    assert LatencyScore().score(REQUEST, TWO_FAR_LOOSE) == 3_000
    assert scores(LatencyScore()) == [100.0, pytest.approx(100 * 1_000 / 3_000)]


def test_box_affinity_prefers_fewer_boxes() -> None:
    assert scores(BoxAffinity()) == [100.0, 50.0]


def test_box_fit_prefers_using_up_the_touched_boxes() -> None:
    assert BoxFit().score(REQUEST, ONE_TIGHT_NEAR) == 100.0
    assert BoxFit().score(REQUEST, TWO_FAR_LOOSE) == 25.0
    assert scores(BoxFit()) == [100.0, 25.0]


def test_host_fit_prefers_filling_the_hosts_free_slots() -> None:
    assert scores(HostFit()) == [100.0, 50.0]


def _on_other_boxes(original: Proposal) -> Proposal:
    """The same shape (rule, free slots, and per take its GPUs, round trip and box's
    usable GPUs) on other boxes: other ids, places, GPU model and memory."""
    takes = tuple(
        Take(
            BoxSupply(
                BoxInfo(f"other-{t.supply.box.box}", Place(f"dc9/p9/r9/{t.supply.box.box}"), True),
                tuple(
                    GpuInfo(f"boxes/x/gpus/{s}", "x", s + 3, "A100", 80, True, True)
                    for s in range(t.supply.available)
                ),
            ),
            t.count,
            t.latency_ns,
        )
        for t in original.takes
    )
    host = HostInfo("h9", Place("dc9/p9/r9/h9"), 8, frozenset({7}), True, cpu_cores=64)
    return Proposal(host, original.free_slots, takes, original.rule)


@pytest.mark.parametrize(
    "plugin",
    [LatencyScore(), BoxAffinity(), BoxFit(), HostFit(), SlotFragmentation()],
    ids=lambda plugin: plugin.name,
)
def test_a_plugin_that_scores_by_take_shape_scores_a_shape_alike_on_any_boxes(
    plugin: LatencyScore | BoxAffinity | BoxFit | HostFit | SlotFragmentation,
) -> None:
    """A plugin declaring ``by_take_shape`` (placement then files the tightest boxes by
    round trip alone) reads of a take only its GPUs, round trip and box's usable GPUs."""
    assert plugin.by_take_shape and plugin.by_host_class
    for original in (ONE_TIGHT_NEAR, TWO_FAR_LOOSE):
        assert plugin.score(REQUEST, _on_other_boxes(original)) == plugin.score(REQUEST, original)
