"""The placement pipelines a benchmark may run, by name.

``default`` is the broker's own. The others add
:class:`~dxpool.broker.placement.plugins.fragmentation.SlotFragmentation` to it with
weight :data:`SLOT_FRAGMENTATION_WEIGHT`: ``slot-frag`` with the plugin's default size
mix, ``slot-frag-trace`` with the node sizes of the trace being replayed (how often each
size comes, by count, as FGD weighs its task types), ``slot-frag-trace-gpus`` with them
weighed by the GPUs they ask for (count x size). ``cpu-balance`` adds
:class:`~dxpool.broker.placement.plugins.resources.HostResourceBalance` with weight
:data:`RESOURCE_BALANCE_WEIGHT` instead (``cpu-balance-light``: with
:data:`RESOURCE_BALANCE_LIGHT_WEIGHT`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from dxpool.broker.placement import Pipeline, WeightedScore, default_pipeline
from dxpool.broker.placement.plugins.fragmentation import SlotFragmentation
from dxpool.broker.placement.plugins.resources import HostResourceBalance

NAMES = (
    "default",
    "slot-frag",
    "slot-frag-trace",
    "slot-frag-trace-gpus",
    "cpu-balance",
    "cpu-balance-light",
)
SLOT_FRAGMENTATION_WEIGHT = 2.0  # above host_fit (1.0), so it decides between hosts
RESOURCE_BALANCE_WEIGHT = 2.0  # likewise
RESOURCE_BALANCE_LIGHT_WEIGHT = 0.5  # below host_fit: it only tells near-equal hosts apart


def with_slot_fragmentation(sizes: Mapping[int, float] | None) -> Pipeline:
    """The default pipeline plus the slot fragmentation score (default mix when None)."""
    base = default_pipeline()
    plugin = SlotFragmentation(sizes) if sizes else SlotFragmentation()
    extra = WeightedScore(plugin, SLOT_FRAGMENTATION_WEIGHT)
    return dataclasses.replace(base, scores=(*base.scores, extra))


def build(name: str, trace_sizes: Mapping[int, float]) -> Pipeline | None:
    """The pipeline called ``name`` (one of :data:`NAMES`); None means the broker's
    default. ``trace_sizes`` is the replayed trace's node size mix."""
    if name == "default":
        return None
    if name == "slot-frag":
        return with_slot_fragmentation(None)
    if name == "slot-frag-trace":
        return with_slot_fragmentation(trace_sizes)
    if name in ("cpu-balance", "cpu-balance-light"):
        base = default_pipeline()
        weight = RESOURCE_BALANCE_WEIGHT if name == "cpu-balance" else RESOURCE_BALANCE_LIGHT_WEIGHT
        extra = WeightedScore(HostResourceBalance(), weight)
        return dataclasses.replace(base, scores=(*base.scores, extra))
    if name == "slot-frag-trace-gpus":
        return with_slot_fragmentation({size: n * size for size, n in trace_sizes.items()})
    raise ValueError(f"unknown pipeline {name!r}; choose one of {', '.join(NAMES)}")
