"""Read-modify-commit over the cache, in the spirit of etcd's STM.

A change is a function of what it read. :func:`transact` runs such a function against a
:class:`TxnView` - reads come from the cache and are recorded with their revisions, writes
are buffered - then commits ONE etcd transaction that compares every recorded revision and
applies every write. If anything read changed meanwhile (another broker, an agent), the
compare fails, the current values come back in the same round trip, the cache takes them
and the function runs again on the fresh state, a bounded number of times. So a change
can never be based on a stale read, and no caller writes a retry loop of its own.

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
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from dxpool.broker import metrics
from dxpool.broker.audit_commit import record_in
from dxpool.broker.cache import Cache
from dxpool.errors import Aborted, NotFound
from dxpool.store.typed import Store, Txn, Versioned

T = TypeVar("T")

DEFAULT_ATTEMPTS = 8
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


class TxnView:
    """Reads through the cache (recording revisions) and buffers writes for one commit."""

    def __init__(self, store: Store, cache: Cache) -> None:
        self._store = store
        self._cache = cache
        self._reads: dict[str, int] = {}  # key -> mod_revision read (0: absent)
        self._present: set[str] = set()  # keys that must merely exist
        self._writes: dict[str, Message | bytes | str | None] = {}

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
            txn.expect_revision(key, revision).read_on_failure(key)
        for key in self._present - set(self._reads):
            txn.expect_present(key).read_on_failure(key)
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
    attempts: int = DEFAULT_ATTEMPTS,
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
    :mod:`~dxpool.broker.audit_commit`).
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
        committed = store.commit(txn)
        if committed.succeeded:
            if stored is not None:
                stored()
            cache.apply_commit(committed.revision, txn.writes, created=created)
            return result
        cache.apply_reads(committed.current)
        metrics.TRANSACTION_CONFLICTS.labels(operation=operation).inc()
        if attempt:
            pause_after_conflict(attempt)
    raise Aborted(
        f"{what} kept conflicting with concurrent changes after {attempts} attempts; retry",
        reason="COMMIT_CONFLICT",
    )


def read_through(store: Store, cache: Cache, collection: str, name: str) -> Versioned[Any] | None:
    """The record from the cache or, when the cache lacks it, from etcd (a linearizable
    read, whose result the cache takes). None only when etcd has no such record either.
    Raises :class:`~dxpool.errors.Unavailable` when etcd cannot confirm a miss."""
    record = cache.get(collection, name)
    if record is not None:
        return record
    key = store.keys.key(collection, name)
    _found_after_all(store, cache, [key])
    return cache.get(collection, name)


def _found_after_all(store: Store, cache: Cache, keys: list[str]) -> bool:
    """Read ``keys`` (absent from the cache) from etcd; the cache takes those that exist.
    Whether any did."""
    if not keys:
        return False
    found = store.read(keys)
    cache.apply_reads(found)
    return bool(found)


__all__ = ["TxnView", "pause_after_conflict", "read_through", "transact"]
