"""The supply: list-at-once GPU filters, verdicts remembered per box, the same answers."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from dxpool.broker.placement import (
    GpuInfo,
    Pipeline,
    PlacementRequest,
    Snapshot,
    Status,
    default_pipeline,
    place,
)
from dxpool.broker.placement.framework import GpuListFilterPlugin
from dxpool.broker.placement.plugins.gpus import (
    GpuFree,
    GpuHealthy,
    GpuMemory,
    GpuModel,
    GpuNotExcluded,
)
from dxpool.broker.placement.registry import WEIGHTS
from dxpool.broker.placement.supply import BoxVerdicts, build_supply

from .pools import Pool, TableLatency


def random_gpus(rng: random.Random, count: int = 200) -> list[GpuInfo]:
    return [
        GpuInfo(
            f"boxes/b{i % 9}/gpus/{i}",
            f"b{i % 9}",
            i,
            rng.choice(("H100", "h100", "A100")),
            rng.choice((24576, 40960, 81920)),
            rng.random() > 0.3,
            rng.random() > 0.1,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize(
    "plugin", [GpuModel(), GpuMemory(), GpuFree(), GpuHealthy(), GpuNotExcluded()]
)
def test_each_gpu_filter_keeps_the_same_gpus_at_once_as_one_by_one(
    plugin: GpuListFilterPlugin,
) -> None:
    rng = random.Random(3)
    gpus = random_gpus(rng)
    request = PlacementRequest(
        "H100", 2, min_memory_mib=40960, exclude_gpus=frozenset(g.name for g in gpus[::7])
    )
    one_by_one = [g for g in gpus if plugin.filter_gpu(request, g).ok]
    assert plugin.filter_gpus(request, gpus) == one_by_one
    assert 0 < len(one_by_one) < len(gpus)


class OnlySlotZero(GpuFree):
    """Changes filter_gpu alone: its parent's filter_gpus must not be used for it."""

    name = "only_slot_zero"

    def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status:
        return Status() if gpu.slot == 0 else Status.unschedulable("not slot 0")


def test_a_subclass_that_changes_filter_gpu_alone_is_asked_gpu_by_gpu() -> None:
    snapshot = Pool().box("b1", 4).host("h1").snapshot()
    supply = build_supply(PlacementRequest("", 1), snapshot, (), (OnlySlotZero(),))
    assert [g.slot for box in supply.boxes for g in box.gpus] == [0]


class Counting(GpuFree):
    """GpuFree, counting the GPUs it is asked about."""

    name = "counting_free"
    seen = 0

    def filter_gpus(self, request: PlacementRequest, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        Counting.seen += len(gpus)
        return super().filter_gpus(request, gpus)


def counting_pipeline() -> Pipeline:
    """The default pipeline with GpuFree counting (and remembering verdicts of its own)."""
    base = default_pipeline(WEIGHTS)
    filters = tuple(Counting() if f.name == "gpu_free" else f for f in base.gpu_filters)
    return replace(base, gpu_filters=filters)


def test_a_new_snapshot_judges_only_the_boxes_that_changed() -> None:
    pool = Pool().box("a", 4).box("b", 4, busy=2).box("c", 2).host("h1").host("h2")
    first = pool.snapshot()
    pipeline = counting_pipeline()
    request = PlacementRequest("H100", 2)
    Counting.seen = 0
    before = place(request, first, TableLatency(), pipeline)
    assert Counting.seen == 4 + 6 + 2
    changed = Pool().box("b", 4, busy=3)  # one more GPU of b taken: a new tuple for b only
    second = Snapshot(
        boxes=dict(first.boxes),
        hosts=dict(first.hosts),
        gpus_by_box={**first.gpus_by_box, "b": tuple(changed.gpus["b"])},
    )
    Counting.seen = 0
    after = place(request, second, TableLatency(), pipeline)
    assert Counting.seen == 7  # box b's GPUs only
    assert after == place(request, second, TableLatency(), counting_pipeline())
    assert before == place(request, first, TableLatency(), counting_pipeline())


def test_placing_again_on_one_snapshot_reuses_what_it_worked_out() -> None:
    snapshot = Pool().box("a", 4).box("b", 2).host("h1").snapshot()
    pipeline = counting_pipeline()
    request = PlacementRequest("H100", 2)
    first = place(request, snapshot, TableLatency(), pipeline)
    Counting.seen = 0
    assert place(request, snapshot, TableLatency(), pipeline) == first
    assert Counting.seen == 0


def test_gpus_given_as_a_list_are_judged_every_time() -> None:
    pool = Pool().box("a", 4).host("h1")
    pipeline = counting_pipeline()
    request = PlacementRequest("H100", 1)
    for expected in (4, 4):
        snapshot = Snapshot(dict(pool.boxes), dict(pool.hosts), {"a": list(pool.gpus["a"])})
        Counting.seen = 0
        assert place(request, snapshot, TableLatency(), pipeline).placement is not None
        assert Counting.seen == expected


def test_a_gpu_listed_under_another_box_lands_where_the_pipeline_always_put_it() -> None:
    pool = Pool().box("a", 2).box("b", 2).host("h1")
    stray = GpuInfo("boxes/b/gpus/7", "b", 7, "H100", 81920, True, True)
    snapshot = Snapshot(
        dict(pool.boxes),
        dict(pool.hosts),
        {"a": (*pool.gpus["a"], stray), "b": tuple(pool.gpus["b"])},
    )
    verdicts = BoxVerdicts()
    request = PlacementRequest("H100", 3)
    remembered = build_supply(request, snapshot, (), default_pipeline().gpu_filters, verdicts)
    reference = build_supply(request, snapshot, (), default_pipeline().gpu_filters)
    assert remembered == reference
    assert [(s.box.box, [g.slot for g in s.gpus]) for s in reference.boxes] == [
        ("a", [0, 1]),
        ("b", [0, 1, 7]),
    ]


def test_a_short_supply_keeps_its_hints_with_remembered_verdicts() -> None:
    pool = Pool().box("b1", 1, busy=7).box("a", 8, model="A100").host("h1")
    verdicts = BoxVerdicts()
    pipeline = default_pipeline()
    request = PlacementRequest("H100", 4)
    for _ in range(2):
        supply = build_supply(
            request, pool.snapshot(), pipeline.box_filters, pipeline.gpu_filters, verdicts
        )
        assert [stage.closest for stage in supply.funnel if stage.closest] == [
            "free GPUs of other models: A100 8"
        ]


def test_verdicts_keep_the_requests_used_last() -> None:
    verdicts = BoxVerdicts(max_requests=2)
    one, two, three = (PlacementRequest("H100", n) for n in (1, 2, 3))
    first, second = verdicts.parts(one), verdicts.parts(two)
    assert verdicts.parts(one) is first  # used again: two is now the oldest
    verdicts.parts(three)
    assert verdicts.parts(one) is first
    assert verdicts.parts(two) is not second


def test_a_pinned_request_shares_the_verdicts_of_the_unpinned_one() -> None:
    verdicts = BoxVerdicts()
    unpinned = PlacementRequest("H100", 2)
    assert verdicts.parts(PlacementRequest("H100", 2, host="h1")) is verdicts.parts(unpinned)
    assert verdicts.parts(PlacementRequest("H100", 3)) is not verdicts.parts(unpinned)
