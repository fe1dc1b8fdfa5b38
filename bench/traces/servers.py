"""The baseline: GPUs bolted into fixed servers, a node is placed on one server.

Best fit, as FGD's ``05-BestFit`` for whole GPUs: the server with the fewest free GPUs
that still fit the node, of a model the node may use, and also has the CPU and memory it
asks for, ties to the lowest index. A CPU-only pod (0 GPUs) goes the same way, so it
lands where the fewest GPUs stay free, and among those on the server with the least
free CPU that holds it. Servers declare CPU and memory or not at all (then a request
asking for either never fits). O(distinct free counts) per decision, plus the servers
of a count that lack the CPU, memory or model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from sortedcontainers import SortedList

from bench.traces.allocator import NONE, Cause, Grant, Resources, refusal


class FixedServers:
    """Servers of the given GPU counts (and, optionally, CPU and memory in the same order);
    every node lands whole on one of them."""

    def __init__(
        self,
        name: str,
        gpus_per_server: Sequence[int],
        cpus: Sequence[int] = (),
        memory_mib: Sequence[int] = (),
        models: Sequence[str] = (),
    ) -> None:
        if not gpus_per_server or min(gpus_per_server) <= 0:
            raise ValueError("fixed servers need at least one server, each with a GPU")
        count = len(gpus_per_server)
        for given, what in ((cpus, "CPU"), (memory_mib, "memory"), (models, "the model")):
            if given and len(given) != count:
                raise ValueError(f"{what} is given for {len(given)} servers, not {count}")
        self._models = list(models) if models else [""] * count
        self._free_by_model: dict[str, int] = {}
        for model, gpus in zip(self._models, gpus_per_server, strict=True):
            self._free_by_model[model] = self._free_by_model.get(model, 0) + gpus
        self.name = name
        self.capacity = sum(gpus_per_server)
        self._free = list(gpus_per_server)
        self._cpu = list(cpus) if cpus else [0] * count
        self._memory = list(memory_mib) if memory_mib else [0] * count
        self._totals = [self.capacity, sum(self._cpu), sum(self._memory)]
        self._by_free: dict[int, SortedList[int]] = {}
        for index, free in enumerate(self._free):
            self._by_free.setdefault(free, SortedList()).add(index)
        self._allocated = 0

    @property
    def allocated(self) -> int:
        return self._allocated

    def allocate(self, gpus: int, needs: Resources = NONE) -> Grant | Cause:
        server = self._best_fit(gpus, needs)
        if server is None:
            allowed = self._allows(needs)
            rooms = (
                (free if allowed(model) else 0, cpu, memory)
                for free, cpu, memory, model in zip(
                    self._free, self._cpu, self._memory, self._models, strict=True
                )
            )
            by_model = self._free_by_model if needs.models else None
            refused = refusal(gpus, needs, self._totals[0], self._take3(), rooms, by_model)
            assert refused is not None, "best fit missed a server that fits"
            return refused
        self._move(server, -gpus, -needs.cpu, -needs.memory_mib)
        self._allocated += gpus
        return Grant((server, gpus, needs), gpus)

    def release(self, grant: Grant) -> None:
        server, gpus, needs = cast(tuple[int, int, Resources], grant.key)
        self._move(server, gpus, needs.cpu, needs.memory_mib)
        self._allocated -= gpus

    def _take3(self) -> tuple[int, int, int]:
        return self._totals[0], self._totals[1], self._totals[2]

    @staticmethod
    def _allows(needs: Resources) -> Callable[[str], bool]:
        """Whether a server of a model may take the request's GPUs."""
        if not needs.models:
            return lambda model: True
        wanted = frozenset(needs.models)
        return wanted.__contains__

    def _best_fit(self, gpus: int, needs: Resources) -> int | None:
        cpu, memory, models = self._cpu, self._memory, self._models
        allowed = self._allows(needs) if gpus else self._allows(NONE)
        for free in sorted(f for f, servers in self._by_free.items() if f >= gpus and servers):
            best: int | None = None
            for server in self._by_free[free]:
                if cpu[server] < needs.cpu or memory[server] < needs.memory_mib:
                    continue
                if not allowed(models[server]):
                    continue
                if gpus:
                    return server  # the lowest index of the tightest count
                if best is None or cpu[server] < cpu[best]:
                    best = server
            if best is not None:
                return best
        return None

    def _move(self, server: int, gpus: int, cpu: int, memory: int) -> None:
        free = self._free[server]
        self._by_free[free].remove(server)
        self._free[server] = free + gpus
        self._by_free.setdefault(free + gpus, SortedList()).add(server)
        self._cpu[server] += cpu
        self._memory[server] += memory
        self._free_by_model[self._models[server]] += gpus
        self._totals[0] += gpus
        self._totals[1] += cpu
        self._totals[2] += memory
