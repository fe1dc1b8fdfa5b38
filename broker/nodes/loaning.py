"""Guaranteed and borrowable capacity: which of a tenant's nodes are on lent capacity.

A tenant whose quota sets ``guaranteed_gpus`` takes part in loaning (Kueue's cohort: every
such tenant shares the pool). Its nodes are of two kinds, decided when each is committed
from the tenant's record that the commit compares:

* **guaranteed**: the node fits in what is left of the guarantee (the GPUs of the
  tenant's guaranteed nodes plus this node's at most ``guaranteed_gpus``). Such a node
  is never preempted, and a request that fits in the guarantee may take lent capacity
  back when nothing is free (:mod:`dxpool.broker.nodes.preemption`).
* **borrowed**: the node does not fit in the guarantee, so it uses capacity that is idle
  now but another tenant may be owed (or that nobody is guaranteed). It is
  ``VirtualNode.preemptible``: reclaimed (an elastic node shrunk, else released after a
  notice) when an owner needs its guarantee back, or preempted by a request of higher
  priority. ``borrow_limit`` bounds how many GPUs a tenant may borrow (0: none, so the
  guarantee is a hard quota).

A node is one kind for its whole life: counting part of a node as borrowed would make
the node preemptible in part, and preempting a part of a job is preempting the job. A
gang is one kind too (all its members together): losing one member is losing the gang.

A tenant without ``guaranteed_gpus`` takes no part: its nodes are never preemptible and
it reclaims nothing (as before loaning existed). Nodes charged to no tenant are the same.

The usage keeps ``borrowed_gpus`` and ``borrowed_nodes`` beside the totals, changed by
the same transactions (:mod:`dxpool.broker.nodes.tenants`), so "what is left of the
guarantee" is read and compared with one record.

This module is pure: it reads records and answers; the callers commit.
"""

from __future__ import annotations

from dataclasses import dataclass

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.limits import MAX_PRIORITY


@dataclass(frozen=True, slots=True)
class LoanTerms:
    """How a new node of ``gpus`` GPUs would be charged to its tenant.

    ``borrowed``: it would be on lent capacity (preemptible). ``within_guarantee``: it
    fits in what is left of the tenant's guarantee, so it may take lent GPUs back.
    Both False for a tenant that takes no part in loaning."""

    borrowed: bool
    within_guarantee: bool


NOT_LOANING = LoanTerms(borrowed=False, within_guarantee=False)


def takes_part(record: pb.Tenant | None) -> bool:
    """Whether the tenant takes part in loaning (its quota sets a guarantee)."""
    return (
        record is not None and record.HasField("quota") and record.quota.HasField("guaranteed_gpus")
    )


def guaranteed_in_use(usage: pb.TenantUsage) -> int:
    """GPUs the tenant holds in guaranteed (not borrowed) nodes."""
    return usage.gpus - usage.borrowed_gpus


def terms(record: pb.Tenant | None, gpus: int) -> LoanTerms:
    """The terms of a new node (or gang: all its members' GPUs together) of ``gpus``
    GPUs for the tenant whose record is ``record`` (None: no record)."""
    if record is None or not takes_part(record):
        return NOT_LOANING
    if guaranteed_in_use(record.usage) + gpus <= record.quota.guaranteed_gpus:
        return LoanTerms(borrowed=False, within_guarantee=True)
    return LoanTerms(borrowed=True, within_guarantee=False)


def guarantee_left(record: pb.Tenant | None) -> int:
    """GPUs still free in the tenant's guarantee (0 for one that takes no part)."""
    if record is None or not takes_part(record):
        return 0
    return max(0, record.quota.guaranteed_gpus - guaranteed_in_use(record.usage))


def priority_allowed(record: pb.Tenant | None, priority: int) -> bool:
    """Whether the tenant's quota lets its nodes ask for ``priority``."""
    if not 0 <= priority <= MAX_PRIORITY:
        return False
    if record is None or not record.HasField("quota"):
        return True
    quota = record.quota
    return not quota.HasField("max_priority") or priority <= quota.max_priority


__all__ = [
    "NOT_LOANING",
    "LoanTerms",
    "guarantee_left",
    "guaranteed_in_use",
    "priority_allowed",
    "takes_part",
    "terms",
]
