"""The compose transaction, with the composes waiting for one host committed together.

A compose commits, in ONE etcd transaction, everything its node depends on (see
:mod:`dxpool.broker.nodes.compose`): each chosen GPU compared and assigned, the host's
allocation record compared and extended, the host's lease present, the node name and the
request id unused, the tenant's record when there is one, and the call's audit record.
Composes in one broker that chose the same host commit one at a time under that host's
lock, because each compares and rewrites the host's one allocation record.

Placement fills one host before the next, so concurrent composes mostly choose the same
host, and they queued for its lock, one etcd round trip each. :class:`ComposeCommitter`
commits them together instead (group commit): a compose queues its placed job for the
host, and whoever holds the host's lock takes every job queued for it (in arrival order,
as many as fit etcd's operation limit), stages them one after the other into one
transaction, each on the allocation as the ones before it left it, and commits.

Each request keeps its compare-and-swap: the transaction compares every record every
job relies on, so it commits all of them or none. When it fails, the current values
come back in the same round trip, the cache takes them, and each job is committed again
on its own, exactly as without grouping (and a job whose GPUs or slots were taken
meanwhile goes back to its caller to be placed again). A job that cannot join (it
writes a key another job of the group writes, e.g. two calls with one request id) waits
for the next group. Composes charged to a tenant commit on their own, under the
tenant's lock as well, since every one of them rewrites the tenant's record.

Each job is staged in the context of the call that placed it, so the call's own audit
record (:func:`~dxpool.broker.state.audit_commit.record_in`) goes into the transaction.
"""

from __future__ import annotations

import contextvars
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dxpool import lifecycle
from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.fit import assign_gpus, reserve_host_resources, write_assigned
from dxpool.broker.nodes.tenants import charge_in
from dxpool.broker.placement import PlacementResult
from dxpool.broker.state import metrics
from dxpool.broker.state.audit_commit import record_in
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.locks import KeyedLocks
from dxpool.broker.state.records import copy, timestamp
from dxpool.broker.state.stm import commit_staged, expect, expect_exists, joined
from dxpool.errors import AlreadyExists
from dxpool.limits import MAX_TXN_OPS
from dxpool.names import node_name
from dxpool.store.typed import Store, Txn, TxnResult, Versioned

# Finds the node an earlier call with a request id made: (request id, spec, the request
# record, owner) -> that node, None when the record names none; raises for a misuse.
NodeForRequest = Callable[[str, pb.NodeSpec, Versioned[bytes] | None, str], pb.VirtualNode | None]


@dataclass(eq=False)
class ComposeJob:
    """One placed compose waiting to commit. ``context`` is the placing call's, taken
    when the job is made (so make it in the call's thread)."""

    request: nodes_pb2.ComposeNodeRequest
    node_id: str
    result: PlacementResult
    owner: str
    attach_timeout_s: float
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    done: bool = False
    node: pb.VirtualNode | None = None  # the committed (or earlier) node; None: place again
    error: BaseException | None = None

    @property
    def host(self) -> str:
        assert self.result.placement is not None
        return self.result.placement.host

    def finish(self, node: pb.VirtualNode | None) -> None:
        self.node, self.done = node, True

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True

    def outcome(self) -> pb.VirtualNode | None:
        """The node, or None to place again; raises what committing it raised."""
        assert self.done
        if self.error is not None:
            raise self.error
        return self.node


@dataclass
class _Staged:
    """A job staged into a transaction part: its node, the part, what it creates, and
    what to call once the part committed (its audit record stored)."""

    job: ComposeJob
    node: pb.VirtualNode
    part: Txn
    created: set[str]
    audited: Callable[[], None] | None


# What a group adds once, beside its jobs' parts: the allocation (compare, put, read on
# failure) and the host's lease (compare, read on failure).
SHARED_COMPARES, SHARED_WRITES, SHARED_READS = 2, 1, 2


def within_limit(parts: list[Txn]) -> bool:
    """Whether one transaction of ``parts`` plus what a group shares stays within etcd's
    limit of operations per list (compares, writes, reads on failure)."""
    compares = sum(len(p.compares) for p in parts) + SHARED_COMPARES
    writes = sum(len(p.success) for p in parts) + SHARED_WRITES
    reads = sum(len(p.failure) for p in parts) + SHARED_READS
    return max(compares, writes, reads) <= MAX_TXN_OPS


