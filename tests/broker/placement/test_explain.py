"""The supply account of a failed placement shows only the stages that dropped GPUs."""

from __future__ import annotations

from dxpool.broker.placement.explain import FunnelStage, supply_line
from dxpool.broker.placement.model import PlacementRequest


def test_supply_line_skips_stages_that_dropped_nothing_and_appends_hints() -> None:
    funnel = [
        FunnelStage("in the pool", 40, None),
        FunnelStage("in schedulable boxes", 40, None),
        FunnelStage("H100", 12, "free GPUs of other models: A100 8"),
        FunnelStage("free", 3, None),
        FunnelStage("healthy", 3, None),
    ]
    assert supply_line(PlacementRequest("H100", 4), funnel) == (
        "gpus: 40 in the pool, 12 H100, 3 free; 4 H100 requested; free GPUs of other models: A100 8"
    )


def test_supply_line_for_any_model_and_an_empty_pool() -> None:
    assert supply_line(PlacementRequest("", 2), []) == "gpus: the pool is empty; 2 GPUs requested"
    funnel = [FunnelStage("in the pool", 0, None)]
    assert supply_line(PlacementRequest("", 1), funnel) == "gpus: 0 in the pool; 1 GPU requested"
