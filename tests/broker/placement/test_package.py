"""The public surface of dxpool.broker.placement is pinned: changing it is deliberate."""

from __future__ import annotations

from dxpool.broker import placement


def test_exported_names() -> None:
    assert sorted(placement.__all__) == sorted(
        [
            "WEIGHTS",
            "Binding",
            "BoxFilterPlugin",
            "BoxInfo",
            "BoxSupply",
            "CandidateReport",
            "Code",
            "DroppedLink",
            "GpuFilterPlugin",
            "GpuInfo",
            "HostFilterPlugin",
            "HostInfo",
            "LinkFilterPlugin",
            "Pipeline",
            "Placement",
            "PlacementRequest",
            "PlacementResult",
            "PreFilterPlugin",
            "Proposal",
            "ScorePlugin",
            "Snapshot",
            "Status",
            "Take",
            "WeightedScore",
            "default_pipeline",
            "place",
        ]
    )
    for name in placement.__all__:
        assert getattr(placement, name) is not None


def test_weights_cover_every_default_score_plugin() -> None:
    names = {weighted.plugin.name for weighted in placement.default_pipeline().scores}
    assert names == set(placement.WEIGHTS)