class _Group:
    """The transaction of a group of jobs for one host, built one job at a time."""

    def __init__(self, store: Store, cache: Cache, host: str) -> None:
        keys = store.keys
        self.host = host
        self.record = cache.host_allocations.get(host)
        # Never changed in place: each job stages on a copy, which then replaces it.
        self.allocation: pb.HostAllocation = (
            self.record.value if self.record else pb.HostAllocation(host=f"hosts/{host}")
        )
        self.allocation_key = keys.host_allocation(host)
        self.lease_key = keys.host_lease(host)
        self.staged: list[_Staged] = []
        self.written: set[str] = set()

    def fits(self, part: Txn) -> bool:
        """Whether ``part`` may join: the group's transaction stays within etcd's limit
        and no key is written twice. The first part always joins."""
        if not self.staged:
            return True
        parts = [s.part for s in self.staged] + [part]
        return within_limit(parts) and not any(key in self.written for key, _ in part.writes)

    def add(self, staged: _Staged, allocation: pb.HostAllocation) -> None:
        self.staged.append(staged)
        self.allocation = allocation
        self.written.update(key for key, _ in staged.part.writes)

    def transaction(self) -> Txn:
        txn = joined(staged.part for staged in self.staged)
        expect(txn, self.allocation_key, self.record.mod_revision if self.record else 0)
        txn.put(self.allocation_key, self.allocation)
        expect_exists(txn, self.lease_key)
        return txn


