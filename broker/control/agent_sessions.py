"""Agent sessions: a host is alive while its own agent proves it, through a broker.

Host agents hold no etcd credentials. Each keeps one session with one broker (the
agent service, :mod:`dxpool.broker.api.agent_service`); this module is the broker's side of
those sessions, free of gRPC so tests drive it directly:

* **Open.** An agent's hello names its host, the token of its identity and its liveness
  TTL. In one transaction the broker puts the host's registration (``hosts/{host}``) and
  its liveness record (``hostleases/{host}``, a :class:`~dxpool.api.v1.resources_pb2.HostLiveness`
  naming the token's digest, this broker and the session) on the broker's own etcd
  lease (:class:`~dxpool.broker.control.agent_lease.BrokerLease`), comparing the liveness record
  it read: absent, or held by the same token (an agent that restarted or reconnected
  to another broker takes its session over). A record held by another token refuses the
  hello (:class:`HostHeldError`) and writes nothing: one agent holds a host. The first
  hello on a lease also puts the broker's registration (``brokers/{broker id}``) on it,
  so that when the broker dies its registration goes with its agents' records, and the
  leader can tell a dead broker's hosts (which get time to reconnect elsewhere) from a
  dead agent's (:mod:`dxpool.broker.control.duties`).
* **Liveness.** Every heartbeat (and status write) sets the session's last-seen time.
  The reaper ends a session whose agent has been silent for its TTL and deletes its
  liveness record, comparing that it still names the session; the host is
  then absent and the leader declares it lost (:mod:`dxpool.broker.control.duties`). A session
  whose stream broke without a goodbye lives on until that TTL too, so the agent can
  come back through any broker; a goodbye with ``release`` deletes the record at once.
  Nothing an agent can send keeps *another* host alive: the record is the broker's,
  on the broker's lease, and only that host's own session refreshes it.
* **Status.** :meth:`AgentSessions.write_status` writes ``hoststatus/{host}`` for the
  agent with the two guards the agent used to put in its own transactions: the
  liveness record still names *this session* (its mod_revision is the session's), and
  a write that claims a GPU compares the spec record's mod_revision the agent acted
  on. A stale session or a stale spec writes nothing (:class:`StaleSpecError`,
  :class:`SessionNotLiveError`).
* **Losing etcd.** When the broker's lease is lost (:mod:`dxpool.broker.control.agent_lease`),
  every session ends (UNAVAILABLE), so the agents move to a broker that reaches etcd.

Thread-safe: hellos and status writes come from the agent service's worker threads,
heartbeats from its event loop, reaping and lease refreshes from two maintenance threads
of their own. Every etcd call is made outside the lock.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control import agent_metrics
from dxpool.broker.control.agent_lease import DEFAULT_BROKER_LEASE_TTL_S, BrokerLease
from dxpool.broker.control.agent_records import check_host_registration, check_host_status
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.stm import SESSION_ATTEMPTS, commit_staged, expect
from dxpool.errors import DxpoolError, FailedPrecondition, InvalidArgument, Unavailable
from dxpool.limits import MAX_TEXT
from dxpool.names import check_id, host_name
from dxpool.store.typed import Store, Txn

log = logging.getLogger(__name__)

# Liveness records a reaping pass deletes in one transaction (etcd allows 128 operations).
DELETE_BATCH = 64


class HostHeldError(FailedPrecondition):
    """Another agent (another identity token) holds the host's live session."""

    default_reason = "HOST_HELD"


class SessionNotLiveError(FailedPrecondition):
    """The session no longer holds its host on this broker: connect again."""

    default_reason = "SESSION_NOT_LIVE"


class StaleSpecError(FailedPrecondition):
    """The host's spec changed since the revision the status write acted on."""

    default_reason = "STALE_SPEC"


@dataclass(frozen=True)
class SessionSettings:
    """Bounds and timing of agent sessions.

    ``min_ttl_s``/``max_ttl_s`` bound the liveness TTL an agent asks for (none given:
    ``default_ttl_s``); ``lease_ttl_s`` is the broker lease's; ``tick_s`` how often
    silent sessions are looked for and the lease refreshed.
    """

    default_ttl_s: float = 10.0
    min_ttl_s: float = 1.0
    max_ttl_s: float = 300.0
    lease_ttl_s: float = DEFAULT_BROKER_LEASE_TTL_S
    tick_s: float = 0.25

    def ttl_for(self, asked_ms: int) -> float:
        if asked_ms <= 0:
            return self.default_ttl_s
        return min(self.max_ttl_s, max(self.min_ttl_s, asked_ms / 1000))


