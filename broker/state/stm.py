"""Read-modify-commit over the cache, in the spirit of etcd's STM.

A change is a function of what it read. :func:`transact` runs such a function against a
:class:`TxnView` - reads come from the cache and are recorded with their revisions, writes
are buffered - then commits ONE etcd transaction that compares every recorded revision and
applies every write. If anything read changed meanwhile (another broker, an agent), the
compare fails, the current values come back in the same round trip, the cache takes them
and the function runs again on the fresh state, a bounded number of times. So a change
can never be based on a stale read, and no caller writes a retry loop of its own.

Changes built part by part - the composes of one host committed together, a gang's
members, a gang's chunks - stage their compares and writes into a :class:`Txn` with
:func:`expect` and :func:`expect_exists` (each compare also asks for the key's current
value should it fail), join parts staged separately with :func:`joined`, and commit it
through :func:`commit_staged`, the staged variant:
it applies the outcome to the cache as :func:`transact` does and leaves to the caller
what to do after a lost compare (answer from what came back, or place again). Those two
are the only places that commit a read-modify-write and keep the cache's books on it.

The function must be free of side effects other than the view's writes: it may run
several times.

A record missing from the cache is not yet proof that it does not exist: another broker
may have just created it and this broker's watch may lag (after an etcd outage, by
seconds). So when the function raises :class:`~dxpool.errors.NotFound`, the records it
found absent are read from etcd; if any exists after all, the cache takes it and the
function runs again. :func:`read_through` does the same for plain lookups. A client that
composed on one broker and then asks another never gets NOT_FOUND for its node.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import Any, Generic, Protocol, TypeVar, cast

from google.protobuf.message import Message

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.state import metrics
from dxpool.broker.state.audit_commit import record_in
from dxpool.broker.state.cache import Cache, Collection
from dxpool.errors import Aborted, NotFound
from dxpool.store import keys as k
from dxpool.store.typed import Store, Txn, TxnResult, Versioned

T = TypeVar("T")
R = TypeVar("R")


class RecordReader(Protocol[R]):
    """Reads one record of a collection: the cache's typed collection
    (:class:`~dxpool.broker.state.cache.Collection`), or a TxnView's
    (:class:`ViewCollection`), which also has the commit compare what it read."""

    def get(self, name: str) -> Versioned[R] | None: ...


# -- attempt limits -------------------------------------------------------------------
# Every commit loop of the broker is bounded by one of these, then answers ABORTED
# (COMMIT_CONFLICT) or, where said, leaves the request waiting.
COMMIT_ATTEMPTS = 8
"""A :func:`transact` body (and an inventory change): it rereads only the records that
changed, so a lost compare means another writer touched the very same records, which
few do at once."""
PLACE_ATTEMPTS = 16
"""A compose or a gang placed again after its commit lost a compare: placement fills one
host before the next, so concurrent composes keep choosing the same host and lose to
each other more often than other writers do; each retry is a fresh placement."""
RELEASE_ATTEMPTS = PLACE_ATTEMPTS
"""A release (of a node, a gang, a batch of a gang's members): it writes its tenant's
usage record, which every compose and release of that tenant on every broker writes
too, so it is as contended as a compose; a user's release should not fail for that."""
RESIZE_ATTEMPTS = COMMIT_ATTEMPTS
"""A resize placed again because its snapshot was stale (each try a :func:`transact`
of its own, under the host's lock, so staleness, not contention, is what repeats)."""
CHUNK_ATTEMPTS = PLACE_ATTEMPTS
"""One chunk of a gang's members: a lost compare replaces the members whose GPUs were
taken and tries again, as contended as a compose's placement."""
ADMISSION_ATTEMPTS = 4
"""A queued node's admission pass: the node stays queued when these run out and the
next pass tries again, so a pass gives up early rather than hold up the queue."""
SESSION_ATTEMPTS = 5
"""An agent's session taking its host's liveness record: the record changes only when
another session of the same agent takes it meanwhile (a reconnect racing itself), so a
few tries tell that apart; then UNAVAILABLE (SESSION_CONTENDED) and the agent connects
again."""
PASS_ATTEMPTS = 3
"""A change a loop makes on one of its passes (the node controller, the leader's duties,
preemption notices, drains): the loop comes back to the record on its next pass, so a
pass gives up after a few lost compares rather than hold up the others."""
NOTE_ATTEMPTS = 2
"""Noting why a queued request waits (its reason and what it reclaims): the next pass
notes it again from a fresh read, so one retry is enough."""

# Full-jitter exponential backoff between attempts that lost a compare: a pause drawn
# from [0, min(MAX_CONFLICT_PAUSE_S, FIRST_CONFLICT_PAUSE_S * 2**attempt)].
FIRST_CONFLICT_PAUSE_S = 0.001
MAX_CONFLICT_PAUSE_S = 0.05


def pause_after_conflict(attempt: int) -> None:
    """Sleep before trying again after attempt number ``attempt`` (0-based) lost a
    compare: a random pause, so writers that conflicted do not meet again in step, that
    doubles with each attempt up to :data:`MAX_CONFLICT_PAUSE_S`. Every commit loop of
    the broker backs off through here."""
    ceiling = min(MAX_CONFLICT_PAUSE_S, FIRST_CONFLICT_PAUSE_S * 2**attempt)
    time.sleep(random.uniform(0, ceiling))


class ViewCollection(Generic[R]):
    """One collection as a :class:`TxnView` reads it, typed by its record, mirroring the
    cache's :class:`~dxpool.broker.state.cache.Collection`: ``view.gpus.get("box1/0")``
    is a ``Versioned[pb.Gpu] | None``. Every read goes through the view's untyped method
    of the same name, so it records the same compare as ``view.gpus.get(...)``."""

    __slots__ = ("_view", "name")

    def __init__(self, view: TxnView, name: str) -> None:
        self._view = view
        self.name = name

    def get(self, name: str) -> Versioned[R] | None:
        """:meth:`TxnView.get`: the cached record; the commit requires it unchanged."""
        return self._view.get(self.name, name)

    def latest(self, name: str) -> R | None:
        """:meth:`TxnView.latest`: the value this view will write, else the cached one."""
        return cast("R | None", self._view.latest(self.name, name))

    def exists(self, name: str) -> bool:
        """:meth:`TxnView.exists`: whether the record exists; the commit requires the
        same answer."""
        return self._view.exists(self.name, name)


class TxnView:
    """Reads through the cache (recording revisions) and buffers writes for one commit.

    Its typed collections (``view.nodes``, ``view.gpus``, ...) read as :meth:`get`,
    :meth:`latest` and :meth:`exists` do, checked by mypy."""

    def __init__(self, store: Store, cache: Cache) -> None:
        self._store = store
        self._cache = cache
        self._reads: dict[str, int] = {}  # key -> mod_revision read (0: absent)
        self._present: set[str] = set()  # keys that must merely exist
        self._writes: dict[str, Message | bytes | str | None] = {}

    # -- the typed collections (reads of one collection, checked by mypy); each is made
    # on first use, so a body pays only for the collections it reads.

    @cached_property
    def boxes(self) -> ViewCollection[pb.Box]:
        return ViewCollection(self, k.BOXES)

    @cached_property
    def gpus(self) -> ViewCollection[pb.Gpu]:
        return ViewCollection(self, k.GPUS)

    @cached_property
    def hosts(self) -> ViewCollection[pb.Host]:
        return ViewCollection(self, k.HOSTS)

    @cached_property
    def host_leases(self) -> ViewCollection[bytes]:
        return ViewCollection(self, k.HOST_LEASES)

    @cached_property
    def host_allocations(self) -> ViewCollection[pb.HostAllocation]:
        return ViewCollection(self, k.HOST_ALLOCATIONS)

    @cached_property
    def host_statuses(self) -> ViewCollection[pb.HostStatus]:
        return ViewCollection(self, k.HOST_STATUSES)

    @cached_property
    def nodes(self) -> ViewCollection[pb.VirtualNode]:
        return ViewCollection(self, k.NODES)

    @cached_property
    def requests(self) -> ViewCollection[bytes]:
        return ViewCollection(self, k.REQUESTS)

    @cached_property
    def tenants(self) -> ViewCollection[pb.Tenant]:
        return ViewCollection(self, k.TENANTS)

    @cached_property
    def brokers(self) -> ViewCollection[bytes]:
        return ViewCollection(self, k.BROKERS)

    @cached_property
    def gangs(self) -> ViewCollection[pb.GangRecord]:
        return ViewCollection(self, k.GANGS)

    # -- the untyped reads and the writes

    def key(self, collection: str, name: str) -> str:
        return self._store.keys.key(collection, name)

    def get(self, collection: str, name: str) -> Versioned[Any] | None:
        """The record as the cache holds it; the commit requires it to be unchanged."""
        record = self._cache.get(collection, name)
        self._reads.setdefault(self.key(collection, name), record.mod_revision if record else 0)
        return record

    def latest(self, collection: str, name: str) -> Any | None:
        """The value this view will write for the record if it wrote one already, else the
        cached value (read as :meth:`get` does); None when absent or deleted. For bodies
        that change one record more than once (e.g. a host's allocation, per GPU)."""
        key = self.key(collection, name)
        record = self.get(collection, name)
        if key in self._writes:
            return self._writes[key]
        return record.value if record is not None else None

    def require(self, collection: str, name: str, revision: int) -> None:
        """Have the commit require the record at ``revision`` (0: absent), a revision the
        body read elsewhere than in the cache (e.g. a linearizable read from etcd)."""
        self._reads[self.key(collection, name)] = revision

    def exists(self, collection: str, name: str) -> bool:
        """Whether the record exists; the commit requires the same answer, whatever
        else changes in the record (e.g. a lease key refreshed in place)."""
        key = self.key(collection, name)
        if self._cache.get(collection, name) is None:
            self._reads.setdefault(key, 0)
            return False
        self._present.add(key)
        return True

    def put(self, collection: str, name: str, value: Message | bytes | str) -> None:
        self._writes[self.key(collection, name)] = value

    def delete(self, collection: str, name: str) -> None:
        self._writes[self.key(collection, name)] = None

    @property
    def has_writes(self) -> bool:
        return bool(self._writes)

    @property
    def absent_keys(self) -> list[str]:
        """The keys this view read as absent."""
        return [key for key, revision in self._reads.items() if revision == 0]

    def build(self) -> tuple[Txn, set[str]]:
        """The transaction, and the keys it creates."""
        txn = Txn()
        for key, revision in self._reads.items():
            expect(txn, key, revision)
        for key in self._present - set(self._reads):
            expect_exists(txn, key)
        for key, value in self._writes.items():
            if value is None:
                txn.delete(key)
            else:
                txn.put(key, value)
        created = {key for key, value in self._writes.items() if value is not None}
        created &= {key for key, revision in self._reads.items() if revision == 0}
        return txn, created


def transact(
    store: Store,
    cache: Cache,
    body: Callable[[TxnView], T],
    *,
    attempts: int = COMMIT_ATTEMPTS,
    what: str = "change",
    operation: str = "other",
    audited: bool = False,
) -> T:
    """Run ``body`` and commit its writes atomically against what it read.

    Returns ``body``'s result from the attempt that committed (or that wrote nothing).
    Raises :class:`~dxpool.errors.Aborted` after ``attempts`` lost compares, and
    :class:`~dxpool.errors.Unavailable` when etcd cannot be reached.

    ``what`` names the change in the Aborted message; ``operation`` (a fixed word, not a
    name) labels its lost compares in ``dxpool_transaction_conflicts_total``.

    With ``audited`` (for a call whose one mutation this is, answered with ``body``'s
    result), the call's audit record commits in the same transaction (see
    :mod:`~dxpool.broker.state.audit_commit`).
    """
    for attempt in range(attempts):
        view = TxnView(store, cache)
        try:
            result = body(view)
        except NotFound:
            if _found_after_all(store, cache, view.absent_keys):
                continue
            raise
        if not view.has_writes:
            return result
        txn, created = view.build()
        stored = record_in(txn, result) if audited else None
        if commit_staged(store, cache, txn, created=created).succeeded:
            if stored is not None:
                stored()
            return result
        metrics.TRANSACTION_CONFLICTS.labels(operation=operation).inc()
        if attempt:
            pause_after_conflict(attempt)
    raise Aborted(
        f"{what} kept conflicting with concurrent changes after {attempts} attempts; retry",
        reason="COMMIT_CONFLICT",
    )


def expect(txn: Txn, key: str, revision: int) -> Txn:
    """Stage into ``txn`` the compare that ``key`` is still at ``revision`` (0: still
    absent), asking for its current value should the compare fail."""
    return txn.expect_revision(key, revision).read_on_failure(key)


def expect_exists(txn: Txn, key: str) -> Txn:
    """Stage into ``txn`` the compare that ``key`` exists, whatever its revision, asking
    for its current value should the compare fail."""
    return txn.expect_present(key).read_on_failure(key)


def joined(parts: Iterable[Txn]) -> Txn:
    """One transaction of ``parts``, staged separately (e.g. one per compose of a
    group), in order: every compare, write and read on failure of each."""
    txn = Txn()
    for part in parts:
        txn.compares.extend(part.compares)
        txn.success.extend(part.success)
        txn.failure.extend(part.failure)
        txn.failure_keys.extend(part.failure_keys)
        txn.writes.extend(part.writes)
    return txn


def commit_staged(
    store: Store, cache: Cache, txn: Txn, *, created: set[str] | None = None
) -> TxnResult:
    """Commit ``txn``, staged with :func:`expect`, :func:`expect_exists` and writes, and
    bring the cache to its outcome: the writes at the commit's revision when it
    succeeded (``created``: the keys it creates, by default every key it puts), else
    the current values of the compared keys. Returns the outcome; after a lost compare
    the caller decides (answer from ``current``, or stage again). Raises
    :class:`~dxpool.errors.Unavailable` when etcd cannot be reached."""
    committed = store.commit(txn)
    if committed.succeeded:
        made = (
            created
            if created is not None
            else {key for key, value in txn.writes if value is not None}
        )
        cache.apply_commit(committed.revision, txn.writes, created=made)
    else:
        cache.apply_reads(committed.current)
    return committed


def read_through(
    store: Store, cache: Cache, collection: Collection[R], name: str
) -> Versioned[R] | None:
    """The record from ``collection`` (one of ``cache``'s) or, when the cache lacks it,
    from etcd (a linearizable read, whose result the cache takes). None only when etcd
    has no such record either. Raises :class:`~dxpool.errors.Unavailable` when etcd
    cannot confirm a miss."""
    record = collection.get(name)
    if record is not None:
        return record
    key = store.keys.key(collection.name, name)
    _found_after_all(store, cache, [key])
    return collection.get(name)


def _found_after_all(store: Store, cache: Cache, keys: list[str]) -> bool:
    """Read ``keys`` (absent from the cache) from etcd; the cache takes those that exist.
    Whether any did."""
    if not keys:
        return False
    found = store.read(keys)
    cache.apply_reads(found)
    return bool(found)


__all__ = [
    "ADMISSION_ATTEMPTS",
    "CHUNK_ATTEMPTS",
    "COMMIT_ATTEMPTS",
    "NOTE_ATTEMPTS",
    "PASS_ATTEMPTS",
    "PLACE_ATTEMPTS",
    "RESIZE_ATTEMPTS",
    "SESSION_ATTEMPTS",
    "RecordReader",
    "TxnView",
    "ViewCollection",
    "commit_staged",
    "expect",
    "expect_exists",
    "joined",
    "pause_after_conflict",
    "read_through",
    "transact",
]
