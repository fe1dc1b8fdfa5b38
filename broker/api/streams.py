"""Budgets for streaming RPCs, so open streams can never starve unary calls.

The broker serves gRPC from one thread pool. A unary call holds a worker thread for
milliseconds; a stream (WatchNodes, reflection, a client-streaming call) holds one for as
long as the client keeps it open, idle or not. Without a budget, enough idle streams take
every worker and every other call waits forever.

:class:`StreamLimiter` is a server interceptor that admits a stream only while its
method and the broker as a whole are under their limits (:class:`StreamLimits`), and
answers RESOURCE_EXHAUSTED (reason ``TOO_MANY_STREAMS``) otherwise, at once. The server
sizes its pool as ``unary workers + StreamLimits.total``, so admitted streams can hold at
most ``total`` threads and unary calls always keep their own workers.

A stream counts from the moment its handler starts until its thread is released (the
handler returned or its generator finished). A handler marked
``experimental_non_blocking`` (gRPC health ``Watch``) returns at once and sends from
other threads; it holds no thread, and counts until its call ends.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import grpc
from grpc_health.v1 import health

from dxpool.api.v1 import nodes_pb2
from dxpool.broker.api.reflection import V1_REFLECTION_INFO, V1ALPHA_REFLECTION_INFO
from dxpool.broker.api.rpc import to_status
from dxpool.broker.state import metrics
from dxpool.errors import ResourceExhausted

log = logging.getLogger(__name__)
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

WATCH_NODES = f"/{nodes_pb2.DESCRIPTOR.services_by_name['NodeService'].full_name}/WatchNodes"
HEALTH_WATCH = f"/{health.SERVICE_NAME}/Watch"
REFLECTION_INFO = V1ALPHA_REFLECTION_INFO


def _default_per_method() -> dict[str, int]:
    return {WATCH_NODES: 256, HEALTH_WATCH: 64, REFLECTION_INFO: 16, V1_REFLECTION_INFO: 16}


@dataclass(frozen=True)
class StreamLimits:
    """How many streams the broker serves at once.

    ``per_method`` maps a full method name (``/package.Service/Method``) to its limit;
    any other streaming method gets ``default``. ``total`` bounds all streams together,
    and with them the threads streams can hold.
    """

    total: int = 384
    per_method: Mapping[str, int] = field(default_factory=_default_per_method)
    default: int = 16

    def __post_init__(self) -> None:
        if self.total < 1 or self.default < 1 or any(v < 1 for v in self.per_method.values()):
            raise ValueError(f"stream limits must be 1 or more: {self}")

    def limit(self, method: str) -> int:
        return self.per_method.get(method, self.default)


class StreamLimiter(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Admits streaming calls within :class:`StreamLimits`; unary calls pass untouched.

    ``intercept_service`` runs on gRPC's dispatch thread for every call, so it only
    wraps the handler; admission happens when the handler starts on a worker.
    """

    def __init__(self, limits: StreamLimits) -> None:
        self.limits = limits
        self._lock = threading.Condition()
        self._open: dict[str, int] = {}
        self._total = 0

    # -- accounting ------------------------------------------------------------------

    def _acquire(self, method: str) -> bool:
        with self._lock:
            if self._total >= self.limits.total:
                return False
            if self._open.get(method, 0) >= self.limits.limit(method):
                return False
            self._open[method] = self._open.get(method, 0) + 1
            self._total += 1
        metrics.STREAMS_OPEN.labels(method=metrics.method_label(method)).inc()
        return True

    def _release(self, method: str) -> None:
        with self._lock:
            self._open[method] -= 1
            self._total -= 1
            self._lock.notify_all()
        metrics.STREAMS_OPEN.labels(method=metrics.method_label(method)).dec()

    def open_streams(self) -> dict[str, int]:
        """Streams being served now, by method."""
        with self._lock:
            return {method: count for method, count in self._open.items() if count}

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no stream is being served; False if some still are after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._total:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def _reject(self, method: str, context: grpc.ServicerContext) -> None:
        metrics.STREAMS_REJECTED.labels(method=metrics.method_label(method)).inc()
        with self._lock:
            open_now, total = self._open.get(method, 0), self._total
        log.debug(  # counted in dxpool_streams_rejected_total; a refusing client may retry often
            "stream refused: limit reached",
            extra={"method": method, "open": open_now, "total": total},
        )
        error = ResourceExhausted(
            f"the broker already serves {open_now} {method} streams ({total} streams in all; "
            f"limits {self.limits.limit(method)} and {self.limits.total}); retry later"
            + (", or poll GetNode" if method == WATCH_NODES else ""),
            reason="TOO_MANY_STREAMS",
            metadata={"method": method},
        )
        context.abort_with_status(to_status(error))

    # -- wrapping --------------------------------------------------------------------

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], _Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        method = handler_call_details.method
        if handler.response_streaming:
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
            wrapped = (
                self._non_blocking(method, behavior)
                if getattr(behavior, "experimental_non_blocking", False)
                else self._streaming(method, behavior)
            )
            make = (
                grpc.stream_stream_rpc_method_handler
                if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler
            )
        else:
            wrapped = self._unary_response(method, handler.stream_unary)
            make = grpc.stream_unary_rpc_method_handler
        return make(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _streaming(self, method: str, behavior: Any) -> Callable[..., Iterator[Any]]:
        def limited(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not self._acquire(method):
                self._reject(method, context)
                return
            try:
                yield from behavior(request, context)
            finally:
                self._release(method)

        return limited

    def _unary_response(self, method: str, behavior: Any) -> Callable[..., Any]:
        def limited(request_iterator: Any, context: grpc.ServicerContext) -> Any:
            if not self._acquire(method):
                self._reject(method, context)
                return None
            try:
                return behavior(request_iterator, context)
            finally:
                self._release(method)

        return limited

    def _non_blocking(self, method: str, behavior: Any) -> Callable[..., Any]:
        @functools.wraps(behavior)
        def limited(request: Any, context: grpc.ServicerContext, *args: Any) -> Any:
            if not self._acquire(method):
                self._reject(method, context)
                return None
            release = _Once(functools.partial(self._release, method))
            if not context.add_callback(release):  # the call has already ended
                release()
                return None
            try:
                return behavior(request, context, *args)
            except BaseException:
                release()
                raise

        limited.experimental_non_blocking = True  # type: ignore[attr-defined]
        limited.experimental_thread_pool = getattr(  # type: ignore[attr-defined]
            behavior, "experimental_thread_pool", None
        )
        return limited


class _Once:
    """Calls ``func`` on the first call only; later calls do nothing."""

    def __init__(self, func: Callable[[], None]) -> None:
        self._func: Callable[[], None] | None = func
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            func, self._func = self._func, None
        if func is not None:
            func()


def end_call(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End a call now, from any thread, with ``code`` and ``message``.

    For a call whose handler is stuck in a send because the client stopped reading: the
    status cannot wait behind the unsent messages, and the worker thread must be freed.
    gRPC core's cancel-with-status sends the status at once (the client reads the
    messages it already holds, then the status) and wakes the blocked send. grpcio
    exposes it only on the call object behind the servicer context; where that is
    missing, a plain cancel ends the call as CANCELLED.
    """
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(code.value[0], message)  # type: ignore[union-attr]
    except Exception:
        log.debug("cancel with status unavailable; cancelling", exc_info=True)
        context.cancel()  # type: ignore[no-untyped-call]
