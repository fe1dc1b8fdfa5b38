"""The agent's link to the pool: one session with one broker at a time, failing over.

A host agent holds no etcd client and no etcd credentials. It reaches the pool only
through a broker's agent port (``AgentService``), with its own certificate
(``dxpool://agent/HOST``): the broker may act for that host alone.

:class:`BrokerLink` keeps one session open from a thread of its own:

* **Connect.** It opens the ``Connect`` stream to a broker and sends a hello (the host's
  registration, the agent's identity token, its liveness TTL, and the spec revision it
  holds); the welcome names the session and carries the host's status record and spec
  (:attr:`on_welcome`). Then it sends a heartbeat every interval the broker asked for
  and hands each spec the broker pushes to :attr:`on_spec`.
* **Which broker.** The link tries the brokers in an order of its host's own
  (:func:`broker_order`: the list shuffled, seeded by the host's name), so hosts given
  the same list spread evenly over the brokers, and when one goes its hosts spread
  evenly over the others instead of all arriving at the next one in the list.
* **Fail over.** When the stream breaks, the broker ends the session, or the broker is
  silent for two heartbeat intervals and a second (a frozen broker), the link tries
  the next broker of its order, with exponential backoff and jitter (tenacity) between
  failed tries (the first try after a session that lasted comes within a random half
  second, so a broker's agents do not all arrive at once), and sends the spec revision
  it holds, so the new broker resumes from there. The host stays alive meanwhile: its
  liveness record lives until the TTL has passed since the last heartbeat, and the new
  broker takes it over. A refusal that cannot pass by waiting a moment (the host held by
  another agent, a certificate that is not the host's) is retried more slowly and logged
  as an error.
* **Status.** :meth:`BrokerLink.write_status` (a
  :class:`~dxpool.hostagent.status.StatusWriter`) sends the whole record on the live
  session (``ReportStatus``); the broker's guards answer :class:`StaleSpecError` or
  :class:`NotRegisteredError` (no session now), and anything else is
  :class:`~dxpool.errors.Unavailable`, its outcome unknown.
* **Stop.** :meth:`BrokerLink.stop` says goodbye (``release``: the host is gone at once;
  otherwise it stays alive for the TTL, for a restart with the same identity) and waits
  briefly for the broker to end the stream.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import tenacity

from dxpool.api.v1 import agent_pb2, agent_pb2_grpc, resources_pb2
from dxpool.errors import (
    DxpoolError,
    FailedPrecondition,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from dxpool.hostagent.status import NotRegisteredError, StaleSpecError
from dxpool.tls import ClientTls

log = logging.getLogger(__name__)

WELCOME_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 10.0
GOODBYE_TIMEOUT_S = 5.0
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
# Refusals that a moment's wait does not cure (another agent holds the host, the
# certificate names another host): tried again, but no faster than this.
REFUSED_RETRY_S = 5.0
RECONNECT_JITTER_S = 0.5
# A session shorter than this counts as a failed try (a broker that welcomes and drops).
STABLE_SESSION_S = 1.0
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_STOP = object()


def broker_order(host: str, endpoints: Sequence[str]) -> tuple[str, ...]:
    """The order in which ``host``'s agent tries ``endpoints``: the list shuffled by a
    generator seeded with the host's name, so the same on every start of the agent.
    Over many hosts each broker comes first equally often, and among the hosts that
    share a first broker each other broker comes next equally often."""
    order = list(endpoints)
    random.Random(host).shuffle(order)
    return tuple(order)


@dataclass(frozen=True)
class LiveSession:
    """The session a link holds now."""

    id: str
    broker: str
    endpoint: str
    stub: agent_pb2_grpc.AgentServiceStub


class _SessionEndedError(Exception):
    """One try at a session ended; ``established`` when it had been welcomed and lasted."""

    def __init__(self, error: DxpoolError, *, established: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.established = established


class _Outgoing:
    """The agent's side of one stream: the hello, then heartbeats every interval until a
    goodbye; cancels the call when the broker has been silent for too long."""

    def __init__(self, hello: agent_pb2.AgentHello) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queue.put(agent_pb2.ConnectRequest(hello=hello))
        self._interval: float | None = None  # set by the welcome
        self._silence_limit = WELCOME_TIMEOUT_S
        self._heard_at = time.monotonic()
        self._sequence = 0
        self.call: Any = None

    def welcomed(self, interval_s: float) -> None:
        self._interval = max(0.05, interval_s)
        self._silence_limit = 2 * self._interval + 1.0
        self.heard()

    def heard(self) -> None:
        self._heard_at = time.monotonic()

    def say(self, message: agent_pb2.ConnectRequest) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(_STOP)

    def messages(self) -> Iterator[agent_pb2.ConnectRequest]:
        """Runs on a gRPC thread for the life of the stream."""
        while True:
            wait = self._interval if self._interval is not None else 0.5
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if time.monotonic() - self._heard_at > self._silence_limit:
                log.warning(
                    "broker silent; leaving it",
                    extra={"silent_s": round(time.monotonic() - self._heard_at, 1)},
                )
                if self.call is not None:
                    self.call.cancel()
                return
            if item is not None:
                yield item
            elif self._interval is not None:
                self._sequence += 1
                yield agent_pb2.ConnectRequest(
                    heartbeat=agent_pb2.AgentHeartbeat(sequence=self._sequence)
                )


class BrokerLink:
    """One host's session with the pool's brokers; see the module docstring.

    ``hello()`` builds the hello for each try (so it carries the spec revision held at
    that moment). ``on_welcome`` and ``on_spec`` run on the link's thread and must not
    block for long.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        host: str,
        hello: Callable[[], agent_pb2.AgentHello],
        on_welcome: Callable[[agent_pb2.AgentWelcome], None],
        on_spec: Callable[[agent_pb2.HostSpec], None],
        *,
        tls: ClientTls | None = None,
        token: str | None = None,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        if not endpoints:
            raise ValueError("a link needs at least one broker endpoint")
        self._endpoints = broker_order(host, endpoints)
        self._host = host
        self._hello = hello
        self._on_welcome = on_welcome
        self._on_spec = on_spec
        self._tls = tls
        self._token = token
        self._backoff_max_s = backoff_max_s
        self._lock = threading.Lock()
        self._session: LiveSession | None = None
        self._outgoing: _Outgoing | None = None
        self._next = 0
        self._stopping = threading.Event()
        self._connected = threading.Event()
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error: DxpoolError | None = None
        self._sessions = 0

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dxpool-broker-link", daemon=True)
        self._thread.start()

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until a session is live (True), or ``timeout_s`` passes or the link stops
        (False); :attr:`last_error` says what went wrong meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._connected.wait(min(left, 0.1)):
                return True
        return False

    @property
    def last_error(self) -> DxpoolError | None:
        """Why the last try at a session failed (None before any failed)."""
        return self._last_error

    @property
    def session(self) -> LiveSession | None:
        with self._lock:
            return self._session

    @property
    def sessions_opened(self) -> int:
        """How many sessions the link has had (reconnects count)."""
        return self._sessions

    def stop(self, *, release: bool) -> None:
        """Say goodbye (see the module docstring) and end the link. Idempotent."""
        self._stopping.set()
        with self._lock:
            outgoing, session = self._outgoing, self._session
        if outgoing is not None:
            if session is not None:
                outgoing.say(
                    agent_pb2.ConnectRequest(goodbye=agent_pb2.AgentGoodbye(release=release))
                )
            outgoing.close()
            if not self._ended.wait(GOODBYE_TIMEOUT_S) and outgoing.call is not None:
                outgoing.call.cancel()
        if self._thread is not None:
            self._thread.join(GOODBYE_TIMEOUT_S + 5)

    # -- the session loop -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            retrying = tenacity.Retrying(
                retry=tenacity.retry_if_exception(
                    lambda e: isinstance(e, _SessionEndedError) and not e.established
                ),
                wait=self._wait,
                stop=tenacity.stop_when_event_set(self._stopping),
                sleep=self._sleep,
                before_sleep=self._log_retry,
                reraise=True,
            )
            try:
                retrying(self._try_next)
            except _SessionEndedError as failed:
                if failed.established:
                    log.warning(
                        "session ended; connecting again",
                        extra={"error": failed.error.message},
                    )
                    # Every agent of a broker that went away reconnects at once: spread
                    # them a little over the brokers that are left.
                    self._stopping.wait(random.uniform(0, RECONNECT_JITTER_S))
            except Exception:
                log.exception("broker link failed; connecting again")
                self._stopping.wait(1.0)

    def _sleep(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    def _wait(self, state: tenacity.RetryCallState) -> float:
        backoff = (
            tenacity.wait_exponential(multiplier=BACKOFF_INITIAL_S, max=self._backoff_max_s)
            + tenacity.wait_random(0, BACKOFF_INITIAL_S)
        )(state)
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, _SessionEndedError) and _refused(error.error):
            return max(backoff, min(REFUSED_RETRY_S, self._backoff_max_s))
        return backoff

    def _log_retry(self, state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        failure = error.error if isinstance(error, _SessionEndedError) else None
        if failure is not None and _refused(failure):
            log.error(
                "broker refused the agent's session",
                extra={"reason": failure.reason, "error": failure.message},
            )
        else:
            log.warning(
                "no session with a broker; trying the next",
                extra={"attempt": state.attempt_number, "error": str(error)},
            )

    def _try_next(self) -> None:
        endpoint = self._endpoints[self._next % len(self._endpoints)]
        self._next += 1
        self._one_session(endpoint)

    def _channel(self, endpoint: str) -> grpc.Channel:
        if self._tls is None:
            return grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        credentials = self._tls.credentials()
        if self._token is not None:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self._token)
            )
        return grpc.secure_channel(
            endpoint, credentials, options=[*_CHANNEL_OPTIONS, *self._tls.channel_options()]
        )

    def _one_session(self, endpoint: str) -> None:
        """One session with the broker at ``endpoint``, from hello to its end; raises
        :class:`_SessionEndedError` (returns only when the link stops)."""
        channel = self._channel(endpoint)
        outgoing = _Outgoing(self._hello())
        started = time.monotonic()
        welcomed = False
        try:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            call = stub.Connect(outgoing.messages())
            outgoing.call = call
            with self._lock:
                self._outgoing = outgoing
            self._ended.clear()
            responses = iter(call)
            welcome = self._welcome(endpoint, responses, call)
            outgoing.welcomed(welcome.heartbeat_interval_ms / 1000)
            self._on_welcome(welcome)
            with self._lock:
                self._session = LiveSession(welcome.session, welcome.broker, endpoint, stub)
            welcomed = True
            self._sessions += 1
            self._last_error = None
            self._connected.set()
            log.info(
                "session opened",
                extra={"broker": welcome.broker, "endpoint": endpoint, "session": welcome.session},
            )
            for message in responses:
                outgoing.heard()
                if message.WhichOneof("kind") == "spec":
                    self._on_spec(message.spec)
            if self._stopping.is_set():
                return
            raise _SessionEndedError(
                Unavailable(f"broker {endpoint} ended the session"),
                established=time.monotonic() - started >= STABLE_SESSION_S,
            )
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
            if not welcomed:
                self._last_error = failure
            if self._stopping.is_set() and welcomed:
                return
            raise _SessionEndedError(
                failure,
                established=welcomed and time.monotonic() - started >= STABLE_SESSION_S,
            ) from None
        finally:
            self._closed(outgoing)
            channel.close()

    @staticmethod
    def _welcome(
        endpoint: str, responses: Iterator[agent_pb2.ConnectResponse], call: Any
    ) -> agent_pb2.AgentWelcome:
        """The stream's first message, which must be a welcome, within
        :data:`WELCOME_TIMEOUT_S` (the call is cancelled otherwise)."""
        watchdog = threading.Timer(WELCOME_TIMEOUT_S, call.cancel)
        watchdog.daemon = True
        watchdog.start()
        try:
            first = next(responses, None)
        finally:
            watchdog.cancel()
        if first is None or first.WhichOneof("kind") != "welcome":
            raise _SessionEndedError(
                Unavailable(f"broker {endpoint} sent no welcome", reason="NO_WELCOME")
            )
        welcome: agent_pb2.AgentWelcome = first.welcome
        return welcome

    def _closed(self, outgoing: _Outgoing) -> None:
        """The stream of ``outgoing`` is over: no session until the next one."""
        with self._lock:
            self._session = None
            if self._outgoing is outgoing:
                self._outgoing = None
        self._connected.clear()
        outgoing.close()
        self._ended.set()

    # -- status ---------------------------------------------------------------------------

    def write_status(self, record: resources_pb2.HostStatus, spec_revision: int) -> None:
        """Write the host's status on the live session (see the module docstring)."""
        session = self.session
        if session is None:
            raise NotRegisteredError(f"{self._host} holds no session with a broker now")
        request = agent_pb2.ReportStatusRequest(
            host=self._host, session=session.id, status=record, spec_revision=spec_revision
        )
        try:
            session.stub.ReportStatus(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
            if isinstance(failure, FailedPrecondition) and failure.reason == "STALE_SPEC":
                raise StaleSpecError(failure.message) from None
            if isinstance(failure, FailedPrecondition) and failure.reason == "SESSION_NOT_LIVE":
                raise NotRegisteredError(failure.message) from None
            if isinstance(failure, Unavailable):
                raise failure from None
            raise Unavailable(
                f"status not written by broker {session.endpoint}: "
                f"{failure.code.name}: {failure.message}",
                reason="STATUS_NOT_WRITTEN",
            ) from None


def _refused(error: DxpoolError) -> bool:
    """Whether a broker refused the session for a reason a moment's wait will not cure."""
    if isinstance(error, PermissionDenied | Unauthenticated):
        return True
    return isinstance(error, FailedPrecondition) and error.reason == "HOST_HELD"


__all__ = ["BrokerLink", "LiveSession", "broker_order"]
