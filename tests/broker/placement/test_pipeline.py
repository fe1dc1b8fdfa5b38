"""The pipeline: phase order, plugin failures as ERROR statuses, latency model failures."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dxpool.broker.placement import (
    GpuInfo,
    HostInfo,
    Pipeline,
    PlacementRequest,
    Proposal,
    Snapshot,
    Status,
    WeightedScore,
    default_pipeline,
    place,
)
from dxpool.broker.placement.plugins.gpus import GpuFree
from dxpool.broker.placement.plugins.hosts import HostAlive
from dxpool.broker.placement.plugins.scores import LatencyScore

from .pools import Pool, TableLatency


class ExplodingHostFilter:
    """Raises for one host, keeps the others."""

    name = "exploding_host"

    def applies(self, request: PlacementRequest) -> bool:
        return True

    def filter_host(self, request: PlacementRequest, host: HostInfo) -> Status:
        if host.host == "h1":
            raise RuntimeError("boom")
        return Status()

    def explain(
        self, request: PlacementRequest, failed: Sequence[HostInfo], reached: int
    ) -> str | None:
        return None


class ExplodingScore:
    name = "exploding_score"

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        raise ValueError("bad score")

    def normalize(self, scores: Sequence[float]) -> list[float]:
        return list(scores)


class RejectEverything:
    name = "reject_everything"

    def pre_filter(self, request: PlacementRequest, snapshot: Snapshot) -> Status:
        return Status.unresolvable("closed for maintenance", plugin=self.name)


class OutOfRange:
    """Returns scores outside 0-100; the pipeline bounds them."""

    name = "out_of_range"

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        return 0.0

    def normalize(self, scores: Sequence[float]) -> list[float]:
        return [1_000.0 for _ in scores]


def two_hosts() -> Snapshot:
    return Pool().box("b1", 8).host("h1").host("h2").snapshot()


def test_a_host_filter_that_raises_drops_only_that_host_and_says_so() -> None:
    pipeline = Pipeline(
        host_filters=(ExplodingHostFilter(),), scores=(WeightedScore(LatencyScore(), 1),)
    )
    result = place(PlacementRequest("", 1), two_hosts(), TableLatency(), pipeline)
    assert result.placement is not None and result.placement.host == "h2"
    (h1,) = [c for c in result.candidates if c.host == "h1"]
    assert not h1.feasible
    assert h1.reasons == ("placement plugin exploding_host failed: RuntimeError: boom",)


def test_a_host_filter_error_is_named_when_nothing_fits() -> None:
    pipeline = Pipeline(host_filters=(ExplodingHostFilter(),))
    snapshot = Pool().box("b1", 8).host("h1").snapshot()
    result = place(PlacementRequest("", 1), snapshot, TableLatency(), pipeline)
    assert result.placement is None
    assert result.unsatisfied == (
        "hosts/h1: placement plugin exploding_host failed: RuntimeError: boom",
    )


def test_a_score_plugin_that_raises_fails_the_placement_with_an_internal_reason() -> None:
    pipeline = Pipeline(scores=(WeightedScore(ExplodingScore(), 1),))
    result = place(PlacementRequest("", 1), two_hosts(), TableLatency(), pipeline)
    assert result.placement is None
    assert result.unsatisfied == (
        "internal: placement plugin exploding_score failed: ValueError: bad score",
    )
    assert [c.host for c in result.candidates] == ["h1", "h2"]
    assert all(not c.feasible for c in result.candidates)


def test_a_rejecting_pre_filter_stops_the_run_and_every_host_carries_its_reason() -> None:
    latency = TableLatency()
    pipeline = Pipeline(pre_filters=(RejectEverything(),))
    result = place(PlacementRequest("", 1), two_hosts(), latency, pipeline)
    assert result.placement is None
    assert result.unsatisfied == ("closed for maintenance",)
    assert {c.reasons for c in result.candidates} == {("closed for maintenance",)}
    assert latency.calls == 0


def test_normalized_scores_are_bounded_to_100() -> None:
    pipeline = Pipeline(scores=(WeightedScore(OutOfRange(), 2),))
    result = place(PlacementRequest("", 1), two_hosts(), TableLatency(), pipeline)
    assert result.placement is not None and result.placement.score == 100.0


def test_a_latency_model_failure_drops_the_pair_not_the_placement() -> None:
    snapshot = Pool().box("b1", 2).box("b2", 2).host("h1").snapshot()
    latency = TableLatency(broken=frozenset({("h1", "b1")}))
    result = place(PlacementRequest("", 2), snapshot, latency)
    assert result.placement is not None
    assert {b.box for b in result.placement.bindings} == {"b2"}
    failed = place(PlacementRequest("", 3), snapshot, latency)
    assert failed.placement is None
    assert failed.unsatisfied == (
        "latency: the fabric model failed for 1 (host, box) pair: latency hosts/h1 to "
        "boxes/b1: LookupError: no route from hosts/h1 to boxes/b1",
        "reach: at most 2 free GPUs usable from one host (hosts/h1), 3 requested",
    )
    (h1,) = failed.candidates
    assert h1.reasons == (
        "only 2 free GPUs within reach, 3 needed; 1 latency error, e.g. latency hosts/h1 to "
        "boxes/b1: LookupError: no route from hosts/h1 to boxes/b1",
    )


def test_filters_that_do_not_apply_are_not_called() -> None:
    class Counting(GpuFree):
        calls = 0

        def applies(self, request: PlacementRequest) -> bool:
            return False

        def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status:
            Counting.calls += 1
            return Status()

    place(PlacementRequest("", 1), two_hosts(), TableLatency(), Pipeline(gpu_filters=(Counting(),)))
    assert Counting.calls == 0


def test_the_latency_model_is_asked_once_per_host_and_usable_box() -> None:
    pool = Pool().box("b1", 2).box("b2", 2).box("busy", 0, busy=4).box("off", 2, schedulable=False)
    pool.host("h1").host("h2").host("dead", alive=False)
    latency = TableLatency()
    place(PlacementRequest("", 1), pool.snapshot(), latency)
    assert latency.calls == 2 * 2  # two live hosts x two boxes with usable GPUs


def test_an_empty_pipeline_takes_any_gpus_on_the_first_host() -> None:
    snapshot = Pool().box("b1", 1, busy=1).host("h2").host("h1").snapshot()
    result = place(PlacementRequest("", 2), snapshot, TableLatency(), Pipeline())
    assert result.placement is not None and result.placement.host == "h1"
    assert len(result.placement.bindings) == 2


def test_plugins_may_not_share_a_name() -> None:
    with pytest.raises(ValueError, match="listed twice: host_alive"):
        Pipeline(host_filters=(HostAlive(), HostAlive()))


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_weights_must_be_positive_and_finite(weight: float) -> None:
    with pytest.raises(ValueError, match="latency: weight must be a positive number"):
        Pipeline(scores=(WeightedScore(LatencyScore(), weight),))


def test_default_pipeline_takes_weight_overrides_by_name() -> None:
    pipeline = default_pipeline(
        {"latency": 1.0, "box_affinity": 1.0, "box_fit": 1.0, "host_fit": 5.0}
    )
    assert [(s.plugin.name, s.weight) for s in pipeline.scores] == [
        ("latency", 1.0),
        ("box_affinity", 1.0),
        ("box_fit", 1.0),
        ("host_fit", 5.0),
    ]
    with pytest.raises(ValueError, match=r"unknown \['speed'\], missing \['host_fit'\]"):
        default_pipeline({"latency": 1.0, "box_affinity": 1.0, "box_fit": 1.0, "speed": 1.0})
