"""The audit log: one record per mutating call, in etcd, read back with ListAuditRecords.

Where: etcd, under ``{prefix minus its slash}-audit/`` (``/dxpool/v1-audit/`` for the
default prefix) — beside the pool's keys, not under them, so the cache's listing and
watch (which cover the pool prefix) never carry audit traffic, and every broker of a
pool writes to, and reads from, one shared log that survives any broker. A file per
broker would be lost with its machine and could not be read through the API.

Keys are ``{time_ns:020d}-{broker}-{seq:010d}``: they sort by time, so ``since`` is a
range start, and retention is one range delete of everything older than the cutoff
(done by whichever broker writes, at most once a minute).

What: :data:`MUTATIONS` lists every mutating RPC with how to find the resource it
names (a test holds every RPC of the services to be either in it or a read). The
:class:`AuditRecorder` interceptor wraps them outermost, so it sees every outcome —
success, a validation error, PERMISSION_DENIED, UNAUTHENTICATED, UNAVAILABLE — and
writes exactly one record per call after the call ends and before its answer is sent
(a successful ComposeNode's or ReleaseNode's record is committed with the node instead, see
:mod:`~dxpool.broker.state.audit_commit`).
A record that cannot be written (etcd away) is logged and counted
(``dxpool_audit_write_failures_total``); the call's own result stands, since the
mutation, if any, has already been committed.

Nobody writes without a reason to: a record holds bounded fields in their own grammar
(:mod:`~dxpool.broker.api.audit_fields`; a request's oversized or malformed field is kept as
its size and digest), and calls refused for want of authentication or permission
(UNAUTHENTICATED, PERMISSION_DENIED) are counted in
``dxpool_audit_refused_calls_total{rpc,code,role}`` and logged at most once a minute,
not written to etcd one record each: anyone who can reach the broker could otherwise
grow etcd at will. Requests too large for their method, or undecodable, never reach the
recorder (see :mod:`~dxpool.broker.api.decoding`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import etcd3
import grpc

from dxpool.api.v1 import audit_pb2, inventory_pb2, nodes_pb2
from dxpool.broker.api.audit_fields import MAX_RECORD_BYTES, normalised
from dxpool.broker.api.decoding import Handler, Interceptor
from dxpool.broker.api.log_throttle import LogThrottle
from dxpool.broker.state import metrics
from dxpool.broker.state.audit_commit import CURRENT, PendingRecord
from dxpool.errors import InvalidArgument, Unauthenticated
from dxpool.identity import Identity
from dxpool.limits import MAX_PAGE_TOKEN
from dxpool.store.errors import classify
from dxpool.store.keys import KeySchema

__all__ = ["MUTATIONS", "AuditLog", "AuditRecorder", "audit_prefix"]

log = logging.getLogger(__name__)

_INVENTORY = inventory_pb2.DESCRIPTOR.services_by_name["InventoryService"].full_name
_NODES = nodes_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name

Target = Callable[[Any, Any], str]
"""``(request, response or None) -> resource name`` of a mutating call."""

MUTATIONS: Mapping[str, Target] = {
    f"/{_INVENTORY}/CreateBox": lambda req, _: f"boxes/{req.box_id}" if req.box_id else "",
    f"/{_INVENTORY}/CordonBox": lambda req, _: str(req.name),
    f"/{_INVENTORY}/UncordonBox": lambda req, _: str(req.name),
    f"/{_INVENTORY}/DeleteBox": lambda req, _: str(req.name),
    f"/{_INVENTORY}/ReclaimGpu": lambda req, _: str(req.name),
    f"/{_INVENTORY}/ClearGpuHealth": lambda req, _: str(req.name),
    f"/{_INVENTORY}/CordonHost": lambda req, _: str(req.name),
    f"/{_INVENTORY}/UncordonHost": lambda req, _: str(req.name),
    f"/{_INVENTORY}/DrainHost": lambda req, _: str(req.name),
    f"/{_INVENTORY}/DrainBox": lambda req, _: str(req.name),
    f"/{_NODES}/ComposeNode": lambda req, resp: (
        str(resp.name) if resp is not None else (f"nodes/{req.node_id}" if req.node_id else "")
    ),
    f"/{_NODES}/ReleaseNode": lambda req, _: str(req.name),
    f"/{_NODES}/ResizeNode": lambda req, _: str(req.name),
    f"/{_NODES}/ComposeGang": lambda req, resp: (
        str(resp.name) if resp is not None else (f"gangs/{req.gang_id}" if req.gang_id else "")
    ),
    f"/{_NODES}/ReleaseGang": lambda req, _: str(req.name),
    f"/{_NODES}/SetTenantQuota": lambda req, _: str(req.name),
    f"/{_NODES}/DeleteTenant": lambda req, _: str(req.name),
}

DEFAULT_RETENTION_S = 30 * 24 * 3600.0
OK = grpc.StatusCode.OK
REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
"""Calls that end so are counted, not recorded (see the module docstring)."""
PRUNE_INTERVAL_S = 60.0
REFUSED_LOG_INTERVAL_S = 60.0
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100
_SCAN_BATCH = 500
# The latest time a Timestamp may hold (9999-12-31T23:59:59Z), and the largest key time.
_MAX_TIMESTAMP_S = 253_402_300_799
_MAX_KEY_NS = 10**20 - 1


def audit_prefix(key_prefix: str) -> str:
    """``/dxpool/v1/`` -> ``/dxpool/v1-audit/``: beside the pool's keys, not under them
    (:attr:`~dxpool.store.keys.KeySchema.audit_prefix`)."""
    return KeySchema(key_prefix).audit_prefix


def _time_key(time_ns: int) -> str:
    return f"{time_ns:020d}"


@dataclass(frozen=True)
class _Filter:
    since_ns: int
    identity: str
    target: str

    def keeps(self, record: audit_pb2.AuditRecord) -> bool:
        return (not self.identity or record.identity == self.identity) and (
            not self.target or record.target == self.target
        )


MAX_RECORDS_PER_TXN = 128
"""Records per transaction of a group write: etcd's limit on operations per txn. With
records of at most ``MAX_RECORD_BYTES`` a transaction stays under 300 KiB, far below
etcd's request limit."""


