"""Results explain lazily, read the same either way; snapshots derive things once."""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import pytest

from dxpool.broker.placement import (
    CandidateReport,
    Placement,
    PlacementRequest,
    PlacementResult,
    Proposal,
    Snapshot,
    WeightedScore,
    default_pipeline,
    place,
)
from dxpool.broker.placement.model import MAX_DERIVED
from dxpool.broker.placement.pipeline import Pipeline

from .pools import Pool, TableLatency

KEPT = CandidateReport("h1", True, ("gpus boxes/b1 x1 @2us (nearest-first)",), 100.0)
PLACEMENT = Placement("h1", (), 100.0)


def test_candidates_given_as_a_function_are_made_once_on_first_read() -> None:
    calls: list[int] = []

    def explain() -> tuple[CandidateReport, ...]:
        calls.append(1)
        return (KEPT,)

    lazy = PlacementResult(PLACEMENT, explain, ())
    assert calls == []
    assert lazy.candidates == (KEPT,)
    assert lazy.candidates == (KEPT,)
    assert calls == [1]


def test_a_lazy_result_reads_compares_and_pickles_like_an_eager_one() -> None:
    eager = PlacementResult(PLACEMENT, (KEPT,), ())
    lazy = PlacementResult(PLACEMENT, lambda: (KEPT,), ())
    assert lazy == eager
    assert hash(lazy) == hash(eager)
    assert repr(lazy) == repr(eager)
    assert "candidates=(CandidateReport(host='h1'" in repr(lazy)
    assert pickle.loads(pickle.dumps(lazy)) == eager
    assert lazy != PlacementResult(None, (KEPT,), ("no host",))
    assert lazy != "a result"


def test_a_result_is_immutable() -> None:
    result = PlacementResult(None, (), ("no host can take 1 GPUs",))
    with pytest.raises(AttributeError, match="immutable"):
        result.placement = PLACEMENT  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del result.unsatisfied


class NameReads:
    """A score plugin that counts how often its name is read (explanations name it)."""

    reads = 0

    @property
    def name(self) -> str:
        NameReads.reads += 1
        return "name_reads"

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        return 1.0

    def normalize(self, scores: Sequence[float]) -> list[float]:
        return [100.0 for _ in scores]


def test_a_placement_explains_only_when_its_candidates_are_read() -> None:
    pipeline = Pipeline(scores=(WeightedScore(NameReads(), 1.0),))
    snapshot = Pool().box("b1", 4).host("h1").host("h2").snapshot()
    NameReads.reads = 0
    result = place(PlacementRequest("H100", 1), snapshot, TableLatency(), pipeline)
    assert result.placement is not None
    assert NameReads.reads == 0
    assert [c.reasons[1:] for c in result.candidates] == [("name_reads 100 x1",)] * 2
    assert NameReads.reads > 0


def test_lazy_explanations_match_those_of_a_fresh_run() -> None:
    snapshot = Pool().box("b1", 4).box("b2", 2).host("h1").host("h2", 4, used=[0]).snapshot()
    request = PlacementRequest("H100", 2)
    first = place(request, snapshot, TableLatency(), default_pipeline())
    again = place(request, snapshot, TableLatency(), default_pipeline())
    assert first.candidates == again.candidates
    assert [c.host for c in first.candidates] == ["h2", "h1"]


def test_a_snapshot_derives_each_thing_once() -> None:
    snapshot = Pool().box("b2").box("b1").host("h2").host("h1").snapshot()
    made: list[str] = []

    def make() -> str:
        made.append("x")
        return "value"

    assert snapshot.derived("key", make) == snapshot.derived("key", make) == "value"
    assert made == ["x"]
    assert snapshot.host_ids() == ("h1", "h2")
    assert snapshot.box_ids() == ("b1", "b2")


def test_a_snapshot_forgets_what_it_derived_beyond_its_limit() -> None:
    snapshot = Snapshot({}, {}, {})
    for key in range(MAX_DERIVED + 1):
        snapshot.derived(key, lambda: "value")
    made: list[int] = []
    snapshot.derived(0, lambda: made.append(1))
    assert made == [1]
    assert snapshot == Snapshot({}, {}, {})  # what it derived is not part of its value


def test_a_copied_snapshot_leaves_what_it_derived_behind() -> None:
    snapshot = Pool().box("b1", 2).host("h1").snapshot()
    place(PlacementRequest("H100", 1), snapshot, TableLatency())
    copied = pickle.loads(pickle.dumps(snapshot))
    assert copied == snapshot
    made: list[int] = []
    copied.derived("host ids", lambda: made.append(1))
    assert made == [1]