@dataclass(eq=False)
class Session:
    """One agent's session on this broker. ``on_end`` is told (once, from any thread)
    when the broker ends the session, with the error the agent's stream ends with."""

    id: str
    host: str
    digest: bytes
    ttl_s: float
    key_revision: int
    last_seen: float
    on_end: Callable[[DxpoolError], None] = field(repr=False)
    connected: bool = True
    ended: bool = False

    @property
    def heartbeat_interval_s(self) -> float:
        return self.ttl_s / 3


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_liveness(value: bytes) -> pb.HostLiveness:
    """A liveness record's value; an unreadable one (written by something else) reads as
    held by nobody's token, which no agent matches."""
    try:
        return pb.HostLiveness.FromString(value)
    except DecodeError:
        return pb.HostLiveness()


def _now_timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def commit_status(
    store: Store,
    host_id: str,
    liveness_revision: int,
    record: pb.HostStatus,
    spec_revision: int,
    cache: Cache | None = None,
) -> tuple[int, list[tuple[str, Any]]]:
    """Write ``host_id``'s status ``record`` in one transaction that requires the host's
    liveness record to be unchanged since ``liveness_revision`` (the session's) and, with
    ``spec_revision`` (0: none), the spec record unchanged since then. Returns the
    commit's revision and writes (``cache``, when given, took them). Raises
    :class:`SessionNotLiveError` or :class:`StaleSpecError` (nothing written; ``cache``
    takes what the failed compare read), :class:`~dxpool.errors.Unavailable`."""
    keys = store.keys
    lease_key = keys.host_lease(host_id)
    spec_key = keys.host_allocation(host_id)
    txn = expect(Txn(), lease_key, liveness_revision)
    if spec_revision:
        expect(txn, spec_key, spec_revision)
    txn.put(keys.host_status(host_id), record)
    result = store.commit(txn) if cache is None else commit_staged(store, cache, txn, created=set())
    if result.succeeded:
        return result.revision, txn.writes
    liveness = result.current.get(lease_key)
    if liveness is None or liveness.mod_revision != liveness_revision:
        raise SessionNotLiveError(
            f"{host_name(host_id)}'s liveness record no longer names this session; connect again"
        )
    current = result.current.get(spec_key)
    now = current.mod_revision if current else 0
    raise StaleSpecError(
        f"the spec of {host_name(host_id)} changed since revision {spec_revision} (now "
        f"{now}); act on the new spec",
        metadata={"spec_revision": str(now)},
    )


