"""PreFilters: requests the pool cannot serve whatever state its GPUs and hosts are in."""

from __future__ import annotations

from collections.abc import Collection

from dxpool.broker.placement.model import HostInfo, PlacementRequest, Snapshot
from dxpool.broker.placement.status import SUCCESS, Status
from dxpool.broker.placement.text import format_memory, plural


class PoolInventory:
    """UNRESOLVABLE when the pool holds fewer than ``count`` GPUs of the model (any model
    of a set) and memory asked for, counting every GPU whatever its state: only new boxes
    can help."""

    name = "pool_inventory"

    def pre_filter(self, request: PlacementRequest, snapshot: Snapshot) -> Status:
        if self._holds(request, snapshot):
            return SUCCESS
        wanted = {model.casefold() for model in request.models}
        memory = request.min_memory_mib
        held = 0
        models: dict[str, int] = {}
        for gpus in snapshot.gpus_by_box.values():
            for gpu in gpus:
                if wanted and gpu.model.casefold() not in wanted:
                    models[gpu.model] = models.get(gpu.model, 0) + 1
                elif gpu.memory_mib >= memory:
                    held += 1
        if not request.model:
            what = "gpus"
        elif len(wanted) > 1:
            what = f"models {request.model}"
        else:
            what = f"model {request.model}"
        if memory:
            what += f" with >= {format_memory(memory)}"
        reason = f"{what}: the pool holds {held} in all, {request.count} requested"
        if models and held == 0:
            ranked = sorted(models.items(), key=lambda item: (-item[1], item[0]))
            reason += "; models in the pool: " + ", ".join(f"{m} {n}" for m, n in ranked)
        return Status.unresolvable(reason, plugin=self.name)

    @staticmethod
    def _holds(request: PlacementRequest, snapshot: Snapshot) -> bool:
        """Whether the pool holds ``count`` such GPUs; stops counting once it does."""
        wanted = request.model
        model = wanted.casefold()
        folded = {part.casefold() for part in request.models}
        one = len(folded) <= 1
        memory = request.min_memory_mib
        needed = request.count
        for gpus in snapshot.gpus_by_box.values():
            for gpu in gpus:
                if one:
                    if model and gpu.model != wanted and gpu.model.casefold() != model:
                        continue
                elif gpu.model.casefold() not in folded:
                    continue
                if gpu.memory_mib >= memory:
                    needed -= 1
                    if needed <= 0:
                        return True
        return False


class HostCapacity:
    """UNRESOLVABLE when no host that may be used has ``count`` proxy slots in all;
    UNSCHEDULABLE when no host is registered yet."""

    name = "host_capacity"

    def pre_filter(self, request: PlacementRequest, snapshot: Snapshot) -> Status:
        if request.host is not None:
            pinned = snapshot.hosts.get(request.host)
            if pinned is None:
                return Status.unresolvable(
                    f"host: hosts/{request.host} is not registered", plugin=self.name
                )
            hosts: Collection[HostInfo] = [pinned]
        else:
            hosts = snapshot.hosts.values()
        if not hosts:
            return Status.unschedulable("hosts: no host is registered", plugin=self.name)
        count = request.count
        if any(host.slot_capacity >= count for host in hosts):
            return SUCCESS
        largest = min(hosts, key=lambda host: (-host.slot_capacity, host.host))
        slots = plural(largest.slot_capacity, "proxy slot")
        if request.host is not None:
            where = f"hosts/{largest.host} has {slots} in all"
        else:
            where = f"the largest host, hosts/{largest.host}, has {slots}"
        return Status.unresolvable(
            f"host capacity: {where}, {request.count} needed", plugin=self.name
        )
