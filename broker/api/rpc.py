"""gRPC plumbing shared by the broker's services: errors and timing (pagination
is :mod:`dxpool.broker.state.pages`).

``@handler("Service.Method")`` wraps a servicer method so a :class:`DxpoolError` becomes
its gRPC status with a ``google.rpc.ErrorInfo`` detail (reason, domain, metadata), an
etcd client error becomes UNAVAILABLE, and anything unexpected becomes INTERNAL with the
details logged, never leaked.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from dxpool.broker.state import metrics
from dxpool.errors import ERROR_DOMAIN, DxpoolError
from dxpool.store.errors import classify
from dxpool.store.errors import unavailable as etcd_unavailable

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def to_status(error: DxpoolError) -> grpc.Status:
    """The rich gRPC status for a domain error."""
    info = error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=error.code.value[0], message=error.message, details=[detail])
    return rpc_status.to_status(status)


def _abort(context: grpc.ServicerContext, method: str, error: Exception) -> None:
    """End the call with the error's status.

    An etcd client error that reached here without the store's translation still becomes
    UNAVAILABLE (etcd failing is never the caller's fault nor final), unlogged: the
    store's health logs etcd going away once. Anything else unexpected becomes INTERNAL,
    logged with its traceback.
    """
    if isinstance(error, DxpoolError):
        context.abort_with_status(to_status(error))
    failure = classify(error)
    if failure is not None:
        context.abort_with_status(to_status(etcd_unavailable(failure, write=True)))
    log.exception("unexpected error in RPC", extra={"method": method})
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see broker logs")


def _code_name(context: grpc.ServicerContext) -> str:
    """The status code the call ends with, by name (``OK`` unless one was set)."""
    # grpc's servicer context has code() (since 1.38); the type stubs lack it.
    read_code = getattr(context, "code", None)
    code = read_code() if callable(read_code) else None
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


def handler(method: str) -> Callable[[F], F]:
    """Decorate a unary servicer method ``(self, request, context)``."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            try:
                return func(self, request, context)
            except Exception as error:
                _abort(context, method, error)
            finally:
                metrics.RPC_SECONDS.labels(method=method).observe(time.perf_counter() - started)
                metrics.RPC_TOTAL.labels(method=method, code=_code_name(context)).inc()

        return wrapper  # type: ignore[return-value]

    return decorate


def stream_handler(method: str) -> Callable[[F], F]:
    """Decorate a server-streaming servicer method (a generator)."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from func(self, request, context)
            except Exception as error:
                _abort(context, method, error)
            finally:
                metrics.RPC_TOTAL.labels(method=method, code=_code_name(context)).inc()

        return wrapper  # type: ignore[return-value]

    return decorate