class _Group:
    """Records written together, and how the write of each ended (None: stored)."""

    __slots__ = ("done", "errors", "records")

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes]] = []
        self.done = False
        self.errors: list[Exception | None] = []


class AuditLog:
    """Writes and reads the audit records of one pool (see the module docstring)."""

    def __init__(
        self,
        etcd: etcd3.MultiEndpointEtcd3Client,
        key_prefix: str,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._etcd = etcd
        self.prefix = audit_prefix(key_prefix)
        self.retention_s = retention_s
        self.broker = uuid.uuid4().hex[:12]
        self._clock_ns = clock_ns
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._pruned_at = 0.0
        # Group write: records that arrive while one write is in flight go to etcd
        # together in the next one (see write).
        self._flushed = threading.Condition(threading.Lock())
        self._open = _Group()
        self._writing = False

    def write(self, record: audit_pb2.AuditRecord) -> None:
        """Store ``record`` (its time and broker are set here, its fields bounded);
        returns once etcd holds it. Raises what etcd raises.

        Records written while another write is in flight wait for it and then go to
        etcd together, one transaction (up to 128 records) for all of them, written by
        the first of their callers: under load a call costs a share of one etcd
        request instead of one, and still returns only after its record is stored.
        When etcd refuses such a transaction (rather than being unreachable) each of
        its records is put on its own, so one record's trouble never costs another
        call its record."""
        key, data = self.prepare(record)
        with self._flushed:
            group = self._open
            index = len(group.records)
            group.records.append((key, data))
            while self._writing and not group.done:
                self._flushed.wait()
            if not group.done:  # this caller writes its group, and others join the next
                self._writing = True
                self._open = _Group()
        if not group.done:
            try:
                self._put_all(group.records)
                group.errors = [None] * len(group.records)
            except Exception as error:
                group.errors = self._put_each_if_refused(group.records, error)
            with self._flushed:
                group.done = True
                self._writing = False
                self._flushed.notify_all()
        failed = group.errors[index]
        if failed is not None:
            raise failed
        self.maybe_prune()

    def _put_each_if_refused(
        self, records: list[tuple[str, bytes]], error: Exception
    ) -> list[Exception | None]:
        """How each of ``records`` ended after their group's write failed with
        ``error``: that error for every one when etcd is away (or there is one record),
        else the outcome of putting each on its own."""
        failure = classify(error)
        if len(records) == 1 or failure is None or failure.outage:
            return [error] * len(records)
        log.warning(
            "audit group write refused; writing its records one by one",
            extra={"records": len(records), "error": str(failure)},
        )
        outcomes: list[Exception | None] = []
        for key, data in records:
            try:
                self._etcd.put(key, data)
                outcomes.append(None)
            except Exception as single:
                outcomes.append(single)
        return outcomes

    def prepare(self, record: audit_pb2.AuditRecord) -> tuple[str, bytes]:
        """The etcd key and bytes ``record`` is stored as (its time and broker are set
        here, its fields bounded: :func:`~dxpool.broker.api.audit_fields.normalised`), for a
        caller that puts it into a transaction of its own."""
        now_ns = self._clock_ns()
        record.time.FromNanoseconds(now_ns)
        record.broker = self.broker
        data = normalised(record).SerializeToString()
        if len(data) > MAX_RECORD_BYTES:  # not reached (a test holds every record to it)
            raise ValueError(f"audit record of {len(data)} bytes; the bound is {MAX_RECORD_BYTES}")
        with self._lock:
            seq = next(self._seq)
        return f"{self.prefix}{_time_key(now_ns)}-{self.broker}-{seq:010d}", data

    def _put_all(self, records: list[tuple[str, bytes]]) -> None:
        """Put ``records``: one put for one, else transactions of up to
        ``MAX_RECORDS_PER_TXN``."""
        if len(records) == 1:
            self._etcd.put(*records[0])
            return
        put = self._etcd.transactions.put
        for start in range(0, len(records), MAX_RECORDS_PER_TXN):
            chunk = records[start : start + MAX_RECORDS_PER_TXN]
            self._etcd.transaction(compare=[], success=[put(k, v) for k, v in chunk], failure=[])

    def maybe_prune(self) -> None:
        """:meth:`prune`, at most once a ``PRUNE_INTERVAL_S`` per log."""
        now = time.monotonic()
        with self._lock:
            if now - self._pruned_at < PRUNE_INTERVAL_S:
                return
            self._pruned_at = now
        self.prune()

    def prune(self, now_ns: int | None = None) -> None:
        """Delete every record older than the retention, in one range delete."""
        now_ns = self._clock_ns() if now_ns is None else now_ns
        cutoff = now_ns - int(self.retention_s * 1e9)
        self._etcd.kvstub.DeleteRange(
            etcd3.etcdrpc.DeleteRangeRequest(
                key=self.prefix.encode(),
                range_end=f"{self.prefix}{_time_key(max(cutoff, 0))}".encode(),
            ),
            self._etcd.timeout,
            metadata=self._etcd.metadata,
        )

    def list(
        self, request: audit_pb2.ListAuditRecordsRequest
    ) -> audit_pb2.ListAuditRecordsResponse:
        """One page of records, oldest first, that match the request's filters."""
        page_size = request.page_size or DEFAULT_PAGE_SIZE
        if not 0 < page_size <= MAX_PAGE_SIZE:
            raise InvalidArgument(
                f"invalid page_size {request.page_size}: use 1 to {MAX_PAGE_SIZE} (0 for "
                f"{DEFAULT_PAGE_SIZE})",
                reason="INVALID_PAGE_SIZE",
            )
        since_ns = _since_ns(request)
        if request.identity:  # a malformed filter is refused, not answered with nothing
            Identity.parse(request.identity)
        wanted = _Filter(since_ns, request.identity, request.target)
        start = f"{self.prefix}{_time_key(since_ns)}".encode()
        if request.page_token:
            start = max(start, self._after(request.page_token))
        end = etcd3.utils.prefix_range_end(self.prefix.encode())
        records: list[audit_pb2.AuditRecord] = []
        last_key = b""
        while len(records) < page_size:
            response = self._etcd.kvstub.Range(
                etcd3.etcdrpc.RangeRequest(key=start, range_end=end, limit=_SCAN_BATCH),
                self._etcd.timeout,
                metadata=self._etcd.metadata,
            )
            for kv in response.kvs:
                last_key = kv.key
                record = audit_pb2.AuditRecord.FromString(kv.value)
                if wanted.keeps(record):
                    records.append(record)
                    if len(records) == page_size:
                        break
            if len(records) == page_size or not response.more or not response.kvs:
                break
            start = response.kvs[-1].key + b"\0"
        more = len(records) == page_size and last_key
        token = last_key.decode()[len(self.prefix) :] if more else ""
        return audit_pb2.ListAuditRecordsResponse(records=records, next_page_token=token)

    def _after(self, token: str) -> bytes:
        """Where a page that follows ``token`` (the last key of the previous page) starts."""
        if len(token) > MAX_PAGE_TOKEN or not token[:20].isascii() or not token[:20].isdigit():
            raise InvalidArgument(
                "invalid page_token: pass the next_page_token of the previous page unchanged",
                reason="INVALID_PAGE_TOKEN",
            )
        return f"{self.prefix}{token}".encode() + b"\0"


def _since_ns(request: audit_pb2.ListAuditRecordsRequest) -> int:
    """``since`` in nanoseconds since 1970 (0 when unset); InvalidArgument for a time
    before 1970 or one a Timestamp cannot hold (after 9999, or nanos outside 0-999999999).
    Times past the largest key time are clamped to it: nothing is that recent."""
    if not request.HasField("since"):
        return 0
    seconds, nanos = request.since.seconds, request.since.nanos
    if seconds < 0:
        raise InvalidArgument("invalid since: give a time after 1970", reason="INVALID_TIME")
    if seconds > _MAX_TIMESTAMP_S or not 0 <= nanos <= 999_999_999:
        raise InvalidArgument(
            f"invalid since (seconds={seconds}, nanos={nanos}): give a time up to "
            "9999-12-31T23:59:59Z, with nanos 0 to 999999999",
            reason="INVALID_TIME",
        )
    return min(seconds * 1_000_000_000 + nanos, _MAX_KEY_NS)


def _status(context: grpc.ServicerContext) -> tuple[grpc.StatusCode, str]:
    """The code and details a call ended with (OK when none was set). The servicer
    context has ``code()`` and ``details()`` since grpcio 1.38; the type stubs lack them."""
    code = getattr(context, "code")()  # noqa: B009
    details = getattr(context, "details")()  # noqa: B009
    if isinstance(details, bytes):
        details = details.decode(errors="replace")
    return code or grpc.StatusCode.OK, str(details or "")


def _peer(context: grpc.ServicerContext) -> str:
    try:
        return str(context.peer())
    except Exception:  # the call is over; the peer is unknown
        return ""


@dataclass(frozen=True)
class _Caller:
    """Who made a call: identity URI (see :class:`AuditRecord`), role (a metric label:
    ``operator``, ``tenant``, ``agent`` or ``none``) and peer address."""

    identity: str
    role: str
    peer: str


class AuditRecorder(Interceptor):
    """Writes one :class:`AuditRecord` per call of a method in :data:`MUTATIONS`.

    ``identify`` names the caller when authentication is on (None: off, identity empty).
    """

    def __init__(
        self,
        audit: AuditLog,
        identify: Callable[[grpc.ServicerContext], Identity] | None = None,
        mutations: Mapping[str, Target] = MUTATIONS,
    ) -> None:
        self._audit = audit
        self._identify = identify
        self._mutations = mutations
        self._refused_log = LogThrottle(REFUSED_LOG_INTERVAL_S)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(details)
        method: str = details.method
        target = self._mutations.get(method)
        if handler is None or target is None or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary
        service, _, rpc_name = method.strip("/").partition("/")
        name = f"{service.rsplit('.', 1)[-1]}.{rpc_name}"

        def recorded(request: Any, context: grpc.ServicerContext) -> Any:
            response = None
            caller = self._caller(context)  # once per call
            pending = PendingRecord(
                lambda answer: self._audit.prepare(
                    self._record_of(name, target, request, answer, caller, OK, "")
                )
            )
            opened = CURRENT.set(pending)
            try:
                response = behavior(request, context)
                return response
            finally:
                CURRENT.reset(opened)
                self._record(name, target, request, response, context, caller, pending.committed)

        return grpc.unary_unary_rpc_method_handler(
            recorded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _caller(self, context: grpc.ServicerContext) -> _Caller:
        peer = _peer(context)
        if self._identify is None:
            return _Caller("", "none", peer)
        try:
            identity = self._identify(context)
        except Unauthenticated:
            return _Caller("unauthenticated", "none", peer)
        return _Caller(identity.uri, identity.role.value, peer)

    def _record_of(
        self,
        rpc: str,
        target: Target,
        request: Any,
        response: Any,
        caller: _Caller,
        code: grpc.StatusCode,
        details: str,
    ) -> audit_pb2.AuditRecord:
        """The record of a call by ``caller`` that ended with ``code`` (its fields are
        bounded when it is stored, see :meth:`AuditLog.prepare`)."""
        record = audit_pb2.AuditRecord(
            identity=caller.identity,
            peer=caller.peer,
            rpc=rpc,
            request_id=str(getattr(request, "request_id", "") or ""),
            code=code.name,
            message=details if code != OK else "",
        )
        try:
            record.target = target(request, response)
        except Exception:  # an undecodable request has no fields to name a target by
            record.target = ""
        return record

    def _record(
        self,
        rpc: str,
        target: Target,
        request: Any,
        response: Any,
        context: grpc.ServicerContext,
        caller: _Caller,
        committed: bool,
    ) -> None:
        """Writes the call's record, unless it was committed with the call's mutation
        and the call ended OK (see :mod:`~dxpool.broker.state.audit_commit`), or it was
        refused for want of authentication or permission (counted instead)."""
        code, details = _status(context)
        if response is None and code == OK:
            code = grpc.StatusCode.UNKNOWN  # raised without setting a status
        if committed:
            self._audit.maybe_prune()
            if code == OK:
                return
        elif code in REFUSED:
            self._count_refused(rpc, code, caller)
            return
        record = self._record_of(rpc, target, request, response, caller, code, details)
        try:
            self._audit.write(record)
        except Exception as error:
            metrics.AUDIT_WRITE_FAILURES.inc()
            log.warning(
                "audit record not written",
                extra={"rpc": rpc, "target": record.target, "error": str(error)},
            )

    def _count_refused(self, rpc: str, code: grpc.StatusCode, caller: _Caller) -> None:
        """A refused call: a counter (labels from fixed sets only) and a log line at most
        once a minute, which names the last caller."""
        metrics.AUDIT_REFUSED_CALLS.labels(rpc=rpc, code=code.name, role=caller.role).inc()
        held = self._refused_log.admit()
        if held is not None:
            log.warning(
                "refused mutating call not recorded in the audit log",
                extra={
                    "rpc": rpc,
                    "code": code.name,
                    "identity": caller.identity[:256],
                    "peer": caller.peer[:128],
                    "suppressed": held,
                },
            )
