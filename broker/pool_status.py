"""The pool at a glance (``GetPoolStatus``, ``dxpool status``), from the cache.

One pass over the cached records: GPUs by model and state, nodes by state, live and
dead hosts, free proxy slots, and how many nodes of 1, 2, 4 and 8 GPUs fit now. With no
latency bound and any model, placement may give any usable GPU to any live host with
enough free slots, so ``n``-GPU nodes fit ``min(sum over live hosts of
free_slots // n, usable GPUs // n)`` times: exact for such requests, an upper bound for
requests that name a model or bound latency.
"""

from __future__ import annotations

from collections import Counter

from dxpool.api.v1 import inventory_pb2 as inv
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.cache import Cache
from dxpool.limits import MAX_HOST_SLOTS
from dxpool.store import keys as k

FIT_SIZES = (1, 2, 4, 8)
_IN_USE = frozenset({pb.GPU_STATE_ATTACHING, pb.GPU_STATE_ATTACHED, pb.GPU_STATE_DETACHING})


def pool_status(cache: Cache) -> inv.PoolStatus:
    """What the pool holds and what fits now, as the cache sees it."""
    active_boxes = {
        name for name, record in cache.items(k.BOXES) if record.value.state == pb.BOX_STATE_ACTIVE
    }
    everything = inv.ModelStatus(model="")
    by_model: dict[str, inv.ModelStatus] = {}
    for name, record in cache.items(k.GPUS):
        gpu: pb.Gpu = record.value
        model = by_model.setdefault(gpu.model, inv.ModelStatus(model=gpu.model))
        for counts in (everything, model):
            _count(counts, gpu, usable_box=name.partition("/")[0] in active_boxes)
    status = inv.PoolStatus(models=[everything, *(by_model[m] for m in sorted(by_model))])

    nodes = Counter(pb.NodeState.Name(r.value.state) for _, r in cache.items(k.NODES))
    for state, count in sorted(nodes.items()):
        status.nodes_by_state[state] = count

    slots: list[int] = []
    for host_id, record in cache.items(k.HOSTS):
        if cache.get(k.HOST_LEASES, host_id) is None:
            status.hosts_dead += 1
            continue
        status.hosts_alive += 1
        allocation = cache.get(k.HOST_ALLOCATIONS, host_id)
        used = {a.host_slot for a in allocation.value.attachments} if allocation else set()
        capacity = min(max(record.value.slot_capacity, 0), MAX_HOST_SLOTS)
        slots.append(max(capacity - sum(1 for s in used if 0 <= s < capacity), 0))
    status.free_host_slots = sum(slots)
    usable = everything.free
    for size in FIT_SIZES:
        nodes_fit = min(sum(free // size for free in slots), usable // size)
        status.fits.append(inv.FitCount(gpus=size, nodes=nodes_fit))
    return status


def _count(status: inv.ModelStatus, gpu: pb.Gpu, *, usable_box: bool) -> None:
    status.total += 1
    if gpu.state == pb.GPU_STATE_FREE and not gpu.node:
        if usable_box and gpu.health != pb.GPU_HEALTH_UNHEALTHY:
            status.free += 1
        else:
            status.unavailable += 1
    elif gpu.state in _IN_USE:
        status.in_use += 1
    elif gpu.state == pb.GPU_STATE_FENCING:
        status.fencing += 1
    elif gpu.state == pb.GPU_STATE_QUARANTINED:
        status.quarantined += 1
    else:  # FAULTED, or a state this broker does not know
        status.unavailable += 1


__all__ = ["FIT_SIZES", "pool_status"]
