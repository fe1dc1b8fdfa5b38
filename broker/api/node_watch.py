"""WatchNodes fan-out: node changes to every watcher, coalesced, resumable, never blocking.

The :class:`NodeFeed` subscribes to the cache once. Its listener runs in whichever thread
applied the change (the etcd watch thread, a compose, the node controller), so it only
records the change and wakes the watchers it concerns: O(1) work under a short lock plus
one ``Event.set`` per idle watcher of that node. It never waits for a watcher.

**Coalescing.** The feed keeps, per node, the latest change it has seen (arrival sequence
number, etcd revision, record or None for a deletion), in arrival order. A watcher keeps
only a cursor (the sequence number it has consumed). When it wakes it takes every node
that changed after its cursor, in its latest state, sorted by revision. A watcher that
falls behind therefore costs nothing per change and gets the latest state of each node,
never a backlog: the feed holds O(nodes), a watcher O(1) plus the batch it is sending
(at most one entry per node).

**Resume positions.** Every event carries ``revision``, a position such that every
matching change at or below it has been sent by the time the event is. Before taking a
batch the watcher reads the cache's notified revision W (every change at or below it has
been applied and its listeners have returned), so every change at or below W is in the
batch or was sent before. The batch goes out in revision order, each event carrying
``min(W, its revision)``, one less while the next event of the batch has the same
revision (one transaction may change several nodes). So a commit the broker applied ahead
of its own etcd watch is sent at once, but its position waits for the watch.

**Replay.** A resume from R sends every node in the cache whose mod_revision is above R
and every deletion above R the feed remembers. It remembers deletions from its start, up
to ``max_tombstones``; :attr:`NodeFeed.horizon` is the revision at or below which it may
have forgotten one (its start, then the newest deletion it dropped). A resume from below
the horizon gets a fresh listing, marked reset. A watcher that had not yet been sent a
deletion the feed drops is ended with ABORTED (``WATCH_TOO_SLOW``).

**Cut-off.** The one way a watcher could still hurt others is by holding its worker
thread: gRPC blocks a send while the client's flow-control window is full. A monitor
thread ends any watch whose send has been blocked longer than ``send_timeout_s`` with
ABORTED (``WATCH_TOO_SLOW``); the client re-watches from the last revision it handled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.streams import end_call
from dxpool.broker.state import metrics
from dxpool.broker.state.cache import Cache, ChangeRoutes
from dxpool.errors import Aborted, NotFound, Unavailable
from dxpool.store.typed import Versioned

log = logging.getLogger(__name__)

_Event = nodes_pb2.NodeEvent
TOO_SLOW = "WATCH_TOO_SLOW"


@dataclass(frozen=True)
class WatchSettings:
    """Tuning of WatchNodes streams.

    ``send_timeout_s``: a send blocked this long (the client is not reading) ends the
    watch with ABORTED (WATCH_TOO_SLOW). ``progress_interval_s``: a watch idle this long
    gets a TYPE_SYNCED event if the broker's revision moved on, so its resume position
    keeps up. ``max_tombstones``: how many node deletions the broker remembers for
    replay.
    """

    send_timeout_s: float = 30.0
    progress_interval_s: float = 10.0
    max_tombstones: int = 10_000

    def __post_init__(self) -> None:
        if self.send_timeout_s <= 0 or self.progress_interval_s <= 0:
            raise ValueError(f"watch timeouts must be positive: {self}")
        if self.max_tombstones < 1:
            raise ValueError(f"max_tombstones must be 1 or more: {self}")


@dataclass(frozen=True)
class WatcherInfo:
    """One watch being served: its node id ("" for all), the revision of the last event
    sent, and how long the send in progress has been waiting for the client (0: none)."""

    node: str
    position: int
    sending_s: float


@dataclass(slots=True)
class _Entry:
    """The latest change of one node: arrival number, revision, record (None: deleted)."""

    seq: int
    revision: int
    record: Versioned[pb.VirtualNode] | None


# (revision, node id, record or None for a deletion)
_Change = tuple[int, str, "Versioned[pb.VirtualNode] | None"]


class _CallOverError(Exception):
    """The call has ended (the client left, or the watch was cut off): stop quietly."""


class _Watcher:
    """One WatchNodes stream. Fields other than ``cursor`` are written from other threads
    (single assignments); ``cursor`` and ``lagging`` only under the feed's lock."""

    __slots__ = (
        "context",
        "cursor",
        "ended",
        "lagging",
        "name",
        "position",
        "sending_since",
        "wake",
    )

    def __init__(self, name: str | None, context: grpc.ServicerContext) -> None:
        self.name = name
        self.context = context
        self.cursor = 0
        self.wake = threading.Event()
        self.ended = ""  # why the stream must end: "", "call", "stopping", TOO_SLOW
        self.lagging = False  # a deletion it was owed has been forgotten
        self.sending_since = 0.0  # monotonic time of the send in progress; 0: none
        self.position = 0  # the revision of the last event sent

    def end(self, why: str) -> None:
        """Ask the stream to end. Never blocks: safe from gRPC's dispatch thread."""
        if not self.ended:
            self.ended = why
        self.wake.set()

    def on_call_end(self) -> None:
        self.end("call")


