"""The queue as this broker's cache shows it: every QUEUED node and gang, in order.

The queue lives in etcd: a waiting request is its QUEUED node record (or a queued gang's
record, ``gangs/{gang}``), so it survives any broker, and serving it is one
compare-and-swap on that record (:mod:`dxpool.broker.nodes.admission`). This index keeps, from
cache events, what the order needs of each waiting request
(:class:`~dxpool.broker.state.queue_order.Waiting`), and answers the order, positions, and
whether any request is taking lent capacity back (``QueueStatus.reclaiming``), which
pauses lending (:mod:`dxpool.broker.nodes.compose_gate`).

Listeners must not block (they run on the cache's threads), so a change only updates a
dictionary; the order is computed when read and kept until the next change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.state.cache import Cache, Routes
from dxpool.broker.state.queue_order import Waiting, ordered
from dxpool.broker.state.records import seconds
from dxpool.request import model_set
from dxpool.store.typed import Versioned


def node_waiting(node: pb.VirtualNode) -> Waiting:
    """A QUEUED node as the order sees it."""
    return Waiting(
        name=node.name,
        tenant=node.spec.tenant,
        priority=node.spec.priority,
        enqueued=seconds(node.queue.enqueue_time),
        gpus=node.spec.gpus.count,
        model=node.spec.gpus.model,
    )


def gang_waiting(gang: pb.GangRecord) -> Waiting:
    """A QUEUED gang as the order sees it: its first member's tenant and priority (a
    gang's members share them), every member's GPUs."""
    first = gang.members[0] if gang.members else pb.NodeSpec()
    if len(gang.members) == 1:
        gpus = first.gpus.count * max(gang.size, 1)
    else:
        gpus = sum(spec.gpus.count for spec in gang.members)
    return Waiting(
        name=gang.name,
        tenant=first.tenant,
        priority=first.priority,
        enqueued=seconds(gang.queue.enqueue_time),
        gpus=gpus,
        model=first.gpus.model,
    )


def models_overlap(a: str, b: str) -> bool:
    """Whether requests for models ``a`` and ``b`` (each a model, a set "X|Y", or ""
    for any) could want the same GPUs."""
    if not a or not b:
        return True
    return bool({m.lower() for m in model_set(a)} & {m.lower() for m in model_set(b)})


class QueueIndex:
    """Waiting requests from ``cache``; thread-safe. ``close`` unsubscribes."""

    def __init__(self, cache: Cache) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, Waiting] = {}
        self._reclaiming: dict[str, str] = {}  # name -> model of a reclaiming request
        self._order: list[Waiting] | None = None
        self._positions: dict[str, int] = {}
        self._listeners: list[Callable[[], None]] = []
        self._unsubscribe = cache.subscribe(
            Routes().on(cache.nodes, self._on_node).on(cache.gangs, self._on_gang)
        )
        for name, record in cache.nodes.items():
            self._on_node(name, record)
        for name, gang in cache.gangs.items():
            self._on_gang(name, gang)

    def close(self) -> None:
        self._unsubscribe()

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (which must not block) whenever a request starts or stops
        waiting or its record changes."""
        self._listeners.append(listener)

    def _on_node(self, name: str, record: Versioned[pb.VirtualNode] | None) -> None:
        value = record.value if record is not None else None
        entry: Waiting | None = None
        if value is not None and value.state == pb.NODE_STATE_QUEUED:
            entry = node_waiting(value)
        self._note(f"nodes/{name}", entry, value is not None and value.queue.reclaiming)

    def _on_gang(self, name: str, record: Versioned[pb.GangRecord] | None) -> None:
        value = record.value if record is not None else None
        entry: Waiting | None = None
        if value is not None and value.state == pb.GANG_STATE_QUEUED:
            entry = gang_waiting(value)
        self._note(f"gangs/{name}", entry, value is not None and value.queue.reclaiming)

    def _note(self, key: str, entry: Waiting | None, reclaiming: bool) -> None:
        """Request ``key`` waits as ``entry`` now (None: it does not wait), reclaiming
        GPUs lent out or not; tells the listeners."""
        with self._lock:
            known = key in self._waiting
            if entry is None and not known:
                return
            if entry is None:
                del self._waiting[key]
                self._reclaiming.pop(key, None)
            else:
                self._waiting[key] = entry
                if reclaiming:
                    self._reclaiming[key] = entry.model
                else:
                    self._reclaiming.pop(key, None)
            self._order = None
        for listener in self._listeners:
            listener()

    def ordered(self) -> list[Waiting]:
        """Every waiting request, in the order they are served."""
        with self._lock:
            if self._order is None:
                self._order = ordered(self._waiting.values())
                self._positions = {entry.name: i + 1 for i, entry in enumerate(self._order)}
            return list(self._order)

    def position(self, name: str) -> int:
        """1 for the next request served; 0 when ``name`` does not wait."""
        self.ordered()
        with self._lock:
            return self._positions.get(name, 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)

    def reclaiming(self, model: str = "") -> list[str]:
        """The waiting requests taking lent capacity back for GPUs that a request of
        ``model`` ("" any) could also want, by name."""
        with self._lock:
            return sorted(n for n, m in self._reclaiming.items() if models_overlap(m, model))


__all__ = ["QueueIndex", "gang_waiting", "models_overlap", "node_waiting"]
