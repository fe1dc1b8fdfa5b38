"""Typed access to the records dxpool keeps in etcd, and transactions over them.

A record is a protobuf message stored under a key built by :class:`KeySchema`. Reads
return :class:`Versioned` values that carry the etcd revisions, and every change is a
:class:`Txn`: compares on the revisions the caller read plus the writes, committed in one
etcd transaction, so a GPU can never be given to two nodes even with several brokers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import etcd3
import tenacity
from etcd3 import transactions, utils
from google.protobuf.message import Message

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.errors import InvalidArgument, Unavailable
from dxpool.limits import MAX_TXN_OPS
from dxpool.store import keys as k
from dxpool.store.client import pause_left_s
from dxpool.store.errors import Applied, classify
from dxpool.store.errors import unavailable as etcd_unavailable
from dxpool.store.health import EtcdHealth
from dxpool.store.keys import KeySchema

MESSAGE_TYPES: dict[str, type[Message] | None] = {
    k.BOXES: pb.Box,
    k.GPUS: pb.Gpu,
    k.HOSTS: pb.Host,
    k.HOST_LEASES: None,  # HostLiveness, read by agent_sessions.parse_liveness (tolerant)
    k.HOST_ALLOCATIONS: pb.HostAllocation,
    k.HOST_STATUSES: pb.HostStatus,
    k.NODES: pb.VirtualNode,
    k.REQUESTS: None,
    k.TENANTS: pb.Tenant,
    k.BROKERS: None,
    k.GANGS: pb.GangRecord,
}

M = TypeVar("M")
T = TypeVar("T")


@dataclass(frozen=True)
class Versioned(Generic[M]):
    """A record as read at ``mod_revision``. Never mutate ``value``: copy it first."""

    value: M
    mod_revision: int
    create_revision: int


def decode(collection: str, raw: bytes) -> Any:
    """Bytes from etcd -> the collection's message (or the raw bytes for untyped ones)."""
    message_type = MESSAGE_TYPES[collection]
    if message_type is None:
        return raw
    message = message_type()
    message.ParseFromString(raw)
    return message


def encode(value: Message | bytes | str) -> bytes:
    if isinstance(value, Message):
        return value.SerializeToString(deterministic=True)
    if isinstance(value, str):
        return value.encode()
    return value


