"""The pool at a glance (``GetPoolStatus``, ``dxpool status``): what is counted, and how.

GPUs by model and state, nodes by state, live and dead hosts, free proxy slots, and how
many nodes of 1, 2, 4 and 8 GPUs fit now; :class:`~dxpool.broker.state.pool_tally.PoolTally`
keeps these counts current from the cache's events. With no
latency bound and any model, placement may give any usable GPU to any live host with
enough free slots, so ``n``-GPU nodes fit ``min(sum over live hosts of
free_slots // n, usable GPUs // n)`` times: exact for such requests, an upper bound for
requests that name a model or bound latency.
"""

from __future__ import annotations

from collections.abc import Mapping

from dxpool.api.v1 import inventory_pb2 as inv
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.limits import MAX_HOST_SLOTS

FIT_SIZES = (1, 2, 4, 8)
MODEL_BUCKETS = ("free", "in_use", "fencing", "quarantined", "unavailable")
"""The fields of ``ModelStatus`` besides ``total``; every GPU counts in exactly one."""
_IN_USE = frozenset({pb.GPU_STATE_ATTACHING, pb.GPU_STATE_ATTACHED, pb.GPU_STATE_DETACHING})


def gpu_bucket(gpu: pb.Gpu, *, usable_box: bool) -> str:
    """The ``ModelStatus`` field ``gpu`` counts in (one of :data:`MODEL_BUCKETS`);
    ``usable_box``: its box is ACTIVE."""
    if gpu.state == pb.GPU_STATE_FREE and not gpu.node:
        if usable_box and gpu.health != pb.GPU_HEALTH_UNHEALTHY:
            return "free"
        return "unavailable"
    if gpu.state in _IN_USE:
        return "in_use"
    if gpu.state == pb.GPU_STATE_FENCING:
        return "fencing"
    if gpu.state == pb.GPU_STATE_QUARANTINED:
        return "quarantined"
    return "unavailable"  # FAULTED, or a state this broker does not know


def free_host_slots(host: pb.Host, allocation: pb.HostAllocation | None) -> int:
    """The proxy slots of a live host that no attachment of its allocation holds."""
    used = {a.host_slot for a in allocation.attachments} if allocation is not None else set()
    capacity = min(max(host.slot_capacity, 0), MAX_HOST_SLOTS)
    return max(capacity - sum(1 for s in used if 0 <= s < capacity), 0)


def status_message(
    models: Mapping[str, Mapping[str, int]],
    nodes: Mapping[str, int],
    *,
    hosts_alive: int,
    hosts_dead: int,
    free_slots: int,
    fits_by_slots: Mapping[int, int],
) -> inv.PoolStatus:
    """The ``PoolStatus`` of these counts: ``models`` maps a model to its GPUs per
    bucket, ``nodes`` a NodeState name to its nodes, ``fits_by_slots`` each of
    :data:`FIT_SIZES` to the sum over live hosts of their free slots // that size."""
    everything = inv.ModelStatus(model="")
    by_model = []
    for model in sorted(models):
        counts = inv.ModelStatus(model=model)
        for bucket in MODEL_BUCKETS:
            count = models[model].get(bucket, 0)
            setattr(counts, bucket, count)
            setattr(everything, bucket, getattr(everything, bucket) + count)
            counts.total += count
        everything.total += counts.total
        by_model.append(counts)
    status = inv.PoolStatus(models=[everything, *by_model])
    for state, count in sorted(nodes.items()):
        status.nodes_by_state[state] = count
    status.hosts_alive = hosts_alive
    status.hosts_dead = hosts_dead
    status.free_host_slots = free_slots
    usable = everything.free
    for size in FIT_SIZES:
        status.fits.append(inv.FitCount(gpus=size, nodes=min(fits_by_slots[size], usable // size)))
    return status


__all__ = [
    "FIT_SIZES",
    "MODEL_BUCKETS",
    "free_host_slots",
    "gpu_bucket",
    "status_message",
]
