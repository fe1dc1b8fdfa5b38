"""Multi-record transitions, written against a :class:`~dxpool.broker.state.stm.TxnView`.

Each function reads what it needs through the view and writes the records that must
change together (a node, its GPUs, its host's allocation), using the record-level rules
of :mod:`dxpool.lifecycle`. The caller commits with :func:`~dxpool.broker.state.stm.transact`,
so each one is a single compare-and-swap over everything it read.
"""

from __future__ import annotations

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.tenants import discharge
from dxpool.broker.state.records import without_node
from dxpool.broker.state.stm import TxnView
from dxpool.names import parse_gpu, parse_host
from dxpool.store import keys as k


def gpu_id(name: str) -> str:
    """``boxes/b1/gpus/3`` -> the cache id ``b1/3``."""
    ref = parse_gpu(name)
    return f"{ref.box}/{ref.slot}"


def let_go(
    view: TxnView,
    node: pb.VirtualNode,
    state: pb.NodeState.ValueType,
    message: str,
    now: float,
    *,
    fence: bool = False,
    reason: str = "",
) -> pb.VirtualNode:
    """Move ``node`` to ``state`` (FAILED, RELEASING or LOST) and let go of its GPUs.

    The GPUs it still owns go DETACHING or, with ``fence``, FENCING (the broker revokes
    them at the box side without waiting for the agent). A DETACHING GPU's attachment
    stays in the host's allocation marked ``release``: the agent scrubs and detaches the
    GPU and reports the outcome, and the GPU is freed or quarantined on that report only
    (:func:`drop_release` goes with it); so does a ``release`` attachment the node had
    already (a GPU a shrink took out). Every other attachment of the node, and its CPU
    and memory reservation, leave the allocation. A charged node leaves its tenant's
    usage (:func:`~dxpool.broker.nodes.tenants.discharge`). ``node`` must be the record the
    view read. ``reason`` names the node's event (default: the state's reason word).
    Returns the new node.
    """
    updated = lifecycle.node_letting_go(node, state, message, now, reason=reason)
    discharge(view, node)
    releasing: set[str] = set()
    view.put(k.NODES, node.name.removeprefix("nodes/"), updated)
    for binding in node.gpus:
        gpu_key = gpu_id(binding.gpu)
        record = view.gpus.get(gpu_key)
        if record is None or record.value.node != node.name:
            continue
        gpu = record.value
        if fence:
            view.put(k.GPUS, gpu_key, lifecycle.begin_fence(gpu, f"fencing: {message}"))
        elif gpu.state in (pb.GPU_STATE_ATTACHING, pb.GPU_STATE_ATTACHED):
            view.put(k.GPUS, gpu_key, lifecycle.begin_detach(gpu))
            releasing.add(binding.gpu)
    if not node.host:
        return updated  # a QUEUED node: no host, no GPUs
    host_id = parse_host(node.host)
    # what this view writes already (another node let go on the same host in this
    # transaction, e.g. a gang's members), else the record read
    allocation = view.host_allocations.latest(host_id)
    if allocation is not None and (
        any(a.node == node.name for a in allocation.attachments)
        or any(r.node == node.name for r in allocation.reservations)
    ):
        spec = without_node(allocation, node.host, node.name)
        for attachment in allocation.attachments:
            # a release already under way (a GPU a resize took out) stays until its
            # outcome is reported, as the GPUs let go of now do
            if attachment.node == node.name and (attachment.release or attachment.gpu in releasing):
                kept = spec.attachments.add()
                kept.CopyFrom(attachment)
                kept.release = True
        view.put(k.HOST_ALLOCATIONS, host_id, spec)
    return updated


def identity_changed(gpu: pb.Gpu, seen: pb.ObservedAttachment) -> str | None:
    """Why the identity the agent reports in ``seen`` is not the one recorded for ``gpu``
    on its first attach, or None when it is (or nothing was recorded or reported)."""
    if gpu.uuid and seen.uuid and seen.uuid != gpu.uuid:
        return f"reports UUID {seen.uuid}, recorded {gpu.uuid} on its first attach"
    if gpu.serial and seen.serial and seen.serial != gpu.serial:
        return f"reports serial {seen.serial}, recorded {gpu.serial} on its first attach"
    return None


def drop_release(view: TxnView, gpu: pb.Gpu) -> None:
    """Take the GPU's ``release`` attachment (any generation up to the GPU's own) out of
    its host's allocation: the outcome of the release is being recorded (the GPU freed or
    quarantined in the same transaction), or the GPU was fenced instead. A no-op when
    there is none."""
    if not gpu.host:
        return
    host_id = parse_host(gpu.host)
    allocation = view.host_allocations.latest(host_id)
    if allocation is None:
        return

    def stale(a: pb.DesiredAttachment) -> bool:
        return a.gpu == gpu.name and a.release and a.generation <= gpu.generation

    if any(stale(a) for a in allocation.attachments):
        spec = pb.HostAllocation()
        spec.CopyFrom(allocation)  # other nodes' CPU and memory, a cordon, stay
        spec.host = allocation.host or gpu.host
        del spec.attachments[:]
        spec.attachments.extend(a for a in allocation.attachments if not stale(a))
        view.put(k.HOST_ALLOCATIONS, host_id, spec)


def fence_detaching(view: TxnView, node: pb.VirtualNode) -> None:
    """Turn a releasing node's DETACHING GPUs into FENCING (a forced retry)."""
    for binding in node.gpus:
        gpu_key = gpu_id(binding.gpu)
        record = view.gpus.get(gpu_key)
        if (
            record is not None
            and record.value.node == node.name
            and record.value.state == pb.GPU_STATE_DETACHING
        ):
            view.put(
                k.GPUS,
                gpu_key,
                lifecycle.begin_fence(record.value, "fencing: force release requested"),
            )


def owned_gpus(view: TxnView, node: pb.VirtualNode) -> list[str]:
    """The GPUs (resource names) that still name ``node`` as their owner, as ``view``
    will leave them (a GPU it freed already is not owned)."""
    owned = []
    for binding in node.gpus:
        gpu = view.gpus.latest(gpu_id(binding.gpu))
        if gpu is not None and gpu.node == node.name:
            owned.append(binding.gpu)
    return owned


__all__ = ["drop_release", "fence_detaching", "gpu_id", "identity_changed", "let_go", "owned_gpus"]