class ComposeCommitter:
    """Commits placed composes (see the module docstring). Thread-safe.

    :meth:`commit` groups a job with the others queued for its host and takes the host's
    lock itself; :meth:`commit_alone` commits one job and expects the caller to hold the
    host's lock (and the tenant's, for a charged node).
    """

    def __init__(
        self,
        store: Store,
        cache: Cache,
        host_locks: KeyedLocks,
        node_for_request: NodeForRequest,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._cache = cache
        self._host_locks = host_locks
        self._node_for_request = node_for_request
        self._clock = clock
        self._guard = threading.Lock()
        self._queued: dict[str, deque[ComposeJob]] = {}

    def commit(self, job: ComposeJob) -> pb.VirtualNode | None:
        """Commit ``job`` with whatever else waits for its host; its node, or None when
        its GPUs or host slots were taken meanwhile (place again). Raises what committing
        it raised (e.g. AlreadyExists, Unavailable)."""
        host = job.host
        with self._guard:
            self._queued.setdefault(host, deque()).append(job)
        with self._host_locks.lock(host):
            while not job.done:
                self._commit_group(host)
        return job.outcome()

    def commit_alone(self, job: ComposeJob) -> pb.VirtualNode | None:
        """Commit ``job`` in a transaction of its own; the caller holds its host's lock."""
        self._commit_one(job)
        return job.outcome()

    # -- groups -----------------------------------------------------------------------

    def _take(self, host: str) -> list[ComposeJob]:
        with self._guard:
            return list(self._queued.pop(host, ()))

    def _put_back(self, host: str, jobs: list[ComposeJob]) -> None:
        """Queue ``jobs`` first again, in order, for the next group."""
        if not jobs:
            return
        with self._guard:
            queued = self._queued.setdefault(host, deque())
            queued.extendleft(reversed(jobs))

    def _commit_group(self, host: str) -> None:
        """Under ``host``'s lock: commit the jobs queued for it, together when several."""
        jobs = self._take(host)
        if not jobs:
            # A job not done is queued until the holder of its host's lock takes it, and
            # the holder finishes or queues again all it took before letting go.
            raise RuntimeError(f"no compose queued for {host} while one waits")
        group = _Group(self._store, self._cache, host)
        left: list[ComposeJob] = []
        for job in jobs:
            if left:
                left.append(job)  # keep arrival order: one that could not join goes first
                continue
            staged = self._stage(job, group)
            if staged is None:
                continue  # finished: failed, or its GPUs or slots are taken (place again)
            if group.fits(staged[0].part):
                group.add(*staged)
            else:
                left.append(job)
        self._put_back(host, left)
        if group.staged:
            self._commit_staged(group)

    def _commit_one(self, job: ComposeJob) -> None:
        """Commit ``job`` alone and finish it; the caller holds its host's lock."""
        group = _Group(self._store, self._cache, job.host)
        staged = self._stage(job, group)
        if staged is not None:
            group.add(*staged)
            self._commit_staged(group)

    def _commit_staged(self, group: _Group) -> None:
        """Commit ``group`` and finish its jobs. If a compare fails, a lone job is
        answered from what came back; in a group each job commits again on its own, so
        each answer rests on its own compares only."""
        staged = group.staged
        txn = group.transaction()
        created: set[str] = set()
        for one in staged:
            created |= one.created
        try:
            with metrics.COMPOSE_STAGE_SECONDS.labels(stage="commit").time():
                committed = commit_staged(self._store, self._cache, txn, created=created)
            metrics.COMPOSE_GROUP_SIZE.observe(len(staged))
            if not committed.succeeded and len(staged) == 1:
                staged[0].job.finish(self._after_failed_compare(staged[0], committed))
                return
        except Exception as error:
            for one in staged:
                one.job.fail(error)
            return
        if not committed.succeeded:
            for one in staged:
                self._commit_one(one.job)
            return
        for one in staged:
            if one.audited is not None:
                one.audited()
            one.job.finish(one.node)

    def _after_failed_compare(self, staged: _Staged, failed: TxnResult) -> pb.VirtualNode | None:
        """A lone job's compare failed: the node of an earlier call with the same request
        id, AlreadyExists for a node name taken, else None (place again)."""
        job = staged.job
        request = job.request
        current = failed.current
        keys = self._store.keys
        if request.request_id:
            existing = self._node_for_request(
                request.request_id,
                request.spec,
                current.get(keys.request(request.request_id)),
                job.owner,
            )
            if existing is not None:
                return existing
        if current.get(keys.node(job.node_id)) is not None and request.node_id:
            raise AlreadyExists(
                f"node {staged.node.name} already exists; pick another node_id or omit it",
                reason="NODE_EXISTS",
            )
        return None

    # -- one job ------------------------------------------------------------------------

    def _stage(self, job: ComposeJob, group: _Group) -> tuple[_Staged, pb.HostAllocation] | None:
        """``job``'s part of ``group``'s transaction, and the host's allocation with it
        added; None, the job finished, when its GPUs, host slots or host resources are
        no longer free as placed (with None: place again) or staging raised (with the
        error). Runs in the placing call's context."""
        try:
            return job.context.run(self._stage_in_context, job, group)
        except Exception as error:
            job.fail(error)
            return None

    def _stage_in_context(
        self, job: ComposeJob, group: _Group
    ) -> tuple[_Staged, pb.HostAllocation] | None:
        request = job.request
        placement = job.result.placement
        assert placement is not None
        keys = self._store.keys
        host_name = f"hosts/{placement.host}"
        name = node_name(job.node_id)
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
            attach_deadline=timestamp(now + job.attach_timeout_s),
            owner=job.owner,
        )
        lifecycle.new_node_event(node, now)
        allocation = copy(group.allocation)
        if allocation.unschedulable:  # cordoned after the snapshot placement read
            job.finish(None)
            return None
        used = {a.host_slot for a in allocation.attachments}
        host_record = self._cache.hosts.get(placement.host)
        if not reserve_host_resources(
            host_record.value if host_record else None, allocation, request.spec, name
        ):
            job.finish(None)
            return None
        assigned = assign_gpus(self._cache, placement, node, allocation, used, request.spec.vfio)
        if assigned is None:
            job.finish(None)  # the snapshot was older than the cache; place again
            return None
        part = Txn()
        write_assigned(part, keys, assigned)
        created: set[str] = set()
        if request.spec.tenant:
            charge = charge_in(
                part, self._store, self._cache, request.spec.tenant, [b.model for b in node.gpus]
            )
            node.charged = True
            node.preemptible = charge.borrowed
            if charge.creates:
                created.add(charge.key)
        node_key = keys.node(job.node_id)
        expect(part, node_key, 0).put(node_key, node)
        created.add(node_key)
        if request.request_id:
            request_key = keys.request(request.request_id)
            expect(part, request_key, 0).put(request_key, name)
            created.add(request_key)
        # The call's audit record commits with the node (one etcd request, not two).
        audited = record_in(part, node)
        return _Staged(job, node, part, created, audited), allocation


__all__ = ["ComposeCommitter", "ComposeJob", "within_limit"]
