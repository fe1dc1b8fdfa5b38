"""A baseline on the pool's own inventory: the model with the most free GPUs first.

The same boxes and hosts as the dxpool pool (any free GPU reaches any host), placed by
two simple rules instead of dxpool's pipeline: the node's GPUs come from the model the
request may use with the most free GPUs (ties to the lowest model name; a request for
any model that no one model can serve takes the most free models first, mixed), and
the node goes to the host with the fewest free proxy slots that has them and the CPU
and memory asked, ties to the lowest index. A CPU-only pod goes to the host with the
fewest free slots that holds it, then the least free CPU. It is what a scheduler that
weighs model scarcity but nothing of the host would do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from sortedcontainers import SortedList

from bench.traces.allocator import NONE, Cause, Grant, Resources, refusal


class MostFreeModel:
    """GPUs of ``gpus_by_model`` (any reaches any host) and hosts of ``host_slots``
    proxy slots with ``cpus`` and ``memory_mib`` (or none declared)."""

    def __init__(
        self,
        name: str,
        gpus_by_model: dict[str, int],
        host_slots: Sequence[int],
        cpus: Sequence[int] = (),
        memory_mib: Sequence[int] = (),
    ) -> None:
        count = len(host_slots)
        if not gpus_by_model or not count:
            raise ValueError("a pool needs at least one GPU and one host")
        self.name = name
        self.capacity = sum(gpus_by_model.values())
        self._free = dict(sorted(gpus_by_model.items()))
        self._slots = list(host_slots)
        self._cpu = list(cpus) if cpus else [0] * count
        self._memory = list(memory_mib) if memory_mib else [0] * count
        self._totals = [sum(self._slots), sum(self._cpu), sum(self._memory)]
        self._by_free: dict[int, SortedList[int]] = {}
        for index, free in enumerate(self._slots):
            self._by_free.setdefault(free, SortedList()).add(index)
        self._allocated = 0

    @property
    def allocated(self) -> int:
        return self._allocated

    def allocate(self, gpus: int, needs: Resources = NONE) -> Grant | Cause:
        host = self._host(gpus, needs)
        takes = self._takes(gpus, needs) if gpus else {}
        if host is None or takes is None:
            rooms = zip(self._slots, self._cpu, self._memory, strict=True)
            free = sum(self._free.values())
            refused = refusal(gpus, needs, free, self._take3(), rooms, self._free)
            assert refused is not None, "the rules missed a host or model that fits"
            return refused
        for model, taken in takes.items():
            self._free[model] -= taken
        self._move(host, -gpus, -needs.cpu, -needs.memory_mib)
        self._allocated += gpus
        return Grant((host, takes, needs), gpus)

    def release(self, grant: Grant) -> None:
        host, takes, needs = cast(tuple[int, dict[str, int], Resources], grant.key)
        for model, taken in takes.items():
            self._free[model] += taken
        self._move(host, grant.gpus, needs.cpu, needs.memory_mib)
        self._allocated -= grant.gpus

    def _takes(self, gpus: int, needs: Resources) -> dict[str, int] | None:
        """GPUs by model: the most free model asked for that holds them all; for any
        model, the most free models mixed when no one model does."""
        allowed = [model for model in needs.models if model in self._free] or (
            [] if needs.models else list(self._free)
        )
        ranked = sorted(allowed, key=lambda model: (-self._free[model], model))
        if ranked and self._free[ranked[0]] >= gpus:
            return {ranked[0]: gpus}
        if needs.models or sum(self._free.values()) < gpus:
            return None
        takes: dict[str, int] = {}
        for model in ranked:
            taken = min(gpus - sum(takes.values()), self._free[model])
            if taken:
                takes[model] = taken
        return takes

    def _host(self, gpus: int, needs: Resources) -> int | None:
        """The host with the fewest free slots that holds the node (a CPU-only pod: then
        the least free CPU), lowest index on ties."""
        cpu, memory = self._cpu, self._memory
        for free in sorted(f for f, hosts in self._by_free.items() if f >= gpus and hosts):
            best: int | None = None
            for index in self._by_free[free]:
                if cpu[index] < needs.cpu or memory[index] < needs.memory_mib:
                    continue
                if gpus:
                    return index
                if best is None or cpu[index] < cpu[best]:
                    best = index
            if best is not None:
                return best
        return None

    def _take3(self) -> tuple[int, int, int]:
        return self._totals[0], self._totals[1], self._totals[2]

    def _move(self, host: int, slots: int, cpu: int, memory: int) -> None:
        if slots:
            self._by_free[self._slots[host]].remove(host)
            self._by_free.setdefault(self._slots[host] + slots, SortedList()).add(host)
        self._slots[host] += slots
        self._cpu[host] += cpu
        self._memory[host] += memory
        self._totals[0] += slots
        self._totals[1] += cpu
        self._totals[2] += memory
