"""The baseline: GPUs bolted into fixed servers, a node is placed on one server.

Best fit, as FGD's ``05-BestFit`` for whole GPUs: the server with the fewest free GPUs
that still fit the node, ties to the lowest index. O(distinct free counts) per decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from sortedcontainers import SortedList

from bench.traces.allocator import Cause, Grant


class FixedServers:
    """Servers of the given GPU counts; every node lands whole on one of them."""

    def __init__(self, name: str, gpus_per_server: Sequence[int]) -> None:
        if not gpus_per_server or min(gpus_per_server) <= 0:
            raise ValueError("fixed servers need at least one server, each with a GPU")
        self.name = name
        self.capacity = sum(gpus_per_server)
        self._free = list(gpus_per_server)
        self._by_free: dict[int, SortedList[int]] = {}
        for index, free in enumerate(self._free):
            self._by_free.setdefault(free, SortedList()).add(index)
        self._allocated = 0

    @property
    def allocated(self) -> int:
        return self._allocated

    def allocate(self, gpus: int) -> Grant | Cause:
        fits = [free for free, servers in self._by_free.items() if free >= gpus and servers]
        if not fits:
            if self.capacity - self._allocated < gpus:
                return Cause.CAPACITY
            return Cause.FRAGMENTATION
        tightest = min(fits)
        server = self._by_free[tightest][0]
        self._move(server, -gpus)
        self._allocated += gpus
        return Grant((server, gpus), gpus)

    def release(self, grant: Grant) -> None:
        server, gpus = cast(tuple[int, int], grant.key)
        self._move(server, gpus)
        self._allocated -= gpus

    def _move(self, server: int, change: int) -> None:
        free = self._free[server]
        self._by_free[free].remove(server)
        self._free[server] = free + change
        self._by_free.setdefault(free + change, SortedList()).add(server)
