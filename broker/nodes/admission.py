"""Serving a QUEUED node: place it now and commit it, or say why it still waits.

Admission is a compose of a node that already exists: placement (the public ``place()``
on the placement index, the choice held there as a compose holds it) and then ONE
transaction (:func:`~dxpool.broker.state.stm.transact`) that compares the QUEUED node record,
each chosen GPU (still FREE), the box, the host's allocation (not cordoned) and lease,
and the tenant's record, and writes the GPUs (ATTACHING), the allocation, the tenant's
raised usage (guaranteed or borrowed, :mod:`dxpool.broker.nodes.loaning`) and the node in
PENDING with its host and bindings. From there it is an ordinary node.

Because the commit compares the node record, two brokers (or two passes) that serve the
same request at once cannot both commit it: the second finds the node PENDING and
leaves it. A release of the node (a cancel) between the read and the commit makes the
commit fail the same way, and the next look finds it RELEASING.

A request whose tenant's record is gone, or carries another ``uid`` than the one the
request was queued with (deleted, and perhaps made anew), fails (FAILED, nothing
charged), as does a request past its queue deadline. The uid is judged on the record
the commit compares, so a deletion racing the admission either lands first (and the
admission fails the node) or after (the delete then finds the tenant's usage and
refuses).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes import loaning
from dxpool.broker.nodes.compose import Composer
from dxpool.broker.nodes.compose_gate import ComposeGate
from dxpool.broker.nodes.enqueue import short
from dxpool.broker.nodes.fit import assign_gpus, placement_request, reserve_host_resources
from dxpool.broker.nodes.tenants import breach, charged, new_tenant
from dxpool.broker.placement import Placement, PlacementRequest, place
from dxpool.broker.state.records import copy, seconds, timestamp
from dxpool.broker.state.stm import ADMISSION_ATTEMPTS, NOTE_ATTEMPTS, TxnView, transact
from dxpool.errors import Aborted, DxpoolError, NotFound, ResourceExhausted
from dxpool.names import parse_host
from dxpool.store import keys as k

log = logging.getLogger(__name__)

ADMITTED = "admitted"
WAITING = "waiting"
FAILED = "failed"
GONE = "gone"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one admission attempt found. ``capacity``: it waits because no placement
    exists now (lent capacity or lower priority may be taken for it); otherwise it
    waits for its quota or for lending to resume. ``placed``: the attempt got as far as
    placing (what a dispatcher pass counts against its bound)."""

    kind: str  # ADMITTED, WAITING, FAILED or GONE (no longer QUEUED)
    reason: str = ""
    capacity: bool = False
    node: pb.VirtualNode | None = None
    placed: bool = False


class _StaleError(Exception):
    """The placement no longer holds against the records the commit reads."""


class _WaitError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _TenantGoneError(Exception):
    pass


def deadline_passed(queue: pb.QueueStatus, now: float) -> bool:
    return queue.HasField("deadline") and now > seconds(queue.deadline)


def tenant_changed(uid: str, record: pb.Tenant | None) -> bool:
    """Whether the tenant a request was queued with (``uid``) is gone: no record, or a
    record made since (another uid). A request queued before uids existed has none."""
    return bool(uid) and (record is None or record.uid != uid)


