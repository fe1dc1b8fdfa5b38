"""Requests too large for their method, or that do not decode, are refused quietly.

grpc decodes a request with the handler's ``request_deserializer`` (the generated
``Message.FromString``) before any servicer code runs. When that raises, grpc logs the
full traceback and answers INTERNAL "Exception deserializing request!": a client's
garbage looks like a broker bug, and every bad call costs a screen of log.

:class:`RequestDecodingGuard` is a server interceptor (``grpc.server(interceptors=...)``)
that wraps every handler's deserializer so it never raises: a payload that does not
decode becomes a marker, and the wrapped behaviour answers INVALID_ARGUMENT (reason
UNDECODABLE_REQUEST, with the usual ``ErrorInfo``) naming the message type it expected.
It applies to every method the server serves, whatever registered it (generated
``add_*Servicer_to_server``, health, reflection), so no service can forget it; the
alternative, a filter on grpc's logger, would hide the traceback but leave the answer
INTERNAL. Rejections are counted in ``dxpool_rpc_undecodable_total`` and logged as one
short line at most once a minute (with the count since the last line), never with a
traceback.

The same wrapper first compares the payload's length with the method's limit
(:mod:`~dxpool.broker.api.request_limits`): a larger payload is not decoded at all and the
call ends RESOURCE_EXHAUSTED (reason REQUEST_TOO_LARGE), counted in
``dxpool_rpc_oversized_total``. The guard is the broker's outermost interceptor, so a
refused request reaches no other: it is neither authorized, admitted as a stream, nor
audited (a record of garbage would be one more thing for a client to fill etcd with).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from dxpool.broker.api.log_throttle import LogThrottle
from dxpool.broker.api.request_limits import MAX_REQUEST_BYTES, limit_for
from dxpool.broker.api.rpc import to_status
from dxpool.broker.state import metrics
from dxpool.errors import DxpoolError, InvalidArgument, ResourceExhausted

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Undecodable:
    """What a guarded deserializer returns for a payload it cannot decode."""

    expected: str  # the full name of the message type, e.g. dxpool.v1.GetBoxRequest
    error: str  # the decoder's complaint, one line


@dataclass(frozen=True)
class Oversized:
    """What a guarded deserializer returns for a payload over its method's limit."""

    expected: str  # the full name of the message type
    size: int  # the payload's length in bytes
    limit: int  # the method's limit in bytes


def _message_name(deserializer: Callable[[bytes], Any]) -> str:
    owner = getattr(deserializer, "__self__", None)  # Message.FromString is a classmethod
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", "") or "protobuf message")


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())[:120]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def guard_deserializer(
    deserializer: Callable[[bytes], Any], max_bytes: int | None = None
) -> Callable[[bytes], Any]:
    """``deserializer`` that returns :class:`Undecodable` instead of raising, and
    :class:`Oversized`, without decoding, for a payload over ``max_bytes``."""
    expected = _message_name(deserializer)

    def decode(payload: bytes) -> Any:
        if max_bytes is not None and len(payload) > max_bytes:
            return Oversized(expected, len(payload), max_bytes)
        try:
            return deserializer(payload)
        except Exception as error:  # whatever the decoder raises, the payload is at fault
            return Undecodable(expected, _one_line(error))

    return decode


if TYPE_CHECKING:  # grpc's classes are generic only in its type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    Interceptor = grpc.ServerInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    Interceptor = grpc.ServerInterceptor


class RequestDecodingGuard(Interceptor):
    """Server interceptor: requests over their method's limit (``limits``, by method path;
    see :mod:`~dxpool.broker.api.request_limits`) get RESOURCE_EXHAUSTED and undecodable ones
    INVALID_ARGUMENT; see the module doc. ``limits`` None checks no size."""

    def __init__(
        self,
        log_interval_s: float = LOG_INTERVAL_S,
        limits: Mapping[str, int] | None = MAX_REQUEST_BYTES,
    ) -> None:
        self._throttle = LogThrottle(log_interval_s)
        self._limits = limits
        self._lock = threading.Lock()
        self._guarded: dict[str, tuple[Handler, Handler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        with self._lock:
            known = self._guarded.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        guarded = self._guard(method, handler)
        with self._lock:
            self._guarded[method] = (handler, guarded)
        return guarded

    def _guard(self, method: str, handler: Handler) -> Handler:
        assert handler.request_deserializer is not None
        max_bytes = None if self._limits is None else limit_for(method, self._limits)
        decode = guard_deserializer(handler.request_deserializer, max_bytes)
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary), decode, serialize
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._unary(method, handler.unary_stream), decode, serialize
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._streaming(method, handler.stream_unary), decode, serialize
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(method, handler.stream_stream), decode, serialize
            )
        return handler  # no behaviour at all: nothing to guard

    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Undecodable | Oversized):
                self._reject(method, request, context)
            return behavior(request, context)

        return call

    def _streaming(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for request in requests:
                if isinstance(request, Undecodable | Oversized):
                    self._reject(method, request, context)
                yield request

        def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return behavior(checked(requests, context), context)

        return call

    def _reject(
        self, method: str, request: Undecodable | Oversized, context: grpc.ServicerContext
    ) -> None:
        """End the call with its error (``abort`` raises); count and maybe log it."""
        error: DxpoolError
        if isinstance(request, Oversized):
            metrics.RPC_OVERSIZED.labels(method=metrics.method_label(method)).inc()
            what = "request over its method's size limit refused"
            details = f"{request.size} bytes, limit {request.limit}"
            error = ResourceExhausted(
                f"the request is {request.size} bytes; {method.rsplit('/', 1)[-1]} takes at "
                f"most {request.limit} bytes: send less (fewer or shorter labels, texts or "
                "items)",
                reason="REQUEST_TOO_LARGE",
                metadata={"size": str(request.size), "limit": str(request.limit)},
            )
        else:
            metrics.RPC_UNDECODABLE.labels(method=metrics.method_label(method)).inc()
            what, details = "undecodable request rejected", request.error
            error = InvalidArgument(
                f"the request body is not a valid {request.expected} message "
                f"({request.error}); send a serialized {request.expected}, e.g. "
                "through the generated dxpool.v1 stubs or dxpool.client",
                reason="UNDECODABLE_REQUEST",
                metadata={"expected": request.expected},
            )
        held = self._throttle.admit()
        if held is not None:
            log.warning(what, extra={"method": method, "error": details, "suppressed": held})
        context.abort_with_status(to_status(error))
