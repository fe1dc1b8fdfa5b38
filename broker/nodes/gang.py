"""ComposeGang, GetGang and ReleaseGang: several nodes all or nothing.

A gang is a job larger than one host: N member nodes that are useful only together.

Placement chooses every member against ONE snapshot of the pool, member by member, each
member's GPUs and host slots taken out of the snapshot before the next member is placed
(:func:`without_placement`), so the members never compete for the same GPU or slot.
Then ONE etcd transaction commits the whole gang: it compares every record placement
relied on (each chosen GPU unchanged since it was read FREE, each host's allocation, each
host's lease present, every member's node key and the request id absent) and writes
every GPU, every host allocation, every member node and the request index. Either every
member exists afterwards or none does, with several brokers on one etcd too. A failed
compare refreshes the cache from the same round trip and the whole gang is placed
again, a bounded number of times.

etcd refuses a transaction of more than 128 compares, so a gang must fit in one: its
GPUs plus 3 per member (node key, host allocation, host lease) plus 1 (request id) may
be at most :data:`~dxpool.limits.MAX_TXN_OPS`. A larger gang is refused with
INVALID_ARGUMENT before anything is read: splitting it over several transactions would
give up all or nothing.

Members are ordinary nodes named ``nodes/{gang}-{i}``, carrying ``gang`` and
``gang_size``. After the commit each goes its own way through the node state machine:
a member whose host dies becomes LOST (its GPUs are fenced) and the other members keep
their state; the gang then can never be whole again, :meth:`GangComposer.get` shows which
member broke, and the caller releases the gang. We do not tear the other members down by
ourselves: the caller may prefer to keep them (a job that restarts from a checkpoint on
a replacement) and a release is one call away.

Members charged to a tenant (``spec.tenant``; a tenant caller's own, see
``broker/api/node_service.py``) are charged in the same transaction, as ComposeNode charges
one node: each tenant's record is compared, its quota checked against the usage read
plus every member charged to it (all GPUs and all member nodes together), and the raised
usage written. A gang that does not fit its tenant's quota as a whole is refused with
QUOTA_EXCEEDED and nothing is written. Each tenant adds one compare to the bound above.

CPU cores and memory the member specs ask of their hosts are reserved in the hosts'
allocations, each member's on top of those before it (members may share a host), and
checked against the very allocation the transaction compares.

Releasing a gang releases every member in one transaction, each as ReleaseNode does
(its GPUs kept in the host's allocation marked ``release`` until the agent reports them
scrubbed, its tenant's usage lowered).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import immutables

from dxpool import lifecycle
from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.fit import (
    assign_gpus,
    placement_request,
    reserve_host_resources,
    write_assigned,
)
from dxpool.broker.nodes.forget import free_released_names
from dxpool.broker.nodes.model_check import check_model_known
from dxpool.broker.nodes.tenants import charge_in, refuse_breach
from dxpool.broker.nodes.transitions import fence_detaching, let_go
from dxpool.broker.nodes.validation import check_node_spec
from dxpool.broker.placement import (
    Placement,
    PlacementRequest,
    Snapshot,
    place,
)
from dxpool.broker.state import metrics
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.locks import KeyedLocks
from dxpool.broker.state.records import copy, timestamp
from dxpool.broker.state.stm import (
    RELEASE_ATTEMPTS,
    TxnView,
    commit_staged,
    expect,
    expect_exists,
    pause_after_conflict,
    read_through,
    transact,
)
from dxpool.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from dxpool.fabric.latency import LatencyModel, LatencySource, as_source
from dxpool.limits import MAX_TXN_OPS
from dxpool.names import (
    check_id,
    check_request_id,
    gang_member_id,
    gang_name,
    node_name,
    parse_gang,
    parse_host,
)
from dxpool.request import format_duration_ns
from dxpool.store.typed import Store, Txn, Versioned

if TYPE_CHECKING:
    from dxpool.broker.nodes.compose_settings import ComposeSettings
    from dxpool.broker.state.placement_index import PlacementIndex

log = logging.getLogger(__name__)

__all__ = ["GangComposer", "gang_ops", "without_placement"]

_K = TypeVar("_K")
_V = TypeVar("_V")

OPS_PER_MEMBER = 3
"""Compares a member adds besides its GPUs: its node key and, at worst, its own host's
allocation and lease."""


def gang_ops(members: list[pb.NodeSpec] | Any) -> int:
    """The most compares the gang's transaction needs: every GPU, 3 per member, one per
    tenant charged, and the request id. A bound, since members sharing a host share its
    two compares."""
    tenants = {spec.tenant for spec in members if spec.tenant}
    return (
        sum(spec.gpus.count for spec in members) + OPS_PER_MEMBER * len(members) + len(tenants) + 1
    )


def _replaced(mapping: Mapping[_K, _V], key: _K, value: _V) -> Mapping[_K, _V]:
    """``mapping`` with ``key`` set to ``value``, leaving ``mapping`` unchanged."""
    if isinstance(mapping, immutables.Map):
        return mapping.set(key, value)
    return {**mapping, key: value}


def without_placement(
    snapshot: Snapshot, placement: Placement, cpu_cores: int = 0, memory_mib: int = 0
) -> Snapshot:
    """``snapshot`` with ``placement``'s GPUs no longer free, its host slots in use and
    ``cpu_cores`` and ``memory_mib`` of its host reserved.

    The result stands alone (no journal), so placement judges it from scratch; the
    snapshot given is left as it was."""
    hosts = snapshot.hosts
    host = hosts[placement.host]
    slots = frozenset(b.host_slot for b in placement.bindings)
    hosts = _replaced(
        hosts,
        placement.host,
        replace(
            host,
            used_slots=host.used_slots | slots,
            used_cpu_cores=host.used_cpu_cores + cpu_cores,
            used_memory_mib=host.used_memory_mib + memory_mib,
        ),
    )
    taken: dict[str, set[int]] = {}
    for binding in placement.bindings:
        taken.setdefault(binding.box, set()).add(binding.slot)
    gpus_by_box = snapshot.gpus_by_box
    for box, box_slots in taken.items():
        gpus = tuple(replace(g, free=False) if g.slot in box_slots else g for g in gpus_by_box[box])
        gpus_by_box = _replaced(gpus_by_box, box, gpus)
    return Snapshot(boxes=snapshot.boxes, hosts=hosts, gpus_by_box=gpus_by_box)


class GangComposer:
    """Composes, reads and releases gangs. Thread-safe; no state of its own.

    Made by :meth:`Composer.gangs`. ``host_locks`` and ``tenant_locks`` must be the
    composer's, so that composes, releases and gangs that touch one host in this broker
    change its allocation one at a time, and those of one tenant its usage. A gang takes
    the locks of all its hosts in sorted order, then those of its tenants in sorted
    order; everything else holds at most one host lock and then one tenant lock, so no
    two callers can wait for each other."""

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

    # -- compose ---------------------------------------------------------------------

    def compose(self, request: nodes_pb2.ComposeGangRequest, owner: str = "") -> nodes_pb2.Gang:
        """Place and commit every member, or none; see the module docstring.

        Raises InvalidArgument (malformed, or too large for one transaction),
        ResourceExhausted (some member does not fit, or QUOTA_EXCEEDED: the gang does
        not fit its tenant's quota; nothing written), FailedPrecondition (a model the
        pool does not have), AlreadyExists (member names taken, request id used for
        something else), NotFound (unknown pinned host), Aborted (the commit kept
        conflicting).

        A request whose gang was already committed gets that gang, also when the
        tenant's quota is full by now (that gang is what fills it): a quota refusal of a
        call with a request id first looks the id up in etcd."""
        try:
            return self._compose(request, owner)
        except ResourceExhausted as error:
            if error.reason != "QUOTA_EXCEEDED" or not request.request_id:
                raise
            record = read_through(
                self._store, self._cache, self._cache.requests, request.request_id
            )
            existing = self._gang_for_request(request, record, owner)
            if existing is None:
                raise
            return existing

    def _compose(self, request: nodes_pb2.ComposeGangRequest, owner: str) -> nodes_pb2.Gang:
        requests = self._check(request)
        if request.request_id:
            existing = self._gang_for_request(
                request, self._cache.requests.get(request.request_id), owner
            )
            if existing is not None:
                return existing
        gang_id = request.gang_id or f"gang-{secrets.token_hex(4)}"
        if request.gang_id:
            member_ids = [gang_member_id(gang_id, i) for i in range(len(request.members))]
            free_released_names(self._store, self._cache, member_ids)
        if request.gang_id and self._cache.nodes.get(gang_member_id(gang_id, 0)) is not None:
            raise _gang_exists(gang_id)
        # Before placement, refuse what the quota refuses whatever GPUs are chosen (the
        # models placement picks are checked at the commit, against fresh usage).
        for tenant_id, members in sorted(_by_tenant(list(request.members), _spec_tenant).items()):
            wanted = [spec.gpus.model for spec in members for _ in range(spec.gpus.count)]
            refuse_breach(self._store, self._cache, tenant_id, wanted, nodes=len(members))
        tenants = sorted({spec.tenant for spec in request.members if spec.tenant})
        for attempt in range(self._settings.max_attempts):
            placements = self._place(request, requests)
            hosts = sorted({p.host for p in placements})
            with self._locked(hosts), self._locked_tenants(tenants):
                outcome = self._try_commit(request, gang_id, placements, owner)
            if outcome is not None:
                metrics.COMPOSE_TOTAL.labels(result="ok").inc()
                return outcome
            metrics.COMPOSE_CONFLICTS.inc()
            log.debug("gang conflict; placing again", extra={"attempt": attempt})
            pause_after_conflict(attempt)
        metrics.COMPOSE_TOTAL.labels(result="aborted").inc()
        raise Aborted(
            f"gang placement kept conflicting with concurrent requests after "
            f"{self._settings.max_attempts} attempts; retry the call (with the same "
            "request_id)",
            reason="COMMIT_CONFLICT",
        )

    def _check(self, request: nodes_pb2.ComposeGangRequest) -> list[PlacementRequest]:
        members = request.members
        if not members:
            raise InvalidArgument(
                "members is empty: give at least one member spec",
                reason="INVALID_GANG",
            )
        check_request_id(request.request_id)
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
        ops = gang_ops(members)
        if ops > MAX_TXN_OPS:
            total = sum(spec.gpus.count for spec in members)
            raise InvalidArgument(
                f"gang too large for one etcd transaction: it needs up to {ops} compares "
                f"({total} GPUs + {OPS_PER_MEMBER} per member x {len(members)} members + 1 "
                "per tenant + 1), "
                f"and etcd allows at most {MAX_TXN_OPS}; use fewer members or fewer GPUs "
                "per member",
                reason="GANG_TOO_LARGE",
            )
        placement_requests = []
        for i, spec in enumerate(members):
            try:
                check_node_spec(spec)
            except InvalidArgument as error:
                raise InvalidArgument(
                    f"members[{i}]: {error.message}", reason=error.reason
                ) from None
            host = parse_host(spec.host) if spec.host else None
            if host is not None and self._cache.hosts.get(host) is None:
                raise NotFound(
                    f"members[{i}]: host {spec.host} is not registered; list hosts with "
                    "`dxpool host list` or leave the host out to let placement choose",
                    reason="HOST_NOT_FOUND",
                )
            placement_requests.append(placement_request(spec, host))
        return placement_requests

    def _place(
        self, request: nodes_pb2.ComposeGangRequest, requests: list[PlacementRequest]
    ) -> list[Placement]:
        """Every member's placement against one snapshot, each taken out before the next."""
        snapshot = self._index.snapshot()
        latency = self._latency.current()
        placements: list[Placement] = []
        with metrics.COMPOSE_STAGE_SECONDS.labels(stage="placement").time():
            for i, placement_request in enumerate(requests):
                result = place(placement_request, snapshot, latency)
                if result.placement is None:
                    try:
                        check_model_known(self._store, self._cache, placement_request.model)
                    except FailedPrecondition:
                        metrics.COMPOSE_TOTAL.labels(result="unknown_model").inc()
                        raise
                    metrics.COMPOSE_TOTAL.labels(result="unschedulable").inc()
                    raise ResourceExhausted(
                        _unschedulable(request.members, i, result.unsatisfied),
                        reason="NO_CAPACITY",
                    )
                placements.append(result.placement)
                spec = request.members[i]
                snapshot = without_placement(
                    snapshot, result.placement, spec.cpu_cores, spec.host_memory_mib
                )
        return placements

    @contextmanager
    def _locked(self, hosts: list[str]) -> Iterator[None]:
        """Hold the locks of ``hosts`` (sorted: every multi-lock holder takes them in
        the same order)."""
        with ExitStack() as stack:
            for host in hosts:
                stack.enter_context(self._host_locks.lock(host))
            yield

    @contextmanager
    def _locked_tenants(self, tenants: list[str]) -> Iterator[None]:
        """Hold the locks of ``tenants`` (sorted), inside the host locks."""
        with ExitStack() as stack:
            for tenant in tenants:
                stack.enter_context(self._tenant_locks.lock(tenant))
            yield

    def _try_commit(
        self,
        request: nodes_pb2.ComposeGangRequest,
        gang_id: str,
        placements: list[Placement],
        owner: str,
    ) -> nodes_pb2.Gang | None:
        """Commit every member in one transaction; the gang, or None to place again."""
        keys = self._store.keys
        now = self._clock()
        gang = gang_name(gang_id)
        txn = Txn()
        allocations: dict[str, tuple[pb.HostAllocation, int]] = {}
        used: dict[str, set[int]] = {}
        nodes: list[pb.VirtualNode] = []
        for i, (spec, placement) in enumerate(zip(request.members, placements, strict=True)):
            host_id = placement.host
            host_name = f"hosts/{host_id}"
            name = node_name(gang_member_id(gang_id, i))
            if host_id not in allocations:
                record = self._cache.host_allocations.get(host_id)
                allocations[host_id] = (
                    copy(record.value) if record else pb.HostAllocation(host=host_name),
                    record.mod_revision if record else 0,
                )
                used[host_id] = {a.host_slot for a in allocations[host_id][0].attachments}
            allocation = allocations[host_id][0]
            node = self._member(
                txn, spec, placement, name, gang, allocation, used[host_id], now, owner
            )
            if node is None:
                return None  # the snapshot was older than the cache; place again
            node.request_id = request.request_id
            node.gang_size = len(request.members)
            lifecycle.new_node_event(node, now)
            nodes.append(node)
        created_tenants = self._charge(txn, nodes)
        for host_id, (allocation, revision) in sorted(allocations.items()):
            allocation_key = keys.host_allocation(host_id)
            expect(txn, allocation_key, revision).put(allocation_key, allocation)
            expect_exists(txn, keys.host_lease(host_id))
        node_keys = []
        for node in nodes:
            node_key = keys.node(node.name.removeprefix("nodes/"))
            node_keys.append(node_key)
            expect(txn, node_key, 0).put(node_key, node)
        request_key = keys.request(request.request_id) if request.request_id else None
        if request_key:
            expect(txn, request_key, 0).put(request_key, gang)
        txn.check_size()
        created = set(node_keys) | ({request_key} if request_key else set())
        created |= created_tenants
        with metrics.COMPOSE_STAGE_SECONDS.labels(stage="commit").time():
            committed = commit_staged(self._store, self._cache, txn, created=created)
        if committed.succeeded:
            return nodes_pb2.Gang(name=gang, nodes=nodes)
        if request_key:
            existing = self._gang_for_request(request, committed.current.get(request_key), owner)
            if existing is not None:
                return existing
        if request.gang_id and any(committed.current.get(key) for key in node_keys):
            raise _gang_exists(gang_id)
        return None

    def _member(
        self,
        txn: Txn,
        spec: pb.NodeSpec,
        placement: Placement,
        name: str,
        gang: str,
        allocation: pb.HostAllocation,
        used: set[int],
        now: float,
        owner: str,
    ) -> pb.VirtualNode | None:
        """Add one member's GPUs to ``txn`` and its attachments to ``allocation`` (slots
        taken go into ``used``); its node, or None when the cache shows that the
        placement no longer holds."""
        host_name = f"hosts/{placement.host}"
        keys = self._store.keys
        host_record = self._cache.hosts.get(placement.host)
        if allocation.unschedulable or not reserve_host_resources(
            host_record.value if host_record else None, allocation, spec, name
        ):
            return None  # cordoned, or its CPU or memory taken, since the snapshot
        node = pb.VirtualNode(
            name=name,
            spec=spec,
            host=host_name,
            state=pb.NODE_STATE_PENDING,
            message="waiting for the host agent to attach the GPUs",
            create_time=timestamp(now),
            update_time=timestamp(now),
            attach_deadline=timestamp(now + self._settings.attach_timeout_s),
            owner=owner,
            gang=gang,
        )
        assigned = assign_gpus(self._cache, placement, node, allocation, used, spec.vfio)
        if assigned is None:
            return None
        write_assigned(txn, keys, assigned)
        return node

    def _charge(self, txn: Txn, nodes: list[pb.VirtualNode]) -> set[str]:
        """Charge every member with a tenant to it in ``txn``: per tenant, compare its
        record as the cache holds it and write it with all its members added to its
        usage. Raises QUOTA_EXCEEDED when they do not fit its quota together (confirmed
        against etcd). Returns the keys of the tenant records the commit creates."""
        created: set[str] = set()
        for tenant_id, members in sorted(_by_tenant(nodes, _node_tenant).items()):
            models = [binding.model for node in members for binding in node.gpus]
            charge = charge_in(txn, self._store, self._cache, tenant_id, models, nodes=len(members))
            if charge.creates:
                created.add(charge.key)
            for node in members:
                node.charged = True
                node.preemptible = charge.borrowed
        return created

    def _gang_for_request(
        self,
        request: nodes_pb2.ComposeGangRequest,
        record: Versioned[bytes] | None,
        owner: str,
    ) -> nodes_pb2.Gang | None:
        """The gang an earlier call with this request id made (given the request record
        the caller has); None when the id is unused."""
        if record is None:
            return None
        request_id = request.request_id
        name = bytes(record.value).decode()
        if not name.startswith("gangs/"):
            raise AlreadyExists(
                f"request_id {request_id!r} was already used for {name}; use a new "
                "request_id for a new gang",
                reason="REQUEST_ID_REUSED",
            )
        members = self._members(parse_gang(name))
        if not members:
            raise FailedPrecondition(
                f"request_id {request_id!r} was used for {name}, which no longer exists; "
                "use a new request_id",
                reason="REQUEST_ID_REUSED",
            )
        if any(node.owner != owner for node in members):
            raise AlreadyExists(
                f"request_id {request_id!r} was already used by another caller; use a new "
                "request_id",
                reason="REQUEST_ID_REUSED",
            )
        if len(members) != len(request.members) or any(
            node.spec != spec for node, spec in zip(members, request.members, strict=True)
        ):
            raise AlreadyExists(
                f"request_id {request_id!r} was already used for a different request "
                f"({name}); use a new request_id for a new gang",
                reason="REQUEST_ID_REUSED",
            )
        return nodes_pb2.Gang(name=name, nodes=members)

    # -- read ------------------------------------------------------------------------

    def _members(self, gang_id: str) -> list[pb.VirtualNode]:
        """The gang's member nodes that exist (read through to etcd on a cache miss), in
        member order; empty for an unknown gang."""
        first = read_through(
            self._store, self._cache, self._cache.nodes, gang_member_id(gang_id, 0)
        )
        if first is None or first.value.gang != gang_name(gang_id):
            return []
        members: list[pb.VirtualNode] = [first.value]
        for i in range(1, first.value.gang_size):
            record = read_through(
                self._store, self._cache, self._cache.nodes, gang_member_id(gang_id, i)
            )
            if record is not None and record.value.gang == gang_name(gang_id):
                members.append(record.value)
        return members

    def get(self, name: str, *, owner: str | None = None) -> nodes_pb2.Gang:
        """The gang's members as they are now. NotFound for an unknown gang, and for a
        gang owned by someone other than ``owner`` when ``owner`` is set."""
        members = self._members(parse_gang(name))
        if not members or (owner is not None and members[0].owner != owner):
            raise _gang_not_found(name)
        return nodes_pb2.Gang(name=name, nodes=members)

    # -- release ---------------------------------------------------------------------

    def release(
        self, name: str, *, force: bool = False, owner: str | None = None
    ) -> nodes_pb2.Gang:
        """Start releasing every member in one transaction (as ``Composer.release`` does
        for one node: RELEASING, tenant discharged, GPUs DETACHING with their attachments
        kept in the host's allocation marked ``release`` until the agent reports them
        scrubbed, or with ``force`` fenced). Members
        already RELEASING or RELEASED stay as they are (with ``force``, a RELEASING
        member's detaching GPUs go FENCING). Idempotent. NotFound for an unknown gang or,
        with ``owner`` set, one owned by someone else (judged in the same transaction)."""
        gang_id = parse_gang(name)
        known = self._members(gang_id)
        if not known:
            raise _gang_not_found(name)
        message = (
            "force release of the gang requested; fencing GPUs at the box side"
            if force
            else "release of the gang requested; detaching GPUs"
        )

        started = [0]  # members the attempt that committed started releasing

        def body(view: TxnView) -> nodes_pb2.Gang:
            released = []
            started[0] = 0
            for i in range(known[0].gang_size):
                record = view.nodes.get(gang_member_id(gang_id, i))
                if record is None or record.value.gang != name:
                    continue
                node = record.value
                if owner is not None and node.owner != owner:
                    raise _gang_not_found(name)
                if node.state in (pb.NODE_STATE_RELEASING, pb.NODE_STATE_RELEASED):
                    if force and node.state == pb.NODE_STATE_RELEASING:
                        fence_detaching(view, node)
                    released.append(node)
                    continue
                released.append(
                    let_go(view, node, pb.NODE_STATE_RELEASING, message, self._clock(), fence=force)
                )
                started[0] += 1
            if not released:
                raise _gang_not_found(name)
            return nodes_pb2.Gang(name=name, nodes=released)

        hosts = sorted({parse_host(node.host) for node in known if node.host})
        tenants = sorted({node.spec.tenant for node in known if node.spec.tenant})
        with self._locked(hosts), self._locked_tenants(tenants):
            gang = transact(
                self._store,
                self._cache,
                body,
                attempts=RELEASE_ATTEMPTS,
                what=f"releasing {name}",
            )
        metrics.RELEASE_TOTAL.inc(started[0])
        return gang


