"""An informer: the broker's in-memory copy of every dxpool record in etcd.

It lists the whole key prefix once, then watches from the next revision, so reads
(placement, Get, List) never go to etcd. Writes the broker commits itself are applied
at once with their commit revision (:meth:`Cache.apply_commit`), so a broker reads its
own writes without waiting for the watch. An event is applied only if it is newer
than what the cache holds, and deletions leave a tombstone until the watch has passed
them, so a late event can never resurrect a record.

Subscribers are called, in the applying thread, with ``(collection, id, record or
None)`` after every change (:meth:`Cache.subscribe`), or with the change's revision as
well (:meth:`Cache.subscribe_changes`). The applying thread is the etcd watch thread or a
thread that committed a write (a compose, the node controller), so a listener must never
block: it does O(1) bookkeeping under its own short lock and wakes its own thread, and
never waits on a client, a bounded queue, I/O or another thread. Listeners must not call
back into the cache while holding their own locks in the opposite order.

If the watch breaks (a member lost, etcd restarted) it resumes on the next member from
the revision after the last event it delivered; only when that history has been
compacted does the cache list again, and subscribers then see the differences as
ordinary changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import etcd3
from google.protobuf.message import Message
from sortedcontainers import SortedDict

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.store import keys as k
from dxpool.store.client import EtcdAddress, addresses_of
from dxpool.store.keys import COLLECTIONS, KeySchema
from dxpool.store.typed import Versioned, decode, encode
from dxpool.store.watch import PrefixWatch

log = logging.getLogger(__name__)

WALK_PAGE = 1000
"""Records :meth:`Cache.walk` reads per hold of the lock (about a millisecond's work)."""

Listener = Callable[[str, str, "Versioned[Any] | None"], None]
ChangeListener = Callable[[str, str, "Versioned[Any] | None", int], None]
"""``(collection, id, record or None, revision)``: the revision is the record's
mod_revision, or the revision that deleted it."""


@dataclass(frozen=True)
class Subscription:
    """A :meth:`Cache.subscribe_changes` registration.

    ``since`` is the highest revision the cache had reached (by its watch or by any
    change applied) when the listener was added: every change above it reaches the
    listener; changes at or below it happened before and are not replayed.
    """

    since: int
    close: Callable[[], None]


R = TypeVar("R")


class Collection(Generic[R]):
    """One collection of the cache, typed by its record: ``cache.gpus.get("box1/0")`` is
    a ``Versioned[pb.Gpu] | None``, as client-go's typed listers return ``*v1.Node``.

    It reads the cache's own index under the cache's lock, so every read keeps the
    cache's contract (see :class:`Cache`): each call sees one consistent state of the
    collection, never a record half-applied. A record read is shared: never mutate its
    ``value``, copy it first.
    """

    __slots__ = ("_lock", "_records", "name")

    def __init__(
        self, name: str, lock: threading.RLock, records: SortedDict[str, Versioned[Any]]
    ) -> None:
        self.name = name
        self._lock = lock
        self._records = records

    def get(self, name: str) -> Versioned[R] | None:
        """The record with id ``name``, or None."""
        with self._lock:
            return self._records.get(name)

    def items(self) -> list[tuple[str, Versioned[R]]]:
        """Every record, in listing order (by id; GPUs by box, then slot as a number)."""
        with self._lock:
            records = self._records
            return list(zip(records.keys(), records.values(), strict=True))

    def scan(
        self,
        after: str | None,
        limit: int,
        keep: Callable[[Versioned[R]], bool] = lambda _: True,
    ) -> tuple[list[tuple[str, Versioned[R]]], bool]:
        """:meth:`Cache.scan` over this collection."""
        return _scan(self._lock, self._records, after, limit, keep)

    def walk(self, page: int = WALK_PAGE) -> Iterator[tuple[str, Versioned[R]]]:
        """:meth:`Cache.walk` over this collection."""
        return _walk(self.scan, page)

    def count(self) -> int:
        with self._lock:
            return len(self._records)


class Routes:
    """A :data:`Listener` that hands each change to the handler of its collection,
    ``handler(id, record or None)``, typed by the collection's record::

        cache.subscribe(Routes().on(cache.nodes, self._on_node).on(cache.gpus, self._on_gpu))

    Changes of a collection without a handler are dropped. The handlers run as the
    listener would (in the applying thread, never blocking; see the module doc)."""

    __slots__ = ("_handlers",)

    def __init__(self) -> None:
        self._handlers: dict[str, Callable[[str, Versioned[Any] | None], None]] = {}

    def on(
        self, collection: Collection[R], handler: Callable[[str, Versioned[R] | None], None]
    ) -> Routes:
        """Route ``collection``'s changes to ``handler``; returns these routes."""
        self._handlers[collection.name] = handler
        return self

    def __call__(self, collection: str, name: str, record: Versioned[Any] | None) -> None:
        handler = self._handlers.get(collection)
        if handler is not None:
            handler(name, record)


class ChangeRoutes:
    """:class:`Routes` for a :data:`ChangeListener`: ``handler(id, record or None,
    revision)``."""

    __slots__ = ("_handlers",)

    def __init__(self) -> None:
        self._handlers: dict[str, Callable[[str, Versioned[Any] | None, int], None]] = {}

    def on(
        self,
        collection: Collection[R],
        handler: Callable[[str, Versioned[R] | None, int], None],
    ) -> ChangeRoutes:
        """Route ``collection``'s changes to ``handler``; returns these routes."""
        self._handlers[collection.name] = handler
        return self

    def __call__(
        self, collection: str, name: str, record: Versioned[Any] | None, revision: int
    ) -> None:
        handler = self._handlers.get(collection)
        if handler is not None:
            handler(name, record, revision)


_Page = tuple[list[tuple[str, Versioned[R]]], bool]


def _walk(
    scan: Callable[[str | None, int], _Page[R]], page: int
) -> Iterator[tuple[str, Versioned[R]]]:
    """Every record ``scan`` finds, ``page`` at a time (one hold of the lock each)."""
    after: str | None = None
    while True:
        found, more = scan(after, page)
        yield from found
        if not more or not found:
            return
        after = found[-1][0]


def _scan(
    lock: threading.RLock,
    records: SortedDict[str, Versioned[Any]],
    after: str | None,
    limit: int,
    keep: Callable[[Versioned[Any]], bool],
) -> tuple[list[tuple[str, Versioned[Any]]], bool]:
    """Up to ``limit`` records ``keep`` accepts after id ``after``, under ``lock``."""
    found: list[tuple[str, Versioned[Any]]] = []
    with lock:
        if after is None:
            names = records.irange()
        elif records.key is None:
            names = records.irange(minimum=after, inclusive=(False, True))
        else:  # a SortedKeyDict: ranges are over the order, not the id
            keyed = cast(Any, records)
            names = keyed.irange_key(min_key=records.key(after), inclusive=(False, True))
        for name in names:
            record = records[name]
            if keep(record):
                if len(found) == limit:
                    return found, True
                found.append((name, record))
    return found, False


def _gpu_order(name: str) -> tuple[str, int, str]:
    """Listing order of GPU ids ``box/slot``: by box, then slot as a number."""
    box, _, slot = name.partition("/")
    return box, int(slot) if slot.isascii() and slot.isdigit() else -1, slot


class Cache:
    """In-memory records by collection and id, fed by list-then-watch.

    The watch (:class:`~dxpool.store.watch.PrefixWatch`) fails over between etcd members
    and resumes from the last revision it delivered, so losing a member costs a moment,
    not the cache's freshness. :meth:`lag_s` says how stale the cache may be: 0 while the
    watch runs, else the seconds since it was last known current.
    """

    def __init__(
        self,
        client: etcd3.MultiEndpointEtcd3Client | str | list[EtcdAddress],
        schema: KeySchema,
        *,
        on_watch_state: Callable[[bool], None] | None = None,
        progress_interval_s: float = 0.5,
        progress_timeout_s: float = 1.5,
    ) -> None:
        self._keys = schema
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        # Kept in listing order (GPUs by box, then slot as a number), so a page of a
        # listing is found in O(log n + page), with no sort per call.
        self._records: dict[str, SortedDict[str, Versioned[Any]]] = {
            c: SortedDict(_gpu_order) if c == k.GPUS else SortedDict() for c in COLLECTIONS
        }
        records = self._records
        lock = self._lock
        # The typed collections (reads of one collection, checked by mypy).
        self.boxes: Collection[pb.Box] = Collection(k.BOXES, lock, records[k.BOXES])
        self.gpus: Collection[pb.Gpu] = Collection(k.GPUS, lock, records[k.GPUS])
        self.hosts: Collection[pb.Host] = Collection(k.HOSTS, lock, records[k.HOSTS])
        self.host_leases: Collection[bytes] = Collection(
            k.HOST_LEASES, lock, records[k.HOST_LEASES]
        )
        self.host_allocations: Collection[pb.HostAllocation] = Collection(
            k.HOST_ALLOCATIONS, lock, records[k.HOST_ALLOCATIONS]
        )
        self.host_statuses: Collection[pb.HostStatus] = Collection(
            k.HOST_STATUSES, lock, records[k.HOST_STATUSES]
        )
        self.nodes: Collection[pb.VirtualNode] = Collection(k.NODES, lock, records[k.NODES])
        self.requests: Collection[bytes] = Collection(k.REQUESTS, lock, records[k.REQUESTS])
        self.tenants: Collection[pb.Tenant] = Collection(k.TENANTS, lock, records[k.TENANTS])
        self.brokers: Collection[bytes] = Collection(k.BROKERS, lock, records[k.BROKERS])
        self.gangs: Collection[pb.GangRecord] = Collection(k.GANGS, lock, records[k.GANGS])
        self._tombstones: dict[tuple[str, str], int] = {}
        self._listeners: tuple[ChangeListener, ...] = ()
        # Revisions whose listeners are running now (revision -> calls), and the highest
        # revision ever applied: see notified_revision and subscribe_changes.
        self._dispatching: dict[int, int] = {}
        self._applied_high = 0
        self._revision = 0
        self._watch = PrefixWatch(
            addresses_of(client),
            schema.prefix,
            on_list=self._on_list,
            on_events=self._on_watch,
            on_state=on_watch_state,
            name="cache-watch",
            progress_interval_s=progress_interval_s,
            progress_timeout_s=progress_timeout_s,
        )

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0, *, wait_for_etcd: bool = False) -> None:
        """List everything and start watching. Raises :class:`~dxpool.errors.Unavailable`
        if no etcd member can be listed and watched (after one try of each, or with
        ``wait_for_etcd`` after trying again with backoff for ``timeout_s``)."""
        self._watch.start(timeout_s, wait_for_etcd=wait_for_etcd)

    def stop(self) -> None:
        self._watch.stop()

    @property
    def watch_connected(self) -> bool:
        """Whether the watch runs now."""
        return self._watch.connected

    @property
    def watch_endpoint(self) -> EtcdAddress | None:
        """The etcd member the watch uses (or last tried)."""
        return self._watch.endpoint

    @property
    def watch_error(self) -> str:
        """Why the watch last broke ("" if it never did)."""
        return self._watch.last_error

    def lag_s(self) -> float:
        """0 while the watch runs; else seconds since the cache was last known current."""
        return self._watch.lag_s()

    def _on_list(self, kvs: Sequence[Any], revision: int) -> None:
        """A full listing at ``revision``: apply it, and drop what it no longer has."""
        listed: list[tuple[str, str, Versioned[Any]]] = []
        for kv in kvs:
            parsed = self._parse_key(kv.key.decode())
            if parsed is None:
                continue
            record = Versioned(decode(parsed[0], kv.value), kv.mod_revision, kv.create_revision)
            listed.append((parsed[0], parsed[1], record))
        if self._took_first_listing(listed):
            self._advance(revision)
            return
        seen: set[tuple[str, str]] = set()
        for collection, name, record in listed:
            seen.add((collection, name))
            self._apply(collection, name, record, revision=record.mod_revision)
        with self._lock:
            gone = [
                (collection, name)
                for collection, records in self._records.items()
                for name in records
                if (collection, name) not in seen
            ]
        for collection, name in gone:
            self._apply(collection, name, None, revision=revision)
        self._advance(revision)

    def _took_first_listing(self, listed: list[tuple[str, str, Versioned[Any]]]) -> bool:
        """Stores the first listing whole, when the cache holds nothing and nobody listens
        yet (a broker's start): then no record can be older than the listing's and no
        listener can miss a change, so the records go in at once rather than one
        :meth:`_apply` at a time (at 100,000 GPUs about 1 s of a broker's start). False,
        storing nothing, otherwise."""
        by_collection: dict[str, list[tuple[str, Versioned[Any]]]] = {c: [] for c in COLLECTIONS}
        for collection, name, record in listed:
            by_collection[collection].append((name, record))
        with self._lock:
            if self._listeners or self._tombstones or any(self._records.values()):
                return False
            for collection, pairs in by_collection.items():
                self._records[collection].update(pairs)
            high = max((record.mod_revision for _, _, record in listed), default=0)
            self._applied_high = max(self._applied_high, high)
            self._changed.notify_all()
        return True

    def _on_watch(self, response: Any) -> None:
        for event in response.events:
            parsed = self._parse_key(event.key.decode())
            if parsed is None or self._holds(parsed[0], parsed[1], event.mod_revision):
                continue  # foreign key, or our own commit already applied: skip decoding
            if isinstance(event, etcd3.events.DeleteEvent):
                self._apply(parsed[0], parsed[1], None, revision=event.mod_revision)
            else:
                record = Versioned(
                    decode(parsed[0], event.value), event.mod_revision, event.create_revision
                )
                self._apply(parsed[0], parsed[1], record, revision=event.mod_revision)
        # The events' own revision, not the header's: while a watch catches up, etcd 3.5
        # may stamp a batch with a later revision than its last event.
        if response.events:
            self._advance(max(int(event.mod_revision) for event in response.events))

    # -- applying changes ------------------------------------------------------------

    def _parse_key(self, key: str) -> tuple[str, str] | None:
        try:
            return self._keys.split(key)
        except ValueError:
            return None

    def _holds(self, collection: str, name: str, revision: int) -> bool:
        """True if the cache already reflects this key at ``revision`` or later."""
        with self._lock:
            current = self._records[collection].get(name)
            if current is not None:
                return current.mod_revision >= revision
            return self._tombstones.get((collection, name), 0) >= revision

    def _apply(
        self, collection: str, name: str, record: Versioned[Any] | None, *, revision: int
    ) -> None:
        with self._lock:
            records = self._records[collection]
            current = records.get(name)
            tomb = self._tombstones.get((collection, name), 0)
            if record is None:
                if current is not None and current.mod_revision >= revision:
                    return
                if current is None and tomb >= revision:
                    return
                records.pop(name, None)
                self._tombstones[(collection, name)] = revision
                if current is None:
                    return
            else:
                if current is not None and current.mod_revision >= record.mod_revision:
                    return
                if tomb >= record.mod_revision:
                    return
                records[name] = record
            self._changed.notify_all()
            self._dispatch_begin(revision)
            listeners = self._listeners
        self._dispatch(listeners, collection, name, record, revision)

    # -- listeners -------------------------------------------------------------------

    def _dispatch_begin(self, revision: int) -> None:
        """Record that the listeners of a change at ``revision`` are about to run.

        Called with ``_lock`` held, in the same critical section that stored the change,
        so :attr:`notified_revision` never passes a change whose listeners have not run.
        """
        self._applied_high = max(self._applied_high, revision)
        self._dispatching[revision] = self._dispatching.get(revision, 0) + 1

    def _dispatch(
        self,
        listeners: tuple[ChangeListener, ...],
        collection: str,
        name: str,
        record: Versioned[Any] | None,
        revision: int,
    ) -> None:
        """Call every listener, outside the cache lock; one failing does not stop the rest."""
        try:
            for listener in listeners:
                try:
                    listener(collection, name, record, revision)
                except Exception:
                    log.exception("cache listener failed", extra={"collection": collection})
        finally:
            with self._lock:
                left = self._dispatching[revision] - 1
                if left:
                    self._dispatching[revision] = left
                else:
                    del self._dispatching[revision]

    def _advance(self, revision: int) -> None:
        with self._lock:
            if revision > self._revision:
                self._revision = revision
                self._tombstones = {
                    key: rev for key, rev in self._tombstones.items() if rev > revision
                }
                self._changed.notify_all()

    def apply_commit(
        self, revision: int, writes: list[tuple[str, Any]], created: set[str] | None = None
    ) -> None:
        """Apply a transaction this process committed at ``revision``.

        ``writes`` are the ``(key, value or None)`` pairs of the transaction; ``created``
        names the keys the transaction created (their create_revision is ``revision``).
        """
        for key, value in writes:
            parsed = self._parse_key(key)
            if parsed is None:
                continue
            collection, name = parsed
            if value is None:
                self._apply(collection, name, None, revision=revision)
                continue
            # Messages this process committed are never mutated afterwards (records from
            # the cache are copied before any change), so they are stored as they are.
            stored = value if isinstance(value, Message) else decode(collection, encode(value))
            with self._lock:
                current = self._records[collection].get(name)
            create = (
                revision
                if (created and key in created) or current is None
                else (current.create_revision)
            )
            self._apply(collection, name, Versioned(stored, revision, create), revision=revision)

    def apply_read(self, key: str, record: Versioned[Any] | None, revision: int) -> None:
        """Apply a record read straight from etcd (e.g. after a failed compare)."""
        parsed = self._parse_key(key)
        if parsed is None:
            return
        if record is None:
            self._apply(parsed[0], parsed[1], None, revision=revision)
        else:
            self._apply(parsed[0], parsed[1], record, revision=record.mod_revision)

    def apply_reads(self, records: Mapping[str, Versioned[Any] | None]) -> None:
        """Apply records read together straight from etcd (``key -> record``, None when
        absent), e.g. what a failed compare sent back."""
        revision = self.revision
        for key, record in records.items():
            self.apply_read(key, record, revision)

    # -- reading ---------------------------------------------------------------------

    @property
    def revision(self) -> int:
        """The etcd revision the watch has caught up to."""
        with self._lock:
            return self._revision

    def get(self, collection: str, name: str) -> Versioned[Any] | None:
        with self._lock:
            return self._records[collection].get(name)

    def items(self, collection: str) -> list[tuple[str, Versioned[Any]]]:
        """Every record of a collection, in listing order (by id; GPUs by box, then slot
        as a number)."""
        with self._lock:
            records = self._records[collection]
            return list(zip(records.keys(), records.values(), strict=True))

    def scan(
        self,
        collection: str,
        after: str | None,
        limit: int,
        keep: Callable[[Versioned[Any]], bool] = lambda _: True,
    ) -> tuple[list[tuple[str, Versioned[Any]]], bool]:
        """Up to ``limit`` records that ``keep`` accepts, in listing order, starting after
        id ``after`` (from the start when None); and whether more such records follow.

        ``keep`` runs under the cache lock: it must be quick and must not call back."""
        return _scan(self._lock, self._records[collection], after, limit, keep)

    def walk(self, collection: str, page: int = WALK_PAGE) -> Iterator[tuple[str, Versioned[Any]]]:
        """Every record of a collection in listing order, read ``page`` records per hold
        of the lock, so a pass over a large collection never holds up the watch for long.
        Not a snapshot: a record changed during the walk may be seen before or after."""
        return _walk(lambda after, limit: self.scan(collection, after, limit), page)

    def count(self, collection: str) -> int:
        with self._lock:
            return len(self._records[collection])

    @property
    def notified_revision(self) -> int:
        """A revision at or below which every change has been applied and every listener
        of it has returned: the watch's revision, held back below any change whose
        listeners are still running (a commit applied ahead of the watch)."""
        with self._lock:
            if not self._dispatching:
                return self._revision
            return min(self._revision, min(self._dispatching) - 1)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(collection, id, record or None)`` after every change; returns a
        function that unsubscribes. The listener must never block (see the module doc)."""

        def with_revision(
            collection: str, name: str, record: Versioned[Any] | None, revision: int
        ) -> None:
            listener(collection, name, record)

        return self.subscribe_changes(with_revision).close

    def subscribe_changes(self, listener: ChangeListener) -> Subscription:
        """Call ``listener(collection, id, record or None, revision)`` after every change.

        The listener must never block (see the module doc). Changes applied from several
        threads may reach it out of revision order; compare revisions to keep the newest.
        """
        with self._lock:
            self._listeners = (*self._listeners, listener)
            # Everything up to the watch's revision is reflected in the records, but
            # changes (deletions above all) up to it were never seen by this listener.
            since = max(self._applied_high, self._revision)

        def close() -> None:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

        return Subscription(since, close)

    def wait_for_revision(self, revision: int, timeout_s: float) -> bool:
        """Block until the watch has reached ``revision``; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._revision < revision:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True