class LeaseIs(transactions.BaseCompare):  # type: ignore[misc]
    """Compare on the lease a key is attached to (python3-etcd3 has no such target)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = compare.LEASE
        compare.lease = int(self.value)


@dataclass
class Txn:
    """One etcd transaction: compares on what was read, then writes.

    ``expect_*`` add compares; ``put``/``delete`` add writes; ``read_on_failure`` asks etcd
    to return the current values of keys when a compare fails (one round trip to refresh).
    Raises :class:`InvalidArgument` when the transaction would exceed etcd's op limit.
    """

    compares: list[Any] = field(default_factory=list)
    success: list[Any] = field(default_factory=list)
    failure: list[Any] = field(default_factory=list)
    failure_keys: list[str] = field(default_factory=list)
    writes: list[tuple[str, Message | bytes | str | None]] = field(default_factory=list)

    def expect_revision(self, key: str, mod_revision: int) -> Txn:
        """The key is unchanged since it was read at ``mod_revision`` (0: it is absent)."""
        if mod_revision == 0:
            self.compares.append(transactions.Create(key) == 0)
        else:
            self.compares.append(transactions.Mod(key) == mod_revision)
        return self

    def expect_absent(self, key: str) -> Txn:
        self.compares.append(transactions.Create(key) == 0)
        return self

    def expect_present(self, key: str) -> Txn:
        self.compares.append(transactions.Version(key) > 0)
        return self

    def expect_lease(self, key: str, lease_id: int) -> Txn:
        """The key exists and is attached to etcd lease ``lease_id``."""
        self.compares.append(LeaseIs(key) == lease_id)
        return self

    def put(self, key: str, value: Message | bytes | str, *, lease: Any = None) -> Txn:
        """Write ``value``; with ``lease`` (an etcd lease) the key goes when it expires."""
        self.success.append(transactions.Put(key, encode(value), lease=lease))
        self.writes.append((key, value))
        return self

    def delete(self, key: str) -> Txn:
        self.success.append(transactions.Delete(key))
        self.writes.append((key, None))
        return self

    def read_on_failure(self, key: str) -> Txn:
        self.failure.append(transactions.Get(key))
        self.failure_keys.append(key)
        return self

    def check_size(self) -> None:
        largest = max(len(self.compares), len(self.success), len(self.failure))
        if largest > MAX_TXN_OPS:
            raise InvalidArgument(
                f"request needs {largest} operations in one etcd transaction, more than "
                f"etcd's limit of {MAX_TXN_OPS}; ask for fewer GPUs",
                reason="TXN_TOO_LARGE",
            )


@dataclass(frozen=True)
class TxnResult:
    """Outcome of :meth:`Store.commit`.

    ``revision`` is the store revision after the commit (or at the failed compare);
    ``current`` maps each ``read_on_failure`` key to its record (None if absent).
    """

    succeeded: bool
    revision: int
    current: dict[str, Versioned[Any] | None]


class Store:
    """etcd client plus key schema: how the broker and the host agents talk to etcd.

    Every failure of an etcd call becomes :class:`~dxpool.errors.Unavailable` (never a raw
    client error) and feeds ``health``. A call that failed without effect on one member
    (refused connection, no leader there) is tried at once on the next member, each
    member at most once per call, so losing a follower costs no failed call. While etcd is
    reachable, a call that finds every member paused by other calls' failures a moment ago
    waits the pause out (a quarter second by default) instead of failing. A write
    whose outcome is unknown (the connection dropped, or it timed out, after it was
    sent) is never retried here: the caller gets UNAVAILABLE with reason
    ``ETCD_OUTCOME_UNKNOWN`` and retries with the same request id. While etcd is
    unreachable a call is tried once, so requests fail fast; the health probe watches
    for recovery.
    """

    def __init__(
        self,
        client: etcd3.MultiEndpointEtcd3Client,
        schema: KeySchema,
        *,
        health: EtcdHealth | None = None,
        name: str = "broker-store",
    ) -> None:
        """``name`` labels the reachability log lines and the probe thread."""
        self.client = client
        self.keys = schema
        self.health = health or EtcdHealth(self.probe, name=name)
        self._members = max(1, len(client.endpoints))

    def probe(self) -> None:
        """One linearizable read (needs a leader and a quorum); raises what etcd raised."""
        self.client.get(self.keys.prefix)

    def commit(self, txn: Txn) -> TxnResult:
        """Commit ``txn``; raises :class:`Unavailable` when etcd cannot be reached."""
        txn.check_size()
        succeeded, responses = self.call(
            lambda: self.client.transaction(
                compare=txn.compares, success=txn.success, failure=txn.failure
            ),
            write=True,
        )
        revision = _txn_revision(responses)
        current: dict[str, Versioned[Any] | None] = {}
        if not succeeded:
            for key, response in zip(txn.failure_keys, responses, strict=True):
                current[key] = self._versioned_from_range(key, response)
        return TxnResult(bool(succeeded), revision, current)

    def _versioned_from_range(self, key: str, response: Any) -> Versioned[Any] | None:
        kvs = list(response)
        if not kvs:
            return None
        value, meta = kvs[0]
        collection, _ = self.keys.split(key)
        return Versioned(decode(collection, value), meta.mod_revision, meta.create_revision)

    def current_revision(self) -> int:
        """etcd's revision now (a linearizable read): every commit acknowledged before
        this call is at or below it. Writes outside the pool's prefix count too, so a
        watch of the prefix alone may never report this revision; see
        :meth:`last_write_revision` for what such a watch is sure to reach."""
        response = self.call(lambda: self.client.get_response(self.keys.prefix), write=False)
        return int(response.header.revision)

    def last_write_revision(self, collection: str) -> int:
        """The revision of the latest put still live under ``collection`` (a linearizable
        read; 0 when it is empty): a watch of the pool's prefix reaches it, unlike
        :meth:`current_revision`. Deletions leave nothing to find, so a caller waiting
        on this sees every put acknowledged before the call, not every delete."""
        prefix = self.keys.collection(collection)
        response = self.call(
            lambda: self.client.get_prefix_response(
                prefix, limit=1, sort_order="descend", sort_target="mod", keys_only=True
            ),
            write=False,
        )
        return int(response.kvs[0].mod_revision) if response.kvs else 0

    def get(self, key: str) -> Versioned[Any] | None:
        """Read one record straight from etcd (linearizable)."""
        value, meta = self.call(lambda: self.client.get(key), write=False)
        if value is None:
            return None
        collection, _ = self.keys.split(key)
        return Versioned(decode(collection, value), meta.mod_revision, meta.create_revision)

    def read(self, keys: Sequence[str], prefixes: Sequence[str] = ()) -> dict[str, Versioned[Any]]:
        """Read ``keys`` and every key under ``prefixes`` at one revision (linearizable).

        One read-only etcd transaction, so the records are a consistent snapshot: no
        commit lands between two of them. Returns the records found, by key; absent
        keys are left out.
        """
        ops = [transactions.Get(key) for key in keys] + [
            transactions.Get(prefix, utils.prefix_range_end(prefix.encode())) for prefix in prefixes
        ]
        _, responses = self.call(
            lambda: self.client.transaction(compare=[], success=ops, failure=[]), write=False
        )
        found: dict[str, Versioned[Any]] = {}
        for response in responses:
            for value, meta in response:
                key = meta.key.decode()
                collection, _ = self.keys.split(key)
                found[key] = Versioned(
                    decode(collection, value), meta.mod_revision, meta.create_revision
                )
        return found

    def call(self, call: Callable[[], T], *, write: bool) -> T:
        """Run a raw etcd call (on :attr:`client`) under the retry policy above, with
        every etcd failure raised as :class:`Unavailable`. ``write`` says whether the call
        changes anything (a write whose outcome is unknown is never resent)."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_NextMember),
            stop=tenacity.stop_after_attempt(self._members if self.health.reachable else 1),
            reraise=True,
        )
        return cast(T, retrying(self._attempt, call, write))

    def _attempt(self, call: Callable[[], T], write: bool) -> T:
        # Other calls' failures may have paused every member for a moment; while etcd is
        # reachable that says little about it, so wait the pause out (see client.py).
        # The lock-free pause check comes first: it is 0 on almost every call.
        pause_s = pause_left_s(self.client)
        if pause_s > 0 and self.health.reachable:
            time.sleep(pause_s)
        token = self.health.begin()
        try:
            result = call()
        except Exception as error:
            failure = classify(error)
            if failure is None:
                raise
            self.health.failed(token, failure)
            unavailable = etcd_unavailable(failure, write=write)
            if failure.outage and (not write or failure.applied is Applied.NO):
                raise _NextMember(
                    unavailable.message, reason=unavailable.reason, metadata=unavailable.metadata
                ) from error
            raise unavailable from error
        self.health.succeeded(token)
        return result


class _NextMember(Unavailable):
    """An etcd failure worth trying on the next member; raised to the caller as it is
    once every member has been tried (it is an :class:`Unavailable`)."""


def key_holder(responses: Any) -> tuple[int, bytes]:
    """The lease id and value of the key that the single Get in a failed transaction's
    failure branch returned (python3-etcd3's raw responses); ``(0, b"")`` if absent.
    For keys held on a lease (liveness, leadership), which typed records do not carry."""
    try:
        for value, meta in responses[0]:
            return int(meta.lease_id), bytes(value)
    except (IndexError, TypeError, AttributeError):
        pass
    return 0, b""


def _txn_revision(responses: Any) -> int:
    # python3-etcd3 drops the TxnResponse header; the per-op responses carry one.
    for response in responses or []:
        which = getattr(response, "WhichOneof", None)
        if which is None:
            continue
        kind = which("response")
        if kind and getattr(response, kind).header.revision:
            return int(getattr(response, kind).header.revision)
    return 0
