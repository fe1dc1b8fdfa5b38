"""The node controller: turns host-agent status into node and GPU state.

Level-based: for each node or GPU that may need attention it reads the current records
from the cache and commits the one transition they call for, comparing revisions, so
running it twice, or in several brokers at once, is safe (the loser's compare fails and
it simply looks again). Transitions:

* PENDING/ATTACHING -> ATTACHING when the agent reports any GPU ATTACHING;
* PENDING/ATTACHING -> READY when every GPU is ATTACHED for the node's generation
  (GPUs go ATTACHED and learn their UUID and serial);
* PENDING/ATTACHING -> FAILED when the agent reports an attach FAILED, or the attach
  deadline passes; the node's GPUs go DETACHING and leave the host's allocation;
* GPU DETACHING -> FREE once its host's status no longer lists it (the agent removes an
  entry only after the detach succeeded);
* RELEASING -> RELEASED once the node owns no GPU.

It wakes on cache changes to nodes, GPUs and host statuses (waiting ``coalesce_s`` so a
burst of changes is handled in one pass), and sweeps everything every
``sweep_interval_s`` to catch deadlines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker import metrics
from dxpool.broker.cache import Cache
from dxpool.broker.compose import detach_txn
from dxpool.broker.records import copy, seconds, timestamp
from dxpool.broker.store import Store, Txn, Versioned
from dxpool.names import parse_gpu, parse_host, parse_node
from dxpool.store import keys as k

log = logging.getLogger(__name__)

PENDING_STATES = (pb.NODE_STATE_PENDING, pb.NODE_STATE_ATTACHING)


class NodeController:
    """Runs in a thread of the broker; ``start``/``stop``."""

    def __init__(
        self,
        store: Store,
        cache: Cache,
        *,
        sweep_interval_s: float = 1.0,
        coalesce_s: float = 0.005,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._cache = cache
        self._sweep_interval_s = sweep_interval_s
        self._coalesce_s = coalesce_s
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._dirty_nodes: set[str] = set()
        self._dirty_gpus: set[str] = set()
        self._dirty_hosts: set[str] = set()
        # host id -> GPUs (cache ids "box/slot") assigned to it, so a host status change
        # touches that host's GPUs only.
        self._gpus_by_host: dict[str, set[str]] = {}
        self._host_of_gpu: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        self._unsubscribe = self._cache.subscribe(self._on_change)
        with self._lock:
            for name, record in self._cache.items(k.GPUS):
                self._index_gpu(name, record.value.host)
        self._thread = threading.Thread(target=self._run, name="node-controller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._unsubscribe:
            self._unsubscribe()
        if self._thread:
            self._thread.join(timeout=5)

    def _on_change(self, collection: str, name: str, record: Versioned[Any] | None) -> None:
        with self._lock:
            if collection == k.NODES:
                self._dirty_nodes.add(name)
            elif collection == k.GPUS:
                self._dirty_gpus.add(name)
                self._index_gpu(name, record.value.host if record is not None else "")
            elif collection == k.HOST_STATUSES:
                self._dirty_hosts.add(name)
            else:
                return
        self._wake.set()

    def _index_gpu(self, name: str, host: str) -> None:
        """Keep ``_gpus_by_host`` current; called with ``_lock`` held."""
        host_id = host.removeprefix("hosts/")
        previous = self._host_of_gpu.get(name, "")
        if previous == host_id:
            return
        if previous:
            self._gpus_by_host[previous].discard(name)
            if not self._gpus_by_host[previous]:
                del self._gpus_by_host[previous]
            del self._host_of_gpu[name]
        if host_id:
            self._gpus_by_host.setdefault(host_id, set()).add(name)
            self._host_of_gpu[name] = host_id

    def _run(self) -> None:
        next_sweep = 0.0
        while not self._stop.is_set():
            if self._wake.wait(timeout=self._sweep_interval_s) and self._coalesce_s:
                # Let a burst of changes land before acting: one pass handles them all,
                # and the pass stays off the path of the RPC that caused the change.
                self._stop.wait(self._coalesce_s)
            self._wake.clear()
            try:
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self._sweep_interval_s
                    self.sweep()
                else:
                    self._process_dirty()
            except Exception:
                log.exception("node controller pass failed; retrying on the next pass")
                time.sleep(0.1)

    # -- passes ----------------------------------------------------------------------

    def sweep(self) -> None:
        """Look at every non-terminal node and every DETACHING GPU."""
        with self._lock:
            self._dirty_nodes.clear()
            self._dirty_gpus.clear()
            self._dirty_hosts.clear()
        for name, record in self._cache.items(k.GPUS):
            if record.value.state == pb.GPU_STATE_DETACHING:
                self._reconcile_gpu(name)
        for name, record in self._cache.items(k.NODES):
            if record.value.state != pb.NODE_STATE_RELEASED:
                self._reconcile_node(name)

    def _process_dirty(self) -> None:
        with self._lock:
            nodes, self._dirty_nodes = self._dirty_nodes, set()
            gpus, self._dirty_gpus = self._dirty_gpus, set()
            hosts, self._dirty_hosts = self._dirty_hosts, set()
            for host in hosts:
                gpus |= self._gpus_by_host.get(host, set())
        for name in sorted(gpus):
            current = self._cache.get(k.GPUS, name)
            if current is not None and current.value.state == pb.GPU_STATE_DETACHING:
                self._reconcile_gpu(name)
            if current is not None and current.value.node:
                nodes.add(parse_node(current.value.node))
        for name in sorted(nodes):
            self._reconcile_node(name)

    # -- one node --------------------------------------------------------------------

    def _reconcile_node(self, node_id: str) -> None:
        record = self._cache.get(k.NODES, node_id)
        if record is None:
            return
        node: pb.VirtualNode = record.value
        if node.state in PENDING_STATES:
            self._advance_attach(record)
        elif node.state == pb.NODE_STATE_RELEASING and not self._owned_gpus(node):
            self._set_node_state(record, pb.NODE_STATE_RELEASED, "all GPUs detached")

    def _owned_gpus(self, node: pb.VirtualNode) -> list[str]:
        owned = []
        for binding in node.gpus:
            ref = parse_gpu(binding.gpu)
            gpu = self._cache.get(k.GPUS, f"{ref.box}/{ref.slot}")
            if gpu is not None and gpu.value.node == node.name:
                owned.append(binding.gpu)
        return owned

    def _advance_attach(self, record: Versioned[pb.VirtualNode]) -> None:
        node = record.value
        host_id = parse_host(node.host)
        status_record = self._cache.get(k.HOST_STATUSES, host_id)
        observed = {a.gpu: a for a in (status_record.value.attachments if status_record else ())}
        gpus: dict[str, Versioned[pb.Gpu]] = {}
        for binding in node.gpus:
            ref = parse_gpu(binding.gpu)
            gpu = self._cache.get(k.GPUS, f"{ref.box}/{ref.slot}")
            if gpu is None or gpu.value.node != node.name:
                self._fail(record, f"{binding.gpu} was taken away from the node")
                return
            gpus[binding.gpu] = gpu
        current = {
            name: observed[name]
            for name, gpu in gpus.items()
            if name in observed and observed[name].generation == gpu.value.generation
        }
        failed = [a for a in current.values() if a.phase == pb.ATTACHMENT_PHASE_FAILED]
        if failed:
            detail = "; ".join(f"{a.gpu}: {a.message}" for a in failed)
            self._fail(record, f"attach failed on {node.host}: {detail}")
            return
        if len(current) == len(gpus) and all(
            a.phase == pb.ATTACHMENT_PHASE_ATTACHED for a in current.values()
        ):
            self._mark_ready(record, gpus, current)
            return
        if self._clock() > seconds(node.attach_deadline):
            alive = self._cache.get(k.HOST_LEASES, host_id) is not None
            hint = "" if alive else f"; the agent of {node.host} is not running"
            self._fail(
                record,
                f"attach did not finish before the deadline ({len(current)} of "
                f"{len(gpus)} GPUs reported){hint}",
            )
            return
        if node.state == pb.NODE_STATE_PENDING and any(
            a.phase == pb.ATTACHMENT_PHASE_ATTACHING for a in current.values()
        ):
            updated = copy(node)
            for binding in updated.gpus:
                seen = current.get(binding.gpu)
                if seen is not None:
                    binding.phase = seen.phase
            self._set_node_state(
                record, pb.NODE_STATE_ATTACHING, "the host agent is attaching GPUs", updated
            )

    def _mark_ready(
        self,
        record: Versioned[pb.VirtualNode],
        gpus: dict[str, Versioned[pb.Gpu]],
        observed: dict[str, pb.ObservedAttachment],
    ) -> None:
        node = copy(record.value)
        now = self._clock()
        node.state = pb.NODE_STATE_READY
        node.message = "all GPUs attached and verified"
        node.update_time.CopyFrom(timestamp(now))
        node.ready_time.CopyFrom(timestamp(now))
        keys = self._store.keys
        txn = Txn()
        for binding in node.gpus:
            seen = observed[binding.gpu]
            binding.phase = pb.ATTACHMENT_PHASE_ATTACHED
            binding.bdf = seen.bdf
            binding.uuid = seen.uuid
            gpu_record = gpus[binding.gpu]
            gpu = copy(gpu_record.value)
            gpu.state = pb.GPU_STATE_ATTACHED
            gpu.uuid = seen.uuid or gpu.uuid
            gpu.serial = seen.serial or gpu.serial
            if seen.health != pb.GPU_HEALTH_UNSPECIFIED:
                gpu.health = seen.health
            ref = parse_gpu(gpu.name)
            gpu_key = keys.gpu(ref.box, ref.slot)
            txn.expect_revision(gpu_key, gpu_record.mod_revision).put(gpu_key, gpu)
        node_key = keys.node(parse_node(node.name))
        txn.expect_revision(node_key, record.mod_revision).put(node_key, node)
        self._commit(txn, "ready", node.name)

    def _fail(self, record: Versioned[pb.VirtualNode], message: str) -> None:
        log.warning("node failed", extra={"node": record.value.name, "reason": message})
        txn = detach_txn(
            self._store, self._cache, record, pb.NODE_STATE_FAILED, message, self._clock()
        )
        self._commit(txn, "failed", record.value.name)

    def _set_node_state(
        self,
        record: Versioned[pb.VirtualNode],
        state: pb.NodeState.ValueType,
        message: str,
        updated: pb.VirtualNode | None = None,
    ) -> None:
        node = updated if updated is not None else copy(record.value)
        node.state = state
        node.message = message
        node.update_time.CopyFrom(timestamp(self._clock()))
        key = self._store.keys.node(parse_node(node.name))
        txn = Txn().expect_revision(key, record.mod_revision).put(key, node)
        self._commit(txn, pb.NodeState.Name(state), node.name)

    # -- one GPU ---------------------------------------------------------------------

    def _reconcile_gpu(self, name: str) -> None:
        """Free a DETACHING GPU once its host's status no longer lists it."""
        record = self._cache.get(k.GPUS, name)
        if record is None or record.value.state != pb.GPU_STATE_DETACHING:
            return
        gpu: pb.Gpu = record.value
        host_id = parse_host(gpu.host) if gpu.host else ""
        status_record = self._cache.get(k.HOST_STATUSES, host_id) if host_id else None
        if status_record is not None and any(
            a.gpu == gpu.name for a in status_record.value.attachments
        ):
            return
        freed = copy(gpu)
        owner = freed.node
        freed.state = pb.GPU_STATE_FREE
        freed.node = ""
        freed.host = ""
        freed.host_slot = 0
        freed.message = ""
        ref = parse_gpu(gpu.name)
        keys = self._store.keys
        gpu_key = keys.gpu(ref.box, ref.slot)
        status_key = keys.host_status(host_id) if host_id else None
        txn = Txn().expect_revision(gpu_key, record.mod_revision).put(gpu_key, freed)
        if status_key:
            txn.expect_revision(status_key, status_record.mod_revision if status_record else 0)
        if self._commit(txn, None, gpu.name):
            metrics.GPU_FREED.inc()
            if owner:
                self._reconcile_node(parse_node(owner))

    def _commit(self, txn: Txn, state: str | None, subject: str) -> bool:
        result = self._store.commit(txn)
        if not result.succeeded:
            log.debug("controller transition lost a compare", extra={"subject": subject})
            return False
        self._cache.apply_commit(result.revision, txn.writes)
        if state is not None:
            metrics.NODE_TRANSITIONS.labels(state=state).inc()
        return True
