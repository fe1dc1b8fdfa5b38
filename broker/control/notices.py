"""Preemption notices: given to a node before it loses GPUs, carried out after its grace.

A node that is to lose its GPUs (lent capacity reclaimed, a higher priority request, a
drain) first gets a notice: ``VirtualNode.preemption`` says why, for what ("nodes/x",
"gangs/g", "hosts/h", "boxes/b"), which GPUs (a shrink) or all of them, and when
(``deadline``: the node's ``spec.preemption_grace_s``, else the broker's default). The
node keeps its state and its GPUs meanwhile; the notice is a change of the node record,
so every watcher sees it at once, and it is one of the node's events
(``PreemptionNotice``). Kubernetes' graceful deletion works the same way.

**Issuing** (:meth:`Notices.issue`) is one transaction over the waiting request and
every victim: each victim must still be what the plan saw (live, borrowed, no notice,
still holding the GPUs to cut), and the request still QUEUED; the request's
``queue.preempting`` names the victims in the same commit. A release, a resize or
another preemption of a victim between the plan and the commit fails the compare, and
the next pass plans again on what is there (a release racing a notice: whichever
commits first wins, and the GPUs are let go once).

**Carrying out** (:meth:`Notices.carry_out`, the leader, once the deadline passed) is one
transaction per node: a whole node goes RELEASING through
:func:`~dxpool.broker.nodes.transitions.let_go` (event ``Preempted``), exactly as a release
(the agent scrubs and detaches the GPUs; they are freed on its report); a shrink goes
through :func:`~dxpool.broker.nodes.resize.shrink_in` (the node RESIZING, then READY with
fewer GPUs). A notice whose purpose is gone (the request was served, cancelled or timed
out, the drain ended) is withdrawn instead (event ``PreemptionCancelled``). A node
released by its owner meanwhile is left alone: the release already let go of the GPUs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.preemption import Cut, Plan
from dxpool.broker.nodes.resize import shrink_in
from dxpool.broker.nodes.transitions import gpu_id, let_go
from dxpool.broker.state import metrics
from dxpool.broker.state.cache import Cache, Routes
from dxpool.broker.state.locks import KeyedLocks
from dxpool.broker.state.records import copy, seconds, timestamp
from dxpool.broker.state.stm import PASS_ATTEMPTS, RecordReader, TxnView, transact
from dxpool.errors import Aborted, DxpoolError
from dxpool.names import parse_box, parse_gang, parse_host, parse_node
from dxpool.store import keys as k
from dxpool.store.typed import Store, Versioned

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0


class _PurposeReads(Protocol):
    """Where a notice's purpose is read: the cache, or a TxnView."""

    @property
    def nodes(self) -> RecordReader[pb.VirtualNode]: ...

    @property
    def gangs(self) -> RecordReader[pb.GangRecord]: ...

    @property
    def host_allocations(self) -> RecordReader[pb.HostAllocation]: ...

    @property
    def boxes(self) -> RecordReader[pb.Box]: ...


class _ChangedError(Exception):
    """A victim or the request is no longer as the plan saw it."""


def grace_s(node: pb.VirtualNode, default_s: float) -> float:
    """The grace period a notice gives ``node``."""
    if node.spec.HasField("preemption_grace_s"):
        return float(node.spec.preemption_grace_s)
    return default_s


def holds_gpus(cache: Cache, node: pb.VirtualNode, only: set[str] | None = None) -> bool:
    """Whether ``node`` still owns any of its GPUs (of ``only``, when given)."""
    for binding in node.gpus:
        if only is not None and binding.gpu not in only:
            continue
        record = cache.gpus.get(gpu_id(binding.gpu))
        if record is not None and record.value.node == node.name:
            return True
    return False


