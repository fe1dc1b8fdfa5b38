"""Carried work (:mod:`dxpool.broker.placement.carry`) against a fresh computation.

A decision read off parts carried across commits and releases must be exactly the one a
pipeline that carries nothing makes on the same snapshot: after any sequence of changes,
whether they touched a part's class or not, for requests of many sizes and shapes."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dxpool.broker.nodes.memory_pool import InMemoryPool
from dxpool.broker.placement import PlacementRequest, carry, default_pipeline, place, tiered
from dxpool.broker.placement import pipeline as pipeline_module
from dxpool.broker.placement.model import Snapshot
from dxpool.broker.placement.pipeline import Pipeline
from dxpool.broker.placement.plugins.scores import BoxFit

RACK_SIZE = 4
RACKS_PER_POD = 3


def _location(index: int, rack_size: int = RACK_SIZE) -> tuple[str, str, str]:
    rack = index // rack_size
    pod, rack_in_pod = divmod(rack, RACKS_PER_POD)
    return "dc0", f"p{pod}", f"r{rack_in_pod}"


def _pool(rng: random.Random, boxes: int, hosts: int, rack_size: int = RACK_SIZE) -> InMemoryPool:
    pool = InMemoryPool(pipeline=default_pipeline(), clock=lambda: 1000.0)
    for index in range(boxes):
        model = "H100" if index % 5 else "A100"
        location = _location(index, rack_size)
        pool.add_box(f"b{index:03d}", model, rng.choice((4, 8)), location=location)
    for index in range(hosts):
        pool.add_host(
            f"h{index:03d}",
            rng.choice((2, 4, 8)),
            cpu_cores=rng.choice((32, 64, 128)),
            memory_mib=rng.choice((256, 512, 1024)) * 1024,
            location=_location(index, rack_size),
        )
    return pool


def _request(rng: random.Random) -> PlacementRequest:
    shape = rng.random()
    count = rng.choice((1, 1, 2, 3, 4, 8))
    if shape < 0.15:
        return PlacementRequest("H100|A100", count, cpu_cores=rng.choice((0, 8)))
    return PlacementRequest(
        "H100",
        count,
        cpu_cores=rng.choice((0, 4, 16, 48)),
        host_memory_mib=rng.choice((0, 32, 128, 384)) * 1024,
        exclude_hosts=frozenset({f"h{rng.randrange(20):03d}"}) if shape > 0.9 else frozenset(),
    )


def _alone(snapshot: Snapshot) -> Snapshot:
    """The same records without version or journal: nothing can be carried onto it."""
    return Snapshot(snapshot.boxes, snapshot.hosts, snapshot.gpus_by_box)


def _answer(result: object) -> object:
    placement = getattr(result, "placement", None)
    if placement is None:
        return None
    return placement.host, placement.bindings, placement.score


@pytest.mark.parametrize(
    ("seed", "boxes", "rack_size"),
    [*((seed, 36, RACK_SIZE) for seed in range(12)), *((seed, 90, 1) for seed in range(8))],
)
def test_after_random_commits_and_releases_a_carried_decision_is_a_fresh_one(
    seed: int, boxes: int, rack_size: int
) -> None:
    """Commits and releases in random order, near and far from each request's class, with
    a stream of sizes and shapes that share and split carried parts: every decision of the
    carrying pipeline equals a pipeline made afresh on the same snapshot, and one on the
    same records without a journal (nothing carried at all). With racks of one box the
    site's tier holds more classes than a walk lists (a choice then rests on that tier's
    least box rather than on its every class)."""
    _carried_decisions_are_fresh_ones(seed, boxes, rack_size)


@pytest.mark.parametrize("share", [0, 10**9])
@pytest.mark.parametrize(("seed", "boxes", "rack_size"), [(3, 36, RACK_SIZE), (5, 90, 1)])
def test_a_table_filed_group_by_group_or_all_at_once_decides_as_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch, share: int, seed: int, boxes: int, rack_size: int
) -> None:
    """A class table moves the groups that changed one by one, or files them all afresh
    in one pass when most changed (``REFILE_ALL_SHARE``): forced to either way for every
    change, the decisions are still those of a pipeline made afresh."""
    monkeypatch.setattr(carry, "REFILE_ALL_SHARE", share)
    _carried_decisions_are_fresh_ones(seed, boxes, rack_size)


@pytest.mark.parametrize("few", [0, 2])
@pytest.mark.parametrize(
    ("seed", "boxes", "rack_size"), [(3, 36, RACK_SIZE), (5, 90, 1), (6, 90, 1)]
)
def test_far_tightest_boxes_decide_as_fresh_ones_whether_or_not_few_classes_hold_one(
    monkeypatch: pytest.MonkeyPatch, few: int, seed: int, boxes: int, rack_size: int
) -> None:
    """A class whose tightest box is a far tier's least box keeps that answer across
    moves of the box and changes of the fewest usable GPUs while it holds, also while
    few classes hold such a box and the rest are answered apart: with the tightest box
    never answered apart (0), or often going from apart to within and back (2), the
    decisions are still those of a pipeline made afresh."""
    monkeypatch.setattr(tiered, "FEW_TIGHTEST", few)
    _carried_decisions_are_fresh_ones(seed, boxes, rack_size)


@pytest.mark.parametrize("few", [0, 2, tiered.FEW_TIGHTEST])
@pytest.mark.parametrize(("seed", "boxes", "rack_size"), [(3, 36, RACK_SIZE), (5, 90, 1)])
def test_a_plugin_that_reads_which_box_is_taken_files_groups_by_box_and_decides_alike(
    monkeypatch: pytest.MonkeyPatch, few: int, seed: int, boxes: int, rack_size: int
) -> None:
    """With a score plugin that does not score by take shape alone, the tightest boxes
    are filed box class by box class and far tiers' least boxes scored each on their
    own: the decisions are still those of a pipeline made afresh."""
    monkeypatch.setattr(BoxFit, "by_take_shape", False)
    monkeypatch.setattr(tiered, "FEW_TIGHTEST", few)
    pipeline = _carried_decisions_are_fresh_ones(seed, boxes, rack_size)
    tables = list(pipeline._carried.tables.values())
    assert tables and not any(table.by_shape for table in tables)
    assert all(
        tight[1] != carry.ANY_BOX_CLASS for table in tables for tight in table.groups_by_tightest
    )
    if few:  # some table answered the tightest box apart
        assert any(table.groups_by_tightest for table in tables)


def test_plugins_that_score_by_take_shape_file_the_few_tightest_boxes_by_round_trip() -> None:
    """The default score plugins score by take shape: a table files the groups whose
    nearest tightest boxes differ but lie equally far together, and scores proposals
    by their shape, not by which boxes they take."""
    pipeline = _carried_decisions_are_fresh_ones(3, 36, RACK_SIZE)
    tables = list(pipeline._carried.tables.values())
    assert tables and all(table.by_shape for table in tables)
    apart = [table for table in tables if table.few_active and table.groups_by_tightest]
    assert apart  # some table answered the tightest box apart
    for table in apart:
        assert all(tight[1] == carry.ANY_BOX_CLASS for tight in table.groups_by_tightest)
        # groups of one key may take different boxes: each has its own class's nearest
        boxes = {
            answer[1]
            for key in table.tightest_of_group
            if not isinstance(answer := table.nearest.answers[key[0]], tiered.FarTightest)
        }
        assert boxes <= set(table.nearest.few)
    for side in pipeline._carried.box_sides.values():
        assert side.shape_scored and not side.scored


def _carried_decisions_are_fresh_ones(seed: int, boxes: int, rack_size: int) -> Pipeline:
    rng = random.Random(seed)
    pool = _pool(rng, boxes=boxes, hosts=30, rack_size=rack_size)
    carrying = pool.pipeline
    live: list[str] = []
    decided: list[object] = []

    def recording(*args: Any) -> object:
        answer = carry.decide(*args)
        decided.append(answer)
        return answer

    for step in range(90):
        request = _request(rng)
        snapshot = pool.snapshot()
        decided.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pipeline_module, "decide", recording)
            carried = place(request, snapshot, pool.latency, carrying)
        fresh = place(request, snapshot, pool.latency, default_pipeline())
        alone = place(request, _alone(snapshot), pool.latency, default_pipeline())
        assert _answer(carried) == _answer(fresh) == _answer(alone), (seed, step, request)
        if carried.placement is not None:
            # read off the carried parts, not by the run host by host it falls back to
            assert decided and decided[-1] is not None, (seed, step, request)
        if carried.placement is not None and rng.random() < 0.7:
            node = f"n{step}"
            pool.commit(node, request, carried.placement)
            live.append(node)
        while live and (rng.random() < 0.35 or len(live) > 14):
            pool.release(live.pop(rng.randrange(len(live))))
    assert carrying is not None and carrying._carried.tables  # the decisions were carried
    return carrying


def test_a_part_is_kept_across_changes_that_do_not_touch_it_and_made_again_when_they_do() -> None:
    """A commit far from a request's class keeps its carried parts (the same objects,
    brought forward); a change that empties the supply drops them; every decision equals
    a fresh one."""
    rng = random.Random(5)
    pool = _pool(rng, boxes=24, hosts=24)
    pipeline = pool.pipeline
    assert pipeline is not None
    request = PlacementRequest("H100", 2, cpu_cores=4)
    first = place(request, pool.snapshot(), pool.latency, pipeline)
    assert first.placement is not None
    carried = pipeline._carried
    tables = dict(carried.tables)
    sides = dict(carried.box_sides)
    assert len(tables) == 1 and len(sides) == 1
    # a different shape of the same size and model set: the box side is shared
    other = PlacementRequest("H100", 2, cpu_cores=48, host_memory_mib=384 * 1024)
    place(other, pool.snapshot(), pool.latency, pipeline)
    assert dict(carried.box_sides) == sides
    # a commit elsewhere: the parts are brought forward, not made again
    far = PlacementRequest("A100", 4)
    placed = place(far, pool.snapshot(), pool.latency, pipeline)
    assert placed.placement is not None
    pool.commit("far", far, placed.placement)
    snapshot = pool.snapshot()
    again = place(request, snapshot, pool.latency, pipeline)
    assert _answer(again) == _answer(place(request, snapshot, pool.latency, default_pipeline()))
    for key, side in sides.items():
        assert carried.box_sides[key] is side
        assert side.version == snapshot.version
    for key, table in tables.items():
        assert carried.tables[key] is table
    # the request's own class changes: still the fresh answer
    assert again.placement is not None
    pool.commit("near", request, again.placement)
    snapshot = pool.snapshot()
    after = place(request, snapshot, pool.latency, pipeline)
    assert _answer(after) == _answer(place(request, snapshot, pool.latency, default_pipeline()))
    pool.release("near")
    pool.release("far")
    snapshot = pool.snapshot()
    back = place(request, snapshot, pool.latency, pipeline)
    assert _answer(back) == _answer(first)
