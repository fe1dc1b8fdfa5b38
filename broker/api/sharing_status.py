"""The queue, preemptions and cordons in the pool's status (``dxpool status``).

Kept cheap like the rest of GetPoolStatus (:mod:`dxpool.broker.state.pool_tally`): the queue
comes from the queue index (waiting requests only), notices from their own index, and
cordoned hosts from a set kept current by cache events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dxpool.api.v1 import inventory_pb2 as inv
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.notices import Notices
from dxpool.broker.state.cache import Cache, Routes
from dxpool.broker.state.queue_index import QueueIndex
from dxpool.names import parse_gang, parse_node
from dxpool.store.typed import Versioned


class SharingStatus:
    """Fills the sharing part of a PoolStatus. Thread-safe."""

    def __init__(
        self,
        cache: Cache,
        queue: QueueIndex,
        notices: Notices,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._cache = cache
        self._queue = queue
        self._notices = notices
        self._clock = clock
        self._lock = threading.Lock()
        self._cordoned: set[str] = set()
        self._unsubscribe = cache.subscribe(
            Routes().on(cache.host_allocations, self._on_allocation)
        )
        for name, record in cache.host_allocations.items():
            self._on_allocation(name, record)

    def close(self) -> None:
        self._unsubscribe()

    def _on_allocation(self, name: str, record: Versioned[pb.HostAllocation] | None) -> None:
        with self._lock:
            if record is not None and record.value.unschedulable:
                self._cordoned.add(name)
            else:
                self._cordoned.discard(name)

    def fill(self, status: inv.PoolStatus) -> None:
        now = self._clock()
        tenants: dict[str, inv.TenantQueue] = {}
        for entry in self._queue.ordered():
            summary = tenants.get(entry.tenant)
            if summary is None:
                summary = tenants[entry.tenant] = inv.TenantQueue(
                    tenant=entry.tenant, head_reason=self._reason(entry.name)
                )
            summary.waiting += 1
            summary.gpus += entry.gpus
            summary.oldest_wait_s = max(summary.oldest_wait_s, 0.0, now - entry.enqueued)
        status.queue.extend(tenants[name] for name in sorted(tenants))
        status.preemptions_pending = self._notices.pending()
        with self._lock:
            status.hosts_cordoned = len(self._cordoned)

    def _reason(self, name: str) -> str:
        if name.startswith("gangs/"):
            gang = self._cache.gangs.get(parse_gang(name))
            return str(gang.value.queue.reason) if gang is not None else ""
        node = self._cache.nodes.get(parse_node(name))
        return str(node.value.queue.reason) if node is not None else ""


__all__ = ["SharingStatus"]
