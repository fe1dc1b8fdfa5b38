"""Singleton duties, run by the elected leader among the brokers.

* **Host loss.** A host whose liveness record is gone (no broker holds a session of its
  agent: the agent fell silent for its liveness TTL, or said goodbye for good) while
  GPUs are on it is lost once the record has been absent for ``host_loss_grace_s`` and
  ``reconnect_grace_s`` has passed since this broker became the leader and since it last
  saw etcd unreachable or its cache stale: a broker that starts, a leader that changes
  and an etcd that restarts give agents time to reconnect before any host is declared
  lost. Each of its PENDING, ATTACHING or READY nodes becomes LOST, and every GPU on it
  goes FENCING, in transactions that also require the liveness record to be still
  absent - a host that came back in time keeps its nodes. A host whose record went
  with its *broker* (the broker's registration, on the same lease, is gone too: the
  broker died, not the agent) gets the reconnect grace as well, counted from when its
  record went, since its agent is reconnecting to another broker.
* **Fencing and reclaim.** For each FENCING GPU the leader asks the box side to revoke
  every mapping made for the GPU's generation (:mod:`dxpool.broker.control.box_fabric`), scrubs
  it, and only then frees it, comparing the GPU's revision. A GPU whose fence or scrub
  keeps failing is QUARANTINED. Without a box fabric configured, FENCING GPUs wait: no
  GPU of a lost host is reused until the box side has revoked the dead host's access.
* **Garbage collection.** RELEASED nodes, and the request ids that name them, are deleted
  ``retention_s`` after their release: request ids are idempotency keys for that long.
  The released nodes wait in a heap by release time, so a pass looks at the nodes due
  and no other: an hour of retention at a high release rate keeps hundreds of
  thousands of them.

Why it is safe when the host is merely partitioned, not dead: the fence is done at the
box side, which the partitioned host cannot reach around; its agent, once its session
is gone, can no longer write status (a broker writes status only for the session the
liveness record names) and its late maps carry a fenced generation and are refused by
the box side. When it returns, it opens a new session, finds nothing wanted of it, and
detaches what its host side still holds.

Attach deadlines are the node controller's, checked there only while this broker leads.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.agent_sessions import parse_liveness
from dxpool.broker.control.box_fabric import BoxFabric, BoxFabricError
from dxpool.broker.nodes.forget import forget_released
from dxpool.broker.nodes.transitions import drop_release, let_go
from dxpool.broker.state import metrics
from dxpool.broker.state.cache import Cache, Routes
from dxpool.broker.state.records import copy, seconds
from dxpool.broker.state.stm import PASS_ATTEMPTS, TxnView, transact
from dxpool.errors import DxpoolError, Unavailable
from dxpool.names import parse_gpu, parse_host
from dxpool.store import keys as k
from dxpool.store.typed import Store, Versioned

log = logging.getLogger(__name__)

LEASE_HOLDING_STATES = frozenset(
    {pb.GPU_STATE_ATTACHING, pb.GPU_STATE_ATTACHED, pb.GPU_STATE_DETACHING}
)
NO_FABRIC_MESSAGE = (
    "fencing: waiting for the box side to revoke the lost host's access; no box fabric is "
    "configured (start the broker with --fabric)"
)


DEFAULT_RECONNECT_GRACE_S = 30.0


@dataclass(frozen=True)
class DutySettings:
    interval_s: float = 0.25
    host_loss_grace_s: float = 0.0
    # Agents' time to come back after this broker became the leader or saw etcd again.
    reconnect_grace_s: float = DEFAULT_RECONNECT_GRACE_S
    fence_attempts: int = 5
    retention_s: float = 3600.0


class SingletonDuties:
    """Runs the duties every ``interval_s`` while ``is_leader()``; ``start``/``stop``."""

    def __init__(
        self,
        store: Store,
        cache: Cache,
        box_fabric: BoxFabric | None,
        is_leader: Callable[[], bool],
        settings: DutySettings = DutySettings(),
        *,
        clock: Callable[[], float] = time.time,
        settled: Callable[[], bool] = lambda: True,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``settled()`` says whether this broker sees etcd as it is now (reachable, its
        cache current); while it does not, and for ``reconnect_grace_s`` after, no host
        is declared lost. ``clock`` is wall time (release times), ``monotonic`` times
        absences and graces."""
        self._store = store
        self._cache = cache
        self._fabric = box_fabric
        self._is_leader = is_leader
        self._settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._host_of: dict[str, str] = {}  # GPU id -> host id, while its lease matters
        self._on_host: dict[str, set[str]] = {}  # host id -> those GPU ids
        self._fencing: set[str] = set()
        # node id -> release time (update_time of the RELEASED record), and the same as a
        # heap of (time, node id); heap entries whose time no longer matches are stale
        self._released_at: dict[str, float] = {}
        self._release_heap: list[tuple[float, str]] = []
        self._absent_since: dict[str, float] = {}
        # host id -> the broker that held its agent's session, as last seen
        self._holder: dict[str, str] = {}
        self._settled = settled
        self._monotonic = monotonic
        # When the agents' reconnect grace last started: this broker began to lead, or
        # saw etcd again after it was unreachable or the cache stale. None: not leading,
        # or not seeing etcd now.
        self._calm_since: float | None = None
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        cache = self._cache
        self._unsubscribe = cache.subscribe(
            Routes()
            .on(cache.gpus, self._on_gpu)
            .on(cache.host_leases, self._on_lease)
            .on(cache.nodes, self._on_node)
        )
        for name, record in cache.gpus.items():
            self._on_gpu(name, record)
        for name, node in cache.nodes.items():
            self._on_node(name, node)
        for name, lease in cache.host_leases.items():
            self._on_lease(name, lease)
        self._thread = threading.Thread(target=self._loop, name="leader-duties", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _on_gpu(self, name: str, record: Versioned[pb.Gpu] | None) -> None:
        with self._lock:
            gpu = record.value if record is not None else None
            host = (
                parse_host(gpu.host)
                if gpu is not None and gpu.state in LEASE_HOLDING_STATES and gpu.host
                else ""
            )
            previous = self._host_of.pop(name, "")
            if previous:
                self._on_host[previous].discard(name)
                if not self._on_host[previous]:
                    del self._on_host[previous]
            if host:
                self._host_of[name] = host
                self._on_host.setdefault(host, set()).add(name)
            if gpu is not None and gpu.state == pb.GPU_STATE_FENCING:
                self._fencing.add(name)
            else:
                self._fencing.discard(name)

    def _on_lease(self, name: str, record: Versioned[bytes] | None) -> None:
        with self._lock:
            if record is not None:
                self._holder[name] = parse_liveness(bytes(record.value)).broker

    def _on_node(self, name: str, record: Versioned[pb.VirtualNode] | None) -> None:
        with self._lock:
            if record is not None and record.value.state == pb.NODE_STATE_RELEASED:
                self._note_released(name, seconds(record.value.update_time))
            else:
                self._released_at.pop(name, None)

    def _note_released(self, node_id: str, at: float) -> None:
        """Under the lock: ``node_id`` was released at ``at``."""
        if self._released_at.get(node_id) != at:
            self._released_at[node_id] = at
            heapq.heappush(self._release_heap, (at, node_id))

    def _loop(self) -> None:
        while not self._stop.wait(self._settings.interval_s):
            if not self._is_leader():
                self._calm_since = None
                continue
            try:
                self.run_once()
            except Unavailable as error:
                # etcd is away; the store logs reachability changes once.
                log.debug("leader duties deferred", extra={"error": error.message})
            except DxpoolError as error:
                log.warning("leader duties failed; retrying", extra={"error": error.message})
            except Exception:
                log.exception("leader duties failed; retrying")

    def run_once(self) -> None:
        """One pass of every duty (also for tests, which drive it directly)."""
        self.handle_host_loss()
        self.reclaim_fencing()
        self.collect_garbage()

    # -- host loss ----------------------------------------------------------------------

    def handle_host_loss(self) -> None:
        """Declare lost the hosts with GPUs whose liveness record has been absent long
        enough (see the module docstring). Called while leading."""
        now = self._monotonic()
        if not self._settled():
            # etcd is away or the cache behind: what it shows cannot be trusted, and the
            # agents' grace starts over once it can.
            self._calm_since = None
            self._absent_since.clear()
            return
        if self._calm_since is None:
            # Leading just began, or etcd just came back: agents get their grace from
            # now, and absences seen before do not count.
            self._calm_since = now
            self._absent_since.clear()
        reconnected_by = self._calm_since + self._settings.reconnect_grace_s
        with self._lock:
            hosts = set(self._on_host)
        for host in list(self._absent_since):
            if host not in hosts:
                del self._absent_since[host]
        for host in sorted(hosts):
            if self._cache.host_leases.get(host) is not None:
                self._absent_since.pop(host, None)
                continue
            since = self._absent_since.setdefault(host, now)
            grace = self._settings.host_loss_grace_s
            if self._broker_gone(host):  # its agent is moving to another broker
                grace = max(grace, self._settings.reconnect_grace_s)
            if now - since >= grace and now >= reconnected_by:
                self._lose_host(host)

    def _broker_gone(self, host: str) -> bool:
        """Whether the broker that last held ``host``'s session is no longer registered
        (it died: its lease took its registration and its agents' records)."""
        with self._lock:
            holder = self._holder.get(host, "")
        return bool(holder) and self._cache.brokers.get(holder) is None

    def _lose_host(self, host: str) -> None:
        host_name = f"hosts/{host}"
        message = f"{host_name} was lost: no broker holds a session of its agent"
        lost_nodes = 0
        for node_id, record in self._cache.nodes.items():
            if record.value.host == host_name and record.value.state in (
                lifecycle.LOSABLE_NODE_STATES
            ):
                lost_nodes += bool(self._apply(self._lose_node(host, node_id, message), node_id))
        with self._lock:
            stray = sorted(self._on_host.get(host, ()))
        for gpu_id in stray:
            self._apply(self._fence_gpu(host, gpu_id, message), gpu_id)
        log.warning(
            "host lost; fencing its GPUs",
            extra={"host": host_name, "nodes": lost_nodes, "gpus": len(stray)},
        )

    def _lose_node(self, host: str, node_id: str, message: str) -> Callable[[TxnView], Any]:
        def body(view: TxnView) -> str | None:
            if view.host_leases.exists(host):
                return None  # the host came back
            record = view.nodes.get(node_id)
            if record is None or record.value.state not in lifecycle.LOSABLE_NODE_STATES:
                return None
            let_go(view, record.value, pb.NODE_STATE_LOST, message, self._clock(), fence=True)
            return "LOST"

        return body

    def _fence_gpu(self, host: str, gpu_id: str, message: str) -> Callable[[TxnView], Any]:
        def body(view: TxnView) -> str | None:
            if view.host_leases.exists(host):
                return None
            record = view.gpus.get(gpu_id)
            if record is None or record.value.state not in LEASE_HOLDING_STATES:
                return None
            if record.value.host != f"hosts/{host}":
                return None
            view.put(k.GPUS, gpu_id, lifecycle.begin_fence(record.value, f"fencing: {message}"))
            return "FENCING"

        return body

    # -- fencing and reclaim ------------------------------------------------------------

    def reclaim_fencing(self) -> None:
        now = time.monotonic()
        with self._lock:
            fencing = sorted(self._fencing)
        for gpu_id in fencing:
            if self._retry_at.get(gpu_id, 0.0) > now:
                continue
            record = self._cache.gpus.get(gpu_id)
            if record is None or record.value.state != pb.GPU_STATE_FENCING:
                continue
            gpu = record.value
            if self._fabric is None:
                if gpu.message != NO_FABRIC_MESSAGE:
                    self._apply(self._annotate(gpu_id, gpu.generation), gpu_id)
                continue
            ref = parse_gpu(gpu.name)
            try:
                self._fabric.fence(ref, gpu.generation)
                self._fabric.scrub(ref, gpu.generation)
            except BoxFabricError as error:
                self._fence_failed(gpu_id, gpu, str(error), now)
                continue
            self._failures.pop(gpu_id, None)
            self._retry_at.pop(gpu_id, None)
            if self._apply(self._free(gpu_id, gpu.generation), gpu_id) == "FREE":
                metrics.GPU_FREED.inc()
                log.info("gpu fenced, scrubbed and freed", extra={"gpu": gpu.name})

    def _fence_failed(self, gpu_id: str, gpu: pb.Gpu, error: str, now: float) -> None:
        count = self._failures.get(gpu_id, 0) + 1
        self._failures[gpu_id] = count
        self._retry_at[gpu_id] = now + min(10.0, self._settings.interval_s * 2**count)
        log.warning("fence or scrub failed", extra={"gpu": gpu.name, "attempt": count})
        if count < self._settings.fence_attempts:
            return
        reason = f"fence or scrub failed {count} times: {error}"

        def body(view: TxnView) -> str | None:
            record = view.gpus.get(gpu_id)
            if record is None or record.value.state != pb.GPU_STATE_FENCING:
                return None
            drop_release(view, record.value)
            view.put(k.GPUS, gpu_id, lifecycle.quarantine(record.value, reason))
            return "QUARANTINED"

        if self._apply(body, gpu_id):
            self._failures.pop(gpu_id, None)
            self._retry_at.pop(gpu_id, None)

    def _free(self, gpu_id: str, generation: int) -> Callable[[TxnView], Any]:
        def body(view: TxnView) -> str | None:
            record = view.gpus.get(gpu_id)
            if record is None or record.value.state != pb.GPU_STATE_FENCING:
                return None
            if record.value.generation != generation:
                return None  # not the assignment that was fenced
            drop_release(view, record.value)
            view.put(k.GPUS, gpu_id, lifecycle.free(record.value))
            return "FREE"

        return body

    def _annotate(self, gpu_id: str, generation: int) -> Callable[[TxnView], Any]:
        def body(view: TxnView) -> str | None:
            record = view.gpus.get(gpu_id)
            if record is None or record.value.state != pb.GPU_STATE_FENCING:
                return None
            if record.value.generation != generation:
                return None
            updated = copy(record.value)
            updated.message = NO_FABRIC_MESSAGE
            view.put(k.GPUS, gpu_id, updated)
            return None

        return body

    # -- garbage collection -------------------------------------------------------------

    def collect_garbage(self) -> None:
        """Delete the RELEASED nodes (and their request ids) released before the
        retention period; looks at those nodes only. One that could not be deleted now
        (etcd unreachable, lost compares) is tried again at the next pass."""
        cutoff = self._clock() - self._settings.retention_s
        due: list[tuple[float, str]] = []
        with self._lock:
            heap = self._release_heap
            while heap and heap[0][0] <= cutoff:
                at, node_id = heapq.heappop(heap)
                if self._released_at.get(node_id) == at:
                    due.append((at, node_id))
        for at, node_id in sorted(due, key=lambda item: item[1]):
            self._apply(self._forget_node(node_id, cutoff), node_id)
            record = self._cache.nodes.get(node_id)
            if record is not None and record.value.state == pb.NODE_STATE_RELEASED:
                with self._lock:
                    if self._released_at.get(node_id) == at:
                        heapq.heappush(self._release_heap, (at, node_id))

    def _forget_node(self, node_id: str, cutoff: float) -> Callable[[TxnView], Any]:
        def body(view: TxnView) -> str | None:
            return "DELETED" if forget_released(view, node_id, released_before=cutoff) else None

        return body

    # -- helpers ------------------------------------------------------------------------

    def _apply(self, body: Callable[[TxnView], Any], subject: str) -> Any:
        try:
            result = transact(
                self._store,
                self._cache,
                body,
                attempts=PASS_ATTEMPTS,
                what=subject,
                operation="duty",
            )
        except DxpoolError as error:
            log.debug("duty not committed", extra={"subject": subject, "error": str(error)})
            return None
        if result == "LOST":
            metrics.NODE_TRANSITIONS.labels(state=result).inc()
        return result


__all__ = ["DEFAULT_RECONNECT_GRACE_S", "DutySettings", "SingletonDuties"]
