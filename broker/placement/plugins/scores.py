"""Score plugins: how good a proposal is, each from one point of view.

Raw scores are normalized across all proposals of one placement to 0-100 (the best gets
100) before the registry's weights are applied.
"""

from __future__ import annotations

from collections.abc import Sequence

from dxpool.broker.placement.framework import (
    MAX_SCORE,
    Proposal,
    invert_to_best,
    scale_to_best,
)
from dxpool.broker.placement.model import PlacementRequest


class LatencyScore:
    """Prefers nearer boxes: the raw score is the mean round trip over the node's GPUs."""

    name = "latency"
    by_host_class = True
    by_take_shape = True

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        return proposal.mean_latency_ns

    def normalize(self, scores: Sequence[float]) -> list[float]:
        return invert_to_best(scores)


class BoxAffinity:
    """Prefers fewer distinct boxes, so GPUs can talk peer-to-peer inside one switch."""

    name = "box_affinity"
    by_host_class = True
    by_take_shape = True

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        return float(proposal.box_count)

    def normalize(self, scores: Sequence[float]) -> list[float]:
        return invert_to_best(scores)


class BoxFit:
    """Prefers boxes whose free GPUs the node uses up, so whole boxes stay free for large
    nodes: the raw score is the share of the usable GPUs in the touched boxes it takes."""

    name = "box_fit"
    by_host_class = True
    by_take_shape = True

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        return MAX_SCORE * proposal.gpu_count / max(proposal.available_in_boxes, 1)

    def normalize(self, scores: Sequence[float]) -> list[float]:
        return scale_to_best(scores)


class HostFit:
    """Prefers hosts whose free proxy slots the node fills, so roomy hosts stay roomy:
    the raw score is the share of the host's free slots the node takes."""

    name = "host_fit"
    by_host_class = True
    by_take_shape = True

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        return MAX_SCORE * proposal.gpu_count / max(proposal.free_slots, 1)

    def normalize(self, scores: Sequence[float]) -> list[float]:
        return scale_to_best(scores)
