"""What a node spec asks of placement and of its host, shared by every path that
places GPUs for a spec (ComposeNode, ComposeGang, ResizeNode)."""

from __future__ import annotations

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.placement import PlacementRequest


def placement_request(spec: pb.NodeSpec, host: str | None) -> PlacementRequest:
    """The placement request for ``spec``'s GPUs; ``host`` is a host id to pin to, or
    None to let placement choose."""
    return PlacementRequest(
        model=spec.gpus.model,
        count=spec.gpus.count,
        min_memory_mib=spec.gpus.min_memory_mib,
        mixed_models=spec.gpus.mixed_models,
        host=host,
        max_latency_ns=spec.max_latency_ns,
        max_slowdown=spec.max_slowdown,
        workload=spec.workload,
        same_box=spec.affinity == pb.GPU_AFFINITY_BOX,
        max_gpus_per_box=spec.max_gpus_per_box,
        host_selector=frozenset(spec.host_selector.items()),
        cpu_cores=spec.cpu_cores,
        host_memory_mib=spec.host_memory_mib,
    )


def fits(host: pb.Host, allocation: pb.HostAllocation, spec: pb.NodeSpec) -> bool:
    """Whether ``host`` has ``spec``'s CPU cores and memory free beside ``allocation``'s
    reservations."""
    cores = sum(r.cpu_cores for r in allocation.reservations) + spec.cpu_cores
    memory = sum(r.memory_mib for r in allocation.reservations) + spec.host_memory_mib
    return (not spec.cpu_cores or cores <= host.cpu_cores) and (
        not spec.host_memory_mib or memory <= host.memory_mib
    )


def reserve_host_resources(
    host: pb.Host | None, allocation: pb.HostAllocation, spec: pb.NodeSpec, name: str
) -> bool:
    """Add the CPU cores and memory ``spec`` asks of ``host`` to ``allocation`` for node
    ``name``; False when they no longer fit (or the host is unknown). Placement may have
    judged an older snapshot, so the fit is checked against the very allocation the
    commit compares: nothing is ever oversubscribed."""
    if not (spec.cpu_cores or spec.host_memory_mib):
        return True
    if host is None or not fits(host, allocation, spec):
        return False
    allocation.reservations.append(
        pb.HostReservation(node=name, cpu_cores=spec.cpu_cores, memory_mib=spec.host_memory_mib)
    )
    return True


__all__ = ["fits", "placement_request", "reserve_host_resources"]
