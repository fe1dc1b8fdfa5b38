"""Gangs with a record: all or nothing beyond one etcd transaction; queued gangs;
distinct hosts and one switch.

A gang too large for one transaction (etcd allows 128 operations; 11 members of 8 GPUs
fit), or one that waits in the queue, or asks for distinct hosts or one switch, has its
own record, ``gangs/{gang}`` (:class:`~dxpool.api.v1.resources_pb2.GangRecord`), and is
committed in chunks. The record is the one place that says whether the members form a
whole: the gang exists (VALID) from the single transaction that flips it, never
before, and a gang that is not VALID is rolled back.

1. **Place every member first** (:mod:`dxpool.broker.nodes.gang_placement`), each choice held
   in the placement index, so nothing is committed for a gang that does not fit.
2. **Create the record** RESERVING (or move a QUEUED one to RESERVING), with a
   ``reserve_deadline``, in one transaction with the request id.
3. **Commit the members in chunks**: each transaction holds as many members as fit
   etcd's limit, and compares every record the chunk relies on (each GPU FREE, each
   host's allocation and lease, each member's node key absent) **and the gang record**,
   which it writes with ``committed`` moved on and the deadline pushed back. Members are
   ordinary PENDING nodes ``{gang}-{i}``; their agents start attaching at once.
4. **Flip** the record to VALID in one transaction comparing it.

**Failure and broker loss.** A member that no longer fits, a commit that keeps
conflicting or a quota that no longer holds rolls the gang back: the record goes
ABORTING (compared), every member committed so far is released as ReleaseNode releases
(its GPUs scrubbed, detached and freed; its tenant discharged), in chunks, and the
record goes FAILED (or back to QUEUED for a queued gang whose wait is not over). A
broker that dies mid-way leaves a RESERVING record whose deadline then passes: the
leader's reaper rolls it back the same way. A broker that is only slow and comes back
after the reaper started finds the record changed: its next chunk's compare fails, and it
stops. The reaper and the flip compare the same record, so exactly one of them wins.

**Charging.** A gang is charged to one tenant (every member names the same one, or
none), as one kind (guaranteed or borrowed, :mod:`dxpool.broker.nodes.loaning`, judged for
all its GPUs together when its reservation starts). Each chunk charges its members in
its own transaction, comparing the tenant's record, so the quota holds at every step; a
quota no longer holding mid-way rolls the gang back.

**Release** of a VALID gang releases its members in chunks (a release need not be one
transaction: each member goes RELEASING on its own, as host loss does), and marks the
record RELEASED. The reaper deletes FAILED and RELEASED records (and their request ids)
once their members are gone and ``retention`` has passed.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass

from dxpool import lifecycle
from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes import loaning
from dxpool.broker.nodes.admission import ADMITTED, FAILED, GONE, WAITING, Outcome, tenant_changed
from dxpool.broker.nodes.compose import Composer
from dxpool.broker.nodes.compose_gate import ComposeGate
from dxpool.broker.nodes.enqueue import never_fits, short
from dxpool.broker.nodes.fit import (
    assign_gpus,
    placement_request,
    reserve_host_resources,
    write_assigned,
)
from dxpool.broker.nodes.gang_placement import GangPlacer, Members, MemberUnplaced
from dxpool.broker.nodes.tenants import breach, charged, new_tenant
from dxpool.broker.nodes.transitions import let_go
from dxpool.broker.nodes.validation import check_node_spec, check_queue_timeout
from dxpool.broker.placement import Placement, PlacementRequest
from dxpool.broker.state import metrics
from dxpool.broker.state.records import copy, seconds, timestamp
from dxpool.broker.state.stm import (
    CHUNK_ATTEMPTS,
    NOTE_ATTEMPTS,
    RELEASE_ATTEMPTS,
    TxnView,
    commit_staged,
    expect,
    expect_exists,
    joined,
    read_through,
    transact,
)
from dxpool.errors import (
    Aborted,
    AlreadyExists,
    DxpoolError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from dxpool.limits import MAX_GANG_MEMBERS, MAX_TXN_OPS
from dxpool.names import (
    check_id,
    check_request_id,
    gang_member_id,
    gang_name,
    node_name,
    parse_gang,
    parse_host,
)
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn, Versioned

log = logging.getLogger(__name__)

RESERVE_TIMEOUT_S = 60.0
"""How long a RESERVING gang may go without a chunk before the leader rolls it back."""
RELEASE_GPUS_PER_TXN = 56
"""A release chunk's members hold at most this many GPUs together (each GPU is a compare
and a write, beside each member's node and host allocation and the tenant)."""

_LIVE = (pb.GANG_STATE_QUEUED, pb.GANG_STATE_RESERVING, pb.GANG_STATE_VALID)


class _GangChangedError(Exception):
    """The gang record moved on under us (rolled back by the leader, released)."""


class _MemberStaleError(Exception):
    def __init__(self, member: int) -> None:
        super().__init__(member)
        self.member = member


def member_specs(gang: pb.GangRecord) -> list[pb.NodeSpec]:
    """Every member's spec, in member order."""
    if len(gang.members) == 1 and gang.size > 1:
        return [gang.members[0]] * gang.size
    return list(gang.members)


