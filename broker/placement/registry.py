"""The one place the default placement plugins and their score weights are listed."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dxpool.broker.placement.framework import ScorePlugin
from dxpool.broker.placement.pipeline import Pipeline, WeightedScore
from dxpool.broker.placement.plugins.boxes import BoxSchedulable, LatencyBound
from dxpool.broker.placement.plugins.gpus import (
    GpuFree,
    GpuHealthy,
    GpuMemory,
    GpuModel,
    GpuNotExcluded,
)
from dxpool.broker.placement.plugins.hosts import (
    HostAlive,
    HostLabels,
    HostNotExcluded,
    HostResources,
    HostSlots,
    PinnedHost,
)
from dxpool.broker.placement.plugins.inventory import HostCapacity, PoolInventory
from dxpool.broker.placement.plugins.scores import BoxAffinity, BoxFit, HostFit, LatencyScore
from dxpool.broker.placement.plugins.slowdown import SlowdownBound
from dxpool.broker.placement.plugins.spread import SameBox, SpreadBoxes

WEIGHTS: Mapping[str, float] = MappingProxyType(
    {
        # Latency costs the tenant on every PCIe transaction: it weighs most.
        LatencyScore.name: 3.0,
        # Peer-to-peer inside one box's switch avoids the fabric entirely.
        BoxAffinity.name: 2.0,
        # Keeping whole boxes free keeps large nodes possible.
        BoxFit.name: 2.0,
        # Keeping roomy hosts roomy matters, but least.
        HostFit.name: 1.0,
    }
)
"""Weight of each score plugin's normalized (0-100) score in the total."""


def default_pipeline(weights: Mapping[str, float] = WEIGHTS) -> Pipeline:
    """The pipeline every compose and plan runs. Filters run in the order listed; the
    GPU filters' order is also the order a failed placement counts the supply in;
    ``SameBox`` and ``SpreadBoxes`` judge a box's usable GPUs together, so they come last.

    ``weights`` may override the score weights by plugin name; every score plugin needs
    one (``ValueError`` names a missing or unknown one).
    """
    scores: tuple[ScorePlugin, ...] = (LatencyScore(), BoxAffinity(), BoxFit(), HostFit())
    names = {score.name for score in scores}
    unknown = sorted(set(weights) - names)
    missing = sorted(names - set(weights))
    if unknown or missing:
        raise ValueError(
            f"score weights: unknown {unknown or 'none'}, missing {missing or 'none'}; "
            f"the score plugins are {', '.join(sorted(names))}"
        )
    return Pipeline(
        pre_filters=(PoolInventory(), HostCapacity()),
        gpu_filters=(
            GpuModel(),
            GpuMemory(),
            GpuFree(),
            GpuHealthy(),
            GpuNotExcluded(),
            SameBox(),
            SpreadBoxes(),
        ),
        box_filters=(BoxSchedulable(),),
        host_filters=(
            PinnedHost(),
            HostAlive(),
            HostLabels(),
            HostNotExcluded(),
            HostResources(),
            HostSlots(),
        ),
        link_filters=(LatencyBound(), SlowdownBound()),
        scores=tuple(WeightedScore(score, weights[score.name]) for score in scores),
    )
