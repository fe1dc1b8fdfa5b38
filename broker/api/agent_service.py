"""AgentService on ``grpc.aio``: the one way a host agent reaches the pool.

Served on the broker's agent port by :class:`~dxpool.broker.api.agent_server.AgentServer`,
on an event loop of its own, so a connected agent costs a coroutine and a little memory,
never a thread: thousands of idle sessions cost the broker almost nothing. etcd calls
(a hello's transaction, a status write, the welcome's read) run on a small thread pool
shared by all agents.

* ``Connect``: the first message must be a hello, within :data:`HELLO_TIMEOUT_S`; the
  caller must be the agent of the host it names (see *Authorization*). The session
  opens (:meth:`AgentSessions.open`), the welcome carries it with the host's status
  record (unless the agent says it knows it) and spec; the session's TTL counts from
  the welcome. Hellos wait their turn on the event loop and at most
  :data:`OPEN_WORKERS` are opened at once, so the worker pool always has room for the
  status writes of the agents already connected; a broker with :data:`MAX_OPENING`
  hellos waiting refuses more at once (UNAVAILABLE, ``BROKER_BUSY``: try another
  broker). The queue is long on purpose: a refused agent comes back on a new
  connection (with TLS, a new handshake), so refusing early makes a reconnect storm
  cost the broker more, not less. Then the stream carries
  heartbeats up and acknowledgements and spec changes down. The spec comes from the
  broker's cache: one cache listener hands each change of ``hostalloc/{host}`` to that
  host's stream, where only the newest waits to be sent (a slow agent gets fewer, newer
  specs, never a backlog); a change between the welcome's read and the stream taking
  changes is sent right after the welcome. When the broker ends the session (silent
  past its TTL, taken over, broker lease lost, broker stopping) the stream ends with
  that status.
* ``ReportStatus``: the status write, for the caller's own host and live session
  (:meth:`AgentSessions.write_status`).

*Authorization.* With authentication on (a client CA or a token file, as on the public
port) the caller must be ``dxpool://agent/HOST`` for the host it names; any other
identity is PERMISSION_DENIED before anything is read or written, and counted in
``dxpool_agent_sessions_refused_total``. With authentication off, every caller may act
for any host (a plaintext test pool). Undecodable messages are INVALID_ARGUMENT; a
message over its method's limit (:mod:`~dxpool.broker.api.request_limits`) is not decoded
and ends the call RESOURCE_EXHAUSTED (reason REQUEST_TOO_LARGE), counted in
``dxpool_rpc_oversized_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import grpc

from dxpool.api.v1 import agent_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.auth import Authenticator
from dxpool.broker.api.decoding import Oversized, Undecodable, guard_deserializer
from dxpool.broker.api.request_limits import limit_for
from dxpool.broker.api.rpc import to_status
from dxpool.broker.control import agent_metrics
from dxpool.broker.control.agent_sessions import AgentSessions, Session
from dxpool.broker.state import metrics
from dxpool.broker.state.cache import Cache, ChangeRoutes, Subscription
from dxpool.errors import (
    DxpoolError,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from dxpool.identity import Role
from dxpool.names import host_name, parse_host
from dxpool.store.typed import Versioned

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # grpc's classes are generic only in its type stubs
    GenericHandler = grpc.GenericRpcHandler[Any, Any]
else:
    GenericHandler = grpc.GenericRpcHandler

# What ``context.read()`` returns once the client has half-closed (absent from the stubs).
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]
SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name
HELLO_TIMEOUT_S = 10.0
# Hellos opened at once, each on a worker with its etcd transaction; the pool's other
# workers stay free for status writes and goodbyes (see agent_server.ETCD_WORKERS).
OPEN_WORKERS = 12
# Hellos a broker holds at once, waiting or being opened; more are refused at once with
# UNAVAILABLE (BROKER_BUSY). A waiting hello costs a coroutine and its stream; one its
# agent stops waiting for (the agent's welcome timeout) is cancelled and gives up its turn.
MAX_OPENING = 2048


class _Outbox:
    """What one session's stream sends next. Filled on the event loop (other threads go
    through ``call_soon_threadsafe``); keeps only the newest spec and acknowledgement."""

    def __init__(self) -> None:
        self.spec: tuple[Versioned[pb.HostAllocation] | None, int] | None = None
        self.ack: int | None = None
        self.finished = False
        self.error: DxpoolError | None = None
        self.left = False
        self._wake = asyncio.Event()

    def offer_spec(self, record: Versioned[pb.HostAllocation] | None, revision: int) -> None:
        if self.spec is None or revision >= self.spec[1]:
            self.spec = (record, revision)
            self._wake.set()

    def offer_ack(self, sequence: int) -> None:
        self.ack = sequence
        self._wake.set()

    def finish(self, error: DxpoolError | None) -> None:
        if not self.finished:
            self.finished, self.error = True, error
        self._wake.set()

    async def next(self) -> agent_pb2.ConnectResponse | None:
        """The next message to send; None once the stream is to end."""
        while True:
            if self.finished:
                return None
            if self.spec is not None:
                record, revision = self.spec
                self.spec = None
                return agent_pb2.ConnectResponse(spec=host_spec(record, revision))
            if self.ack is not None:
                sequence, self.ack = self.ack, None
                return agent_pb2.ConnectResponse(
                    heartbeat_ack=agent_pb2.HeartbeatAck(sequence=sequence)
                )
            self._wake.clear()
            await self._wake.wait()


def host_spec(record: Versioned[pb.HostAllocation] | None, revision: int) -> agent_pb2.HostSpec:
    """The spec message for a cached ``hostalloc`` record (None: there is none) as of
    ``revision``."""
    if record is None:
        return agent_pb2.HostSpec(revision=revision)
    return agent_pb2.HostSpec(
        allocation=record.value,
        spec_revision=record.mod_revision,
        revision=max(revision, record.mod_revision),
    )


class AgentService:
    """The servicer; :meth:`handler` is what the aio server registers. Bind it to its
    event loop with :meth:`bind` before serving."""

    def __init__(
        self,
        sessions: AgentSessions,
        cache: Cache,
        executor: Executor,
        authenticator: Authenticator | None,
    ) -> None:
        self._sessions = sessions
        self._cache = cache
        self._executor = executor
        self._authenticator = authenticator
        self._loop: asyncio.AbstractEventLoop | None = None
        # host id -> (session, outbox) of the stream serving it; changed on the loop only
        self._streams: dict[str, tuple[Session, _Outbox]] = {}
        self._opening = 0  # hellos between their arrival and their welcome; the loop's
        self._open_turns = asyncio.Semaphore(OPEN_WORKERS)  # used on the loop only
        self._subscription: Subscription | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve on ``loop`` and start passing spec changes to the streams."""
        self._loop = loop
        self._subscription = self._cache.subscribe_changes(
            ChangeRoutes().on(self._cache.host_allocations, self._on_allocation)
        )

    def unbind(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None

    def handler(self) -> GenericHandler:
        """The service's methods, with deserializers that never raise."""
        methods = {
            "Connect": grpc.stream_stream_rpc_method_handler(
                self.connect,
                request_deserializer=guard_deserializer(
                    agent_pb2.ConnectRequest.FromString, limit_for(f"/{SERVICE}/Connect")
                ),
                response_serializer=agent_pb2.ConnectResponse.SerializeToString,
            ),
            "ReportStatus": grpc.unary_unary_rpc_method_handler(
                self.report_status,
                request_deserializer=guard_deserializer(
                    agent_pb2.ReportStatusRequest.FromString,
                    limit_for(f"/{SERVICE}/ReportStatus"),
                ),
                response_serializer=agent_pb2.ReportStatusResponse.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    # -- spec changes (any thread; must not block) ----------------------------------------

    def _on_allocation(
        self, name: str, record: Versioned[pb.HostAllocation] | None, revision: int
    ) -> None:
        entry = self._streams.get(name)
        loop = self._loop
        if entry is None or loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
            loop.call_soon_threadsafe(entry[1].offer_spec, record, revision)

    # -- calls ----------------------------------------------------------------------------

    def _authorize(self, context: grpc.aio.ServicerContext[Any, Any], host_id: str) -> None:
        if self._authenticator is None:
            return
        identity = self._authenticator.identify(context)  # type: ignore[arg-type]
        if identity.role is not Role.AGENT or identity.name != host_id:
            raise PermissionDenied(
                f"{identity.uri} may not act for {host_name(host_id)}: only that host's "
                f"agent may; use the certificate of dxpool://agent/{host_id}",
                reason="NOT_OWN_HOST",
                metadata={"host": host_name(host_id)},
            )

    async def _run(self, call: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, call, *args)

    async def connect(
        self,
        request_iterator: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except TimeoutError:
            await self._refuse(
                context,
                InvalidArgument(
                    f"no hello within {HELLO_TIMEOUT_S:g}s: send the hello (host, token, "
                    "liveness TTL) as the session's first message",
                    reason="NO_HELLO",
                ),
            )
            return
        if first is _EOF:
            return
        outbox = _Outbox()
        if self._opening >= MAX_OPENING:
            await self._refuse(
                context,
                Unavailable(
                    f"this broker is opening {self._opening} sessions already; retry "
                    "shortly, or use another broker",
                    reason="BROKER_BUSY",
                ),
            )
            return
        self._opening += 1
        try:
            hello = _hello(first)
            host_id = parse_host(hello.host.name)
            self._authorize(context, host_id)
            loop = asyncio.get_running_loop()

            def on_end(error: DxpoolError) -> None:
                with contextlib.suppress(RuntimeError):  # the server is stopping
                    loop.call_soon_threadsafe(outbox.finish, error)

            async with self._open_turns:
                session, welcome, seen = await self._run(self._open, host_id, hello, on_end)
        except DxpoolError as error:
            await self._refuse(context, error)
            return
        finally:
            self._opening -= 1
        self._streams[host_id] = (session, outbox)
        self._catch_up(outbox, host_id, seen)
        reader: asyncio.Task[None] | None = None
        try:
            await context.write(agent_pb2.ConnectResponse(welcome=welcome))
            self._sessions.heartbeat(session)  # its TTL counts from the welcome
            reader = asyncio.create_task(self._read(context, session, outbox))
            while (message := await outbox.next()) is not None:
                await context.write(message)
            if outbox.error is not None:
                status = to_status(outbox.error)
                await context.abort(status.code, status.details, status.trailing_metadata)
        finally:
            if reader is not None:
                reader.cancel()
            if self._streams.get(host_id, (None,))[0] is session:
                del self._streams[host_id]
            if not outbox.left:
                self._sessions.detach(session)

    def _open(
        self,
        host_id: str,
        hello: agent_pb2.AgentHello,
        on_end: Callable[[DxpoolError], None],
    ) -> tuple[Session, agent_pb2.AgentWelcome, int]:
        """Runs on a worker thread: the session and its welcome, in one go (a hello costs
        one worker, however busy the pool is), and the spec record's mod_revision the
        welcome was decided from (0: none)."""
        session = self._sessions.open(
            host_id, hello.host, hello.token, hello.liveness_ttl_ms, on_end
        )
        try:
            welcome, seen = self._welcome(session, hello)
            return session, welcome, seen
        except DxpoolError:
            self._sessions.detach(session)  # the agent tries again and takes it over
            raise

    def _welcome(
        self, session: Session, hello: agent_pb2.AgentHello
    ) -> tuple[agent_pb2.AgentWelcome, int]:
        """Runs on a worker thread: the status record as stored, and the spec unless the
        cache's is older than the agent's; with the spec record's mod_revision read (0:
        none), for :meth:`_catch_up`."""
        welcome = agent_pb2.AgentWelcome(
            session=session.id,
            broker=self._sessions.broker_id,
            liveness_ttl_ms=round(session.ttl_s * 1000),
            heartbeat_interval_ms=round(session.heartbeat_interval_s * 1000),
        )
        if not hello.status_known:
            status = self._sessions.read_status(session.host)
            if status is not None:
                welcome.status.CopyFrom(status)
        revision = self._cache.revision
        record = self._cache.host_allocations.get(session.host)
        held = record.mod_revision if record is not None else 0
        if held >= hello.spec_revision and (record is not None or not hello.spec_revision):
            welcome.spec.CopyFrom(host_spec(record, revision))
        return welcome, held

    def _catch_up(self, outbox: _Outbox, host_id: str, seen: int) -> None:
        """On the loop, once the stream is in ``_streams``: offer the spec if it changed
        after the welcome read it (at mod_revision ``seen``). A change in between found
        no stream to take it, and the agent would otherwise keep the welcome's spec until
        the next change. A change that reached the stream as well may go out twice,
        which is harmless: the agent adopts a spec no older than its own, and the same
        one again changes nothing."""
        revision = self._cache.revision
        record = self._cache.host_allocations.get(host_id)
        if (record.mod_revision if record is not None else 0) != seen:
            outbox.offer_spec(record, revision)

    async def _read(
        self, context: grpc.aio.ServicerContext[Any, Any], session: Session, outbox: _Outbox
    ) -> None:
        """Heartbeats and the goodbye, until the agent's side of the stream ends."""
        try:
            while True:
                message = await context.read()
                if message is _EOF:
                    outbox.finish(None)
                    return
                if isinstance(message, Undecodable | Oversized):
                    outbox.finish(_refused_payload("Connect", message))
                    return
                kind = message.WhichOneof("kind")
                if kind == "heartbeat":
                    if not self._sessions.heartbeat(session):
                        return  # ended: the outbox has been told why
                    outbox.offer_ack(message.heartbeat.sequence)
                elif kind == "goodbye":
                    outbox.left = True
                    try:
                        await self._run(
                            functools.partial(
                                self._sessions.leave, session, release=message.goodbye.release
                            )
                        )
                    except DxpoolError as error:
                        log.warning(
                            "goodbye not recorded; the host goes when its TTL passes",
                            extra={"host": session.host, "error": error.message},
                        )
                    outbox.finish(None)
                    return
                else:
                    outbox.finish(
                        InvalidArgument(
                            "a session sends one hello, then heartbeats and a goodbye",
                            reason="UNEXPECTED_MESSAGE",
                        )
                    )
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the call ended under us (cancelled, reset)
            log.debug("agent stream read ended", extra={"error": repr(error)})
            outbox.finish(None)

    async def report_status(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.ReportStatusResponse:
        try:
            if isinstance(request, Undecodable | Oversized):
                raise _refused_payload("ReportStatus", request)
            host_id = parse_host(request.host)
            self._authorize(context, host_id)
            revision = await self._run(
                self._sessions.write_status,
                host_id,
                request.session,
                request.status,
                request.spec_revision,
            )
        except DxpoolError as error:
            if error.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                agent_metrics.STATUS_WRITES.labels(result=error.code.name).inc()
            status = to_status(error)
            await context.abort(status.code, status.details, status.trailing_metadata)
            raise AssertionError("abort returns only by raising") from None
        return agent_pb2.ReportStatusResponse(revision=revision)

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        error: DxpoolError,
        *,
        counted: bool = True,
    ) -> None:
        if counted:
            agent_metrics.SESSIONS_REFUSED.labels(reason=error.reason).inc()
        status = to_status(error)
        await context.abort(status.code, status.details, status.trailing_metadata)


def _hello(message: Any) -> agent_pb2.AgentHello:
    if isinstance(message, Undecodable | Oversized):
        raise _refused_payload("Connect", message)
    if message.WhichOneof("kind") != "hello":
        raise InvalidArgument(
            "a session starts with a hello: send the hello (host, token, liveness TTL) as "
            "its first message",
            reason="NO_HELLO",
        )
    hello: agent_pb2.AgentHello = message.hello
    return hello


def _refused_payload(method: str, message: Undecodable | Oversized) -> DxpoolError:
    """The error for a message that did not decode, or was too large to (counted)."""
    if isinstance(message, Oversized):
        metrics.RPC_OVERSIZED.labels(method=f"AgentService.{method}").inc()
        return ResourceExhausted(
            f"the message is {message.size} bytes; {method} takes at most {message.limit} "
            "bytes: send less (fewer or shorter labels, texts or entries)",
            reason="REQUEST_TOO_LARGE",
            metadata={"size": str(message.size), "limit": str(message.limit)},
        )
    return InvalidArgument(
        f"the message is not a valid {message.expected} ({message.error}); send a "
        f"serialized {message.expected}, e.g. through the generated dxpool.v1 stubs",
        reason="UNDECODABLE_REQUEST",
    )


__all__ = ["HELLO_TIMEOUT_S", "MAX_OPENING", "OPEN_WORKERS", "SERVICE", "AgentService", "host_spec"]