class Admitter:
    """Admits, fails and annotates QUEUED nodes (see the module docstring). Thread-safe."""

    def __init__(
        self, composer: Composer, gate: ComposeGate, clock: Callable[[], float] = time.time
    ) -> None:
        self._composer = composer
        self._store = composer.store
        self._cache = composer.cache
        self._gate = gate
        self._clock = clock

    def queued(self, node_id: str) -> pb.VirtualNode | None:
        record = self._cache.nodes.get(node_id)
        if record is None or record.value.state != pb.NODE_STATE_QUEUED:
            return None
        node = record.value
        return node

    def admit(self, node_id: str) -> Outcome:
        """Try to place and commit the QUEUED node ``node_id`` now."""
        node = self.queued(node_id)
        if node is None:
            return Outcome(GONE)
        now = self._clock()
        if deadline_passed(node.queue, now):
            return self.fail(node_id, self.timeout_message(node, now))
        spec = node.spec
        tenant = self._gate.tenant(spec.tenant)
        if spec.tenant and tenant_changed(node.queue.tenant_uid, tenant):
            current = self._confirmed_tenant(spec.tenant)
            if tenant_changed(node.queue.tenant_uid, current):
                return self.fail(node_id, self.tenant_gone_message(spec.tenant))
        count = spec.gpus.count
        quota = breach(spec.tenant, tenant, [spec.gpus.model] * count) if spec.tenant else None
        if quota is not None:
            return Outcome(WAITING, f"quota: {quota.message}")
        try:
            self._gate.check(spec, count, requester=node.name)
        except ResourceExhausted as error:
            return Outcome(WAITING, error.message)
        request = self._request(node)
        if request is None:
            return self.fail(node_id, f"host {spec.host} is no longer registered")
        for _ in range(ADMISSION_ATTEMPTS):
            result = place(
                request, self._composer.index.snapshot(), self._composer.latency.current()
            )
            if result.placement is None:
                reasons = "; ".join(result.unsatisfied) or "no host can take the node"
                return Outcome(WAITING, f"no capacity: {reasons}", capacity=True, placed=True)
            if not self._composer.index.hold(result.placement):
                continue
            try:
                return replace(self._commit(node_id, result.placement), placed=True)
            except _StaleError:
                continue
            finally:
                self._composer.index.let_go(result.placement)
        return Outcome(
            WAITING, "no capacity: the GPUs placed kept being taken", capacity=True, placed=True
        )

    def _request(self, node: pb.VirtualNode) -> PlacementRequest | None:
        host = parse_host(node.spec.host) if node.spec.host else None
        if host is not None and self._cache.hosts.get(host) is None:
            return None
        return placement_request(node.spec, host)

    def _confirmed_tenant(self, tenant_id: str) -> pb.Tenant | None:
        key = self._store.keys.tenant(tenant_id)
        found = self._store.read([key]).get(key)
        self._cache.apply_read(key, found, self._cache.revision)
        return found.value if found is not None else None

    def _commit(self, node_id: str, placement: Placement) -> Outcome:
        tenant_id = self._cache.nodes.get(node_id)
        spec_tenant = tenant_id.value.spec.tenant if tenant_id is not None else ""
        locks = self._composer.host_locks.lock(placement.host)
        tenant_lock = (
            self._composer.tenant_locks.lock(spec_tenant) if spec_tenant else nullcontext()
        )
        try:
            with locks, tenant_lock:
                node = transact(
                    self._store,
                    self._cache,
                    lambda view: self._admit_in(view, node_id, placement),
                    what=f"admitting nodes/{node_id}",
                    operation="transition",
                )
        except _WaitError as wait:
            return Outcome(WAITING, wait.reason)
        except _TenantGoneError:
            record = self._cache.nodes.get(node_id)
            tenant = record.value.spec.tenant if record is not None else ""
            return self.fail(node_id, self.tenant_gone_message(tenant))
        except Aborted as error:
            return Outcome(WAITING, f"commit kept conflicting: {error.message}", capacity=True)
        if node is None:
            return Outcome(GONE)
        return Outcome(ADMITTED, node=node)

    def _admit_in(self, view: TxnView, node_id: str, placement: Placement) -> pb.VirtualNode | None:
        record = view.nodes.get(node_id)
        if record is None or record.value.state != pb.NODE_STATE_QUEUED:
            return None
        node = record.value
        spec = node.spec
        host_id = placement.host
        if not view.host_leases.exists(host_id):
            raise _StaleError
        allocation_record = view.host_allocations.get(host_id)
        allocation = (
            copy(allocation_record.value)
            if allocation_record is not None
            else pb.HostAllocation(host=f"hosts/{host_id}")
        )
        if allocation.unschedulable:
            raise _StaleError
        now = self._clock()
        waited = now - seconds(node.queue.enqueue_time)
        admitted = lifecycle.node_to(
            node,
            pb.NODE_STATE_PENDING,
            f"placed after {waited:.1f}s in the queue; waiting for the host agent to "
            "attach the GPUs",
            now,
        )
        admitted.host = f"hosts/{host_id}"
        admitted.attach_deadline.CopyFrom(timestamp(now + self._composer.settings.attach_timeout_s))
        admitted.queue.reason = ""
        del admitted.queue.preempting[:]
        admitted.queue.reclaiming = False
        host_record = self._cache.hosts.get(host_id)
        if not reserve_host_resources(
            host_record.value if host_record is not None else None, allocation, spec, node.name
        ):
            raise _StaleError
        used = {a.host_slot for a in allocation.attachments}
        assigned = assign_gpus(view, placement, admitted, allocation, used, spec.vfio)
        if assigned is None:
            raise _StaleError
        for name, _, gpu in assigned:
            view.put(k.GPUS, name, gpu)
        view.put(k.HOST_ALLOCATIONS, host_id, allocation)
        if spec.tenant:
            self._charge(view, node, admitted)
        view.put(k.NODES, node_id, admitted)
        return admitted

    def _charge(self, view: TxnView, node: pb.VirtualNode, admitted: pb.VirtualNode) -> None:
        tenant_id = node.spec.tenant
        record = view.tenants.get(tenant_id)
        tenant = record.value if record is not None else None
        if tenant_changed(node.queue.tenant_uid, tenant):
            raise _TenantGoneError
        models = [binding.model for binding in admitted.gpus]
        error = breach(tenant_id, tenant, models)
        if error is not None:
            raise _WaitError(f"quota: {error.message}")
        terms = loaning.terms(tenant, len(models))
        updated = copy(tenant) if tenant is not None else new_tenant(tenant_id)
        updated.usage.CopyFrom(charged(updated.usage, models, borrowed=terms.borrowed))
        view.put(k.TENANTS, tenant_id, updated)
        admitted.charged = True
        admitted.preemptible = terms.borrowed

    # -- waiting and failing -------------------------------------------------------------

    def fail(self, node_id: str, message: str) -> Outcome:
        """QUEUED -> FAILED with ``message`` (nothing was charged or held)."""

        def body(view: TxnView) -> pb.VirtualNode | None:
            record = view.nodes.get(node_id)
            if record is None or record.value.state != pb.NODE_STATE_QUEUED:
                return None
            failed = lifecycle.node_to(record.value, pb.NODE_STATE_FAILED, message, self._clock())
            failed.queue.reclaiming = False
            view.put(k.NODES, node_id, failed)
            return failed

        try:
            node = transact(self._store, self._cache, body, what=f"failing nodes/{node_id}")
        except (Aborted, NotFound):
            return Outcome(WAITING, "could not record the failure; trying again")
        if node is None:
            return Outcome(GONE)
        log.info("queued node failed", extra={"node": node_id, "reason": message})
        return Outcome(FAILED, message, node=node)

    def note(
        self,
        node_id: str,
        reason: str,
        *,
        preempting: list[str] | None = None,
        reclaiming: bool | None = None,
    ) -> bool:
        """Record why the QUEUED node waits (and, when given, which nodes are preempted
        for it and whether it reclaims lent capacity), if that changed. Best effort:
        False when the node moved on or the write lost its compare."""
        reason = short(reason)

        def body(view: TxnView) -> bool:
            record = view.nodes.get(node_id)
            if record is None or record.value.state != pb.NODE_STATE_QUEUED:
                return False
            node = record.value
            wanted_preempting = list(node.queue.preempting) if preempting is None else preempting
            wanted_reclaiming = node.queue.reclaiming if reclaiming is None else reclaiming
            if (
                node.queue.reason == reason
                and list(node.queue.preempting) == wanted_preempting
                and node.queue.reclaiming == wanted_reclaiming
            ):
                return False
            updated = copy(node)
            updated.queue.reason = reason
            updated.message = short(f"waiting in the queue: {reason}")
            del updated.queue.preempting[:]
            updated.queue.preempting.extend(wanted_preempting)
            updated.queue.reclaiming = wanted_reclaiming
            view.put(k.NODES, node_id, updated)
            return True

        try:
            return transact(
                self._store,
                self._cache,
                body,
                attempts=NOTE_ATTEMPTS,
                what=f"noting nodes/{node_id}",
            )
        except (Aborted, NotFound):
            return False
        except DxpoolError as error:
            log.debug("queue reason not recorded", extra={"node": node_id, "error": error.message})
            return False

    @staticmethod
    def timeout_message(node: pb.VirtualNode, now: float) -> str:
        waited = now - seconds(node.queue.enqueue_time)
        return (
            f"not placed within its queue timeout (waited {waited:.0f}s); last reason: "
            f"{node.queue.reason or 'none recorded'}"
        )

    @staticmethod
    def tenant_gone_message(tenant_id: str) -> str:
        return (
            f"tenant {tenant_id} was deleted while the request waited; nothing was charged "
            "(compose again to charge the tenant as it is now)"
        )


__all__ = [
    "ADMITTED",
    "FAILED",
    "GONE",
    "WAITING",
    "Admitter",
    "Outcome",
    "deadline_passed",
    "tenant_changed",
]
