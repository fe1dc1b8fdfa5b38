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
usage read and the raised usage written (:mod:`dxpool.broker.nodes.tenants`), so concurrent
composes of one tenant can never exceed its quota either.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TypeVar

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.compose_commit import ComposeCommitter, ComposeJob
from dxpool.broker.nodes.compose_settings import ComposeSettings
from dxpool.broker.nodes.fit import placement_request
from dxpool.broker.nodes.forget import free_released_names
from dxpool.broker.nodes.gang import GangComposer
from dxpool.broker.nodes.model_check import check_model_known
from dxpool.broker.nodes.resize import Resizer
from dxpool.broker.nodes.tenants import refuse_breach
from dxpool.broker.nodes.transitions import fence_detaching, let_go
from dxpool.broker.nodes.validation import check_node_spec
from dxpool.broker.placement import PlacementRequest, PlacementResult, place
from dxpool.broker.state import metrics
from dxpool.broker.state.cache import Cache, Collection
from dxpool.broker.state.locks import KeyedLocks
from dxpool.broker.state.placement_index import PlacementIndex
from dxpool.broker.state.stm import (
    RELEASE_ATTEMPTS,
    TxnView,
    pause_after_conflict,
    read_through,
    transact,
)
from dxpool.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
)
from dxpool.fabric.latency import LatencyModel, LatencySource, as_source
from dxpool.gc_policy import CollectorPolicy
from dxpool.names import (
    check_id,
    check_request_id,
    parse_host,
    parse_node,
)
from dxpool.request import format_duration_ns
from dxpool.store.typed import Store, Versioned