class NodeFeed:
    """Serves WatchNodes streams from the cache; ``close`` ends them all."""

    def __init__(
        self,
        cache: Cache,
        settings: WatchSettings | None = None,
        *,
        lookup: Callable[[str], Versioned[pb.VirtualNode] | None] | None = None,
    ) -> None:
        """``lookup(id)`` decides whether a watched node exists (default: the cache);
        the broker passes one that confirms a cache miss with etcd."""
        self._cache = cache
        self._lookup = lookup or cache.nodes.get
        self.settings = settings or WatchSettings()
        self._lock = threading.Lock()
        self._seq = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # by arrival
        self._tombstones: OrderedDict[str, int] = OrderedDict()  # deleted id -> revision
        self._all: set[_Watcher] = set()
        self._named: dict[str, set[_Watcher]] = {}
        self._closed = False
        self._subscription = cache.subscribe_changes(ChangeRoutes().on(cache.nodes, self._on_node))
        self._horizon = self._subscription.since
        self._stop_monitor = threading.Event()
        self._monitor = threading.Thread(
            target=self._watch_sends, name="node-watch-monitor", daemon=True
        )
        self._monitor.start()

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Stop feeding: every watch ends with UNAVAILABLE. Returns without waiting for
        them (a send blocked on a stalled client ends when the server cancels the call)."""
        self._subscription.close()
        with self._lock:
            self._closed = True
            watchers = self._watchers()
        for watcher in watchers:
            watcher.end("stopping")
        self._stop_monitor.set()
        self._monitor.join(timeout=5)

    @property
    def horizon(self) -> int:
        """Resumes from below this revision get a fresh listing (see the module doc)."""
        with self._lock:
            return self._horizon

    def watchers(self) -> list[WatcherInfo]:
        """The watches being served now."""
        now = time.monotonic()
        with self._lock:
            watchers = self._watchers()
        return [
            WatcherInfo(
                node=w.name or "",
                position=w.position,
                sending_s=now - w.sending_since if w.sending_since else 0.0,
            )
            for w in watchers
        ]

    def _watchers(self) -> list[_Watcher]:
        return [*self._all, *(w for group in self._named.values() for w in group)]

    # -- the cache listener ----------------------------------------------------------

    def _on_node(self, name: str, record: Versioned[pb.VirtualNode] | None, revision: int) -> None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and entry.revision >= revision:
                return  # an older change applied by another thread arrived late
            self._seq += 1
            self._entries[name] = _Entry(self._seq, revision, record)
            self._entries.move_to_end(name)
            if record is None:
                self._tombstones[name] = revision
                self._tombstones.move_to_end(name)
                if len(self._tombstones) > self.settings.max_tombstones:
                    self._forget_oldest_deletion()
            else:
                self._tombstones.pop(name, None)
            woken = [w for w in self._all if not w.wake.is_set()]
            woken.extend(w for w in self._named.get(name, ()) if not w.wake.is_set())
        for watcher in woken:
            watcher.wake.set()

    def _forget_oldest_deletion(self) -> None:
        """Drop the oldest remembered deletion; called with ``_lock`` held."""
        name, revision = self._tombstones.popitem(last=False)
        entry = self._entries.pop(name)
        self._horizon = max(self._horizon, revision)
        owed = [w for w in self._all if w.cursor < entry.seq]
        owed.extend(w for w in self._named.get(name, ()) if w.cursor < entry.seq)
        for watcher in owed:
            watcher.lagging = True
            watcher.wake.set()

    # -- serving a stream ------------------------------------------------------------

    def watch(
        self, name: str | None, start_revision: int, context: grpc.ServicerContext
    ) -> Iterator[nodes_pb2.NodeEvent]:
        """The events of one WatchNodes stream (see nodes.proto for the protocol)."""
        watcher = _Watcher(name, context)
        with self._lock:
            if self._closed:
                raise Unavailable(
                    "the broker is stopping; watch again (on another broker if there is one)",
                    reason="BROKER_STOPPING",
                )
            watcher.cursor = self._seq
            (self._named.setdefault(name, set()) if name else self._all).add(watcher)
            horizon = self._horizon
        try:
            if not context.add_callback(watcher.on_call_end):
                return  # the call ended before it started
            yield from self._serve(watcher, start_revision, horizon)
        except _CallOverError:
            return
        finally:
            self._remove(watcher)

    def _remove(self, watcher: _Watcher) -> None:
        with self._lock:
            if watcher.name is None:
                self._all.discard(watcher)
                return
            group = self._named.get(watcher.name)
            if group is not None:
                group.discard(watcher)
                if not group:
                    del self._named[watcher.name]

    def _serve(
        self, watcher: _Watcher, start_revision: int, horizon: int
    ) -> Iterator[nodes_pb2.NodeEvent]:
        # Registered first, then read: a change from here on reaches the watcher's
        # cursor, and every change at or below `notified` is already in the cache.
        notified = self._cache.notified_revision
        watcher.position = start_revision
        if start_revision and start_revision >= horizon:
            changes = self._replay(watcher.name, start_revision)
            if watcher.name is not None and not changes:
                self._require(watcher.name)
            yield from self._send(watcher, self._events(changes, notified))
            reset = False
        else:
            yield from self._send(watcher, self._listing(watcher.name, start_revision))
            reset = True
        synced = _Event(type=_Event.TYPE_SYNCED, revision=notified, reset=reset)
        yield from self._send(watcher, [synced])
        while True:
            woke = watcher.wake.wait(self.settings.progress_interval_s)
            watcher.wake.clear()
            self._check(watcher)
            notified = self._cache.notified_revision
            changes = self._take(watcher)
            if changes:
                yield from self._send(watcher, self._events(changes, notified))
            elif not woke and notified > watcher.position:  # idle: a progress mark
                yield from self._send(watcher, [_Event(type=_Event.TYPE_SYNCED, revision=notified)])

    def _send(
        self, watcher: _Watcher, events: Iterable[nodes_pb2.NodeEvent]
    ) -> Iterator[nodes_pb2.NodeEvent]:
        """Yield the events (built one at a time), marking each send for the monitor."""
        for event in events:
            self._check(watcher)
            # gRPC asks for the next event only once this one has been sent, so a
            # client that stops reading leaves the stream suspended here.
            watcher.sending_since = time.monotonic()
            yield event
            watcher.sending_since = 0.0
            watcher.position = event.revision

    def _check(self, watcher: _Watcher) -> None:
        """End the stream if it must end: quietly, or with the status that says why."""
        if watcher.lagging:
            metrics.WATCH_CUTOFFS.labels(reason=TOO_SLOW).inc()
            raise Aborted(
                "the watch fell so far behind that the broker no longer remembers a "
                "deletion it owed it; watch again with start_revision set to the revision "
                "of the last event handled",
                reason=TOO_SLOW,
                metadata={"revision": str(watcher.position)},
            )
        if watcher.ended == "stopping":
            raise Unavailable(
                "the broker is stopping; watch again with start_revision set to the revision "
                "of the last event handled (on another broker if there is one)",
                reason="BROKER_STOPPING",
                metadata={"revision": str(watcher.position)},
            )
        if watcher.ended:
            raise _CallOverError()

    def _require(self, name: str) -> None:
        if self._lookup(name) is None:
            raise NotFound(
                f"node nodes/{name} does not exist; list nodes with `dxpool node list`",
                reason="NODE_NOT_FOUND",
            )

    def _listing(self, name: str | None, start_revision: int) -> Iterator[nodes_pb2.NodeEvent]:
        if name is not None:
            found = self._cache.nodes.get(name)
            if found is None:
                self._require(name)
            records = [found] if found is not None else []
        else:
            records = [record for _, record in self._cache.nodes.items()]
        for record in records:
            yield _Event(type=_Event.TYPE_EXISTING, node=record.value, revision=start_revision)

    def _replay(self, name: str | None, since: int) -> list[_Change]:
        """Every node that changed after ``since`` (latest state) and every deletion."""
        if name is not None:
            found = self._cache.nodes.get(name)
            live = [(name, found)] if found is not None else []
        else:
            live = self._cache.nodes.items()
        changes: list[_Change] = [(r.mod_revision, n, r) for n, r in live if r.mod_revision > since]
        with self._lock:
            changes.extend(
                (revision, n, None)
                for n, revision in self._tombstones.items()
                if revision > since and (name is None or n == name)
            )
        return changes

    def _take(self, watcher: _Watcher) -> list[_Change]:
        """The changes after the watcher's cursor, and move the cursor to the end."""
        with self._lock:
            cursor, watcher.cursor = watcher.cursor, self._seq
            if watcher.name is not None:
                entry = self._entries.get(watcher.name)
                if entry is None or entry.seq <= cursor:
                    return []
                return [(entry.revision, watcher.name, entry.record)]
            changes: list[_Change] = []
            for name, entry in reversed(self._entries.items()):
                if entry.seq <= cursor:
                    break
                changes.append((entry.revision, name, entry.record))
            return changes

    @staticmethod
    def _events(changes: list[_Change], notified: int) -> Iterator[nodes_pb2.NodeEvent]:
        """Changes as events in revision order, each with its resume position."""
        changes.sort(key=lambda change: (change[0], change[1]))
        for index, (revision, name, record) in enumerate(changes):
            tied = index + 1 < len(changes) and changes[index + 1][0] == revision
            position = min(notified, revision - 1 if tied else revision)
            if record is None:
                node = pb.VirtualNode(name=f"nodes/{name}")
                kind = _Event.TYPE_DELETED
            else:
                node, kind = record.value, _Event.TYPE_CHANGED
            yield _Event(type=kind, node=node, revision=position)

    # -- cutting off stalled clients -------------------------------------------------

    def _watch_sends(self) -> None:
        timeout = self.settings.send_timeout_s
        while not self._stop_monitor.wait(min(1.0, timeout / 4)):
            now = time.monotonic()
            with self._lock:
                watchers = self._watchers()
            for watcher in watchers:
                since = watcher.sending_since
                if since and now - since > timeout and not watcher.ended:
                    self._cut_off(watcher, timeout)

    @staticmethod
    def _cut_off(watcher: _Watcher, timeout: float) -> None:
        watcher.end(TOO_SLOW)
        metrics.WATCH_CUTOFFS.labels(reason=TOO_SLOW).inc()
        log.warning(
            "watch cut off: client not reading",
            extra={"node": watcher.name or "*", "peer": watcher.context.peer()},
        )
        end_call(
            watcher.context,
            grpc.StatusCode.ABORTED,
            f"{TOO_SLOW}: the client read nothing for {timeout:g}s, so the broker ended the "
            "watch; watch again with start_revision set to the revision of the last event "
            "handled",
        )