class AgentSessions:
    """The sessions this broker holds, by host; see the module docstring."""

    def __init__(
        self,
        store: Store,
        cache: Cache,
        broker_id: str,
        settings: SessionSettings = SessionSettings(),
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = store.keys
        self._cache = cache
        self.broker_id = broker_id
        self.settings = settings
        self._clock = clock
        self._wall_clock = wall_clock
        self.lease = BrokerLease(store, settings.lease_ttl_s, on_lost=self._lease_lost, clock=clock)
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._registered_lease = 0  # the lease this broker's registration is on
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the two maintenance threads: the lease's refreshes, and reaping silent
        sessions. Apart, so that reaping many sessions while etcd is slow never delays
        the refresh every one of them depends on."""
        for target, name in ((self.lease.tick, "agent-lease"), (self.reap, "agent-reaper")):
            thread = threading.Thread(
                target=self._every_tick, args=(target, name), name=name, daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the maintenance threads and end every session (UNAVAILABLE, so agents
        reconnect elsewhere). Liveness records stay, on the lease, for other brokers to
        take over."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._end_all(Unavailable("this broker is stopping: connect to another broker"))

    def _every_tick(self, step: Callable[[], object], name: str) -> None:
        while not self._stop.wait(self.settings.tick_s):
            try:
                step()
            except Exception:
                log.exception("agent session maintenance failed; retrying", extra={"step": name})

    # -- reading ------------------------------------------------------------------------

    def get(self, host_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(host_id)

    def count(self) -> int:
        with self._lock:
            return len(self._sessions)

    # -- open, heartbeat, leave ---------------------------------------------------------

    def open(
        self,
        host_id: str,
        registration: pb.Host,
        token: str,
        ttl_ms: int,
        on_end: Callable[[DxpoolError], None],
    ) -> Session:
        """Open a session for ``host_id``'s agent: put its registration and liveness
        record (see the module docstring) and return the session. Raises
        :class:`HostHeldError` when another identity holds the host,
        :class:`~dxpool.errors.InvalidArgument` for a bad registration or token, and
        :class:`~dxpool.errors.Unavailable` when etcd cannot be reached."""
        check_id(host_id, "host")
        record = check_host_registration(host_id, registration)
        if not token or len(token) > MAX_TEXT:
            raise InvalidArgument(
                f"the hello's identity token has {len(token)} characters: send the "
                f"agent's token, 1-{MAX_TEXT} characters",
                reason="INVALID_TOKEN",
            )
        now = self._wall_clock()
        record.register_time.CopyFrom(_now_timestamp(now))
        ttl_s = self.settings.ttl_for(ttl_ms)
        digest = token_digest(token)
        session_id = uuid.uuid4().hex
        lease = self.lease.current()
        key = self._keys.host_lease(host_id)
        liveness = pb.HostLiveness(
            agent_digest=digest,
            broker=self.broker_id,
            session=session_id,
            since=_now_timestamp(now),
            liveness_ttl_ms=round(ttl_s * 1000),
        ).SerializeToString(deterministic=True)
        # The cache's view first: one transaction when it is current (a reconnect storm
        # costs etcd one round trip per agent); a failed compare returns what etcd holds.
        current = self._cache.host_leases.get(host_id)
        confirmed = False
        for _ in range(SESSION_ATTEMPTS):
            if current is not None and parse_liveness(bytes(current.value)).agent_digest != digest:
                if not confirmed:  # never refuse on a cached view: read it from etcd
                    current, confirmed = self._store.get(key), True
                    continue
                holder = parse_liveness(bytes(current.value))
                raise HostHeldError(
                    f"{host_name(host_id)} is held by another live agent (its session on "
                    f"broker {holder.broker or 'unknown'}); stop that agent, or retry once "
                    f"its broker has not heard from it for {holder.liveness_ttl_ms / 1000:g}s",
                    metadata={"host": host_name(host_id)},
                )
            txn = expect(Txn(), key, current.mod_revision if current is not None else 0)
            txn.put(self._keys.host(host_id), record).put(key, liveness, lease=lease)
            registered = self._registered_lease == int(lease.id)
            if not registered:  # the broker's registration goes on the same lease
                txn.put(self._keys.broker(self.broker_id), b"", lease=lease)
            result = commit_staged(self._store, self._cache, txn, created=set())
            if result.succeeded:
                self._registered_lease = int(lease.id)
                break
            current, confirmed = result.current.get(key), True
        else:
            raise Unavailable(
                f"the liveness record of {host_name(host_id)} kept changing while this "
                "broker took it; connect again",
                reason="SESSION_CONTENDED",
            )
        session = Session(
            id=session_id,
            host=host_id,
            digest=digest,
            ttl_s=ttl_s,
            key_revision=result.revision,
            last_seen=self._clock(),
            on_end=on_end,
        )
        with self._lock:
            previous = self._sessions.get(host_id)
            self._sessions[host_id] = session
        if previous is None:
            agent_metrics.SESSIONS.inc()
        if previous is not None and not previous.ended:
            self._end(previous, SessionNotLiveError("this agent opened a newer session"))
        agent_metrics.SESSIONS_OPENED.inc()
        log.debug(
            "agent session opened",
            extra={"host": host_id, "session": session_id, "took_over": current is not None},
        )
        return session

    def heartbeat(self, session: Session) -> bool:
        """The agent is alive now; False when the session has ended."""
        if session.ended:
            return False
        session.last_seen = self._clock()
        return True

    def detach(self, session: Session) -> None:
        """The session's stream ended without a goodbye: the host stays alive until the
        TTL has passed since the agent's last heartbeat, for it to reconnect anywhere."""
        session.connected = False

    def leave(self, session: Session, *, release: bool) -> None:
        """The agent said goodbye. ``release``: delete the liveness record now (the host
        is gone); otherwise as :meth:`detach`. Raises
        :class:`~dxpool.errors.Unavailable` when the record could not be deleted (it then
        goes when the TTL passes)."""
        session.connected = False
        if not release:
            return
        self._forget(session)
        self._delete_record(session)

    # -- status -------------------------------------------------------------------------

    def write_status(
        self, host_id: str, session_id: str, status: pb.HostStatus, spec_revision: int
    ) -> int:
        """Write ``host_id``'s status record for session ``session_id``; returns the
        revision of the write. ``spec_revision`` (0: none) is the spec's mod_revision a
        claim in the record was decided from. Raises :class:`SessionNotLiveError`,
        :class:`StaleSpecError` (nothing written),
        :class:`~dxpool.errors.InvalidArgument` for a bad record, and
        :class:`~dxpool.errors.Unavailable`."""
        record = check_host_status(host_id, status)
        session = self.get(host_id)
        if session is None or session.id != session_id or session.ended:
            agent_metrics.STATUS_WRITES.labels(result="SESSION_NOT_LIVE").inc()
            raise SessionNotLiveError(
                f"session {session_id[:40]!r} does not hold {host_name(host_id)} on this "
                "broker; connect again"
            )
        session.last_seen = self._clock()
        try:
            revision, _ = commit_status(
                self._store, host_id, session.key_revision, record, spec_revision, self._cache
            )
        except SessionNotLiveError:
            agent_metrics.STATUS_WRITES.labels(result="SESSION_NOT_LIVE").inc()
            self._forget(session)
            self._end(session, SessionNotLiveError("another session took the host over"))
            raise
        except StaleSpecError:
            agent_metrics.STATUS_WRITES.labels(result="STALE_SPEC").inc()
            raise
        agent_metrics.STATUS_WRITES.labels(result="OK").inc()
        return revision

    # -- ending -------------------------------------------------------------------------

    def reap(self) -> int:
        """End every session whose agent has been silent for its TTL and delete their
        liveness records (up to :data:`DELETE_BATCH` in one transaction); returns how
        many ended. A record that cannot be deleted now (etcd away) is tried again on the
        next pass; it is on the broker's lease, so it goes with the lease at the latest."""
        now = self._clock()
        with self._lock:
            silent = [s for s in self._sessions.values() if now - s.last_seen >= s.ttl_s]
        newly = [session for session in silent if not session.ended]
        if newly:
            agent_metrics.SESSIONS_EXPIRED.inc(len(newly))
            log.warning(
                "agents silent past their liveness TTL; their hosts are no longer alive",
                extra={
                    "count": len(newly),
                    "hosts": ",".join(s.host for s in newly[:5]),
                    "ttl_s": newly[0].ttl_s,
                },
            )
        for session in newly:
            self._end(
                session,
                SessionNotLiveError(
                    f"no heartbeat for {session.ttl_s:g}s: the host is no longer alive; "
                    "connect again",
                ),
            )
        for start in range(0, len(silent), DELETE_BATCH):
            batch = silent[start : start + DELETE_BATCH]
            try:
                self._delete_records(batch)
            except Unavailable:
                continue
            for session in batch:
                self._forget(session)
        return len(silent)

    def _delete_records(self, sessions: list[Session]) -> None:
        """Delete the sessions' liveness records that still name them: all in one
        transaction, or one by one when one of them changed meanwhile."""
        txn = Txn()
        for session in sessions:
            key = self._keys.host_lease(session.host)
            txn.expect_revision(key, session.key_revision).delete(key)
        if commit_staged(self._store, self._cache, txn, created=set()).succeeded:
            return
        for session in sessions:
            self._delete_record(session)

    def _delete_record(self, session: Session) -> None:
        """Delete the session's liveness record if it still names the session."""
        key = self._keys.host_lease(session.host)
        txn = Txn().expect_revision(key, session.key_revision).delete(key)
        commit_staged(self._store, self._cache, txn, created=set())

    def _forget(self, session: Session) -> None:
        with self._lock:
            if self._sessions.get(session.host) is not session:
                return
            del self._sessions[session.host]
        agent_metrics.SESSIONS.dec()

    def _end(self, session: Session, error: DxpoolError) -> None:
        if session.ended:
            return
        session.ended = True
        try:
            session.on_end(error)
        except Exception:
            log.exception("ending an agent's stream failed", extra={"host": session.host})

    def _end_all(self, error: DxpoolError) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        agent_metrics.SESSIONS.dec(len(sessions))
        for session in sessions:
            self._end(session, error)

    def _lease_lost(self, reason: str) -> None:
        """The broker's lease is gone, or may be: its records cannot be vouched for, so
        the agents go to a broker that reaches etcd."""
        self._end_all(
            Unavailable(
                f"this broker lost its etcd lease ({reason}): connect to another broker",
                reason="BROKER_LEASE_LOST",
            )
        )

    def read_status(self, host_id: str) -> pb.HostStatus | None:
        """``host_id``'s status record as stored (a linearizable read), for a welcome."""
        found = self._store.get(self._keys.host_status(host_id))
        return found.value if found is not None else None


__all__ = [
    "AgentSessions",
    "HostHeldError",
    "Session",
    "SessionNotLiveError",
    "SessionSettings",
    "StaleSpecError",
    "commit_status",
    "parse_liveness",
    "token_digest",
]
