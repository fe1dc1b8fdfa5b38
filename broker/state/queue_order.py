"""The order in which waiting requests are served: priority, then turns between tenants,
then age.

Waiting requests (QUEUED nodes and gangs) are served highest ``priority`` first. Among
requests of one priority, tenants take turns: every tenant's oldest request comes before
any tenant's second oldest, and so on (requests charged to no tenant are one more
"tenant"); within a turn, the older request first, then the name. So a tenant that queues
a thousand requests delays another tenant's single request by at most one request per
tenant, and a request's position never depends on how much another tenant queued after
it.

The queue is best effort, not strict: a request that does not fit now does not hold
back the ones behind it (it may take lent capacity back or preempt lower priority
instead, see :mod:`dxpool.broker.nodes.preemption`). Large requests behind a stream of small
ones are therefore served when capacity frees in one piece, or by preemption; what the
dispatcher keeps for a request that is preempting is in :mod:`dxpool.broker.control.dispatcher`.

Pure: the broker's queue index and the replay benchmark order with the same function.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Waiting:
    """One waiting request as the order sees it."""

    name: str  # "nodes/{node}" or "gangs/{gang}"
    tenant: str  # "" when charged to no tenant
    priority: int
    enqueued: float  # seconds since the epoch (or the replay's clock)
    gpus: int  # every GPU it asks for (all members of a gang)
    model: str = ""  # the GPU model (or set) it asks for; "" any


def order_key(entry: Waiting, turn: int) -> tuple[int, int, float, str]:
    """Sort key of ``entry`` when it is its tenant's ``turn``-th oldest (0-based) at its
    priority."""
    return (-entry.priority, turn, entry.enqueued, entry.name)


def ordered(entries: Iterable[Waiting]) -> list[Waiting]:
    """``entries`` in the order they are served (see the module docstring)."""
    by_class: dict[tuple[int, str], list[Waiting]] = defaultdict(list)
    for entry in entries:
        by_class[(entry.priority, entry.tenant)].append(entry)
    keyed: list[tuple[tuple[int, int, float, str], Waiting]] = []
    for group in by_class.values():
        group.sort(key=lambda e: (e.enqueued, e.name))
        keyed.extend((order_key(entry, turn), entry) for turn, entry in enumerate(group))
    keyed.sort(key=lambda pair: pair[0])
    return [entry for _, entry in keyed]


__all__ = ["Waiting", "order_key", "ordered"]