class Notices:
    """Issues, carries out and withdraws notices (see the module docstring). Keeps the
    nodes under a notice from cache events, so finding the due ones costs what is
    pending, not the pool. Thread-safe."""

    def __init__(
        self,
        store: Store,
        cache: Cache,
        host_locks: KeyedLocks,
        *,
        default_grace_s: float = DEFAULT_GRACE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._cache = cache
        self._host_locks = host_locks
        self._default_grace_s = default_grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}  # node id -> notice deadline
        self._unsubscribe = cache.subscribe(Routes().on(cache.nodes, self._on_node))
        for name, record in cache.nodes.items():
            self._on_node(name, record)

    def close(self) -> None:
        self._unsubscribe()

    def _on_node(self, name: str, record: Versioned[pb.VirtualNode] | None) -> None:
        node = record.value if record is not None else None
        with self._lock:
            if (
                node is not None
                and node.HasField("preemption")
                and node.state in lifecycle.LOSABLE_NODE_STATES
            ):
                self._pending[name] = seconds(node.preemption.deadline)
            else:
                self._pending.pop(name, None)

    def pending(self) -> int:
        """Nodes under a notice not yet carried out."""
        with self._lock:
            return len(self._pending)

    def outstanding(self, victim: str, by: str) -> bool:
        """Whether node ``victim``, given a notice for ``by``, has yet to let go of the
        GPUs: its notice is not carried out yet, or GPUs it let go of are still being
        detached (they are freed on the agent's report)."""
        record = self._cache.nodes.get(parse_node(victim))
        if record is None:
            return False
        node = record.value
        if node.state in lifecycle.LOSABLE_NODE_STATES and node.HasField("preemption"):
            return node.preemption.by == by
        for binding in node.gpus:
            gpu = self._cache.gpus.get(gpu_id(binding.gpu))
            if (
                gpu is not None
                and gpu.value.node == node.name
                and gpu.value.state in (pb.GPU_STATE_DETACHING, pb.GPU_STATE_FENCING)
            ):
                return True
        return False

    # -- issuing -------------------------------------------------------------------------

    def issue(self, requester: str, plan: Plan, *, reclaiming: bool, reason: str) -> bool:
        """Give every victim of ``plan`` its notice for ``requester`` (a QUEUED node or
        gang) and record them on the request, in one transaction. False when anything
        changed since the plan (plan again)."""
        now = self._clock()

        def body(view: TxnView) -> bool:
            self._mark_requester(view, requester, plan, reclaiming, reason)
            for cut in plan.cuts:
                self._give(view, cut, requester, now)
            return True

        try:
            done = transact(
                self._store,
                self._cache,
                body,
                attempts=PASS_ATTEMPTS,
                what=f"preempting for {requester}",
            )
        except (_ChangedError, Aborted):
            return False
        if done:
            metrics.PREEMPTION_NOTICES.labels(kind="shrink").inc(
                sum(1 for c in plan.cuts if not c.whole)
            )
            metrics.PREEMPTION_NOTICES.labels(kind="release").inc(
                sum(1 for c in plan.cuts if c.whole)
            )
            log.info(
                "preemption notices given",
                extra={"for": requester, "nodes": ",".join(c.node for c in plan.cuts)},
            )
        return done

    def _mark_requester(
        self, view: TxnView, requester: str, plan: Plan, reclaiming: bool, reason: str
    ) -> None:
        victims = [cut.node for cut in plan.cuts]
        if requester.startswith("gangs/"):
            gang_id = parse_gang(requester)
            gang_record = view.gangs.get(gang_id)
            if gang_record is None or gang_record.value.state != pb.GANG_STATE_QUEUED:
                raise _ChangedError
            gang = copy(gang_record.value)
            del gang.queue.preempting[:]
            gang.queue.preempting.extend(victims)
            gang.queue.reclaiming = reclaiming
            gang.queue.reason = reason
            gang.message = f"waiting in the queue: {reason}"
            view.put(k.GANGS, gang_id, gang)
            return
        node_id = parse_node(requester)
        record = view.nodes.get(node_id)
        if record is None or record.value.state != pb.NODE_STATE_QUEUED:
            raise _ChangedError
        node = copy(record.value)
        del node.queue.preempting[:]
        node.queue.preempting.extend(victims)
        node.queue.reclaiming = reclaiming
        node.queue.reason = reason
        node.message = f"waiting in the queue: {reason}"
        view.put(k.NODES, node_id, node)

    def _give(self, view: TxnView, cut: Cut, requester: str, now: float) -> None:
        node_id = parse_node(cut.node)
        record = view.nodes.get(node_id)
        if record is None:
            raise _ChangedError
        node = record.value
        if (
            node.state not in lifecycle.LOSABLE_NODE_STATES
            or not node.preemptible
            or node.HasField("preemption")
        ):
            raise _ChangedError
        bound = [b.gpu for b in node.gpus]
        if cut.gpus:
            left = len(bound) - len(cut.gpus)
            if (
                node.state != pb.NODE_STATE_READY
                or any(g not in bound for g in cut.gpus)
                or left < max(node.spec.min_gpus, 1)
            ):
                raise _ChangedError
        deadline = now + grace_s(node, self._default_grace_s)
        noticed = copy(node)
        noticed.preemption.CopyFrom(
            pb.PreemptionNotice(
                time=timestamp(now),
                deadline=timestamp(deadline),
                reason=f"{cut.reason}: taken for {requester}",
                by=requester,
                gpus=list(cut.gpus),
            )
        )
        what = f"{len(cut.gpus)} of its GPUs" if cut.gpus else "its GPUs"
        lifecycle.add_event(
            noticed,
            "PreemptionNotice",
            f"{cut.reason}: {what} will be taken for {requester} at "
            f"{time.strftime('%H:%M:%S', time.gmtime(deadline))} UTC "
            f"({deadline - now:.0f}s grace)",
            now,
            warning=True,
        )
        view.put(k.NODES, node_id, noticed)

    def drain_notice(self, node_id: str, by: str, reason: str) -> bool:
        """Give node ``node_id`` a notice that it is released for a drain (``by`` is the
        host or box). False when it has one already or is no longer live."""
        now = self._clock()

        def body(view: TxnView) -> bool:
            record = view.nodes.get(node_id)
            if record is None:
                return False
            node = record.value
            if node.state not in lifecycle.LOSABLE_NODE_STATES or node.HasField("preemption"):
                return False
            deadline = now + grace_s(node, self._default_grace_s)
            noticed = copy(node)
            noticed.preemption.CopyFrom(
                pb.PreemptionNotice(
                    time=timestamp(now), deadline=timestamp(deadline), reason=reason, by=by
                )
            )
            lifecycle.add_event(
                noticed,
                "PreemptionNotice",
                f"{reason}: released at {time.strftime('%H:%M:%S', time.gmtime(deadline))} "
                f"UTC ({deadline - now:.0f}s grace)",
                now,
                warning=True,
            )
            view.put(k.NODES, node_id, noticed)
            return True

        try:
            return transact(
                self._store, self._cache, body, attempts=PASS_ATTEMPTS, what=f"draining {node_id}"
            )
        except Aborted:
            return False

    # -- carrying out ----------------------------------------------------------------------

    def due(self) -> list[str]:
        """Nodes whose notice's deadline has passed, by name."""
        now = self._clock()
        with self._lock:
            return sorted(name for name, deadline in self._pending.items() if deadline <= now)

    def under_notice(self) -> list[str]:
        """Every node under a notice not yet carried out."""
        with self._lock:
            return sorted(self._pending)

    def carry_out_due(self) -> int:
        """Carry out (or withdraw) every due notice, and withdraw any whose purpose is
        gone; returns how many nodes changed."""
        changed = 0
        due = set(self.due())
        for node_id in self.under_notice():
            if node_id in due or not self._purpose_holds_cached(node_id):
                try:
                    changed += self.carry_out(node_id) is not None
                except DxpoolError as error:
                    log.debug(
                        "notice not carried out", extra={"node": node_id, "error": error.message}
                    )
        return changed

    def _purpose_holds_cached(self, node_id: str) -> bool:
        record = self._cache.nodes.get(node_id)
        if record is None or not record.value.HasField("preemption"):
            return True
        return self._purpose_holds(self._cache, record.value.preemption.by)

    @staticmethod
    def _purpose_holds(read: _PurposeReads, by: str) -> bool:
        """Whether what a notice was given for still wants it, read through ``read``
        (the cache, or a TxnView, which has the commit compare what it read)."""
        if by.startswith("nodes/"):
            node = read.nodes.get(parse_node(by))
            return node is not None and node.value.state == pb.NODE_STATE_QUEUED
        if by.startswith("gangs/"):
            gang = read.gangs.get(parse_gang(by))
            return gang is not None and gang.value.state == pb.GANG_STATE_QUEUED
        if by.startswith("hosts/"):
            allocation = read.host_allocations.get(parse_host(by))
            return allocation is not None and allocation.value.HasField("drain")
        if by.startswith("boxes/"):
            box = read.boxes.get(parse_box(by))
            return box is not None and box.value.HasField("drain")
        return False

    def carry_out(self, node_id: str) -> str | None:
        """Carry out node ``node_id``'s notice if due, or withdraw it if its purpose is
        gone; returns what happened ("released", "shrunk", "withdrawn") or None."""
        record = self._cache.nodes.get(node_id)
        host = parse_host(record.value.host) if record is not None and record.value.host else ""
        with self._host_locks.lock(host):
            outcome = transact(
                self._store,
                self._cache,
                lambda view: self._carry_out_in(view, node_id),
                attempts=PASS_ATTEMPTS,
                what=f"preempting nodes/{node_id}",
                operation="transition",
            )
        if outcome is not None:
            metrics.PREEMPTIONS.labels(outcome=outcome).inc()
            log.info("preemption notice", extra={"node": node_id, "outcome": outcome})
        return outcome

    def _carry_out_in(self, view: TxnView, node_id: str) -> str | None:
        record = view.nodes.get(node_id)
        if record is None or not record.value.HasField("preemption"):
            return None
        node = record.value
        if node.state not in lifecycle.LOSABLE_NODE_STATES:
            return None  # released (or lost) meanwhile: its GPUs are let go already
        notice = node.preemption
        now = self._clock()
        if not self._purpose_holds(view, notice.by):
            withdrawn = copy(node)
            withdrawn.ClearField("preemption")
            lifecycle.add_event(
                withdrawn,
                "PreemptionCancelled",
                f"the notice for {notice.by} is withdrawn: it no longer needs the GPUs",
                now,
            )
            view.put(k.NODES, node_id, withdrawn)
            return "withdrawn"
        if now < seconds(notice.deadline):
            return None
        message = f"preempted: {notice.reason}"
        if notice.gpus and node.state == pb.NODE_STATE_RESIZING:
            return None  # its own resize first; the shrink follows once READY
        if notice.gpus and node.state == pb.NODE_STATE_READY:
            bound = {b.gpu for b in node.gpus}
            removes = [g for g in notice.gpus if g in bound]
            if len(removes) >= len(bound):
                removes = removes[: len(bound) - 1]
            cleared = copy(node)
            cleared.ClearField("preemption")
            if not removes:
                view.put(k.NODES, node_id, cleared)
                return "withdrawn"
            shrunk = shrink_in(view, cleared, removes, now, reason="Preempted")
            shrunk.message = f"{message}; {shrunk.message}"
            view.put(k.NODES, node_id, shrunk)
            return "shrunk"
        let_go(view, node, pb.NODE_STATE_RELEASING, message, now, reason="Preempted")
        return "released"


__all__ = ["DEFAULT_GRACE_S", "Notices", "grace_s", "holds_gpus"]
