"""What a node spec asks of placement and of its host, shared by every path that
places GPUs for a spec (ComposeNode, ComposeGang, ResizeNode)."""

from __future__ import annotations

from typing import Protocol

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.placement import Binding, Placement, PlacementRequest
from dxpool.broker.state.stm import RecordReader, expect
from dxpool.names import parse_host
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Txn, Versioned


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
        same_switch=spec.affinity == pb.GPU_AFFINITY_SWITCH,
        max_gpus_per_box=spec.max_gpus_per_box,
        host_selector=frozenset(spec.host_selector.items()),
        cpu_cores=spec.cpu_cores,
        host_memory_mib=spec.host_memory_mib,
        exclude_hosts=frozenset(parse_host(name) for name in spec.exclude_hosts),
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


def still_takable(
    gpu: Versioned[pb.Gpu] | None, box: Versioned[pb.Box] | None, host_slot: int, used: set[int]
) -> bool:
    """Whether a placed GPU can still be committed as placed: the GPU is free, its box
    is schedulable and the host slot is unused. Placement may have judged an older
    snapshot than the records the commit compares."""
    return (
        gpu is not None
        and lifecycle.is_free(gpu.value)
        and host_slot not in used
        and box is not None
        and box.value.state == pb.BOX_STATE_ACTIVE
    )


def bind(
    allocation: pb.HostAllocation,
    node: pb.VirtualNode,
    gpu: pb.Gpu,
    binding: Binding,
    vfio: bool,
) -> None:
    """Add ``gpu`` (just assigned to ``node``) to the host's desired attachments and to
    the node's bindings, as ``binding`` placed it."""
    allocation.attachments.append(
        pb.DesiredAttachment(
            gpu=gpu.name,
            host_slot=binding.host_slot,
            node=node.name,
            generation=gpu.generation,
            vfio=vfio,
            expected_uuid=gpu.uuid,
            expected_serial=gpu.serial,
            model=gpu.model,
            pci_id=gpu.pci_id,
        )
    )
    node.gpus.append(
        pb.GpuBinding(
            gpu=gpu.name,
            model=gpu.model,
            host_slot=binding.host_slot,
            latency_ns=binding.latency_ns,
            uuid=gpu.uuid,
            phase=pb.ATTACHMENT_PHASE_ATTACHING,
        )
    )


class GpuReads(Protocol):
    """Where :func:`assign_gpus` reads GPUs and boxes: the cache, or a
    :class:`~dxpool.broker.state.stm.TxnView` (which has the commit compare them)."""

    @property
    def gpus(self) -> RecordReader[pb.Gpu]: ...

    @property
    def boxes(self) -> RecordReader[pb.Box]: ...


def assign_gpus(
    read: GpuReads,
    placement: Placement,
    node: pb.VirtualNode,
    allocation: pb.HostAllocation,
    used: set[int],
    vfio: bool,
) -> list[tuple[str, Versioned[pb.Gpu], pb.Gpu]] | None:
    """Assign ``placement``'s GPUs to ``node``: each GPU, read through ``read``, made
    ATTACHING for the node and bound in ``allocation`` and on the node, its host slot
    added to ``used``. Returns (GPU id ``box/slot``, the record read, the assigned GPU)
    for the caller to write; None as soon as one is no longer takable as placed (the
    snapshot was older than the records), ``allocation`` and ``node`` then partly
    changed, so the caller drops them."""
    host_name = f"hosts/{placement.host}"
    assigned = []
    for binding in placement.bindings:
        name = f"{binding.box}/{binding.slot}"
        gpu_record = read.gpus.get(name)
        if not still_takable(gpu_record, read.boxes.get(binding.box), binding.host_slot, used):
            return None
        assert gpu_record is not None
        used.add(binding.host_slot)
        gpu = lifecycle.assign(
            gpu_record.value, node=node.name, host=host_name, host_slot=binding.host_slot
        )
        bind(allocation, node, gpu, binding, vfio)
        assigned.append((name, gpu_record, gpu))
    return assigned


def write_assigned(
    txn: Txn, keys: KeySchema, assigned: list[tuple[str, Versioned[pb.Gpu], pb.Gpu]]
) -> None:
    """Write :func:`assign_gpus`' GPUs into ``txn``, each compared at the revision read."""
    for name, record, gpu in assigned:
        key = keys.key(k.GPUS, name)
        expect(txn, key, record.mod_revision).put(key, gpu)


__all__ = [
    "assign_gpus",
    "bind",
    "fits",
    "placement_request",
    "reserve_host_resources",
    "still_takable",
    "write_assigned",
]
