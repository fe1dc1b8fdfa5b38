"""ComposeNode, PlanNode and ReleaseNode: placement plus one etcd transaction each.

Compose reads the inventory from the cache, asks the placement pipeline for a host and
GPUs, then commits, in ONE transaction that compares the revision of every record it
relied on: each chosen GPU (must still be FREE), the host's allocation (the proxy slots),
the host's lease (the agent is alive), the node name and the request id (both unused).
A failed compare returns the current values in the same round trip; the cache takes
them and placement runs again, a bounded number of times. So two composes, in one
broker or in several, can never take the same GPU or the same host slot.

A node with a tenant (``spec.tenant``) is charged to it in the same transaction: the
tenant's record (``tenants/{tenant}``) is compared too, its quota checked against the
usage read and the raised usage written (:mod:`dxpool.broker.tenants`), so concurrent
composes of one tenant can never exceed its quota either.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from dxpool import lifecycle
from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker import metrics
from dxpool.broker.audit_commit import record_in
from dxpool.broker.cache import Cache
from dxpool.broker.fit import bind, placement_request, reserve_host_resources, still_takable
from dxpool.broker.gang import GangComposer
from dxpool.broker.locks import KeyedLocks
from dxpool.broker.model_check import check_model_known
from dxpool.broker.placement import PlacementRequest, PlacementResult, place
from dxpool.broker.placement_index import PlacementIndex
from dxpool.broker.records import copy, timestamp
from dxpool.broker.resize import Resizer
from dxpool.broker.stm import TxnView, read_through, transact
from dxpool.broker.tenants import charge_in, refuse_breach
from dxpool.broker.transitions import fence_detaching, let_go
from dxpool.broker.validation import check_node_spec
from dxpool.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
)
from dxpool.fabric.latency import LatencyModel, LatencySource, as_source
from dxpool.names import (
    check_id,
    check_request_id,
    node_name,
    parse_host,
    parse_node,
)
from dxpool.request import format_duration_ns
from dxpool.store import keys as k
from dxpool.store.typed import Store, Txn, Versioned

log = logging.getLogger(__name__)

MAX_COMMIT_ATTEMPTS = 16


@dataclass(frozen=True)
class ComposeSettings:
    attach_timeout_s: float = 120.0
    max_attempts: int = MAX_COMMIT_ATTEMPTS


class Composer:
    """Places, commits and releases virtual nodes. Thread-safe; no state of its own."""

    def __init__(
        self,
        store: Store,
        cache: Cache,
        index: PlacementIndex,
        latency: LatencyModel | LatencySource,
        settings: ComposeSettings = ComposeSettings(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._cache = cache
        self._index = index
        self._latency = as_source(latency)  # asked for its current model per placement
        self._settings = settings
        self._clock = clock
        self._host_locks = KeyedLocks()
        self._tenant_locks = KeyedLocks()
        # Composes place and hold one at a time: each then places on a snapshot showing
        # every hold made before, so none chooses what another already holds (with
        # concurrent placements they all chose the same best GPUs and all but one placed
        # again), and no two make the same snapshot's preparation. The broker's Python
        # runs one thread at a time anyway, so this costs no parallelism.
        self._placing = threading.Lock()

    @property
    def store(self) -> Store:
        """The etcd store this composer commits to."""
        return self._store

    @property
    def host_locks(self) -> KeyedLocks:
        """The per-host locks under which this broker changes a host's allocation:
        composes and releases hold one, gangs (:mod:`dxpool.broker.gang`) several, in
        sorted order."""
        return self._host_locks

    def gangs(self) -> GangComposer:
        """A gang composer (ComposeGang, GetGang, ReleaseGang) over the same store,
        cache, placement index, latency source, settings and host locks."""
        return GangComposer(
            self._store,
            self._cache,
            self._index,
            self._latency,
            self._host_locks,
            self._tenant_locks,
            self._settings,
            self._clock,
        )

    def resizer(self) -> Resizer:
        """A resizer (ResizeNode) over the same store, cache, placement index, latency
        source, settings and host locks."""
        return Resizer(
            self._store,
            self._cache,
            self._index,
            self._latency,
            self._host_locks,
            self._tenant_locks,
            self._settings,
            self._clock,
        )

    # -- compose ---------------------------------------------------------------------

    def compose(self, request: nodes_pb2.ComposeNodeRequest, owner: str = "") -> pb.VirtualNode:
        """Place and commit a node; see the module docstring and NodeService.ComposeNode.

        ``owner`` (the caller's identity URI; empty without authentication) is recorded
        on the node. A request id is the owner's own: another owner's id answers
        ALREADY_EXISTS without naming the node it made.

        A request whose node was already committed gets that node, also when the
        tenant's quota is full by now (that node is what fills it): a quota refusal of
        a call with a request id first looks the id up in etcd, since this broker's
        cache may not have seen another broker commit it yet."""
        try:
            return self._compose(request, owner)
        except ResourceExhausted as error:
            if error.reason != "QUOTA_EXCEEDED" or not request.request_id:
                raise
            record = self.lookup(k.REQUESTS, request.request_id)
            existing = self._node_for_request(request.request_id, request.spec, record, owner)
            if existing is None:
                raise
            return existing

    def _compose(self, request: nodes_pb2.ComposeNodeRequest, owner: str) -> pb.VirtualNode:
        placement_request = self._check(request)
        request_id = request.request_id
        if request_id:
            existing = self._node_for_request(
                request_id, request.spec, self._cache.get(k.REQUESTS, request_id), owner
            )
            if existing is not None:
                return existing
        node_id = request.node_id or _generate_node_id()
        if request.node_id and self._cache.get(k.NODES, node_id) is not None:
            raise AlreadyExists(
                f"node nodes/{node_id} already exists; pick another node_id or omit it",
                reason="NODE_EXISTS",
            )
        tenant_id = request.spec.tenant
        if tenant_id:
            # Before placement, refuse what the quota refuses whatever GPUs are chosen
            # (a model placement picks is checked at the commit, against fresh usage).
            wanted = [request.spec.gpus.model] * request.spec.gpus.count
            refuse_breach(self._store, self._cache, tenant_id, wanted)
        for attempt in range(self._settings.max_attempts):
            with self._placing:
                with metrics.COMPOSE_STAGE_SECONDS.labels(stage="placement").time():
                    result = place(
                        placement_request, self._index.snapshot(), self._latency.current()
                    )
                # Every earlier hold shows in that snapshot: a refusal would mean a hold
                # made outside this lock (the index promises no more than that).
                held = result.placement is not None and self._index.hold(result.placement)
            if result.placement is None:
                try:
                    check_model_known(self._store, self._cache, placement_request.model)
                except FailedPrecondition:
                    metrics.COMPOSE_TOTAL.labels(result="unknown_model").inc()
                    raise
                metrics.COMPOSE_TOTAL.labels(result="unschedulable").inc()
                raise ResourceExhausted(
                    _unschedulable_message(request.spec, result), reason="NO_CAPACITY"
                )
            chosen = result.placement
            host = chosen.host
            # Composes placing while this one is on its way to commit see its GPUs and
            # host slots taken, so they choose others.
            if not held:
                metrics.COMPOSE_CONFLICTS.inc()
                continue
            try:
                # Composes in this broker that chose the same host commit one at a time,
                # so they never fail each other's compares; only other brokers can.
                # Under the lock the choice is re-checked against the cache (GPUs still
                # free, host slots unused, boxes schedulable) rather than placed again,
                # and the commit compares every record it depends on.
                with self._host_locks.lock(host), self._tenant_lock(tenant_id):
                    outcome = self._try_commit(request, node_id, result, owner)
                    if outcome is None:
                        # Taken meanwhile (by another broker, or by a compose that placed
                        # before this one's hold): try this host again, which is cheaper
                        # than a full placement.
                        pinned = replace(placement_request, host=host)
                        result = place(pinned, self._index.snapshot(), self._latency.current())
                        if result.placement is not None:
                            outcome = self._try_commit(request, node_id, result, owner)
            finally:
                self._index.let_go(chosen)
            if isinstance(outcome, pb.VirtualNode):
                metrics.COMPOSE_TOTAL.labels(result="ok").inc()
                return outcome
            metrics.COMPOSE_CONFLICTS.inc()
            log.debug("compose conflict; placing again", extra={"attempt": attempt})
            time.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))
        metrics.COMPOSE_TOTAL.labels(result="aborted").inc()
        raise Aborted(
            f"placement kept conflicting with concurrent requests after "
            f"{self._settings.max_attempts} attempts; retry the call (with the same "
            "request_id)",
            reason="COMMIT_CONFLICT",
        )

    def _tenant_lock(self, tenant_id: str) -> AbstractContextManager[None]:
        """Composes of one tenant in this broker commit one at a time (inside their host
        locks), so they do not fail each other's compares on the tenant's record."""
        return self._tenant_locks.lock(tenant_id) if tenant_id else nullcontext()

    def lookup(self, collection: str, name: str) -> Versioned[Any] | None:
        """A record from the cache, or from etcd when the cache lacks it (see
        :func:`~dxpool.broker.stm.read_through`): None means it does not exist."""
        return read_through(self._store, self._cache, collection, name)

    def plan(self, request: nodes_pb2.ComposeNodeRequest) -> nodes_pb2.NodePlan:
        """Where ``compose`` would put the node now, and why; commits nothing."""
        placement_request = self._check(request)
        result = place(placement_request, self._index.snapshot(), self._latency.current())
        if result.placement is None:
            check_model_known(self._store, self._cache, placement_request.model)
        plan = nodes_pb2.NodePlan(unsatisfied=list(result.unsatisfied))
        if result.placement is not None:
            plan.host = f"hosts/{result.placement.host}"
            plan.gpus.extend(_bindings(result))
        plan.hosts.extend(
            nodes_pb2.PlanCandidate(
                name=f"hosts/{c.host}", feasible=c.feasible, reasons=list(c.reasons), score=c.score
            )
            for c in result.candidates
        )
        return plan

    def _check(self, request: nodes_pb2.ComposeNodeRequest) -> PlacementRequest:
        check_node_spec(request.spec)
        check_request_id(request.request_id)
        if request.node_id:
            check_id(request.node_id, "node")
        host = parse_host(request.spec.host) if request.spec.host else None
        if host is not None and self._cache.get(k.HOSTS, host) is None:
            raise NotFound(
                f"host {request.spec.host} is not registered; list hosts with "
                "`dxpool host list` or leave the host out to let placement choose",
                reason="HOST_NOT_FOUND",
            )
        return placement_request(request.spec, host)

    def _node_for_request(
        self, request_id: str, spec: pb.NodeSpec, record: Versioned[Any] | None, owner: str
    ) -> pb.VirtualNode | None:
        """The node an earlier call with ``request_id`` made, given its request record.

        The caller passes the record it has (the cache's, or the one a failed compare
        returned); a request id missing from the cache needs no etcd read, because the
        compose transaction itself fails if the request key exists.
        """
        if record is None:
            return None
        name = bytes(record.value).decode()
        if not name.startswith("nodes/"):
            raise AlreadyExists(
                f"request_id {request_id!r} was already used for {name}; "
                "use a new request_id for a new node",
                reason="REQUEST_ID_REUSED",
            )
        node = self.lookup(k.NODES, parse_node(name))
        if node is None:
            raise FailedPrecondition(
                f"request_id {request_id!r} was used for {name}, which no longer exists; "
                "use a new request_id",
                reason="REQUEST_ID_REUSED",
            )
        found: pb.VirtualNode = node.value
        if found.owner != owner:
            raise AlreadyExists(
                f"request_id {request_id!r} was already used by another caller; use a new "
                "request_id",
                reason="REQUEST_ID_REUSED",
            )
        if found.spec != spec:
            raise AlreadyExists(
                f"request_id {request_id!r} was already used for a different request "
                f"({name}); use a new request_id for a new node",
                reason="REQUEST_ID_REUSED",
            )
        return found

    def _reserve_host_resources(
        self, host_id: str, allocation: pb.HostAllocation, spec: pb.NodeSpec, name: str
    ) -> bool:
        """Reserve ``spec``'s CPU cores and memory on the host in ``allocation`` (see
        :func:`~dxpool.broker.fit.reserve_host_resources`); False when they no longer fit."""
        host_record = self._cache.get(k.HOSTS, host_id)
        return reserve_host_resources(
            host_record.value if host_record else None, allocation, spec, name
        )

    def _try_commit(
        self,
        request: nodes_pb2.ComposeNodeRequest,
        node_id: str,
        result: PlacementResult,
        owner: str,
    ) -> pb.VirtualNode | None:
        """Commit ``result``; return the node, or None when a compare failed."""
        assert result.placement is not None
        keys = self._store.keys
        host_id = result.placement.host
        host_name = f"hosts/{host_id}"
        name = node_name(node_id)
        txn = Txn()
        now = self._clock()
        node = pb.VirtualNode(
            name=name,
            spec=request.spec,
            host=host_name,
            state=pb.NODE_STATE_PENDING,
            message="waiting for the host agent to attach the GPUs",
            request_id=request.request_id,
            create_time=timestamp(now),
            update_time=timestamp(now),
            attach_deadline=timestamp(now + self._settings.attach_timeout_s),
            owner=owner,
        )
        lifecycle.new_node_event(node, now)
        allocation_record = self._cache.get(k.HOST_ALLOCATIONS, host_id)
        allocation = (
            copy(allocation_record.value)
            if allocation_record
            else pb.HostAllocation(host=host_name)
        )
        used = {a.host_slot for a in allocation.attachments}
        if not self._reserve_host_resources(host_id, allocation, request.spec, name):
            return None
        for binding in result.placement.bindings:
            gpu_record = self._cache.get(k.GPUS, f"{binding.box}/{binding.slot}")
            box_record = self._cache.get(k.BOXES, binding.box)
            if not still_takable(gpu_record, box_record, binding.host_slot, used):
                return None  # the snapshot was older than the cache; place again
            assert gpu_record is not None
            used.add(binding.host_slot)
            gpu = lifecycle.assign(
                gpu_record.value, node=name, host=host_name, host_slot=binding.host_slot
            )
            gpu_key = keys.gpu(binding.box, binding.slot)
            txn.expect_revision(gpu_key, gpu_record.mod_revision).put(gpu_key, gpu)
            txn.read_on_failure(gpu_key)
            bind(allocation, node, gpu, binding, request.spec.vfio)
        tenant_key = self._charge(txn, request.spec.tenant, node)
        allocation_key = keys.host_allocation(host_id)
        txn.expect_revision(
            allocation_key, allocation_record.mod_revision if allocation_record else 0
        ).put(allocation_key, allocation).read_on_failure(allocation_key)
        lease_key = keys.host_lease(host_id)
        txn.expect_present(lease_key).read_on_failure(lease_key)
        node_key = keys.node(node_id)
        txn.expect_absent(node_key).put(node_key, node).read_on_failure(node_key)
        request_key = keys.request(request.request_id) if request.request_id else None
        if request_key:
            txn.expect_absent(request_key).put(request_key, name).read_on_failure(request_key)
        # The call's audit record commits with the node (one etcd request, not two).
        audited = record_in(txn, node)
        with metrics.COMPOSE_STAGE_SECONDS.labels(stage="commit").time():
            committed = self._store.commit(txn)
        if committed.succeeded:
            if audited is not None:
                audited()
            created = {node_key} | ({request_key} if request_key else set())
            if tenant_key is not None and tenant_key[1]:
                created.add(tenant_key[0])
            self._cache.apply_commit(committed.revision, txn.writes, created=created)
            return node
        self._refresh(committed.current)
        if request_key:
            existing = self._node_for_request(
                request.request_id, request.spec, committed.current.get(request_key), owner
            )
            if existing is not None:
                return existing
        if committed.current.get(node_key) is not None and request.node_id:
            raise AlreadyExists(
                f"node {name} already exists; pick another node_id or omit it",
                reason="NODE_EXISTS",
            )
        return None

    def _charge(self, txn: Txn, tenant_id: str, node: pb.VirtualNode) -> tuple[str, bool] | None:
        """Charge ``node`` (its GPUs bound) to ``tenant_id`` in ``txn``: compare the
        tenant's record as the cache holds it and write it with the node added to its
        usage. Raises QUOTA_EXCEEDED when the node does not fit the quota (confirmed
        against etcd). Returns the record's key and whether the commit creates it;
        None for a node with no tenant."""
        if not tenant_id:
            return None
        models = [binding.model for binding in node.gpus]
        charge = charge_in(txn, self._store, self._cache, tenant_id, models)
        node.charged = True
        return charge

    def _refresh(self, current: dict[str, Versioned[Any] | None]) -> None:
        revision = self._cache.revision
        for key, record in current.items():
            self._cache.apply_read(key, record, revision)

    # -- release ---------------------------------------------------------------------

    def release(
        self, name: str, *, force: bool = False, owner: str | None = None
    ) -> pb.VirtualNode:
        """Start releasing a node. Idempotent for RELEASING and RELEASED nodes.

        With ``owner`` set (a tenant's call) a node owned by anyone else is NOT_FOUND,
        judged in the same transaction that releases it.

        Without ``force`` the host's agent detaches the GPUs and they are freed once it
        confirms. With ``force`` the broker does not wait for the agent: the GPUs go
        FENCING, the leader revokes them at the box side, scrubs and frees them. A LOST
        node's GPUs are already fencing, so its release never waits for its agent.
        """
        node_id = parse_node(name)

        def body(view: TxnView) -> pb.VirtualNode:
            record = view.get(k.NODES, node_id)
            if record is None or (owner is not None and record.value.owner != owner):
                raise NotFound(
                    f"node {name} does not exist; list nodes with `dxpool node list`",
                    reason="NODE_NOT_FOUND",
                )
            node: pb.VirtualNode = record.value
            if node.state in (pb.NODE_STATE_RELEASING, pb.NODE_STATE_RELEASED):
                if force and node.state == pb.NODE_STATE_RELEASING:
                    fence_detaching(view, node)
                return node
            message = (
                "force release requested; fencing GPUs at the box side"
                if force
                else "release requested; detaching GPUs"
            )
            return let_go(view, node, pb.NODE_STATE_RELEASING, message, self._clock(), fence=force)

        # Composes and releases on one host in this broker change its allocation record
        # one at a time (composes commit under this lock too), so a release does not
        # keep losing its compare to composes that land on the same host meanwhile.
        known = self.lookup(k.NODES, node_id)
        host = parse_host(known.value.host) if known is not None and known.value.host else ""
        with self._host_locks.lock(host):
            released = transact(
                self._store, self._cache, body, what=f"releasing {name}", audited=True
            )
        metrics.RELEASE_TOTAL.inc()
        return released


def _bindings(result: PlacementResult) -> list[pb.GpuBinding]:
    assert result.placement is not None
    return [
        pb.GpuBinding(gpu=b.gpu, model=b.model, host_slot=b.host_slot, latency_ns=b.latency_ns)
        for b in result.placement.bindings
    ]


def _unschedulable_message(spec: pb.NodeSpec, result: PlacementResult) -> str:
    wanted = f"{spec.gpus.model or 'any'}:{spec.gpus.count}"
    if spec.gpus.mixed_models:
        wanted += " (models mixed)"
    extra = []
    if spec.host:
        extra.append(f"on {spec.host}")
    if spec.max_latency_ns:
        extra.append(f"within {format_duration_ns(spec.max_latency_ns)}")
    if spec.max_slowdown:
        extra.append(f"at most {spec.max_slowdown:g}x slower for {spec.workload}")
    if spec.affinity == pb.GPU_AFFINITY_BOX:
        extra.append("from one box")
    if spec.affinity == pb.GPU_AFFINITY_SWITCH:
        extra.append("from one rack switch")
    if spec.max_gpus_per_box:
        extra.append(f"at most {spec.max_gpus_per_box} per box")
    if spec.cpu_cores:
        extra.append(f"with {spec.cpu_cores} CPU cores")
    if spec.host_memory_mib:
        extra.append(f"with {spec.host_memory_mib} MiB of host memory")
    if spec.host_selector:
        pairs = ", ".join(f"{key}={value}" for key, value in sorted(spec.host_selector.items()))
        extra.append(f"on hosts labelled {pairs}")
    head = f"no placement for {wanted} GPUs" + (" " + " ".join(extra) if extra else "")
    reasons = "; ".join(result.unsatisfied) or "no host can take the node"
    return (
        f"{head}: {reasons}. Relax the request (fewer GPUs, another model, a larger "
        "max_latency or max_slowdown, no host pin, affinity or spread) or release nodes; "
        "`dxpool node plan` "
        "shows every candidate"
    )


def _generate_node_id() -> str:
    return f"node-{secrets.token_hex(4)}"


__all__ = ["ComposeSettings", "Composer"]
