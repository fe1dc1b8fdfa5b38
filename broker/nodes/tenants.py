"""Tenants: per-tenant quotas and the usage they are checked against.

A node is charged to the tenant its ``spec.tenant`` names (a tenant caller's own name;
an operator may name one; empty charges no one). ``tenants/{tenant}`` holds the
tenant's :class:`~dxpool.api.v1.resources_pb2.Tenant`: its quota (absent: no limits;
in a quota, an unset limit is no limit) and its usage, the GPUs (in all and per model)
and the nodes of its charged nodes that are PENDING, ATTACHING or READY.

Usage changes only in the transactions that change those nodes, so it cannot drift:

* compose reads the tenant record with the GPUs and the host it chose, checks the quota
  against the usage plus the new node, and writes the raised usage in its one
  transaction, which compares the record's revision. Two composes of one tenant cannot
  both pass a check made on the same usage: the second one's compare fails, it reads
  the new usage and checks again.
* :func:`discharge` lowers it in the transaction that lets the node go (release,
  force release, failed attach, host loss: every path out of PENDING, ATTACHING and
  READY is :func:`~dxpool.broker.nodes.transitions.let_go`), compared the same way.

A node's GPUs stop counting when the node lets go of them, not when they are FREE
again: GPUs that are detaching or fencing are handed to no one, so counting them
against the tenant would only delay its next node without protecting anybody.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes import loaning
from dxpool.broker.nodes.validation import check_page_size
from dxpool.broker.state import metrics, records
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.pages import cache_page
from dxpool.broker.state.stm import TxnView, expect, read_through, transact
from dxpool.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from dxpool.limits import MAX_PRIORITY, MAX_QUOTA, MAX_QUOTA_MODELS
from dxpool.names import parse_tenant, tenant_name
from dxpool.request import check_model
from dxpool.store import keys as k
from dxpool.store.typed import Store, Txn

CHARGED_NODE_STATES = lifecycle.LOSABLE_NODE_STATES
"""The states in which a charged node counts in its tenant's usage: every state that
holds GPUs (a RESIZING or DEGRADED node keeps the GPUs it had while READY), the ones a
lost host would take from it."""


def check_quota(quota: pb.TenantQuota) -> None:
    """INVALID_ARGUMENT unless every limit is 0..MAX_QUOTA and every model name valid."""
    for field in ("gpus", "nodes", "guaranteed_gpus", "borrow_limit"):
        if quota.HasField(field) and not 0 <= getattr(quota, field) <= MAX_QUOTA:
            raise InvalidArgument(
                f"quota.{field} {getattr(quota, field)} is out of range: use 0 (nothing "
                f"allowed) up to {MAX_QUOTA}, or leave it unset for no limit",
                reason="INVALID_QUOTA",
            )
    if quota.HasField("max_priority") and not 0 <= quota.max_priority <= MAX_PRIORITY:
        raise InvalidArgument(
            f"quota.max_priority {quota.max_priority} is out of range: use 0 up to "
            f"{MAX_PRIORITY}, or leave it unset to allow any priority",
            reason="INVALID_QUOTA",
        )
    if quota.HasField("borrow_limit") and not quota.HasField("guaranteed_gpus"):
        raise InvalidArgument(
            "quota.borrow_limit is set without quota.guaranteed_gpus: a tenant borrows "
            "only beyond a guarantee; set guaranteed_gpus too (0 for a tenant that only "
            "borrows), or leave borrow_limit out",
            reason="INVALID_QUOTA",
        )
    if len(quota.gpus_by_model) > MAX_QUOTA_MODELS:
        raise InvalidArgument(
            f"quota.gpus_by_model has {len(quota.gpus_by_model)} models: at most "
            f"{MAX_QUOTA_MODELS} may be limited; remove some, or limit them together with "
            "quota.gpus",
            reason="INVALID_QUOTA",
        )
    for model, limit in quota.gpus_by_model.items():
        if not model:
            raise InvalidArgument(
                "quota.gpus_by_model has an empty model name: use a GPU model, e.g. H100, "
                "or limit every model together with quota.gpus",
                reason="INVALID_QUOTA",
            )
        check_model(model)
        if not 0 <= limit <= MAX_QUOTA:
            raise InvalidArgument(
                f"quota.gpus_by_model[{model}] {limit} is out of range: use 0 up to "
                f"{MAX_QUOTA}, or leave the model out for no limit of its own",
                reason="INVALID_QUOTA",
            )


def charged(
    usage: pb.TenantUsage,
    models: Iterable[str],
    sign: int = 1,
    *,
    nodes: int = 1,
    borrowed: bool = False,
) -> pb.TenantUsage:
    """``usage`` with ``nodes`` nodes of GPUs of ``models`` (one entry per GPU, all nodes
    together) added (``sign`` 1) or taken away (-1); ``nodes`` 0 changes GPUs only (a
    resize). ``borrowed``: the nodes are on lent capacity, so the borrowed counts move
    too (see :mod:`~dxpool.broker.nodes.loaning`). Models whose count reaches 0 are dropped."""
    updated = pb.TenantUsage()
    updated.CopyFrom(usage)
    counted = Counter(models)
    updated.nodes += sign * nodes
    updated.gpus += sign * sum(counted.values())
    if borrowed:
        updated.borrowed_nodes += sign * nodes
        updated.borrowed_gpus += sign * sum(counted.values())
    for model, count in counted.items():
        left = updated.gpus_by_model.get(model, 0) + sign * count
        if left:
            updated.gpus_by_model[model] = left
        else:
            updated.gpus_by_model.pop(model, None)
    return updated


def breach(
    tenant_id: str,
    record: pb.Tenant | None,
    models: list[str],
    *,
    nodes: int = 1,
    borrowed: bool | None = None,
) -> ResourceExhausted | None:
    """The QUOTA_EXCEEDED error ``nodes`` new nodes with GPUs ``models`` (all of them
    together) would cause for the tenant whose record is ``record`` (None: no record, no
    limits), or None if it fits. ``nodes`` 0: GPUs added to a node that is counted
    already (a resize), whose kind ``borrowed`` gives (a guaranteed node grows within
    the guarantee only, a borrowed one within ``borrow_limit``); several: the members of
    a gang. A new node's kind is the one :func:`~dxpool.broker.nodes.loaning.terms` gives.

    ``models`` may hold empty strings for GPUs whose model is not known yet (before
    placement): they count against the total only.
    """
    if record is None or not record.HasField("quota"):
        return None
    quota, usage = record.quota, record.usage
    wanted = len(models)
    if quota.HasField("guaranteed_gpus"):
        lent = loaning.terms(record, wanted).borrowed if borrowed is None else borrowed
        used = loaning.guaranteed_in_use(usage)
        if not lent and nodes == 0 and used + wanted > quota.guaranteed_gpus:
            return _exceeded(
                tenant_id,
                "guaranteed_gpus",
                quota.guaranteed_gpus,
                used,
                wanted,
                "guaranteed GPUs (a node composed within the guarantee grows within it)",
            )
        if (
            lent
            and quota.HasField("borrow_limit")
            and usage.borrowed_gpus + wanted > quota.borrow_limit
        ):
            return _exceeded(
                tenant_id,
                "borrow_limit",
                quota.borrow_limit,
                usage.borrowed_gpus,
                wanted,
                f"borrowed GPUs beyond its guarantee of {quota.guaranteed_gpus}",
            )
    if nodes and quota.HasField("nodes") and usage.nodes + nodes > quota.nodes:
        return _exceeded(tenant_id, "nodes", quota.nodes, usage.nodes, nodes, "nodes")
    if quota.HasField("gpus") and usage.gpus + wanted > quota.gpus:
        return _exceeded(tenant_id, "gpus", quota.gpus, usage.gpus, wanted, "GPUs")
    for model, count in sorted(Counter(m for m in models if m).items()):
        if model in quota.gpus_by_model:
            limit, used = quota.gpus_by_model[model], usage.gpus_by_model.get(model, 0)
            if used + count > limit:
                return _exceeded(
                    tenant_id, f"gpus_by_model[{model}]", limit, used, count, f"{model} GPUs"
                )
    return None


def _exceeded(
    tenant_id: str, limit: str, quota: int, usage: int, requested: int, what: str
) -> ResourceExhausted:
    return ResourceExhausted(
        f"tenant {tenant_id} would exceed its quota of {quota} {what} (quota.{limit}): it "
        f"holds {usage} and the request needs {requested} more. Release nodes of the tenant "
        "(`dxpool node delete`) or have an operator raise the quota (`dxpool tenant "
        "set-quota`)",
        reason="QUOTA_EXCEEDED",
        metadata={
            "tenant": tenant_id,
            "limit": limit,
            "quota": str(quota),
            "usage": str(usage),
            "requested": str(requested),
        },
    )


def node_models(node: pb.VirtualNode) -> list[str]:
    """One model per GPU of ``node``, as it was charged."""
    return [binding.model for binding in node.gpus]


def discharge(view: TxnView, node: pb.VirtualNode) -> None:
    """Take ``node`` (the record the view read) out of its tenant's usage, if it counts
    there: it is charged and still in a charged state. Call it in the transaction that
    moves the node out of those states."""
    if not node.charged or not node.spec.tenant or node.state not in CHARGED_NODE_STATES:
        return
    # what this view writes already (another node of the tenant let go in this
    # transaction, e.g. a gang's members), else the record read
    current = view.tenants.latest(node.spec.tenant)
    if current is None:
        # Tenant records are never deleted, so a charged node's record exists; a
        # missing one means it was removed by hand, and there is nothing to lower.
        return
    tenant = records.copy(current)
    tenant.usage.CopyFrom(
        charged(tenant.usage, node_models(node), sign=-1, borrowed=node.preemptible)
    )
    view.put(k.TENANTS, node.spec.tenant, tenant)


def discharge_gpus(view: TxnView, node: pb.VirtualNode, models: list[str]) -> None:
    """Take GPUs of ``models`` that ``node`` (the record the view read) no longer holds
    out of its tenant's usage, if the node counts there; the node itself still counts.
    Call it in the transaction that drops the GPUs' bindings from the node (a shrink
    done, a grow abandoned)."""
    if not models or not node.charged or not node.spec.tenant:
        return
    if node.state not in CHARGED_NODE_STATES:
        return
    current = view.tenants.latest(node.spec.tenant)
    if current is None:
        return
    tenant = records.copy(current)
    tenant.usage.CopyFrom(
        charged(tenant.usage, models, sign=-1, nodes=0, borrowed=node.preemptible)
    )
    view.put(k.TENANTS, node.spec.tenant, tenant)


def confirmed_breach(
    store: Store,
    cache: Cache,
    tenant_id: str,
    models: list[str],
    *,
    nodes: int = 1,
    borrowed: bool | None = None,
) -> ResourceExhausted | None:
    """The QUOTA_EXCEEDED error ``nodes`` nodes of GPUs ``models`` would cause, judged on
    the tenant's record as etcd holds it now; None if they fit.

    The cache's record is tried first; a refusal is confirmed by a linearizable read
    (the cache may lag behind a release another broker committed), which the cache
    takes. A pass is never final: the commit compares the record it was based on."""
    cached = cache.tenants.get(tenant_id)
    error = breach(
        tenant_id, cached.value if cached else None, models, nodes=nodes, borrowed=borrowed
    )
    if error is None:
        return None
    key = store.keys.tenant(tenant_id)
    current = store.read([key]).get(key)
    if current is None:
        return None
    cache.apply_read(key, current, cache.revision)
    return breach(tenant_id, current.value, models, nodes=nodes, borrowed=borrowed)


def refuse_breach(
    store: Store, cache: Cache, tenant_id: str, models: list[str], *, nodes: int = 1
) -> None:
    """Raise (and count) the QUOTA_EXCEEDED error of :func:`confirmed_breach`, if any."""
    error = confirmed_breach(store, cache, tenant_id, models, nodes=nodes)
    if error is not None:
        metrics.COMPOSE_TOTAL.labels(result="quota_exceeded").inc()
        raise error


@dataclass(frozen=True, slots=True)
class Charge:
    """What :func:`charge_in` did: the tenant record's key, whether the commit creates
    it, and whether the nodes are on lent capacity (to set ``VirtualNode.preemptible``)."""

    key: str
    creates: bool
    borrowed: bool


def new_tenant(tenant_id: str) -> pb.Tenant:
    """A tenant record made now: no quota, no usage, a fresh ``uid``."""
    return pb.Tenant(name=tenant_name(tenant_id), uid=secrets.token_hex(8))


def charge_in(
    txn: Txn, store: Store, cache: Cache, tenant_id: str, models: list[str], *, nodes: int = 1
) -> Charge:
    """Charge ``nodes`` nodes of GPUs ``models`` to ``tenant_id`` in ``txn``: compare the
    tenant's record as the cache holds it and write it with them added to its usage,
    as guaranteed or borrowed nodes (:func:`~dxpool.broker.nodes.loaning.terms` on that very
    record: all ``nodes`` are one kind). Raises QUOTA_EXCEEDED when they do not fit its
    quota (confirmed against etcd, see :func:`confirmed_breach`)."""
    refuse_breach(store, cache, tenant_id, models, nodes=nodes)
    record = cache.tenants.get(tenant_id)
    tenant = records.copy(record.value) if record else new_tenant(tenant_id)
    borrowed = loaning.terms(record.value if record else None, len(models)).borrowed
    tenant.usage.CopyFrom(charged(tenant.usage, models, nodes=nodes, borrowed=borrowed))
    key = store.keys.tenant(tenant_id)
    expect(txn, key, record.mod_revision if record else 0).put(key, tenant)
    return Charge(key, record is None, borrowed)


def _waiting_for(cache: Cache, tenant_id: str) -> list[str]:
    """The QUEUED nodes and gangs charged to ``tenant_id``, as this broker's cache holds
    them (a request queued after the check is failed at admission: its tenant's uid
    no longer matches)."""
    waiting = [
        f"nodes/{node_id}"
        for node_id, record in cache.nodes.items()
        if record.value.state == pb.NODE_STATE_QUEUED and record.value.spec.tenant == tenant_id
    ]
    for gang_id, record in cache.gangs.items():
        members = record.value.members
        if (
            record.value.state == pb.GANG_STATE_QUEUED
            and members
            and members[0].tenant == tenant_id
        ):
            waiting.append(f"gangs/{gang_id}")
    return sorted(waiting)


class Tenants:
    """SetTenantQuota, GetTenant, ListTenants and DeleteTenant over the cache and etcd."""

    def __init__(self, store: Store, cache: Cache, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._cache = cache
        self._clock = clock

    def set_quota(self, name: str, quota: pb.TenantQuota) -> pb.Tenant:
        """Replace the quota of tenant ``name``; its usage is kept. Returns the record."""
        tenant_id = parse_tenant(name)
        check_quota(quota)

        def body(view: TxnView) -> pb.Tenant:
            record = view.tenants.get(tenant_id)
            tenant = records.copy(record.value) if record is not None else new_tenant(tenant_id)
            tenant.quota.CopyFrom(quota)
            tenant.quota_update_time.CopyFrom(records.timestamp(self._clock()))
            view.put(k.TENANTS, tenant_id, tenant)
            return tenant

        return transact(self._store, self._cache, body, what=f"setting the quota of {name}")

    def get(self, name: str) -> pb.Tenant:
        """The record of tenant ``name``, read through to etcd on a cache miss; a
        tenant without one has no quota and no usage."""
        tenant_id = parse_tenant(name)
        record = read_through(self._store, self._cache, self._cache.tenants, tenant_id)
        if record is None:
            return pb.Tenant(name=tenant_name(tenant_id))
        return record.value

    def delete(self, name: str) -> None:
        """Delete tenant ``name``'s record (quota and usage). NotFound when it has none;
        FailedPrecondition (``TENANT_HAS_NODES``) while nodes charged to it hold GPUs.

        The transaction compares the record's revision, so a compose that charges the
        tenant meanwhile (it writes the record) makes the delete read again and refuse;
        a compose after the delete starts the tenant afresh, without a quota. Nodes that
        name the tenant but were never charged (composed before quotas existed) are
        looked for in the cache and refuse the delete too.
        """
        tenant_id = parse_tenant(name)

        def body(view: TxnView) -> None:
            record = view.tenants.get(tenant_id)
            if record is None:
                raise NotFound(
                    f"tenant {tenant_name(tenant_id)} has no record (no quota and no nodes "
                    "charged so far); `dxpool tenant list` shows those that do",
                    reason="TENANT_NOT_FOUND",
                )
            live = sorted(
                node_id
                for node_id, node in self._cache.nodes.items()
                if node.value.spec.tenant == tenant_id and node.value.state in CHARGED_NODE_STATES
            )
            waiting = _waiting_for(self._cache, tenant_id)
            if waiting:
                shown = ", ".join(waiting[:5]) + (", ..." if len(waiting) > 5 else "")
                raise FailedPrecondition(
                    f"tenant {tenant_name(tenant_id)} has {len(waiting)} request(s) waiting in "
                    f"the queue ({shown}); release them first (`dxpool node delete NODE`, "
                    "`dxpool gang delete GANG`), then delete the tenant",
                    reason="TENANT_HAS_NODES",
                    metadata={"tenant": tenant_id, "queued": str(len(waiting))},
                )
            if record.value.usage.nodes or live:
                count = max(record.value.usage.nodes, len(live))
                shown = ", ".join(f"nodes/{n}" for n in live[:5]) + (
                    ", ..." if len(live) > 5 else ""
                )
                raise FailedPrecondition(
                    f"tenant {tenant_name(tenant_id)} still holds {count} node(s)"
                    + (f" ({shown})" if shown else "")
                    + "; release them first (`dxpool node delete NODE`), then delete the tenant",
                    reason="TENANT_HAS_NODES",
                    metadata={"tenant": tenant_id, "nodes": str(count)},
                )
            view.delete(k.TENANTS, tenant_id)

        transact(self._store, self._cache, body, what=f"deleting {tenant_name(tenant_id)}")

    def list(self, page_size: int, page_token: str) -> tuple[list[pb.Tenant], str]:
        """One page of tenant records, by name, and the next page token."""
        chunk, token = cache_page(self._cache.tenants, check_page_size(page_size), page_token)
        return [record.value for _, record in chunk], token


__all__ = [
    "CHARGED_NODE_STATES",
    "Charge",
    "Tenants",
    "breach",
    "charged",
    "check_quota",
    "confirmed_breach",
    "discharge",
    "discharge_gpus",
    "new_tenant",
    "node_models",
]
