"""Maintenance: cordon, drain and uncordon hosts; drain boxes.

**Cordon (hosts).** A host's cordon lives in its allocation record, ``hostalloc/{host}``
(``unschedulable``, ``unschedulable_reason``): the broker's own spec of the host, which
the agent reads and never writes, so a re-registering agent cannot undo it. The placement
index shows a cordoned host as unable to take nodes, and every commit that adds a node
to a host (compose, gang, admission) compares that record and refuses a cordoned one, so
a compose placed on a snapshot taken before the cordon places again rather than land
(the cordon changes the record every such commit compares). Nodes already there stay.

**Drain (hosts).** A drain is a cordon plus ``drain`` (policy RELEASE, start time). The
leader's maintenance step gives every live node on the host a preemption notice
(:mod:`dxpool.broker.control.notices`, its own grace period) and the notices are carried out as
any: the node is released, its GPUs scrubbed, detached and freed. A node cannot keep
running on another host (its CPU side is the host), so a host drain releases; the notice
is the orchestrator's cue to compose a replacement.

**Drain (boxes).** A box drain cordons the box (``BOX_STATE_CORDONED``) and records
``Box.drain``. With policy MOVE (the default), every node holding GPUs in the box keeps
running on its own host and has those GPUs replaced: it is grown by as many GPUs
(placement pinned to its host; the cordoned box is not chosen) and, once READY with
them, shrunk by the box's GPUs, both through ResizeNode's paths with request ids derived
from the drain, so a step that ran already is never run twice (a new leader finds where
the last one stopped). A node that cannot be moved (not READY, composed with box or
switch affinity or spread, no capacity on its host, its quota) is reported in
``drain.blocked`` and waits; policy RELEASE gives notices instead, as a host drain does.

**Progress** is computed when read (GetHost, GetBox, ListHosts, ListBoxes): the live
nodes and the GPUs still on the host or still in the box (held, or being detached or
fenced), and what blocks; DRAINED once none is left. Uncordon (UncordonHost,
UncordonBox) ends the cordon and the drain; notices given for the drain are then
withdrawn.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable

from dxpool import lifecycle
from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.notices import Notices
from dxpool.broker.nodes.resize import Resizer
from dxpool.broker.nodes.validation import check_enum, check_text
from dxpool.broker.state.cache import Cache, Routes
from dxpool.broker.state.records import copy, seconds, timestamp
from dxpool.broker.state.stm import TxnView, read_through, transact
from dxpool.errors import DxpoolError, InvalidArgument, NotFound
from dxpool.names import parse_box, parse_host, parse_node
from dxpool.store import keys as k
from dxpool.store.typed import Store, Versioned

log = logging.getLogger(__name__)

# GPU states in which a host may still map the GPU (so a host or box is not drained).
_ON_HOST = lifecycle.ON_HOST_GPU_STATES - {pb.GPU_STATE_QUARANTINED}


def _host_not_found(name: str) -> NotFound:
    return NotFound(
        f"host {name} is not registered; its host agent registers it when it starts "
        "(`dxpool host list` shows those that did)",
        reason="HOST_NOT_FOUND",
    )


def _box_not_found(name: str) -> NotFound:
    return NotFound(
        f"box {name} does not exist; list boxes with `dxpool box list`",
        reason="BOX_NOT_FOUND",
    )


def move_request_ids(box: pb.Box, node: pb.VirtualNode) -> tuple[str, str]:
    """The request ids of the grow and of the shrink that move ``node``'s GPUs out of
    draining ``box``: fixed by the drain (its start) and the node, so each step runs
    once whoever runs it."""
    seed = f"{box.name}|{seconds(box.drain.start_time):.6f}|{node.name}".encode()
    digest = hashlib.sha256(seed).hexdigest()[:20]
    return f"drain-{digest}-grow", f"drain-{digest}-shrink"


class Maintenance:
    """Cordon, drain and uncordon (the API), the leader's drain step, and progress.
    Keeps, from cache events, which GPUs are on each host (so progress costs what is
    on the host, not the pool). Thread-safe."""

    def __init__(
        self,
        store: Store,
        cache: Cache,
        notices: Notices,
        resizer: Resizer,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._cache = cache
        self._notices = notices
        self._resizer = resizer
        self._clock = clock
        self._lock = threading.Lock()
        self._on_host: dict[str, set[str]] = {}  # host id -> GPU ids on it (mapped maybe)
        self._host_of: dict[str, str] = {}
        self._blocks: dict[str, str] = {}  # node id -> why the last step could not move it
        # What is being drained, so a step costs the drains, not a pass over the pool.
        self._draining_hosts: set[str] = set()
        self._draining_boxes: set[str] = set()
        self._unsubscribe = cache.subscribe(
            Routes()
            .on(cache.gpus, self._on_gpu)
            .on(cache.host_allocations, self._on_allocation)
            .on(cache.boxes, self._on_box)
        )
        for name, gpu_record in cache.gpus.items():
            self._on_gpu(name, gpu_record)
        for name, allocation_record in cache.host_allocations.items():
            self._on_allocation(name, allocation_record)
        for name, box_record in cache.boxes.items():
            self._on_box(name, box_record)

    def close(self) -> None:
        self._unsubscribe()

    def _on_allocation(self, name: str, record: Versioned[pb.HostAllocation] | None) -> None:
        self._note_drain(
            self._draining_hosts, name, record is not None and record.value.HasField("drain")
        )

    def _on_box(self, name: str, record: Versioned[pb.Box] | None) -> None:
        self._note_drain(
            self._draining_boxes, name, record is not None and record.value.HasField("drain")
        )

    def _note_drain(self, tracked: set[str], name: str, draining: bool) -> None:
        with self._lock:
            if draining:
                tracked.add(name)
            else:
                tracked.discard(name)

    def _on_gpu(self, name: str, record: Versioned[pb.Gpu] | None) -> None:
        gpu = record.value if record is not None else None
        host = (
            parse_host(gpu.host) if gpu is not None and gpu.host and gpu.state in _ON_HOST else ""
        )
        with self._lock:
            previous = self._host_of.pop(name, "")
            if previous:
                self._on_host[previous].discard(name)
                if not self._on_host[previous]:
                    del self._on_host[previous]
            if host:
                self._host_of[name] = host
                self._on_host.setdefault(host, set()).add(name)

    # -- the API -------------------------------------------------------------------------

    def cordon_host(self, name: str, reason: str) -> str:
        """Cordon host ``name``; returns its id."""
        check_text(reason, "reason")
        return self._set_host(name, cordon=True, reason=reason)

    def uncordon_host(self, name: str) -> str:
        return self._set_host(name, cordon=False, reason="")

    def drain_host(self, name: str, reason: str, policy: int) -> str:
        check_text(reason, "reason")
        check_enum(policy, pb.DrainPolicy.DESCRIPTOR, "policy")
        if policy == pb.DRAIN_POLICY_MOVE:
            raise InvalidArgument(
                "policy MOVE does not apply to a host: a node runs on its host and cannot "
                "keep running on another; drain the host with policy RELEASE (its nodes "
                "get notices and are released), or drain a box to move GPUs",
                reason="INVALID_POLICY",
            )
        return self._set_host(name, cordon=True, reason=reason or "draining", drain=True)

    def _set_host(self, name: str, *, cordon: bool, reason: str, drain: bool = False) -> str:
        host_id = parse_host(name)
        if read_through(self._store, self._cache, self._cache.hosts, host_id) is None:
            raise _host_not_found(name)
        now = self._clock()

        def body(view: TxnView) -> None:
            record = view.host_allocations.get(host_id)
            if record is None and not cordon:
                return  # never cordoned: nothing to undo
            allocation = copy(record.value) if record is not None else pb.HostAllocation(host=name)
            changed = copy(allocation)
            changed.unschedulable = cordon
            changed.unschedulable_reason = reason if cordon else ""
            if drain and not changed.HasField("drain"):
                changed.drain.CopyFrom(
                    pb.DrainStatus(policy=pb.DRAIN_POLICY_RELEASE, start_time=timestamp(now))
                )
            if not cordon:
                changed.ClearField("drain")
            if changed != allocation or record is None:
                view.put(k.HOST_ALLOCATIONS, host_id, changed)

        transact(self._store, self._cache, body, what=f"cordoning {name}", audited=False)
        return host_id

    def drain_box(self, name: str, reason: str, policy: int) -> pb.Box:
        check_text(reason, "reason")
        check_enum(policy, pb.DrainPolicy.DESCRIPTOR, "policy")
        box_id = parse_box(name)
        now = self._clock()

        def body(view: TxnView) -> pb.Box:
            record = view.boxes.get(box_id)
            if record is None:
                raise _box_not_found(name)
            box = copy(record.value)
            box.state = pb.BOX_STATE_CORDONED
            box.cordon_reason = reason or "draining"
            wanted = pb.DrainPolicy.ValueType(policy or pb.DRAIN_POLICY_MOVE)
            if not box.HasField("drain") or box.drain.policy != wanted:
                box.drain.CopyFrom(pb.DrainStatus(policy=wanted, start_time=timestamp(now)))
            if box != record.value:
                view.put(k.BOXES, box_id, box)
            return box

        drained: pb.Box = transact(self._store, self._cache, body, what=f"draining {name}")
        return drained

    # -- progress ------------------------------------------------------------------------

    def host_gpus(self, host_id: str) -> list[str]:
        """GPU ids a host may still map (held, detaching or fencing)."""
        with self._lock:
            return sorted(self._on_host.get(host_id, ()))

    def _live_nodes_of(self, gpu_ids: list[str]) -> dict[str, list[str]]:
        """Live nodes (by id) owning the GPUs ``gpu_ids`` names, with the GPUs each owns."""
        owners: dict[str, list[str]] = {}
        for gpu_id in gpu_ids:
            record = self._cache.gpus.get(gpu_id)
            if record is None or not record.value.node:
                continue
            node_id = parse_node(record.value.node)
            node = self._cache.nodes.get(node_id)
            if node is not None and node.value.state in lifecycle.LOSABLE_NODE_STATES:
                owners.setdefault(node_id, []).append(record.value.name)
        return owners

    def describe_host(self, view: pb.Host, allocation: pb.HostAllocation | None) -> None:
        """Fill ``view``'s cordon and drain fields (a copy being answered)."""
        if allocation is None:
            return
        view.unschedulable = allocation.unschedulable
        view.cordon_reason = allocation.unschedulable_reason
        if allocation.HasField("drain"):
            view.drain.CopyFrom(allocation.drain)
            gpus = self.host_gpus(parse_host(view.name))
            owners = self._live_nodes_of(gpus)
            self._progress(view.drain, owners, len(gpus))

    def describe_box(self, view: pb.Box) -> None:
        """Fill ``view``'s drain progress (a copy being answered)."""
        if not view.HasField("drain"):
            return
        box_id = parse_box(view.name)
        chunk, _ = self._cache.gpus.scan(f"{box_id}/", 64)
        on_host = [
            name
            for name, record in chunk
            if name.startswith(f"{box_id}/") and record.value.state in _ON_HOST
        ]
        owners = self._live_nodes_of(on_host)
        self._progress(view.drain, owners, len(on_host))

    def _progress(self, drain: pb.DrainStatus, owners: dict[str, list[str]], gpus: int) -> None:
        drain.nodes_left = len(owners)
        drain.gpus_left = gpus
        drain.state = pb.DRAIN_STATE_DRAINED if gpus == 0 else pb.DRAIN_STATE_DRAINING
        del drain.blocked[:]
        for node_id in sorted(owners)[:16]:
            note = self._blocked(node_id)
            if note:
                drain.blocked.append(f"nodes/{node_id}: {note}")

    def _blocked(self, node_id: str) -> str:
        record = self._cache.nodes.get(node_id)
        if record is None:
            return ""
        node = record.value
        if node.HasField("preemption"):
            left = seconds(node.preemption.deadline) - self._clock()
            return f"released after its notice ({max(left, 0):.0f}s left)"
        return self._blocks.get(node_id, "")

    # -- the leader's step ---------------------------------------------------------------

    def step(self) -> None:
        """Drive every drain one step: notices for RELEASE, grow or shrink for MOVE."""
        blocks: dict[str, str] = {}
        with self._lock:
            hosts, boxes = sorted(self._draining_hosts), sorted(self._draining_boxes)
        for host_id in hosts:
            for node_id in self._live_nodes_of(self.host_gpus(host_id)):
                self._notices.drain_notice(
                    node_id, f"hosts/{host_id}", f"host hosts/{host_id} is draining"
                )
        for box_id in boxes:
            record = self._cache.boxes.get(box_id)
            if record is None or not record.value.HasField("drain"):
                continue
            box = record.value
            chunk, _ = self._cache.gpus.scan(f"{box_id}/", 64)
            on_box = [
                n for n, r in chunk if n.startswith(f"{box_id}/") and r.value.state in _ON_HOST
            ]
            for node_id, gpus in sorted(self._live_nodes_of(on_box).items()):
                if box.drain.policy == pb.DRAIN_POLICY_RELEASE:
                    self._notices.drain_notice(node_id, box.name, f"box {box.name} is draining")
                else:
                    note = self._move(box, node_id, gpus)
                    if note:
                        blocks[node_id] = note
        self._blocks = blocks

    def _move(self, box: pb.Box, node_id: str, gpus: list[str]) -> str:
        """One step of moving ``node_id``'s GPUs ``gpus`` out of ``box``; what blocks it
        ("" when a step was taken or is under way)."""
        record = self._cache.nodes.get(node_id)
        if record is None:
            return ""
        node = record.value
        if node.HasField("preemption"):
            return ""
        grow_id, shrink_id = move_request_ids(box, node)
        if node.state == pb.NODE_STATE_RESIZING:
            return ""
        if node.state != pb.NODE_STATE_READY:
            return f"not moved while {pb.NodeState.Name(node.state).removeprefix('NODE_STATE_')}"
        in_box = [b.gpu for b in node.gpus if b.gpu in gpus]
        outside = len(node.gpus) - len(in_box)
        try:
            if node.resize_request_id == grow_id and outside >= len(in_box):
                self._resizer.resize(
                    nodes_pb2.ResizeNodeRequest(name=node.name, remove=in_box, request_id=shrink_id)
                )
                return ""
            if node.resize_request_id == grow_id:
                return f"its grow did not take: {node.message}"
            if node.resize_request_id == shrink_id:
                return ""
            self._resizer.resize(
                nodes_pb2.ResizeNodeRequest(
                    name=node.name, gpu_count=len(node.gpus) + len(in_box), request_id=grow_id
                )
            )
        except DxpoolError as error:
            return error.message
        return ""


__all__ = ["Maintenance", "move_request_ids"]
