"""gRPC plumbing shared by the broker's services: errors, timing, pagination.

``@handler("Service.Method")`` wraps a servicer method so a :class:`DxpoolError` becomes
its gRPC status with a ``google.rpc.ErrorInfo`` detail (reason, domain, metadata), an
etcd client error becomes UNAVAILABLE, and anything unexpected becomes INTERNAL with the
details logged, never leaked.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from dxpool.broker.state import metrics
from dxpool.broker.state.cache import Cache
from dxpool.errors import ERROR_DOMAIN, DxpoolError, InvalidArgument
from dxpool.limits import MAX_PAGE_TOKEN
from dxpool.store.errors import classify
from dxpool.store.errors import unavailable as etcd_unavailable
from dxpool.store.typed import Versioned

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


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


def page(items: Sequence[tuple[str, T]], page_size: int, page_token: str) -> tuple[list[T], str]:
    """One page of ``(sort_key, item)`` pairs sorted by key, and the next page token.

    The token is the opaque encoding of the last key returned, so pages stay correct
    while records are added or removed between calls.
    """
    after = _decode_token(page_token) if page_token else None
    start = 0
    if after is not None:
        start = next((i for i, (key, _) in enumerate(items) if key > after), len(items))
    chunk = items[start : start + page_size]
    more = start + page_size < len(items)
    token = _encode_token(chunk[-1][0]) if more and chunk else ""
    return [item for _, item in chunk], token


def cache_page(
    cache: Cache,
    collection: str,
    page_size: int,
    page_token: str,
    keep: Callable[[Versioned[Any]], bool] = lambda _: True,
) -> tuple[list[tuple[str, Versioned[Any]]], str]:
    """One page of the records of ``collection`` that ``keep`` accepts, as ``(id,
    record)`` in the cache's listing order, and the next page token (the last id).

    O(log n + what the page skips): the cache keeps its records sorted, so no call sorts
    the collection. Like :func:`page`, pages stay correct while records come and go.
    """
    after = _decode_token(page_token) if page_token else None
    chunk, more = cache.scan(collection, after, page_size, keep)
    token = _encode_token(chunk[-1][0]) if more and chunk else ""
    return chunk, token


def _encode_token(key: str) -> str:
    return base64.urlsafe_b64encode(("v1:" + key).encode()).decode()


def check_page_token(token: str) -> str:
    """Return ``token`` if it is empty or a page token this broker handed out."""
    if token:
        _decode_token(token)
    return token


def _decode_token(token: str) -> str:
    raw = ""
    if len(token) <= MAX_PAGE_TOKEN and token.isascii():
        try:
            raw = base64.urlsafe_b64decode(token.encode()).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raw = ""
    if not raw.startswith("v1:"):
        raise InvalidArgument(
            "invalid page_token: pass the next_page_token of the previous response unchanged",
            reason="INVALID_PAGE_TOKEN",
        )
    return raw[3:]