def gang_gpus(gang: pb.GangRecord) -> int:
    return sum(spec.gpus.count for spec in member_specs(gang))


def _not_found(name: str) -> NotFound:
    return NotFound(
        f"gang {name} does not exist; its members are listed by `dxpool node list`",
        reason="GANG_NOT_FOUND",
    )


@dataclass
class _Reservation:
    """One gang being committed by this broker."""

    gang_id: str
    specs: list[pb.NodeSpec]
    requests: list[PlacementRequest]
    members: Members
    owner: str
    request_id: str
    borrowed: bool
    revision: int = 0  # of the gang record, as last written by us
    record: pb.GangRecord | None = None


class ChunkedGangs:
    """ComposeGang, GetGang and ReleaseGang for gangs with a record, their admission
    from the queue, and the leader's reaper (see the module docstring). Thread-safe."""

    def __init__(
        self,
        composer: Composer,
        gate: ComposeGate,
        *,
        broker: str = "",
        reserve_timeout_s: float = RESERVE_TIMEOUT_S,
        retention_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._composer = composer
        self._store: Store = composer.store
        self._cache = composer.cache
        self._gate = gate
        self._broker = broker
        self._reserve_timeout_s = reserve_timeout_s
        self._retention_s = retention_s
        self._clock = clock
        self.transactions = 0  # etcd transactions committed or tried (a benchmark's count)

    @staticmethod
    def needs_record(request: nodes_pb2.ComposeGangRequest) -> bool:
        """Whether a ComposeGang request goes this way: queued, options, or too large
        for one transaction."""
        from dxpool.broker.nodes.gang import gang_ops

        return (
            request.queue
            or request.distinct_hosts
            or request.same_switch
            or gang_ops(request.members) > MAX_TXN_OPS
        )

    def has_record(self, name: str) -> bool:
        return (
            read_through(self._store, self._cache, self._cache.gangs, parse_gang(name)) is not None
        )

    # -- compose -------------------------------------------------------------------------

    def compose(self, request: nodes_pb2.ComposeGangRequest, owner: str = "") -> nodes_pb2.Gang:
        """Compose the gang now (VALID), or, with ``queue``, leave it QUEUED when it does
        not fit now. Raises as ComposeGang does; a gang that could not be committed
        whole is rolled back before the error is raised."""
        specs, requests = self._check(request)
        if request.request_id:
            existing = self._for_request(request, owner)
            if existing is not None:
                return existing
        gang_id = request.gang_id or f"gang-{secrets.token_hex(4)}"
        if request.gang_id and (
            self._cache.gangs.get(gang_id) is not None
            or self._cache.nodes.get(gang_member_id(gang_id, 0)) is not None
        ):
            raise _gang_exists(gang_id)
        tenant = specs[0].tenant
        total = sum(spec.gpus.count for spec in specs)
        try:
            self._admissible(specs, total)
            members = GangPlacer(self._composer.index, self._composer.latency.current()).place_all(
                requests,
                distinct_hosts=request.distinct_hosts,
                same_switch=request.same_switch,
            )
        except (ResourceExhausted, MemberUnplaced) as error:
            if not request.queue or (
                isinstance(error, ResourceExhausted)
                and error.reason not in ("NO_CAPACITY", "QUOTA_EXCEEDED", "LENDING_PAUSED")
            ):
                raise _refusal(error, specs) from None
            if isinstance(error, ResourceExhausted) and error.reason == "QUOTA_EXCEEDED":
                hopeless = never_fits(
                    tenant,
                    self._gate.tenant(tenant),
                    [s.gpus.model for s in specs for _ in range(s.gpus.count)],
                    len(specs),
                )
                if hopeless is not None:
                    raise hopeless from None
            return self._enqueue(request, gang_id, specs, owner, _why(error))
        reservation = _Reservation(
            gang_id,
            specs,
            requests,
            members,
            owner,
            request.request_id,
            loaning.terms(self._gate.tenant(tenant), total).borrowed if tenant else False,
        )
        try:
            existing = self._create(request, reservation)
            if existing is not None:
                return existing
            self._commit_members(reservation)
            return self._flip(reservation)
        finally:
            members.let_go()

    def _admissible(self, specs: list[pb.NodeSpec], total: int) -> None:
        """Quota (on the cache, confirmed at each chunk's commit) and the gate."""
        tenant = specs[0].tenant
        if tenant:
            models = [s.gpus.model for s in specs for _ in range(s.gpus.count)]
            error = breach(tenant, self._gate.tenant(tenant), models, nodes=len(specs))
            if error is not None:
                raise error
        self._gate.check(specs[0], total)

    def _check(
        self, request: nodes_pb2.ComposeGangRequest
    ) -> tuple[list[pb.NodeSpec], list[PlacementRequest]]:
        members = list(request.members)
        if not members:
            raise InvalidArgument(
                "members is empty: give at least one member spec", reason="INVALID_GANG"
            )
        if len(members) > MAX_GANG_MEMBERS:
            raise InvalidArgument(
                f"a gang has at most {MAX_GANG_MEMBERS} members; got {len(members)}: split "
                "the job, or use members with more GPUs each",
                reason="GANG_TOO_LARGE",
            )
        check_request_id(request.request_id)
        check_queue_timeout(request.queue, request.queue_timeout_s)
        if request.gang_id:
            check_id(request.gang_id, "gang")
            last = gang_member_id(request.gang_id, len(members) - 1)
            try:
                check_id(last, "node")
            except InvalidArgument:
                raise InvalidArgument(
                    f"gang_id {request.gang_id!r} is too long for {len(members)} members: "
                    f"member node ids such as {last!r} must be at most 63 characters",
                    reason="INVALID_NAME",
                ) from None
        requests = []
        for i, spec in enumerate(members):
            try:
                check_node_spec(spec)
            except InvalidArgument as error:
                raise InvalidArgument(
                    f"members[{i}]: {error.message}", reason=error.reason
                ) from None
            if spec.tenant != members[0].tenant or spec.priority != members[0].priority:
                raise InvalidArgument(
                    f"members[{i}] names tenant {spec.tenant!r} and priority {spec.priority}, "
                    f"members[0] {members[0].tenant!r} and {members[0].priority}: a queued, "
                    "large or distinct-host gang is charged to one tenant at one priority; "
                    "give every member the same",
                    reason="INVALID_GANG",
                )
            host = parse_host(spec.host) if spec.host else None
            if host is not None and self._cache.hosts.get(host) is None:
                raise NotFound(
                    f"members[{i}]: host {spec.host} is not registered; list hosts with "
                    "`dxpool host list` or leave the host out to let placement choose",
                    reason="HOST_NOT_FOUND",
                )
            requests.append(placement_request(spec, host))
        return members, requests

    # -- the record ------------------------------------------------------------------------

    def _record(
        self,
        gang_id: str,
        specs: Sequence[pb.NodeSpec],
        owner: str,
        request_id: str,
        state: pb.GangState.ValueType,
        request: nodes_pb2.ComposeGangRequest,
    ) -> pb.GangRecord:
        now = self._clock()
        record = pb.GangRecord(
            name=gang_name(gang_id),
            state=state,
            size=len(specs),
            request_id=request_id,
            owner=owner,
            distinct_hosts=request.distinct_hosts,
            same_switch=request.same_switch,
            create_time=timestamp(now),
            update_time=timestamp(now),
            broker=self._broker,
        )
        uniform = all(spec == specs[0] for spec in specs)
        record.members.extend([specs[0]] if uniform else specs)
        return record

    def _enqueue(
        self,
        request: nodes_pb2.ComposeGangRequest,
        gang_id: str,
        specs: list[pb.NodeSpec],
        owner: str,
        why: str,
    ) -> nodes_pb2.Gang:
        record = self._record(
            gang_id, specs, owner, request.request_id, pb.GANG_STATE_QUEUED, request
        )
        now = self._clock()
        record.queue.enqueue_time.CopyFrom(timestamp(now))
        if request.queue_timeout_s:
            record.queue.deadline.CopyFrom(timestamp(now + request.queue_timeout_s))
        record.queue.reason = short(why)
        record.message = short(f"waiting in the queue: {why}")
        tenant_id = specs[0].tenant

        def body(view: TxnView) -> pb.GangRecord:
            if request.request_id and view.requests.get(request.request_id) is not None:
                raise _RetryLookup
            if view.gangs.get(gang_id) is not None:
                raise _gang_exists(gang_id)
            if tenant_id:
                cached = self._cache.tenants.get(tenant_id)
                if cached is not None and cached.value.uid:
                    record.queue.tenant_uid = cached.value.uid
                else:
                    found = view.tenants.get(tenant_id)
                    tenant = copy(found.value) if found is not None else new_tenant(tenant_id)
                    if not tenant.uid:
                        tenant.uid = new_tenant(tenant_id).uid
                    view.put(k.TENANTS, tenant_id, tenant)
                    record.queue.tenant_uid = tenant.uid
            view.put(k.GANGS, gang_id, record)
            if request.request_id:
                view.put(k.REQUESTS, request.request_id, record.name)
            return record

        try:
            stored = transact(
                self._store, self._cache, body, what=f"queueing gangs/{gang_id}", audited=True
            )
        except _RetryLookup:
            existing = self._for_request(request, owner)
            if existing is None:
                raise
            return existing
        return self._answer(stored)

    def _create(
        self, request: nodes_pb2.ComposeGangRequest, reservation: _Reservation
    ) -> nodes_pb2.Gang | None:
        """The RESERVING record and the request id, in one transaction; the gang an
        earlier call with the request id made, when one did meanwhile."""
        record = self._record(
            reservation.gang_id,
            reservation.specs,
            reservation.owner,
            reservation.request_id,
            pb.GANG_STATE_RESERVING,
            request,
        )
        record.reserve_deadline.CopyFrom(timestamp(self._clock() + self._reserve_timeout_s))
        record.message = f"committing {record.size} members"
        keys = self._store.keys
        gang_key = keys.gang(reservation.gang_id)
        txn = expect(Txn(), gang_key, 0).put(gang_key, record)
        if reservation.request_id:
            request_key = keys.request(reservation.request_id)
            expect(txn, request_key, 0).put(request_key, record.name)
        result = self._commit(txn)
        if not result:
            existing = self._for_request(request, reservation.owner) if request.request_id else None
            if existing is not None:
                return existing
            raise _gang_exists(reservation.gang_id)
        reservation.record = record
        reservation.revision = result
        return None

    def _commit(self, txn: Txn, *, created: set[str] | None = None) -> int:
        """Commit ``txn``; its revision, or 0 when a compare failed (the cache then
        holds what failed)."""
        self.transactions += 1
        committed = commit_staged(self._store, self._cache, txn, created=created)
        return committed.revision if committed.succeeded else 0

    # -- chunks ------------------------------------------------------------------------------

    def _commit_members(self, reservation: _Reservation) -> None:
        """Commit every member in chunks; raises (after rolling back) when it cannot."""
        start = reservation.record.committed if reservation.record is not None else 0
        try:
            while start < len(reservation.specs):
                start += self._commit_chunk(reservation, start)
        except _GangChangedError:
            raise Aborted(
                f"gang gangs/{reservation.gang_id} was rolled back while it was being "
                "committed (its reservation took longer than the leader allows, or it was "
                "released); compose it again",
                reason="GANG_ROLLED_BACK",
            ) from None
        except MemberUnplaced as error:
            self.rollback(
                reservation.gang_id,
                f"member {error.index} no longer fits: {'; '.join(error.reasons)}",
            )
            raise ResourceExhausted(
                f"gang gangs/{reservation.gang_id} was rolled back: member {error.index} of "
                f"{len(reservation.specs)} no longer fits ({'; '.join(error.reasons)}). "
                "Nothing is left of it; retry, ask for fewer members or GPUs, or queue it",
                reason="NO_CAPACITY",
            ) from None
        except DxpoolError as error:
            self.rollback(reservation.gang_id, f"could not be committed: {error.message}")
            raise

    def _commit_chunk(self, reservation: _Reservation, start: int) -> int:
        """Commit members ``start``.. as many as one transaction holds; how many."""
        for _ in range(CHUNK_ATTEMPTS):
            try:
                txn, count, created = self._chunk(reservation, start)
            except _MemberStaleError as stale:
                self._replace(reservation, stale.member)
                continue
            revision = self._commit(txn, created=created)
            if revision:
                reservation.revision = revision
                metrics.GANG_CHUNKS.labels(result="committed").inc()
                return count
            metrics.GANG_CHUNKS.labels(result="conflict").inc()
            current = self._cache.gangs.get(reservation.gang_id)
            if current is None or current.mod_revision != reservation.revision:
                raise _GangChangedError
            for member in range(start, start + count):
                if self._taken(reservation, member):
                    self._replace(reservation, member)
        raise Aborted(
            f"committing gang gangs/{reservation.gang_id} kept conflicting with concurrent "
            "requests",
            reason="COMMIT_CONFLICT",
        )

    def _replace(self, reservation: _Reservation, member: int) -> None:
        """Place member ``member`` again (its GPUs or slots were taken meanwhile)."""
        placer = GangPlacer(self._composer.index, self._composer.latency.current())
        record = reservation.record
        placer.place_one(
            reservation.members,
            member,
            reservation.requests[member],
            distinct_hosts=bool(record and record.distinct_hosts),
        )

    def _taken(self, reservation: _Reservation, member: int) -> bool:
        placement = reservation.members.placements[member]
        if placement is None:
            return True
        for binding in placement.bindings:
            gpu = self._cache.gpus.get(f"{binding.box}/{binding.slot}")
            if gpu is None or not lifecycle.is_free(gpu.value):
                return True
        allocation = self._cache.host_allocations.get(placement.host)
        used = {a.host_slot for a in allocation.value.attachments} if allocation else set()
        return any(b.host_slot in used for b in placement.bindings) or bool(
            allocation and allocation.value.unschedulable
        )

    def _chunk(self, reservation: _Reservation, start: int) -> tuple[Txn, int, set[str]]:
        """The transaction committing members ``start``.., as many as fit."""
        keys = self._store.keys
        now = self._clock()
        allocations: dict[str, tuple[pb.HostAllocation, int, set[int]]] = {}
        parts: list[Txn] = []
        nodes: list[tuple[str, pb.VirtualNode]] = []
        models: list[str] = []
        ops = 2  # compares, writes and reads on failure alike: the gang's and the tenant's
        member = start
        while member < len(reservation.specs):
            spec = reservation.specs[member]
            placement = reservation.members.placements[member]
            if placement is None:
                raise _MemberStaleError(member)
            new_host = placement.host not in allocations
            cost = len(placement.bindings) + 1 + (2 if new_host else 0)
            if ops + cost > MAX_TXN_OPS:
                break
            if new_host:
                record = self._cache.host_allocations.get(placement.host)
                allocation = (
                    copy(record.value)
                    if record is not None
                    else pb.HostAllocation(host=f"hosts/{placement.host}")
                )
                allocations[placement.host] = (
                    allocation,
                    record.mod_revision if record is not None else 0,
                    {a.host_slot for a in allocation.attachments},
                )
            allocation, _, used = allocations[placement.host]
            node, part = self._member(reservation, member, spec, placement, allocation, used, now)
            parts.append(part)
            nodes.append((node.name.removeprefix("nodes/"), node))
            models.extend(binding.model for binding in node.gpus)
            ops += cost
            member += 1
        count = member - start
        if count == 0:
            raise InvalidArgument(
                f"member {start} alone needs more operations than one etcd transaction allows",
                reason="GANG_TOO_LARGE",
            )
        txn = _assembled(parts, allocations, keys)
        created = {keys.node(node_id) for node_id, _ in nodes}
        gang = copy(reservation.record) if reservation.record is not None else pb.GangRecord()
        gang.committed = start + count
        gang.update_time.CopyFrom(timestamp(now))
        gang.reserve_deadline.CopyFrom(timestamp(now + self._reserve_timeout_s))
        gang.message = f"committed {gang.committed} of {gang.size} members"
        gang_key = keys.gang(reservation.gang_id)
        expect(txn, gang_key, reservation.revision).put(gang_key, gang)
        tenant_id = reservation.specs[0].tenant
        if tenant_id:
            self._charge(txn, reservation, tenant_id, models, count, created)
        reservation.record = gang
        return txn, count, created

    def _member(
        self,
        reservation: _Reservation,
        member: int,
        spec: pb.NodeSpec,
        placement: Placement,
        allocation: pb.HostAllocation,
        used: set[int],
        now: float,
    ) -> tuple[pb.VirtualNode, Txn]:
        name = node_name(gang_member_id(reservation.gang_id, member))
        host_record = self._cache.hosts.get(placement.host)
        if allocation.unschedulable or not reserve_host_resources(
            host_record.value if host_record else None, allocation, spec, name
        ):
            raise _MemberStaleError(member)
        node = pb.VirtualNode(
            name=name,
            spec=spec,
            host=f"hosts/{placement.host}",
            state=pb.NODE_STATE_PENDING,
            message="waiting for the host agent to attach the GPUs",
            request_id=reservation.request_id,
            create_time=timestamp(now),
            update_time=timestamp(now),
            attach_deadline=timestamp(now + self._composer.settings.attach_timeout_s),
            owner=reservation.owner,
            gang=gang_name(reservation.gang_id),
            gang_size=len(reservation.specs),
        )
        assigned = assign_gpus(self._cache, placement, node, allocation, used, spec.vfio)
        if assigned is None:
            raise _MemberStaleError(member)
        if spec.tenant:
            node.charged = True
            node.preemptible = reservation.borrowed
        lifecycle.new_node_event(node, now)
        part = Txn()
        write_assigned(part, self._store.keys, assigned)
        key = self._store.keys.node(name.removeprefix("nodes/"))
        expect(part, key, 0).put(key, node)
        return node, part

    def _charge(
        self,
        txn: Txn,
        reservation: _Reservation,
        tenant_id: str,
        models: list[str],
        nodes: int,
        created: set[str],
    ) -> None:
        record = self._cache.tenants.get(tenant_id)
        tenant = record.value if record is not None else None
        error = breach(tenant_id, tenant, models, nodes=nodes, borrowed=reservation.borrowed)
        if error is not None:
            raise error
        updated = copy(tenant) if tenant is not None else new_tenant(tenant_id)
        updated.usage.CopyFrom(
            charged(updated.usage, models, nodes=nodes, borrowed=reservation.borrowed)
        )
        key = self._store.keys.tenant(tenant_id)
        expect(txn, key, record.mod_revision if record is not None else 0).put(key, updated)
        if record is None:
            created.add(key)

    def _flip(self, reservation: _Reservation) -> nodes_pb2.Gang:
        """RESERVING -> VALID in one transaction comparing the record."""
        assert reservation.record is not None
        gang = copy(reservation.record)
        gang.state = pb.GANG_STATE_VALID
        gang.message = f"all {gang.size} members committed"
        gang.update_time.CopyFrom(timestamp(self._clock()))
        gang.ClearField("reserve_deadline")
        key = self._store.keys.gang(reservation.gang_id)
        txn = expect(Txn(), key, reservation.revision).put(key, gang)
        if not self._commit(txn, created=set()):
            raise Aborted(
                f"gang gangs/{reservation.gang_id} was rolled back before it became valid; "
                "compose it again",
                reason="GANG_ROLLED_BACK",
            )
        log.info("gang valid", extra={"gang": gang.name, "members": gang.size})
        return self._answer(gang)

    # -- rollback ---------------------------------------------------------------------------

    def rollback(self, gang_id: str, message: str) -> None:
        """RESERVING -> ABORTING, every committed member released, -> FAILED (or back to
        QUEUED for a queued gang still within its wait). Safe to run twice, and from any
        broker: each step compares the record."""

        def to_aborting(view: TxnView) -> pb.GangRecord | None:
            record = view.gangs.get(gang_id)
            if record is None or record.value.state not in (
                pb.GANG_STATE_RESERVING,
                pb.GANG_STATE_ABORTING,
            ):
                return None
            gang = copy(record.value)
            if gang.state != pb.GANG_STATE_ABORTING:
                gang.state = pb.GANG_STATE_ABORTING
                gang.message = f"rolling back: {message}"
                gang.update_time.CopyFrom(timestamp(self._clock()))
                gang.reserve_deadline.CopyFrom(timestamp(self._clock() + self._reserve_timeout_s))
                view.put(k.GANGS, gang_id, gang)
            return gang

        gang = transact(self._store, self._cache, to_aborting, what=f"rolling back {gang_id}")
        if gang is None:
            return
        self._release_members(gang_id, gang.size, f"gang rolled back: {message}")
        requeue = gang.HasField("queue") and gang.queue.HasField("enqueue_time")

        def finish(view: TxnView) -> None:
            record = view.gangs.get(gang_id)
            if record is None or record.value.state != pb.GANG_STATE_ABORTING:
                return
            done = copy(record.value)
            now = self._clock()
            expired = done.queue.HasField("deadline") and now > seconds(done.queue.deadline)
            if requeue and not expired:
                done.state = pb.GANG_STATE_QUEUED
                done.queue.reason = short(f"queued again after a rollback: {message}")
                done.message = done.queue.reason
            else:
                done.state = pb.GANG_STATE_FAILED
                done.message = short(f"rolled back: {message}")
            done.committed = 0
            done.ClearField("reserve_deadline")
            done.update_time.CopyFrom(timestamp(now))
            view.put(k.GANGS, gang_id, done)

        transact(self._store, self._cache, finish, what=f"rolling back {gang_id}")
        log.warning("gang rolled back", extra={"gang": gang_id, "reason": message})

    def _release_members(
        self, gang_id: str, size: int, message: str, *, fence: bool = False
    ) -> None:
        """Release every live member ``{gang}-{i}``, i < size, in chunks (``fence``: as a
        force release, the GPUs fenced at the box side)."""
        batch: list[str] = []
        gpus = 0
        for i in range(size):
            node_id = gang_member_id(gang_id, i)
            record = read_through(self._store, self._cache, self._cache.nodes, node_id)
            if record is None or record.value.state in (
                pb.NODE_STATE_RELEASING,
                pb.NODE_STATE_RELEASED,
            ):
                continue
            if batch and gpus + len(record.value.gpus) > RELEASE_GPUS_PER_TXN:
                self._release_batch(batch, message, fence)
                batch, gpus = [], 0
            batch.append(node_id)
            gpus += len(record.value.gpus)
        if batch:
            self._release_batch(batch, message, fence)

    def _release_batch(self, node_ids: list[str], message: str, fence: bool) -> None:
        def body(view: TxnView) -> None:
            for node_id in node_ids:
                record = view.nodes.get(node_id)
                if record is None or record.value.state in (
                    pb.NODE_STATE_RELEASING,
                    pb.NODE_STATE_RELEASED,
                ):
                    continue
                let_go(
                    view, record.value, pb.NODE_STATE_RELEASING, message, self._clock(), fence=fence
                )

        self.transactions += 1
        transact(
            self._store,
            self._cache,
            body,
            attempts=RELEASE_ATTEMPTS,
            what="releasing gang members",
        )

    # -- queued gangs -------------------------------------------------------------------------

    def queued(self, gang_id: str) -> pb.GangRecord | None:
        record = self._cache.gangs.get(gang_id)
        if record is None or record.value.state != pb.GANG_STATE_QUEUED:
            return None
        gang = record.value
        return gang

    def admit_queued(self, gang_id: str) -> Outcome:
        """Try to compose the QUEUED gang ``gang_id`` now (for the dispatcher)."""
        record = self._cache.gangs.get(gang_id)
        if record is None or record.value.state != pb.GANG_STATE_QUEUED:
            return Outcome(GONE)
        gang = record.value
        now = self._clock()
        specs = member_specs(gang)
        tenant = specs[0].tenant if specs else ""
        if gang.queue.HasField("deadline") and now > seconds(gang.queue.deadline):
            return self._fail_queued(gang_id, "not composed within its queue timeout")
        if tenant and tenant_changed(gang.queue.tenant_uid, self._gate.tenant(tenant)):
            return self._fail_queued(
                gang_id, f"tenant {tenant} was deleted while the gang waited; nothing charged"
            )
        total = sum(s.gpus.count for s in specs)
        try:
            self._admissible(specs, total)
        except ResourceExhausted as error:
            return Outcome(WAITING, error.message)
        requests = [placement_request(s, parse_host(s.host) if s.host else None) for s in specs]
        try:
            members = GangPlacer(self._composer.index, self._composer.latency.current()).place_all(
                requests, distinct_hosts=gang.distinct_hosts, same_switch=gang.same_switch
            )
        except MemberUnplaced as error:
            return Outcome(
                WAITING,
                f"no capacity: member {error.index} of {len(specs)}: {'; '.join(error.reasons)}",
                capacity=True,
                placed=True,
            )
        reservation = _Reservation(
            gang_id,
            specs,
            requests,
            members,
            gang.owner,
            gang.request_id,
            loaning.terms(self._gate.tenant(tenant), total).borrowed if tenant else False,
        )
        try:
            if not self._start_queued(reservation, record):
                return Outcome(GONE, placed=True)
            self._commit_members(reservation)
            self._flip(reservation)
        except DxpoolError as error:
            return Outcome(
                WAITING, error.message, capacity=error.reason == "NO_CAPACITY", placed=True
            )
        finally:
            members.let_go()
        return Outcome(ADMITTED, placed=True)

    def _start_queued(self, reservation: _Reservation, record: Versioned[pb.GangRecord]) -> bool:
        gang = copy(record.value)
        gang.state = pb.GANG_STATE_RESERVING
        now = self._clock()
        gang.reserve_deadline.CopyFrom(timestamp(now + self._reserve_timeout_s))
        gang.update_time.CopyFrom(timestamp(now))
        gang.message = f"committing {gang.size} members"
        gang.broker = self._broker
        gang.queue.reclaiming = False
        del gang.queue.preempting[:]
        key = self._store.keys.gang(reservation.gang_id)
        txn = expect(Txn(), key, record.mod_revision).put(key, gang)
        revision = self._commit(txn, created=set())
        if not revision:
            return False
        reservation.record = gang
        reservation.revision = revision
        return True

    def _fail_queued(self, gang_id: str, message: str) -> Outcome:
        def body(view: TxnView) -> bool:
            record = view.gangs.get(gang_id)
            if record is None or record.value.state != pb.GANG_STATE_QUEUED:
                return False
            gang = copy(record.value)
            gang.state = pb.GANG_STATE_FAILED
            gang.message = message
            gang.queue.reclaiming = False
            gang.update_time.CopyFrom(timestamp(self._clock()))
            view.put(k.GANGS, gang_id, gang)
            return True

        failed = transact(self._store, self._cache, body, what=f"failing gangs/{gang_id}")
        return Outcome(FAILED, message) if failed else Outcome(GONE)

    def note_queued(self, gang_id: str, reason: str, *, reclaiming: bool | None = None) -> bool:
        reason = short(reason)

        def body(view: TxnView) -> bool:
            record = view.gangs.get(gang_id)
            if record is None or record.value.state != pb.GANG_STATE_QUEUED:
                return False
            gang = record.value
            wanted = gang.queue.reclaiming if reclaiming is None else reclaiming
            if gang.queue.reason == reason and gang.queue.reclaiming == wanted:
                return False
            updated = copy(gang)
            updated.queue.reason = reason
            updated.queue.reclaiming = wanted
            updated.message = short(f"waiting in the queue: {reason}")
            view.put(k.GANGS, gang_id, updated)
            return True

        with suppress(DxpoolError):
            return transact(
                self._store, self._cache, body, attempts=NOTE_ATTEMPTS, what="noting a gang"
            )
        return False

    # -- the leader's reaper --------------------------------------------------------------------

    def reap(self) -> None:
        """Roll back gangs whose broker went away (RESERVING or ABORTING past their
        deadline), and delete FAILED and RELEASED records whose members are gone once
        ``retention`` has passed."""
        now = self._clock()
        for gang_id, record in self._cache.gangs.items():
            gang = record.value
            if gang.state in (pb.GANG_STATE_RESERVING, pb.GANG_STATE_ABORTING):
                if gang.HasField("reserve_deadline") and now > seconds(gang.reserve_deadline):
                    self.rollback(
                        gang_id,
                        gang.message.removeprefix("rolling back: ")
                        if gang.state == pb.GANG_STATE_ABORTING
                        else f"its broker {gang.broker or '(unknown)'} stopped committing it "
                        f"after {gang.committed} of {gang.size} members",
                    )
            elif (
                gang.state in (pb.GANG_STATE_FAILED, pb.GANG_STATE_RELEASED)
                and now - seconds(gang.update_time) > self._retention_s
            ):
                self._collect(gang_id, gang)

    def _collect(self, gang_id: str, gang: pb.GangRecord) -> None:
        for i in range(gang.size):
            if self._cache.nodes.get(gang_member_id(gang_id, i)) is not None:
                return  # members still there; garbage collection of nodes comes first

        def body(view: TxnView) -> None:
            record = view.gangs.get(gang_id)
            if record is None or record.value.state not in (
                pb.GANG_STATE_FAILED,
                pb.GANG_STATE_RELEASED,
            ):
                return
            view.delete(k.GANGS, gang_id)
            request_id = record.value.request_id
            if request_id:
                used = view.requests.get(request_id)
                if used is not None and bytes(used.value).decode() == record.value.name:
                    view.delete(k.REQUESTS, request_id)

        transact(self._store, self._cache, body, what=f"collecting gangs/{gang_id}")

    # -- read and release -------------------------------------------------------------------------

    def _answer(self, gang: pb.GangRecord) -> nodes_pb2.Gang:
        gang_id = parse_gang(gang.name)
        answer = nodes_pb2.Gang(
            name=gang.name, state=gang.state, message=gang.message, size=gang.size
        )
        answer.queue.CopyFrom(gang.queue)
        if gang.state in (pb.GANG_STATE_QUEUED, pb.GANG_STATE_FAILED) and not gang.committed:
            return answer
        for i in range(gang.size):
            record = self._cache.nodes.get(gang_member_id(gang_id, i))
            if record is not None:
                answer.nodes.append(record.value)
        return answer

    def get(self, name: str, *, owner: str | None = None) -> nodes_pb2.Gang:
        gang_id = parse_gang(name)
        record = read_through(self._store, self._cache, self._cache.gangs, gang_id)
        if record is None or (owner is not None and record.value.owner != owner):
            raise _not_found(name)
        return self._answer(record.value)

    def release(
        self, name: str, *, force: bool = False, owner: str | None = None
    ) -> nodes_pb2.Gang:
        """Cancel a queued gang, roll back a reserving one, release a valid one's members
        (in chunks); the record ends RELEASED (a FAILED one stays FAILED). Idempotent."""
        gang_id = parse_gang(name)
        record = read_through(self._store, self._cache, self._cache.gangs, gang_id)
        if record is None or (owner is not None and record.value.owner != owner):
            raise _not_found(name)
        gang = record.value
        if gang.state in (pb.GANG_STATE_RESERVING, pb.GANG_STATE_ABORTING):
            self.rollback(gang_id, "released by its owner")
        if gang.state == pb.GANG_STATE_VALID or force:
            self._release_members(gang_id, gang.size, "release of the gang requested", fence=force)

        def body(view: TxnView) -> pb.GangRecord | None:
            current = view.gangs.get(gang_id)
            if current is None:
                return None
            found = current.value
            if found.state in (pb.GANG_STATE_RELEASED, pb.GANG_STATE_FAILED):
                return found
            done = copy(found)
            done.state = pb.GANG_STATE_RELEASED
            done.message = "released by its owner"
            done.queue.reclaiming = False
            done.update_time.CopyFrom(timestamp(self._clock()))
            view.put(k.GANGS, gang_id, done)
            return done

        released = transact(self._store, self._cache, body, what=f"releasing {name}", audited=True)
        if released is None:
            raise _not_found(name)
        metrics.RELEASE_TOTAL.inc()
        return self._answer(released)

    def _for_request(
        self, request: nodes_pb2.ComposeGangRequest, owner: str
    ) -> nodes_pb2.Gang | None:
        used = read_through(self._store, self._cache, self._cache.requests, request.request_id)
        if used is None:
            return None
        name = bytes(used.value).decode()
        if not name.startswith("gangs/"):
            raise AlreadyExists(
                f"request_id {request.request_id!r} was already used for {name}; use a new "
                "request_id for a new gang",
                reason="REQUEST_ID_REUSED",
            )
        record = read_through(self._store, self._cache, self._cache.gangs, parse_gang(name))
        if record is None:
            raise FailedPrecondition(
                f"request_id {request.request_id!r} was used for {name}, which no longer "
                "exists; use a new request_id",
                reason="REQUEST_ID_REUSED",
            )
        gang = record.value
        if gang.owner != owner or member_specs(gang) != list(request.members):
            raise AlreadyExists(
                f"request_id {request.request_id!r} was already used for a different request "
                f"({name}); use a new request_id for a new gang",
                reason="REQUEST_ID_REUSED",
            )
        return self._answer(gang)


class _RetryLookup(Exception):  # noqa: N818 - a signal inside one call
    pass


def _assembled(
    parts: list[Txn],
    allocations: dict[str, tuple[pb.HostAllocation, int, set[int]]],
    keys: KeySchema,
) -> Txn:
    """One transaction of the members' ``parts`` and every host's allocation (compared
    at the revision read) and lease (present)."""
    txn = joined(parts)
    for host, (allocation, revision, _) in sorted(allocations.items()):
        key = keys.host_allocation(host)
        expect(txn, key, revision).put(key, allocation)
        expect_exists(txn, keys.host_lease(host))
    return txn


def _why(error: BaseException) -> str:
    if isinstance(error, MemberUnplaced):
        return f"no capacity: member {error.index}: {'; '.join(error.reasons)}"
    if isinstance(error, DxpoolError):
        return error.message
    return str(error)


def _refusal(error: BaseException, specs: list[pb.NodeSpec]) -> BaseException:
    if isinstance(error, MemberUnplaced):
        return ResourceExhausted(
            f"no placement for gang member {error.index} of {len(specs)} "
            f"({specs[error.index].gpus.model or 'any'}:{specs[error.index].gpus.count} GPUs): "
            f"{'; '.join(error.reasons)}. Nothing was committed. Ask for fewer members or "
            "GPUs, relax the options, release nodes, or compose with queue to wait",
            reason="NO_CAPACITY",
        )
    return error


def _gang_exists(gang_id: str) -> AlreadyExists:
    return AlreadyExists(
        f"gang gangs/{gang_id} (or a node named like its members, nodes/{gang_id}-N) "
        "already exists; pick another gang_id or omit it",
        reason="GANG_EXISTS",
    )


__all__ = ["RESERVE_TIMEOUT_S", "ChunkedGangs", "gang_gpus", "member_specs"]
