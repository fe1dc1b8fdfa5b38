"""SameBox and SpreadBoxes: GPU filters that judge each box's usable GPUs together."""

from __future__ import annotations

import random

import pytest

from dxpool.broker.placement.guard import applying
from dxpool.broker.placement.model import GpuInfo, PlacementRequest
from dxpool.broker.placement.plugins.spread import SameBox, SpreadBoxes
from dxpool.broker.placement.registry import default_pipeline
from dxpool.broker.placement.supply import BoxVerdicts, build_supply
from dxpool.errors import InvalidArgument

from ..pools import Pool


def gpus_of(boxes: dict[str, int]) -> list[GpuInfo]:
    return [
        GpuInfo(f"boxes/{box}/gpus/{slot}", box, slot, "H100", 81920, True, True)
        for box, count in boxes.items()
        for slot in range(count)
    ]


def test_same_box_keeps_only_boxes_that_hold_the_whole_node() -> None:
    plugin = SameBox()
    request = PlacementRequest("", 3, same_box=True)
    assert plugin.applies(request) and not plugin.applies(PlacementRequest("", 3))
    kept = plugin.filter_gpus(request, gpus_of({"a": 2, "b": 3, "c": 5}))
    assert sorted({gpu.box for gpu in kept}) == ["b", "c"] and len(kept) == 8
    assert plugin.label(request) == "in a box holding 3 of them (affinity box)"
    everything = gpus_of({"a": 1})
    assert plugin.filter_gpus(PlacementRequest("", 3), everything) == everything


def test_spread_keeps_the_lowest_slots_of_each_box_up_to_the_limit() -> None:
    plugin = SpreadBoxes()
    request = PlacementRequest("", 3, max_gpus_per_box=2)
    gpus = gpus_of({"a": 1, "b": 4})
    shuffled = list(reversed(gpus))
    kept = plugin.filter_gpus(request, shuffled)
    assert [gpu.name for gpu in kept] == ["boxes/b/gpus/1", "boxes/b/gpus/0", "boxes/a/gpus/0"]
    assert plugin.label(request) == "usable at 2 per box (spread boxes:2)"
    assert not plugin.applies(PlacementRequest("", 3))


@pytest.mark.parametrize(
    "request_",
    [
        PlacementRequest("H100", 3, same_box=True),
        PlacementRequest("H100", 5, max_gpus_per_box=1),
        PlacementRequest("H100", 4, max_gpus_per_box=2),
    ],
)
def test_box_by_box_and_all_at_once_give_the_same_supply(request_: PlacementRequest) -> None:
    rng = random.Random(7)
    pool = Pool().host("h1")
    for index in range(12):
        pool.box(f"b{index:02d}", rng.randint(0, 6), busy=rng.randint(0, 3))
    snapshot = pool.snapshot()
    filters = applying(default_pipeline().gpu_filters, request_)
    boxwise = build_supply(request_, snapshot, (), filters, BoxVerdicts())
    at_once = build_supply(request_, snapshot, (), filters)
    assert boxwise == at_once
    assert at_once.usable > 0


def test_same_box_and_spread_contradict_each_other() -> None:
    with pytest.raises(InvalidArgument, match="contradicts affinity box") as error:
        PlacementRequest("", 2, same_box=True, max_gpus_per_box=1)
    assert error.value.reason == "INVALID_SPREAD"
    with pytest.raises(InvalidArgument, match="out of range"):
        PlacementRequest("", 2, max_gpus_per_box=65)
