"""ResizeNode: grow or shrink a READY node's GPUs in place, on its own host.

**Grow** places the extra GPUs with the public placement API pinned to the node's host
(so the host needs free proxy slots), then commits one transaction that compares the
node, each chosen GPU (still FREE), the host's allocation and its lease, and writes the
GPUs (ATTACHING, owner, slot, generation+1), the allocation with the new attachments,
and the node in RESIZING with the new bindings and a fresh attach deadline. The agent
attaches the new GPUs as it attaches any; the node controller turns RESIZING into READY
once every GPU is ATTACHED, or, if an added GPU's attach fails or the deadline passes,
into READY without the added GPUs (they are detached and freed). The GPUs the node had
stay attached and in use throughout: a failed grow never costs the node what it had.

**Shrink** takes out the GPUs named in ``remove``, or else the last bindings (bindings
are kept in the order they were added, so those are the most recently added GPUs), in
one transaction: the node goes RESIZING with those bindings DETACHING, the GPUs go
DETACHING (still owned by the node) and their attachments stay in the host's allocation
marked ``release``, as a released node's do. From there it is the ordinary release
path: the agent scrubs and detaches them and reports RELEASED (the controller frees
them) or SCRUB_FAILED (quarantined); a GPU is never freed otherwise. When the node owns
none of them any more the controller drops their bindings and the node is READY again.
The other GPUs stay in use throughout. (A GPU always names an owner that lists it, so
the node keeps the bindings until the GPUs are freed.)

**Tenants.** A charged node's GPUs count in its tenant's usage for as long as the node
lists them. A grow checks the tenant's quota against the usage plus the added GPUs and
writes the raised usage in its own transaction, comparing the tenant's record (under the
tenant's lock, inside the host's, as a compose does); QUOTA_EXCEEDED writes nothing. The
controller lowers the usage in the transaction that drops bindings from the node (a
shrink done, a grow abandoned).

**Only READY nodes.** A DEGRADED node (a GPU reported unhealthy) is refused with
FAILED_PRECONDITION like any node that is not READY: growing it would hide the health
problem behind a RESIZING state, and shrinking it is no way to drop the unhealthy GPU
(that GPU is quarantined only through release or an operator's ClearGpuHealth). Clear or
release it first. A node composed with box or switch affinity or a per-box spread limit
is not grown (FAILED_PRECONDITION): the added GPUs would have to be placed against the boxes the
node already uses, which placement does not do; shrinking it is allowed. A grow takes
GPUs of the model the node already has unless it was composed with mixed models.

Both compare the node record, so a resize and a release (or two resizes) that race
commit one after the other: the second sees the first's result (or loses its compare
and runs again on it). A resize of a node that is no longer READY is
FAILED_PRECONDITION and writes nothing.

The size asked for is the size wanted (``gpu_count``), not a difference, so running a
resize twice leaves the node as once. A request id makes a retry return the node
without looking at sizes at all; a node remembers the request id of its last resize
(``VirtualNode.resize_request_id``) and its request key is replaced by the next
resize's and deleted with the node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING

from dxpool import lifecycle
from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.fit import assign_gpus, placement_request
from dxpool.broker.nodes.tenants import charged, confirmed_breach
from dxpool.broker.nodes.transitions import gpu_id
from dxpool.broker.placement import place
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.locks import KeyedLocks
from dxpool.broker.state.records import copy, timestamp
from dxpool.broker.state.stm import RESIZE_ATTEMPTS, TxnView, read_through, transact
from dxpool.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from dxpool.fabric.latency import LatencyModel, LatencySource, as_source
from dxpool.limits import MAX_GPUS_PER_NODE
from dxpool.names import check_request_id, parse_gpu, parse_host, parse_node, tenant_name
from dxpool.store import keys as k
from dxpool.store.typed import Store

if TYPE_CHECKING:
    from dxpool.broker.nodes.compose_settings import ComposeSettings
    from dxpool.broker.state.placement_index import PlacementIndex

__all__ = ["Resizer", "resize_request_value", "shrink_in"]


def resize_request_value(node: str) -> str:
    """What a resize's request key holds: ``resize/nodes/{node}`` (not a resource name,
    so ComposeNode and ComposeGang treat the id as used for something else)."""
    return f"resize/{node}"


class _StaleSnapshotError(Exception):
    """The snapshot placement used is older than the cache the commit reads."""


class Resizer:
    """Grows and shrinks nodes. Thread-safe; no state of its own. Made by
    :meth:`Composer.resizer`, sharing its host and tenant locks: a resize holds its
    node's host lock, as composes and releases on that host do, and inside it, for a
    charged node, its tenant's lock, as composes of that tenant do."""

    def __init__(
        self,
        store: Store,
        cache: Cache,
        index: PlacementIndex,
        latency: LatencyModel | LatencySource,
        host_locks: KeyedLocks,
        tenant_locks: KeyedLocks,
        settings: ComposeSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._cache = cache
        self._index = index
        self._latency = as_source(latency)
        self._host_locks = host_locks
        self._tenant_locks = tenant_locks
        self._settings = settings
        self._clock = clock

    def resize(
        self, request: nodes_pb2.ResizeNodeRequest, *, owner: str | None = None
    ) -> pb.VirtualNode:
        """Grow or shrink; see the module docstring. ``owner`` set (a tenant's call):
        another owner's node is NOT_FOUND, judged in the resize's own transaction.

        Raises InvalidArgument, NotFound, FailedPrecondition (not READY, DEGRADED
        included; a GPU to remove that is not the node's; a shrink to no GPU; a grow of a
        node with box affinity or spread), ResourceExhausted (the host cannot take more;
        QUOTA_EXCEEDED: the tenant's quota cannot), AlreadyExists (request id used for
        something else), Aborted."""
        node_id = parse_node(request.name)
        check_request_id(request.request_id)
        removes = [parse_gpu(name).name for name in request.remove]
        if len(set(removes)) != len(removes):
            raise InvalidArgument(
                "remove names a GPU more than once; give each GPU once", reason="INVALID_GPUS"
            )
        if not removes and not 1 <= request.gpu_count <= MAX_GPUS_PER_NODE:
            raise InvalidArgument(
                f"invalid gpu_count {request.gpu_count}: a node has 1 to {MAX_GPUS_PER_NODE} "
                "GPUs; give the count the node should have, or the GPUs to remove",
                reason="INVALID_GPU_COUNT",
            )
        known = read_through(self._store, self._cache, self._cache.nodes, node_id)
        if known is None or (owner is not None and known.value.owner != owner):
            raise _not_found(request.name)
        host = parse_host(known.value.host) if known.value.host else ""
        tenant = known.value.spec.tenant if known.value.charged else ""
        for _ in range(RESIZE_ATTEMPTS):
            try:
                with self._host_locks.lock(host), self._tenant_lock(tenant):
                    return transact(
                        self._store,
                        self._cache,
                        lambda view: self._body(view, request, node_id, removes, owner),
                        what=f"resizing {request.name}",
                    )
            except _StaleSnapshotError:
                continue
        raise Aborted(
            f"resizing {request.name} kept conflicting with concurrent requests; retry the "
            "call (with the same request_id)",
            reason="COMMIT_CONFLICT",
        )

    def _tenant_lock(self, tenant_id: str) -> AbstractContextManager[None]:
        return self._tenant_locks.lock(tenant_id) if tenant_id else nullcontext()

    def _body(
        self,
        view: TxnView,
        request: nodes_pb2.ResizeNodeRequest,
        node_id: str,
        removes: list[str],
        owner: str | None,
    ) -> pb.VirtualNode:
        record = view.nodes.get(node_id)
        if record is None or (owner is not None and record.value.owner != owner):
            raise _not_found(request.name)
        node = record.value
        if request.request_id:
            used = view.requests.get(request.request_id)
            if used is not None:
                if (
                    bytes(used.value).decode() == resize_request_value(node.name)
                    and node.resize_request_id == request.request_id
                ):
                    return node  # a retry: this resize was made
                raise AlreadyExists(
                    f"request_id {request.request_id!r} was already used for another "
                    "request; use a new request_id",
                    reason="REQUEST_ID_REUSED",
                )
        if node.state == pb.NODE_STATE_DEGRADED:
            raise FailedPrecondition(
                f"node {node.name} is DEGRADED ({node.message}): a node with an unhealthy GPU "
                "is not resized; release it, or resize it once its GPUs are healthy again "
                "(an operator may clear a GPU with `dxpool gpu clear-health`)",
                reason="NODE_NOT_READY",
            )
        if node.state != pb.NODE_STATE_READY:
            raise FailedPrecondition(
                f"node {node.name} is {pb.NodeState.Name(node.state)}: only a READY node can "
                "be resized; wait for it to be READY (`dxpool node get`) and retry",
                reason="NODE_NOT_READY",
            )
        current = len(node.gpus)
        if removes:
            owned = {b.gpu for b in node.gpus}
            foreign = [name for name in removes if name not in owned]
            if foreign:
                raise FailedPrecondition(
                    f"{', '.join(foreign)} not in node {node.name}; remove only its own GPUs "
                    f"({', '.join(sorted(owned))})",
                    reason="NOT_NODE_GPU",
                )
            target = current - len(removes)
            if request.gpu_count and request.gpu_count != target:
                raise InvalidArgument(
                    f"gpu_count {request.gpu_count} disagrees with removing {len(removes)} of "
                    f"{current} GPUs; give 0 or {target}",
                    reason="INVALID_GPU_COUNT",
                )
        else:
            target = request.gpu_count
            removes = [b.gpu for b in node.gpus[target:]]
        if target < 1:
            raise FailedPrecondition(
                f"a node keeps at least one GPU; release {node.name} instead",
                reason="NODE_WOULD_BE_EMPTY",
            )
        if target == current:
            return node
        if target < current:
            updated = self._shrink(view, node, removes)
        else:
            updated = self._grow(view, node, target - current)
        self._remember(view, node, updated, request.request_id)
        return updated

    def _remember(
        self, view: TxnView, node: pb.VirtualNode, updated: pb.VirtualNode, request_id: str
    ) -> None:
        """Record ``request_id`` as the node's last resize; forget the one before."""
        previous = node.resize_request_id
        if previous and previous != request_id:
            record = view.requests.get(previous)
            if record is not None and bytes(record.value).decode() == resize_request_value(
                node.name
            ):
                view.delete(k.REQUESTS, previous)
        updated.resize_request_id = request_id
        if request_id:
            view.put(k.REQUESTS, request_id, resize_request_value(node.name))
        view.put(k.NODES, node.name.removeprefix("nodes/"), updated)

    def _shrink(self, view: TxnView, node: pb.VirtualNode, removes: list[str]) -> pb.VirtualNode:
        return shrink_in(view, node, removes, self._clock())

    def _grow(self, view: TxnView, node: pb.VirtualNode, extra: int) -> pb.VirtualNode:
        host_id = parse_host(node.host)
        spec = node.spec
        if node.HasField("preemption"):
            raise FailedPrecondition(
                f"node {node.name} has a preemption notice ({node.preemption.reason}): it is "
                "not grown while its GPUs are being taken; shrink it, or wait for the notice",
                reason="NODE_PREEMPTING",
            )
        if spec.affinity != pb.GPU_AFFINITY_UNSPECIFIED or spec.max_gpus_per_box:
            raise FailedPrecondition(
                f"node {node.name} was composed with box or switch affinity or a per-box "
                "spread limit: it cannot be grown in place (the new GPUs would not be "
                "placed against the boxes it uses); compose a new node, or shrink this one",
                reason="RESIZE_NOT_SUPPORTED",
            )
        # The host's CPU cores and memory were reserved at compose and do not change;
        # the host selector was met by the host the node is on.
        wanted = replace(
            placement_request(spec, host_id),
            count=extra,
            host_selector=frozenset(),
            cpu_cores=0,
            host_memory_mib=0,
        )
        if node.gpus and not spec.gpus.mixed_models:
            # one model per node: the model the node already has
            wanted = replace(wanted, model=node.gpus[0].model)
        result = place(wanted, self._index.snapshot(), self._latency.current())
        if result.placement is None:
            reasons = "; ".join(result.unsatisfied) or f"{node.host} cannot take them"
            raise ResourceExhausted(
                f"cannot grow {node.name} by {extra} GPUs on {node.host}: {reasons}. A node "
                "grows on its own host only: free proxy slots there (release or shrink "
                "nodes on it) or ask for fewer GPUs",
                reason="NO_CAPACITY",
            )
        if not view.host_leases.exists(host_id):
            raise ResourceExhausted(
                f"{node.host} is not alive; a node grows on its own host only",
                reason="NO_CAPACITY",
            )
        now = self._clock()
        updated = lifecycle.node_to(
            node,
            pb.NODE_STATE_RESIZING,
            f"growing from {len(node.gpus)} to {len(node.gpus) + extra} GPUs; the host agent "
            "is attaching the new ones",
            now,
        )
        updated.attach_deadline.CopyFrom(timestamp(now + self._settings.attach_timeout_s))
        allocation_record = view.host_allocations.get(host_id)
        allocation = (
            copy(allocation_record.value)
            if allocation_record
            else pb.HostAllocation(host=node.host)
        )
        used = {a.host_slot for a in allocation.attachments}
        assigned = assign_gpus(view, result.placement, updated, allocation, used, spec.vfio)
        if assigned is None:
            raise _StaleSnapshotError
        for name, _, gpu in assigned:
            view.put(k.GPUS, name, gpu)
        view.put(k.HOST_ALLOCATIONS, host_id, allocation)
        self._charge(view, node, [b.model for b in updated.gpus[len(node.gpus) :]])
        return updated

    def _charge(self, view: TxnView, node: pb.VirtualNode, models: list[str]) -> None:
        """Add the GPUs of ``models`` a grow gives ``node`` to its tenant's usage, if the
        node is charged; QUOTA_EXCEEDED when they do not fit (confirmed against etcd).
        The view compares the tenant's record."""
        tenant_id = node.spec.tenant
        if not node.charged or not tenant_id:
            return
        error = confirmed_breach(
            self._store, self._cache, tenant_id, models, nodes=0, borrowed=node.preemptible
        )
        if error is not None:
            raise error
        record = view.tenants.get(tenant_id)
        tenant = copy(record.value) if record else pb.Tenant(name=tenant_name(tenant_id))
        tenant.usage.CopyFrom(charged(tenant.usage, models, nodes=0, borrowed=node.preemptible))
        view.put(k.TENANTS, tenant_id, tenant)


def shrink_in(
    view: TxnView, node: pb.VirtualNode, removes: list[str], now: float, *, reason: str = ""
) -> pb.VirtualNode:
    """Begin shrinking ``node`` (READY, the record the view read) by the GPUs ``removes``
    names: the node goes RESIZING with their bindings DETACHING, the GPUs go DETACHING
    and their attachments stay in the host's allocation marked ``release``; the release
    path then frees them and the controller drops their bindings. Returns the new node
    (the caller writes it). ``reason`` names the node's event (default: Resizing)."""
    gone = set(removes)
    updated = lifecycle.node_to(
        node,
        pb.NODE_STATE_RESIZING,
        f"shrinking from {len(node.gpus)} to {len(node.gpus) - len(gone)} GPUs; the host "
        f"agent is detaching {', '.join(removes)}",
        now,
        reason=reason,
    )
    for binding in updated.gpus:
        if binding.gpu in gone:
            binding.phase = pb.ATTACHMENT_PHASE_DETACHING
    releasing: set[str] = set()
    for name in removes:
        record = view.gpus.get(gpu_id(name))
        if (
            record is not None
            and record.value.node == node.name
            and record.value.state in (pb.GPU_STATE_ATTACHING, pb.GPU_STATE_ATTACHED)
        ):
            view.put(k.GPUS, gpu_id(name), lifecycle.begin_detach(record.value))
            releasing.add(name)
    host_id = parse_host(node.host)
    allocation = view.host_allocations.get(host_id)
    if allocation is not None:
        # A GPU going DETACHING keeps its attachment, marked release: the agent scrubs
        # and detaches it and reports the outcome, and only that report frees it.
        trimmed = pb.HostAllocation()
        trimmed.CopyFrom(allocation.value)
        del trimmed.attachments[:]
        for attachment in allocation.value.attachments:
            if attachment.node != node.name or attachment.gpu not in gone:
                trimmed.attachments.append(attachment)
            elif attachment.gpu in releasing:
                kept = trimmed.attachments.add()
                kept.CopyFrom(attachment)
                kept.release = True
        view.put(k.HOST_ALLOCATIONS, host_id, trimmed)
    return updated


def _not_found(name: str) -> NotFound:
    return NotFound(
        f"node {name} does not exist; list nodes with `dxpool node list`",
        reason="NODE_NOT_FOUND",
    )