def _by_tenant(items: list[_V], tenant_of: Callable[[_V], str]) -> dict[str, list[_V]]:
    """``items`` (member specs, or nodes with ``tenant_of``) grouped by the tenant they
    are charged to; those charged to no one are left out."""
    grouped: dict[str, list[_V]] = {}
    for item in items:
        tenant = tenant_of(item)
        if tenant:
            grouped.setdefault(tenant, []).append(item)
    return grouped


def _spec_tenant(spec: pb.NodeSpec) -> str:
    return spec.tenant


def _node_tenant(node: pb.VirtualNode) -> str:
    return node.spec.tenant


def _gang_exists(gang_id: str) -> AlreadyExists:
    return AlreadyExists(
        f"gang gangs/{gang_id} (or a node named like its members, nodes/{gang_id}-N) "
        "already exists; pick another gang_id or omit it",
        reason="GANG_EXISTS",
    )


def _gang_not_found(name: str) -> NotFound:
    return NotFound(
        f"gang {name} does not exist; its members are listed by `dxpool node list`",
        reason="GANG_NOT_FOUND",
    )


def _unschedulable(members: Any, index: int, unsatisfied: tuple[str, ...]) -> str:
    spec: pb.NodeSpec = members[index]
    wanted = f"{spec.gpus.model or 'any'}:{spec.gpus.count}"
    extra = []
    if spec.host:
        extra.append(f"on {spec.host}")
    if spec.max_latency_ns:
        extra.append(f"within {format_duration_ns(spec.max_latency_ns)}")
    reasons = "; ".join(unsatisfied) or "no host can take the member"
    placed = f" once members 0-{index - 1} were placed" if index else ""
    return (
        f"no placement for gang member {index} of {len(members)} ({wanted} GPUs"
        f"{' ' + ' '.join(extra) if extra else ''}){placed}: {reasons}. Nothing was "
        "committed. Ask for fewer members or GPUs, relax the bounds, or release nodes"
    )