R = TypeVar("R")
log = logging.getLogger(__name__)


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
        collector: CollectorPolicy | None = None,
    ) -> None:
        self._store = store
        self._collector = collector
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
        self._commits = ComposeCommitter(
            store, cache, self._host_locks, self.node_for_request, clock
        )

    @property
    def store(self) -> Store:
        """The etcd store this composer commits to."""
        return self._store

    @property
    def cache(self) -> Cache:
        """The cache this composer reads."""
        return self._cache

    @property
    def index(self) -> PlacementIndex:
        """The placement index this composer places on (and holds choices in)."""
        return self._index

    @property
    def latency(self) -> LatencySource:
        """The latency source placement asks for its current model."""
        return self._latency

    @property
    def settings(self) -> ComposeSettings:
        return self._settings

    @property
    def tenant_locks(self) -> KeyedLocks:
        """The per-tenant locks under which this broker changes a tenant's usage."""
        return self._tenant_locks

    @property
    def host_locks(self) -> KeyedLocks:
        """The per-host locks under which this broker changes a host's allocation:
        composes and releases hold one, gangs (:mod:`dxpool.broker.nodes.gang`) several, in
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

    def between_decisions(self) -> None:
        """The garbage collector's turn (:meth:`~dxpool.gc_policy.CollectorPolicy.between`),
        where no placement runs: called after each compose, by NodeService after each gang
        compose and resize, and by the queue's dispatcher after each admission, outside the
        placement lock. Nothing without a collector."""
        if self._collector is not None:
            self._collector.between()

    # -- compose ---------------------------------------------------------------------

    def compose(self, request: nodes_pb2.ComposeNodeRequest, owner: str = "") -> pb.VirtualNode:
        """Place and commit a node; see the module docstring and NodeService.ComposeNode.

        ``owner`` (the caller's identity URI; empty without authentication) is recorded
        on the node. A request id is the owner's own: another owner's id answers
        ALREADY_EXISTS without naming the node it made.

        A request whose node was already committed gets that node, also when the
        tenant's quota is full by now (that node is what fills it): a quota refusal of
        a call with a request id first looks the id up in etcd, since this broker's
        cache may not have seen another broker commit it yet.

        Once it is done, whatever the outcome, the collector gets its turn
        (:meth:`between_decisions`)."""
        try:
            return self._compose(request, owner)
        except ResourceExhausted as error:
            if error.reason != "QUOTA_EXCEEDED" or not request.request_id:
                raise
            record = self.lookup(self._cache.requests, request.request_id)
            existing = self.node_for_request(request.request_id, request.spec, record, owner)
            if existing is None:
                raise
            return existing
        finally:
            self.between_decisions()

    def _compose(self, request: nodes_pb2.ComposeNodeRequest, owner: str) -> pb.VirtualNode:
        placement_request = self._check(request)
        request_id = request.request_id
        if request_id:
            existing = self.node_for_request(
                request_id, request.spec, self._cache.requests.get(request_id), owner
            )
            if existing is not None:
                return existing
        node_id = request.node_id or _generate_node_id()
        if request.node_id:
            free_released_names(self._store, self._cache, [node_id])
        if request.node_id and self._cache.nodes.get(node_id) is not None:
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
            # Composes placing while this one is on its way to commit see its GPUs and
            # host slots taken, so they choose others.
            if not held:
                metrics.COMPOSE_CONFLICTS.inc()
                continue
            try:
                job = ComposeJob(request, node_id, result, owner, self._settings.attach_timeout_s)
                outcome = self._commit(job, placement_request)
            finally:
                self._index.let_go(chosen)
            if isinstance(outcome, pb.VirtualNode):
                metrics.COMPOSE_TOTAL.labels(result="ok").inc()
                return outcome
            metrics.COMPOSE_CONFLICTS.inc()
            log.debug("compose conflict; placing again", extra={"attempt": attempt})
            pause_after_conflict(attempt)
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

    def lookup(self, collection: Collection[R], name: str) -> Versioned[R] | None:
        """A record of ``collection`` (one of the cache's), or from etcd when the cache
        lacks it (see :func:`~dxpool.broker.state.stm.read_through`): None means it does
        not exist."""
        return read_through(self._store, self._cache, collection, name)

    def lookup_node(self, node_id: str) -> Versioned[pb.VirtualNode] | None:
        """:meth:`lookup` of node ``node_id``."""
        return self.lookup(self._cache.nodes, node_id)

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
        if host is not None and self._cache.hosts.get(host) is None:
            raise NotFound(
                f"host {request.spec.host} is not registered; list hosts with "
                "`dxpool host list` or leave the host out to let placement choose",
                reason="HOST_NOT_FOUND",
            )
        return placement_request(request.spec, host)

    def node_for_request(
        self, request_id: str, spec: pb.NodeSpec, record: Versioned[bytes] | None, owner: str
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
        node = self.lookup_node(parse_node(name))
        if node is None:
            raise FailedPrecondition(
                f"request_id {request_id!r} was used for {name}, which no longer exists; "
                "use a new request_id",
                reason="REQUEST_ID_REUSED",
            )
        found = node.value
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

    def _commit(
        self, job: ComposeJob, placement_request: PlacementRequest
    ) -> pb.VirtualNode | None:
        """Commit a placed and held job: the node, or None to place again.

        Composes in this broker that chose the same host commit under its lock, together
        when several wait (see :mod:`~dxpool.broker.nodes.compose_commit`), so they never fail
        each other's compares; only other brokers can. Under the lock the choice is
        re-checked against the cache (GPUs still free, host slots unused, boxes
        schedulable) rather than placed again, and the commit compares every record it
        depends on. A node charged to a tenant commits alone, under the tenant's lock
        too."""
        tenant_id = job.request.spec.tenant
        if tenant_id:
            with self._host_locks.lock(job.host), self._tenant_lock(tenant_id):
                outcome = self._commits.commit_alone(job)
                return outcome or self._commit_pinned(job, placement_request)
        outcome = self._commits.commit(job)
        if outcome is not None:
            return outcome
        with self._host_locks.lock(job.host):
            return self._commit_pinned(job, placement_request)

    def _commit_pinned(
        self, job: ComposeJob, placement_request: PlacementRequest
    ) -> pb.VirtualNode | None:
        """``job``'s GPUs or slots were taken meanwhile (by another broker, or by a
        compose that placed before this one's hold): place it again on the same host,
        which is cheaper than a full placement, and commit alone. The caller holds the
        host's lock (and the tenant's)."""
        pinned = replace(placement_request, host=job.host)
        result = place(pinned, self._index.snapshot(), self._latency.current())
        if result.placement is None:
            return None
        return self._commits.commit_alone(replace(job, result=result, done=False))

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
        started = [False]  # whether the attempt that committed started a release

        def body(view: TxnView) -> pb.VirtualNode:
            record = view.nodes.get(node_id)
            if record is None or (owner is not None and record.value.owner != owner):
                raise NotFound(
                    f"node {name} does not exist; list nodes with `dxpool node list`",
                    reason="NODE_NOT_FOUND",
                )
            node = record.value
            started[0] = False
            if node.state in (pb.NODE_STATE_RELEASING, pb.NODE_STATE_RELEASED):
                if force and node.state == pb.NODE_STATE_RELEASING:
                    fence_detaching(view, node)
                return node
            started[0] = True
            message = (
                "force release requested; fencing GPUs at the box side"
                if force
                else "release requested; detaching GPUs"
            )
            return let_go(view, node, pb.NODE_STATE_RELEASING, message, self._clock(), fence=force)

        # Composes and releases on one host in this broker change its allocation record
        # one at a time, and those of one tenant its usage record (composes commit under
        # these locks too, in the same order), so a release does not keep losing its
        # compare to this broker's composes and releases on the same host or tenant.
        known = self.lookup_node(node_id)
        host = parse_host(known.value.host) if known is not None and known.value.host else ""
        tenant = known.value.spec.tenant if known is not None else ""
        with self._host_locks.lock(host), self._tenant_lock(tenant):
            released = transact(
                self._store,
                self._cache,
                body,
                attempts=RELEASE_ATTEMPTS,
                what=f"releasing {name}",
                operation="release",
                audited=True,
            )
        if started[0]:
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
    if spec.exclude_hosts:
        extra.append(f"off {len(set(spec.exclude_hosts))} excluded hosts")
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


__all__ = ["Composer"]
