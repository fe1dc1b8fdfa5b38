"""Placement: which host and which GPUs a new node gets, and why.

A pipeline of small plugins in the style of the Kubernetes scheduler framework: a
PreFilter rejects requests the pool can never serve, filters drop GPUs, boxes, hosts and
(host, box) links, greedy rules propose GPUs per host at box granularity, and weighted
score plugins choose among the proposals. Every decision is explained: each host's
report says why it was kept or dropped, and a failed placement names each constraint
that stood in the way and the closest thing available.

Entry point: :func:`place`. Plugins are listed in :mod:`.registry`.
"""

from __future__ import annotations

from dxpool.broker.placement.framework import (
    BoxFilterPlugin,
    BoxSupply,
    DroppedLink,
    GpuFilterPlugin,
    HostFilterPlugin,
    LinkFilterPlugin,
    PreFilterPlugin,
    Proposal,
    ScorePlugin,
    Take,
)
from dxpool.broker.placement.model import (
    Binding,
    BoxInfo,
    CandidateReport,
    GpuInfo,
    HostInfo,
    Placement,
    PlacementRequest,
    PlacementResult,
    Snapshot,
)
from dxpool.broker.placement.pipeline import Pipeline, WeightedScore
from dxpool.broker.placement.placer import place
from dxpool.broker.placement.registry import WEIGHTS, default_pipeline
from dxpool.broker.placement.status import Code, Status

__all__ = [
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
