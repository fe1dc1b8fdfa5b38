"""The broker's agent port: AgentService on a ``grpc.aio`` server in a thread of its own.

The public API keeps its synchronous server (every unary handler on the code path it is
tested on, streams within a thread budget, see :mod:`dxpool.broker.api.streams`). Agents are
different: every host keeps one session open for good, thousands per broker, so the
agent port runs an asynchronous server on an event loop in its own thread, where an idle
session is a coroutine and a few kilobytes, not a thread. etcd calls go to a small
worker pool (:data:`ETCD_WORKERS`).

The port takes the broker's TLS (``ServerTls``; with a client CA, agents must present
certificates from it) and the broker's authentication (see
:mod:`dxpool.broker.api.agent_service`). gRPC core refuses any message over
:data:`MAX_AGENT_MESSAGE_BYTES` (the largest of the agent methods' limits, see
:mod:`dxpool.broker.api.request_limits`); the service checks each method's own limit before
decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from dxpool.broker.api.agent_service import OPEN_WORKERS, AgentService
from dxpool.broker.api.request_limits import AGENT_SERVER_MAX_RECEIVE_BYTES
from dxpool.tls import ServerTls, is_loopback_listen

log = logging.getLogger(__name__)

DEFAULT_AGENT_LISTEN = "127.0.0.1:8471"
# Worker threads for the service's etcd calls: OPEN_WORKERS for hellos, the rest always
# free for the status writes and goodbyes of connected agents.
ETCD_WORKERS = OPEN_WORKERS + 4
MAX_AGENT_MESSAGE_BYTES = AGENT_SERVER_MAX_RECEIVE_BYTES
START_TIMEOUT_S = 30.0
_OPTIONS = [
    ("grpc.so_reuseport", 0),
    # Ping idle connections, so a vanished host's connection goes; agents send their
    # own heartbeats, which is what liveness rests on.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_AGENT_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_AGENT_MESSAGE_BYTES),
]


class AgentServer:
    """Serves ``service`` on ``listen`` from a thread running its own event loop. Give
    the service and the server one executor of :data:`ETCD_WORKERS` threads."""

    def __init__(
        self,
        listen: str,
        service: AgentService,
        tls: ServerTls | None,
        executor: ThreadPoolExecutor,
    ) -> None:
        """``executor`` is the worker pool the service runs etcd calls on; stopping the
        server shuts it down."""
        self.listen = listen
        self.service = service
        self._tls = tls
        self.executor = executor
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._grace_s = 1.0
        self.port = 0

    @property
    def endpoint(self) -> str:
        host = self.listen.rpartition(":")[0] or "127.0.0.1"
        return f"{host}:{self.port}"

    def start(self) -> AgentServer:
        """Bind and serve; returns once serving. Raises OSError when the port cannot be
        had, InvalidArgument when a TLS file cannot be read."""
        credentials = self._tls.credentials() if self._tls is not None else None
        if credentials is None and not is_loopback_listen(self.listen):
            log.warning(
                "serving the agent port in plaintext on a non-loopback address: anyone who "
                "can reach it may act as any host's agent; configure TLS for production",
                extra={"listen": self.listen},
            )
        self._thread = threading.Thread(
            target=self._run, args=(credentials,), name="agent-server", daemon=True
        )
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise OSError(f"the agent port {self.listen} did not start in {START_TIMEOUT_S:g}s")
        if self._failure is not None:
            raise self._failure
        log.info("agent port serving", extra={"endpoint": self.endpoint})
        return self

    def _run(self, credentials: grpc.ServerCredentials | None) -> None:
        try:
            asyncio.run(self._serve(credentials))
        except BaseException as error:  # reported to start(), or logged after it
            if not self._started.is_set():
                self._failure = error
                self._started.set()
            else:
                log.exception("agent port failed")

    async def _serve(self, credentials: grpc.ServerCredentials | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = grpc.aio.server(options=_OPTIONS)
        server.add_generic_rpc_handlers((self.service.handler(),))
        try:
            if credentials is not None:
                port = server.add_secure_port(self.listen, credentials)
            else:
                port = server.add_insecure_port(self.listen)
        except RuntimeError as error:
            raise OSError(f"cannot listen on {self.listen} for agents: {error}") from None
        if port == 0:
            raise OSError(f"cannot listen on {self.listen} for agents: address in use or invalid")
        self.port = port
        self.service.bind(self._loop)
        await server.start()
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            self.service.unbind()
            await server.stop(self._grace_s)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving: open streams end (agents reconnect elsewhere), calls in flight
        get ``grace_s``. Idempotent."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            self._grace_s = grace_s
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(timeout=grace_s + 5)
        self.executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["DEFAULT_AGENT_LISTEN", "ETCD_WORKERS", "MAX_AGENT_MESSAGE_BYTES", "AgentServer"]
