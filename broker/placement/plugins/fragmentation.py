"""Fragmentation-aware scoring of host proxy slots, in the sense of FGD (Weng et al.,
"Beware of Fragmentation", USENIX ATC'23).

In a pool any free GPU can reach any host, so GPUs do not strand; a host's free proxy
slots do. A host with ``f`` free slots can take no node of more than ``f`` GPUs, so for a
mix of node sizes its *fragmentation* is the free slots that a node drawn from the mix
cannot use: ``f x P(size > f)``. The pool's fragmentation is the sum over hosts, and
placing ``n`` GPUs on a host with ``f`` free slots changes it by
``F(f - n) - F(f)``. :class:`SlotFragmentation` prefers the host that raises it least
(or lowers it most): like best fit it fills nearly full hosts first, but it leaves a
host with 5 free slots before one with exactly 4 when 4-GPU nodes are common, since the
second would stop serving them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from dxpool.broker.placement.framework import MAX_SCORE, Proposal
from dxpool.broker.placement.model import PlacementRequest
from dxpool.limits import MAX_HOST_SLOTS

DEFAULT_SIZE_MIX: Mapping[int, float] = MappingProxyType({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
"""The node sizes expected, by how often they come: without knowledge of the workload,
each power of two up to a full 8-GPU server equally often."""

DEFAULT_SPREAD_SLOTS = 4.0
"""A proposal whose fragmentation change is this many slots worse than the best one's
scores 0 (the best scores 100, in between in proportion)."""


class SlotFragmentation:
    """Prefers the host whose free proxy slots the node fragments least.

    ``sizes`` maps node sizes (GPUs, 1 to ``MAX_HOST_SLOTS``) to how often they come
    (any positive scale; only the proportions count). The raw score is the change of the
    pool's expected fragmentation, in slots (lower is better, may be negative); it
    depends only on the host's free slot count and the node's size, so the plugin scores
    by host class. Construction raises ``ValueError`` naming a bad size or weight.
    """

    name = "slot_fragmentation"
    by_host_class = True
    by_take_shape = True

    def __init__(
        self,
        sizes: Mapping[int, float] = DEFAULT_SIZE_MIX,
        *,
        spread_slots: float = DEFAULT_SPREAD_SLOTS,
    ) -> None:
        if not sizes:
            raise ValueError("slot_fragmentation: give at least one node size")
        for size, weight in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int):
                raise ValueError(f"slot_fragmentation: node sizes are integers, got {size!r}")
            if not 1 <= size <= MAX_HOST_SLOTS:
                raise ValueError(
                    f"slot_fragmentation: node size {size} is outside 1-{MAX_HOST_SLOTS}"
                )
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(
                    f"slot_fragmentation: size {size} needs a positive weight, got {weight!r}"
                )
        if not (math.isfinite(spread_slots) and spread_slots > 0):
            raise ValueError(
                f"slot_fragmentation: spread_slots must be positive, got {spread_slots!r}"
            )
        total = math.fsum(sizes.values())
        self.sizes: Mapping[int, float] = MappingProxyType(
            {size: sizes[size] / total for size in sorted(sizes)}
        )
        self.spread_slots = spread_slots
        self._fragmentation = tuple(
            free * math.fsum(p for size, p in self.sizes.items() if size > free)
            for free in range(MAX_HOST_SLOTS + 1)
        )

    def fragmentation(self, free_slots: int) -> float:
        """Expected free slots of a host with ``free_slots`` free that a node of the mix
        cannot use (0 for a full host or one that fits every size)."""
        return self._fragmentation[min(max(free_slots, 0), MAX_HOST_SLOTS)]

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        free = proposal.free_slots
        return self.fragmentation(free - proposal.gpu_count) - self.fragmentation(free)

    def normalize(self, scores: Sequence[float]) -> list[float]:
        best = min(scores, default=0.0)
        spread = self.spread_slots
        return [max(0.0, MAX_SCORE * (1 - (score - best) / spread)) for score in scores]
