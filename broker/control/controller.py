"""The node controller: turns host-agent status into node and GPU state.

Level-based: for each node or GPU that may need attention it reads the current records
from the cache and commits the one transition they call for, comparing revisions, so
running it twice, or in several brokers at once, is safe (the loser's compare fails and
it simply looks again). Transitions:

* PENDING/ATTACHING -> ATTACHING when the agent reports any GPU ATTACHING;
* PENDING/ATTACHING -> READY when every GPU is ATTACHED for the node's generation
  (GPUs go ATTACHED and learn their UUID and serial);
* PENDING/ATTACHING -> FAILED when the agent reports an attach FAILED, or the attach
  deadline passes (checked by the leader only); the node's GPUs go DETACHING (released
  through the agent, see below). A GPU whose identity is not the one recorded on its
  first attach (the agent found another UUID, serial, PCI id or model, or reports a
  UUID or serial other than the recorded one) is QUARANTINED as suspect instead. After
  such a mismatch the node fails only once every GPU's attach has an outcome (or the
  deadline passed), so each GPU the agent refuses is quarantined, none freed unchecked;
* GPU DETACHING -> FREE only when its host's agent reports it RELEASED for the GPU's
  generation: drained, reset and found healthy, then detached (or it never reached the
  host). No entry, or any other phase, frees nothing;
* GPU DETACHING -> QUARANTINED when the agent reports SCRUB_FAILED (the scrub or the
  detach failed); the GPU lets go of its node and is never handed out again.
  Either way the GPU's ``release`` attachment leaves the host's allocation in the same
  transaction, and only then does the agent drop its entry (and, after a failed scrub,
  the mapping), so the broker cannot miss the outcome;
* RELEASING -> RELEASED once the node owns no GPU, in the transaction that frees or
  quarantines its last GPUs when that is how it came to own none;
* READY/DEGRADED: the health the agent reports for each attached GPU (of the current
  generation) is copied into the GPU record; a node with an UNHEALTHY GPU goes
  DEGRADED, and back to READY when none is. The copy is a compare-and-swap on the GPU,
  the node and the host's status together, so a release or a fence committed meanwhile
  makes it look again instead of writing over them;
* RESIZING (a READY node growing or shrinking, see ``broker/nodes/resize.py``), growing ->
  READY when every GPU is ATTACHED (only the new ones are confirmed), or, when an added
  GPU's attach fails or the deadline passes, -> READY without the added GPUs, which go
  DETACHING and are released through the agent as above (suspects quarantined);
  shrinking -> READY without the leaving bindings once none of their GPUs names the node
  any more (the agent reported them RELEASED, or SCRUB_FAILED). The GPUs the node keeps
  are never touched. A charged node's usage loses the GPUs dropped from it in the
  transaction that drops their bindings. Health reports of a RESIZING node's GPUs are
  copied once it is READY again.

Every transition is a :func:`~dxpool.broker.state.stm.transact` body built from
:mod:`dxpool.lifecycle`.

It wakes on cache changes to nodes, GPUs and host statuses (waiting ``coalesce_s`` so a
burst of changes is handled in one pass) and looks at what they touched. Every
``sweep_interval_s`` it also looks at the attaching nodes whose attach deadline has
passed (kept in a heap by deadline, so a pass costs what is due, not every node in
flight). Every ``full_sweep_interval_s``, and on the pass after one that failed (etcd
away), it sweeps every node in flight and every DETACHING GPU, which catches whatever
a failed pass dropped.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.tenants import discharge_gpus
from dxpool.broker.nodes.transitions import (
    drop_release,
    gpu_id,
    identity_changed,
    let_go,
    owned_gpus,
)
from dxpool.broker.state import metrics
from dxpool.broker.state.cache import Cache, Routes
from dxpool.broker.state.records import seconds
from dxpool.broker.state.stm import PASS_ATTEMPTS, TxnView, transact
from dxpool.errors import Aborted, Unavailable
from dxpool.names import parse_host, parse_node
from dxpool.store import keys as k
from dxpool.store.typed import Store, Versioned

log = logging.getLogger(__name__)

# A settle transaction compares each GPU and the host's status and writes each GPU: 60
# GPUs stay well inside etcd's 128 operations per list.
GPUS_PER_TXN = 60


class NodeController:
    """Runs in a thread of the broker; ``start``/``stop``."""

    def __init__(
        self,
        store: Store,
        cache: Cache,
        *,
        sweep_interval_s: float = 1.0,
        full_sweep_interval_s: float = 30.0,
        coalesce_s: float = 0.005,
        clock: Callable[[], float] = time.time,
        is_leader: Callable[[], bool] = lambda: True,
    ) -> None:
        self._store = store
        self._cache = cache
        self._sweep_interval_s = sweep_interval_s
        self._full_sweep_interval_s = full_sweep_interval_s
        self._coalesce_s = coalesce_s
        self._clock = clock
        self._is_leader = is_leader
        self._failures: dict[str, str] = {}  # node -> why it failed, logged once committed
        # Health changes the last health pass wrote, logged once committed.
        self._health_changes: list[tuple[str, pb.Gpu]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._dirty_nodes: set[str] = set()
        self._dirty_gpus: set[str] = set()
        self._dirty_hosts: set[str] = set()
        # host id -> GPUs (cache ids "box/slot") assigned to it, so a host status change
        # touches that host's GPUs only.
        self._gpus_by_host: dict[str, set[str]] = {}
        self._host_of_gpu: dict[str, str] = {}
        # GPU id -> its owner node id, so a GPU that lets go of its node (freed,
        # quarantined) wakes that node (e.g. RELEASING -> RELEASED).
        self._owner_of_gpu: dict[str, str] = {}
        # What a sweep must look at, kept current from cache events so an idle sweep
        # costs O(work in flight), not O(pool): DETACHING GPUs, and nodes that are
        # attaching or releasing.
        self._detaching: set[str] = set()
        self._active_nodes: set[str] = set()
        # (attach deadline, node id) of every attaching node, a min-heap; an entry whose
        # node moved on (or got another deadline) is dropped when it comes due
        self._deadlines: list[tuple[float, str]] = []
        self._full_sweep_due = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        cache = self._cache
        self._unsubscribe = cache.subscribe(
            Routes()
            .on(cache.nodes, self._on_node)
            .on(cache.gpus, self._on_gpu)
            .on(cache.host_statuses, self._on_host_status)
        )
        with self._lock:
            for name, record in self._cache.gpus.items():
                self._index_gpu(name, record.value.host)
                self._track_gpu(name, record.value)
                if record.value.node:
                    self._owner_of_gpu[name] = parse_node(record.value.node)
            for name, node in self._cache.nodes.items():
                self._track_node(name, node.value)
        self._thread = threading.Thread(target=self._loop, name="node-controller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._unsubscribe:
            self._unsubscribe()
        if self._thread:
            self._thread.join(timeout=5)

    def _on_node(self, name: str, record: Versioned[pb.VirtualNode] | None) -> None:
        with self._lock:
            self._dirty_nodes.add(name)
            self._track_node(name, record.value if record is not None else None)
        self._wake.set()

    def _on_gpu(self, name: str, record: Versioned[pb.Gpu] | None) -> None:
        with self._lock:
            self._dirty_gpus.add(name)
            self._index_gpu(name, record.value.host if record is not None else "")
            self._track_gpu(name, record.value if record is not None else None)
            owner = parse_node(record.value.node) if record and record.value.node else ""
            previous = self._owner_of_gpu.pop(name, "")
            if previous and previous != owner:
                self._dirty_nodes.add(previous)
            if owner:
                self._owner_of_gpu[name] = owner
        self._wake.set()

    def _on_host_status(self, name: str, record: object) -> None:
        with self._lock:
            self._dirty_hosts.add(name)
        self._wake.set()

    def _track_gpu(self, name: str, gpu: pb.Gpu | None) -> None:
        """Keep ``_detaching`` current; called with ``_lock`` held."""
        if gpu is not None and gpu.state == pb.GPU_STATE_DETACHING:
            self._detaching.add(name)
        else:
            self._detaching.discard(name)

    def _track_node(self, name: str, node: pb.VirtualNode | None) -> None:
        """Keep ``_active_nodes`` and ``_deadlines`` current; called with ``_lock`` held."""
        if node is not None and (
            node.state in lifecycle.ATTACHING_NODE_STATES or node.state == pb.NODE_STATE_RELEASING
        ):
            self._active_nodes.add(name)
        else:
            self._active_nodes.discard(name)
        if node is not None and node.state in lifecycle.ATTACHING_NODE_STATES:
            heapq.heappush(self._deadlines, (seconds(node.attach_deadline), name))

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

    def _loop(self) -> None:
        next_tick = 0.0
        next_full_sweep = 0.0
        while not self._stop.is_set():
            if self._wake.wait(timeout=self._sweep_interval_s) and self._coalesce_s:
                # Let a burst of changes land before acting: one pass handles them all,
                # and the pass stays off the path of the RPC that caused the change.
                self._stop.wait(self._coalesce_s)
            self._wake.clear()
            try:
                now = time.monotonic()
                if now >= next_full_sweep or self._full_sweep_due:
                    self._full_sweep_due = False
                    next_full_sweep = now + self._full_sweep_interval_s
                    next_tick = now + self._sweep_interval_s
                    self.sweep()
                    continue
                self._process_dirty()
                if now >= next_tick:
                    next_tick = now + self._sweep_interval_s
                    self._process_deadlines()
            except Unavailable as error:
                # etcd is away; the store logs reachability changes once, so a pass that
                # fails for it says so only at debug level. The next pass sweeps all.
                self._full_sweep_due = True
                log.debug("node controller pass deferred", extra={"error": error.message})
                self._stop.wait(self._sweep_interval_s)
            except Exception:
                self._full_sweep_due = True
                log.exception("node controller pass failed; sweeping on the next pass")
                time.sleep(0.1)

    # -- passes ----------------------------------------------------------------------

    def sweep(self) -> None:
        """Look at every DETACHING GPU and every node still attaching or releasing (kept
        as sets from cache events; before :meth:`start`, found by a full scan)."""
        with self._lock:
            self._dirty_nodes.clear()
            self._dirty_gpus.clear()
            self._dirty_hosts.clear()
            if self._unsubscribe is None:  # not started: nothing tracks the sets
                for name, record in self._cache.gpus.items():
                    self._track_gpu(name, record.value)
                for name, node in self._cache.nodes.items():
                    self._track_node(name, node.value)
            detaching = sorted(self._detaching)
            active = sorted(self._active_nodes)
        self._reconcile_gpus(detaching)
        for name in active:
            self._reconcile_node(name)

    def _process_deadlines(self) -> None:
        """Look at every attaching node whose attach deadline has passed. One still
        attaching afterwards (this broker is not the leader, or the transition lost its
        compares) stays due, and is looked at again on the next tick."""
        now = self._clock()
        due: set[str] = set()
        with self._lock:
            while self._deadlines and self._deadlines[0][0] < now:
                due.add(heapq.heappop(self._deadlines)[1])
        for name in sorted(due):
            record = self._cache.nodes.get(name)
            if record is None or record.value.state not in lifecycle.ATTACHING_NODE_STATES:
                continue
            self._reconcile_node(name)
        with self._lock:
            for name in due:
                record = self._cache.nodes.get(name)
                if record is not None and record.value.state in lifecycle.ATTACHING_NODE_STATES:
                    heapq.heappush(self._deadlines, (seconds(record.value.attach_deadline), name))

    def _process_dirty(self) -> None:
        with self._lock:
            nodes, self._dirty_nodes = self._dirty_nodes, set()
            gpus, self._dirty_gpus = self._dirty_gpus, set()
            hosts, self._dirty_hosts = self._dirty_hosts, set()
            for host in hosts:
                gpus |= self._gpus_by_host.get(host, set())
        detaching = []
        for name in sorted(gpus):
            current = self._cache.gpus.get(name)
            if current is not None and current.value.state == pb.GPU_STATE_DETACHING:
                detaching.append(name)
            if current is not None and current.value.node:
                nodes.add(parse_node(current.value.node))
        self._reconcile_gpus(detaching)
        for name in sorted(nodes):
            self._reconcile_node(name)

    # -- one node --------------------------------------------------------------------

    def _reconcile_node(self, node_id: str) -> None:
        record = self._cache.nodes.get(node_id)
        if record is None:
            return
        state = record.value.state
        if state in lifecycle.ATTACHING_NODE_STATES:
            self._run(lambda view: self._advance_attach(view, node_id), node_id)
        elif state == pb.NODE_STATE_RELEASING:
            self._run(lambda view: self._finish_release(view, node_id), node_id)
        elif state in lifecycle.IN_USE_NODE_STATES:
            self._run(lambda view: self._follow_health(view, node_id), node_id)

    def _follow_health(self, view: TxnView, node_id: str) -> str | None:
        """Copy the agent's health reports into the node's GPUs; READY <-> DEGRADED.
        Returns the state the node moved to, if any."""
        self._health_changes.clear()  # this attempt's, not a lost one's
        record = view.nodes.get(node_id)
        if record is None or record.value.state not in lifecycle.IN_USE_NODE_STATES:
            return None
        node = record.value
        status_record = view.host_statuses.get(parse_host(node.host))
        observed = {a.gpu: a for a in (status_record.value.attachments if status_record else ())}
        unhealthy: list[str] = []
        for binding in node.gpus:
            key = gpu_id(binding.gpu)
            gpu_record = view.gpus.get(key)
            if gpu_record is None or gpu_record.value.node != node.name:
                continue
            gpu = gpu_record.value
            seen = observed.get(binding.gpu)
            if (
                seen is not None
                and seen.generation == gpu.generation
                and seen.phase == pb.ATTACHMENT_PHASE_ATTACHED
            ):
                updated = lifecycle.health_observed(gpu, seen)
                if updated is not None:
                    view.put(k.GPUS, key, updated)
                    self._health_changes.append((binding.gpu, updated))
                    gpu = updated
            if gpu.health == pb.GPU_HEALTH_UNHEALTHY:
                unhealthy.append(f"{binding.gpu}: {gpu.health_reason or 'unhealthy'}")
        now = self._clock()
        if unhealthy and node.state == pb.NODE_STATE_READY:
            message = "GPU unhealthy: " + "; ".join(unhealthy)
            view.put(
                k.NODES, node_id, lifecycle.node_to(node, pb.NODE_STATE_DEGRADED, message, now)
            )
            return "DEGRADED"
        if not unhealthy and node.state == pb.NODE_STATE_DEGRADED:
            message = "all GPUs healthy again"
            view.put(k.NODES, node_id, lifecycle.node_to(node, pb.NODE_STATE_READY, message, now))
            return "READY"
        return None

    def _finish_release(self, view: TxnView, node_id: str) -> str | None:
        record = view.nodes.get(node_id)
        if record is None or record.value.state != pb.NODE_STATE_RELEASING:
            return None
        if owned_gpus(view, record.value):
            return None
        view.put(
            k.NODES,
            node_id,
            lifecycle.node_to(
                record.value, pb.NODE_STATE_RELEASED, "all GPUs let go", self._clock()
            ),
        )
        return "RELEASED"

    def _advance_attach(self, view: TxnView, node_id: str) -> str | None:
        """One step of an attaching node; returns the state it moved to, if any."""
        record = view.nodes.get(node_id)
        if record is None or record.value.state not in lifecycle.ATTACHING_NODE_STATES:
            return None
        node = record.value
        leaving = [b for b in node.gpus if b.phase == pb.ATTACHMENT_PHASE_DETACHING]
        if node.state == pb.NODE_STATE_RESIZING and leaving:
            return self._advance_shrink(view, node, leaving)
        host_id = parse_host(node.host)
        status_record = view.host_statuses.get(host_id)
        observed = {a.gpu: a for a in (status_record.value.attachments if status_record else ())}
        gpus: dict[str, Versioned[pb.Gpu]] = {}
        for binding in node.gpus:
            gpu = view.gpus.get(gpu_id(binding.gpu))
            if gpu is None or gpu.value.node != node.name:
                return self._fail(view, node, f"{binding.gpu} was taken away from the node")
            gpus[binding.gpu] = gpu
        current = {
            name: observed[name]
            for name, gpu in gpus.items()
            if name in observed and observed[name].generation == gpu.value.generation
        }
        failed = [a for a in current.values() if a.phase == pb.ATTACHMENT_PHASE_FAILED]
        now = self._clock()
        if failed and not _awaiting_verdicts(failed, current, gpus, node, now):
            detail = "; ".join(f"{a.gpu}: {a.message}" for a in failed)
            suspects = {a.gpu: a.message for a in failed if a.identity_mismatch}
            for name, seen in current.items():
                if seen.phase == pb.ATTACHMENT_PHASE_ATTACHED:
                    problem = identity_changed(gpus[name].value, seen)
                    if problem is not None:
                        suspects[name] = problem
            return self._fail(
                view,
                node,
                f"attach failed on {node.host}: {detail}",
                suspects,
                reason="AttachFailed",
            )
        if failed:
            return None  # the other GPUs' verdicts first (see _awaiting_verdicts)
        if len(current) == len(gpus) and all(
            a.phase == pb.ATTACHMENT_PHASE_ATTACHED for a in current.values()
        ):
            suspects = {
                name: problem
                for name, gpu in gpus.items()
                if (problem := identity_changed(gpu.value, current[name])) is not None
            }
            if suspects:
                detail = "; ".join(f"{name}: {problem}" for name, problem in suspects.items())
                return self._fail(view, node, f"attach failed on {node.host}: {detail}", suspects)
            for name, gpu in gpus.items():
                if gpu.value.state == pb.GPU_STATE_ATTACHING:  # a grown node's others are
                    confirmed = lifecycle.attach_confirmed(gpu.value, current[name])
                    view.put(k.GPUS, gpu_id(name), confirmed)
            ready = lifecycle.node_ready(node, current, now)
            if node.state == pb.NODE_STATE_RESIZING:
                ready.ready_time.CopyFrom(node.ready_time)  # ready since it was composed
                ready.message = f"grown to {len(node.gpus)} GPUs; all attached and verified"
            view.put(k.NODES, node_id, ready)
            return "READY"
        if now > seconds(node.attach_deadline) and self._is_leader():
            alive = view.host_leases.exists(host_id)
            hint = "" if alive else f"; the agent of {node.host} is not running"
            return self._fail(
                view,
                node,
                f"attach did not finish before the deadline ({len(current)} of "
                f"{len(gpus)} GPUs reported){hint}",
            )
        if node.state == pb.NODE_STATE_PENDING and any(
            a.phase == pb.ATTACHMENT_PHASE_ATTACHING for a in current.values()
        ):
            view.put(k.NODES, node_id, lifecycle.node_attaching(node, current, now))
            return "ATTACHING"
        return None

    def _fail(
        self,
        view: TxnView,
        node: pb.VirtualNode,
        message: str,
        suspects: Mapping[str, str] | None = None,
        *,
        reason: str = "",
    ) -> str:
        """Fail the node and let go of its GPUs; ``suspects`` (GPU name -> why) are GPUs
        whose identity is not the one the inventory knows: quarantined, not released.
        ``reason`` names the node's event (default: the state's reason word). A RESIZING
        (growing) node is not failed: it goes back to READY without the GPUs the grow
        added (:meth:`_abandon_grow`)."""
        if node.state == pb.NODE_STATE_RESIZING:
            return self._abandon_grow(view, node, message, suspects)
        let_go(view, node, pb.NODE_STATE_FAILED, message, self._clock(), reason=reason)
        _quarantine_suspects(view, node, suspects)
        self._failures[node.name] = message
        return "FAILED"

    def _advance_shrink(
        self, view: TxnView, node: pb.VirtualNode, leaving: list[pb.GpuBinding]
    ) -> str | None:
        """A shrinking node: READY again, without the leaving bindings, once none of
        their GPUs names the node any more (freed, or quarantined)."""
        for binding in leaving:
            record = view.gpus.get(gpu_id(binding.gpu))
            if record is not None and record.value.node == node.name:
                return None  # still detaching
        gone = {b.gpu for b in leaving}
        updated = lifecycle.node_to(
            node,
            pb.NODE_STATE_READY,
            f"shrunk to {len(node.gpus) - len(gone)} GPUs",
            self._clock(),
        )
        kept = [b for b in updated.gpus if b.gpu not in gone]
        del updated.gpus[:]
        updated.gpus.extend(kept)
        view.put(k.NODES, node.name.removeprefix("nodes/"), updated)
        discharge_gpus(view, node, [b.model for b in leaving])
        return "READY"

    def _abandon_grow(
        self,
        view: TxnView,
        node: pb.VirtualNode,
        message: str,
        suspects: Mapping[str, str] | None = None,
    ) -> str:
        """RESIZING -> READY without the GPUs the grow added (those still ATTACHING):
        they go DETACHING and are released through the agent (their attachments stay in
        the host's allocation marked ``release`` until it reports them scrubbed), or, for
        ``suspects``, are quarantined. The node keeps the GPUs it had, which stayed
        attached and in use throughout; a charged node's usage loses the dropped GPUs."""
        dropped: set[str] = set()
        releasing: set[str] = set()
        for binding in node.gpus:
            record = view.gpus.get(gpu_id(binding.gpu))
            if record is None or record.value.node != node.name:
                dropped.add(binding.gpu)  # taken away: nothing of ours to detach
            elif record.value.state == pb.GPU_STATE_ATTACHING:
                dropped.add(binding.gpu)
                releasing.add(binding.gpu)
                view.put(k.GPUS, gpu_id(binding.gpu), lifecycle.begin_detach(record.value))
        kept = [b for b in node.gpus if b.gpu not in dropped]
        updated = lifecycle.node_to(
            node,
            pb.NODE_STATE_READY,
            f"grow failed, the node keeps its {len(kept)} GPUs: {message}",
            self._clock(),
            reason="GrowFailed",
        )
        del updated.gpus[:]
        updated.gpus.extend(kept)
        view.put(k.NODES, node.name.removeprefix("nodes/"), updated)
        discharge_gpus(view, node, [b.model for b in node.gpus if b.gpu in dropped])
        host_id = parse_host(node.host)
        allocation = view.host_allocations.latest(host_id)
        if allocation is not None and any(
            a.node == node.name and a.gpu in dropped and not a.release
            for a in allocation.attachments
        ):
            trimmed = pb.HostAllocation()
            trimmed.CopyFrom(allocation)
            del trimmed.attachments[:]
            for attachment in allocation.attachments:
                ours = attachment.node == node.name and not attachment.release
                if not ours or attachment.gpu not in dropped:
                    trimmed.attachments.append(attachment)
                elif attachment.gpu in releasing:
                    kept_attachment = trimmed.attachments.add()
                    kept_attachment.CopyFrom(attachment)
                    kept_attachment.release = True
            view.put(k.HOST_ALLOCATIONS, host_id, trimmed)
        _quarantine_suspects(view, node, suspects)
        return "READY"

    # -- one GPU ---------------------------------------------------------------------

    def _reconcile_gpus(self, names: Iterable[str]) -> None:
        """Settle DETACHING GPUs, one transaction per host (at most ``GPUS_PER_TXN``
        GPUs each): a released node's GPUs are freed together, not one commit apiece."""
        by_host: dict[str, list[str]] = {}
        for name in names:
            record = self._cache.gpus.get(name)
            if record is not None and record.value.state == pb.GPU_STATE_DETACHING:
                by_host.setdefault(record.value.host, []).append(name)
        for host, group in sorted(by_host.items()):
            group.sort()
            for start in range(0, len(group), GPUS_PER_TXN):
                self._settle_detaches(host, group[start : start + GPUS_PER_TXN])

    def _settle_detaches(self, host: str, names: list[str]) -> None:
        """Free (or quarantine) the GPUs of one host whose agent reported the outcome
        of their release, and in the same transaction move each RELEASING node that
        owns none of its GPUs any more to RELEASED (one commit, not one more per node)."""
        outcomes: dict[str, str] = {}
        released: list[str] = []

        def body(view: TxnView) -> None:
            outcomes.clear()
            released.clear()
            owners: set[str] = set()
            for name in names:
                record = view.gpus.get(name)
                outcome = self._settle_detach(view, name)
                if outcome is not None:
                    outcomes[name] = outcome
                    if record is not None and record.value.node:
                        owners.add(parse_node(record.value.node))
            for node_id in sorted(owners):
                if self._finish_release(view, node_id) is not None:
                    released.append(node_id)

        subject = f"{len(names)} detaching GPUs of {host or 'no host'}"
        try:
            transact(
                self._store,
                self._cache,
                body,
                attempts=PASS_ATTEMPTS,
                what=subject,
                operation="free",
            )
        except Aborted:
            log.debug("controller transition kept losing compares", extra={"subject": subject})
            return
        for _ in released:
            metrics.NODE_TRANSITIONS.labels(state="RELEASED").inc()
        for name, outcome in sorted(outcomes.items()):
            if outcome == "FREE":
                metrics.GPU_FREED.inc()
            else:
                record = self._cache.gpus.get(name)
                reason = record.value.message if record is not None else ""
                log.warning("gpu quarantined", extra={"gpu": name, "reason": reason})

    def _settle_detach(self, view: TxnView, name: str) -> str | None:
        record = view.gpus.get(name)
        if record is None or record.value.state != pb.GPU_STATE_DETACHING:
            return None
        gpu = record.value
        host_id = parse_host(gpu.host) if gpu.host else ""
        # Read through the view even when absent: the commit then requires the status
        # to be unchanged, so an agent that writes a claim meanwhile makes it fail.
        status = view.host_statuses.get(host_id) if host_id else None
        entry = next(
            (a for a in (status.value.attachments if status else ()) if a.gpu == gpu.name), None
        )
        if entry is None or entry.generation != gpu.generation:
            return None  # the agent has not reported the outcome of this release yet
        if entry.phase == pb.ATTACHMENT_PHASE_RELEASED:
            drop_release(view, gpu)
            view.put(k.GPUS, name, lifecycle.free(gpu))
            return "FREE"
        if entry.phase == pb.ATTACHMENT_PHASE_SCRUB_FAILED:
            drop_release(view, gpu)
            view.put(
                k.GPUS,
                name,
                lifecycle.quarantine(gpu, f"release failed on {gpu.host}: {entry.message}"),
            )
            return "QUARANTINED"
        return None

    def _run(self, body: Callable[[TxnView], str | None], subject: str) -> str | None:
        """Commit one transition; a transition that keeps losing compares is left to the
        next pass (the records it read changed: it will be woken again)."""
        self._health_changes.clear()
        try:
            state = transact(
                self._store,
                self._cache,
                body,
                attempts=PASS_ATTEMPTS,
                what=subject,
                operation="transition",
            )
        except Aborted:
            log.debug("controller transition kept losing compares", extra={"subject": subject})
            return None
        for name, gpu in self._health_changes:
            level = logging.INFO if gpu.health == pb.GPU_HEALTH_HEALTHY else logging.WARNING
            log.log(
                level,
                "gpu health changed",
                extra={
                    "gpu": name,
                    "health": pb.GpuHealth.Name(gpu.health),
                    "reason": gpu.health_reason,
                },
            )
        self._health_changes.clear()
        if state is not None:
            metrics.NODE_TRANSITIONS.labels(state=state).inc()
            failure = self._failures.pop(f"nodes/{subject}", None)
            if failure is not None:
                log.warning("node failed", extra={"node": subject, "reason": failure})
        return state


def _awaiting_verdicts(
    failed: list[pb.ObservedAttachment],
    current: Mapping[str, pb.ObservedAttachment],
    gpus: Mapping[str, Versioned[pb.Gpu]],
    node: pb.VirtualNode,
    now: float,
) -> bool:
    """Whether a node whose attach failed waits for its other GPUs' outcomes first.

    An identity mismatch says the inventory may be wrong about more than one GPU (a box
    registered with the wrong model has every slot wrong). Failing the node at once
    would release the GPUs whose attach had not reported yet, and free them unchecked
    for the next node to fail on; waiting until every GPU is ATTACHED or FAILED for the
    node's generation quarantines each one the agent refuses. Other failures say
    nothing about the other GPUs, and the wait ends at the attach deadline whatever
    happens.
    """
    if not any(a.identity_mismatch for a in failed) or now > seconds(node.attach_deadline):
        return False
    settled = (pb.ATTACHMENT_PHASE_ATTACHED, pb.ATTACHMENT_PHASE_FAILED)
    return any(name not in current or current[name].phase not in settled for name in gpus)


def _quarantine_suspects(
    view: TxnView, node: pb.VirtualNode, suspects: Mapping[str, str] | None
) -> None:
    """Quarantine ``suspects`` (GPU name -> why its identity is not the one recorded)
    that this view just moved to DETACHING for ``node``, instead of releasing them:
    their ``release`` attachments leave the host's allocation."""
    for name, problem in sorted((suspects or {}).items()):
        key = gpu_id(name)
        gpu = view.gpus.latest(key)
        if gpu is None or gpu.node != node.name or gpu.state != pb.GPU_STATE_DETACHING:
            continue
        drop_release(view, gpu)
        view.put(k.GPUS, key, lifecycle.quarantine(gpu, f"suspect identity: {problem}"))
