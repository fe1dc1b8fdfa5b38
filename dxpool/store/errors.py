"""What an etcd failure means: one table from client errors to a verdict.

``python3-etcd3`` raises raw ``grpc.RpcError`` (any status code), its own exception
classes (which it raises *in place of* the ``grpc.RpcError``, keeping that error as
``__context__``), ``NoServerAvailableError`` while every endpoint is marked failed, and
``ValueError`` for a closed channel. :func:`classify` turns any of them into an
:class:`EtcdFailure` that says:

* ``applied``: whether the call may have taken effect. ``NO`` only when the request
  provably never ran (no connection, no leader, throttled); a lost connection or a
  timeout leaves a write's outcome ``UNKNOWN``. Reads may always be retried; writes only
  when ``applied`` is ``NO``.
* ``outage``: whether the failure says etcd is unreachable or cannot serve (transport,
  no leader, timeouts, out of space), as opposed to a problem with one request.

``unavailable(failure)`` is the :class:`~dxpool.errors.Unavailable` the broker answers with.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import etcd3.exceptions
import grpc

from dxpool.errors import Unavailable

# The code of the client's own refusal while every endpoint rests after failing.
NO_ENDPOINT = "NO_ENDPOINT"


class Applied(enum.Enum):
    NO = "no"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class EtcdFailure:
    """The verdict on one failed etcd call. ``code`` is the gRPC status name (or the
    client's own error name), ``detail`` the server's or transport's text."""

    code: str
    detail: str
    applied: Applied
    outage: bool

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}" if self.detail else self.code


# Texts (lower case) that show a request never reached etcd's state machine.
_NOT_SENT_DETAILS = (
    "failed to connect",
    "connection refused",
    "connect failed",
    "dns resolution failed",
    "etcdserver: no leader",
    "etcdserver: not capable",
    "etcdserver: too many requests",
    "no route to host",
)

# gRPC codes that describe etcd being unable to serve, not a bad request.
_OUTAGE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

# gRPC codes with which etcd rejects a request before proposing it.
_REJECTED_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)

_CODE_OF_CLIENT_ERROR: dict[type[Exception], grpc.StatusCode] = {
    etcd3.exceptions.ConnectionFailedError: grpc.StatusCode.UNAVAILABLE,
    etcd3.exceptions.ConnectionTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    etcd3.exceptions.InternalServerError: grpc.StatusCode.INTERNAL,
    etcd3.exceptions.PreconditionFailedError: grpc.StatusCode.FAILED_PRECONDITION,
}


def classify(error: BaseException) -> EtcdFailure | None:
    """The verdict on ``error``, or None if it is not an etcd client failure."""
    if isinstance(error, etcd3.exceptions.NoServerAvailableError):
        return EtcdFailure(
            NO_ENDPOINT,
            "every etcd endpoint failed a moment ago and waits before it is tried again",
            Applied.NO,
            outage=True,
        )
    if isinstance(error, etcd3.exceptions.WatchTimedOut):
        return EtcdFailure("DEADLINE_EXCEEDED", "watch not created in time", Applied.NO, True)
    if isinstance(error, etcd3.exceptions.RevisionCompactedError):
        return EtcdFailure(
            "OUT_OF_RANGE",
            f"revision compacted (oldest kept: {error.compacted_revision})",
            Applied.NO,
            outage=False,
        )
    rpc_error = _rpc_error_of(error)
    if rpc_error is not None:
        code = _code_of(rpc_error)
        detail = _detail_of(rpc_error)
        return _verdict(code, detail)
    code_of_class = _code_of_client_error(error)
    if code_of_class is not None:
        return _verdict(code_of_class, "")
    if isinstance(error, etcd3.exceptions.Etcd3Exception):
        return EtcdFailure(type(error).__name__, str(error), Applied.UNKNOWN, outage=True)
    if isinstance(error, ValueError) and "closed channel" in str(error):
        return EtcdFailure("CANCELLED", "the etcd client is closed", Applied.NO, outage=False)
    return None


def unavailable(failure: EtcdFailure, *, write: bool) -> Unavailable:
    """The error a broker call answers with when etcd failed it."""
    if write and failure.applied is Applied.UNKNOWN:
        return Unavailable(
            f"etcd did not confirm the change ({failure}); it may or may not have been "
            "applied: retry with the same request_id, which returns the earlier result",
            reason="ETCD_OUTCOME_UNKNOWN",
            metadata={"etcd_code": failure.code},
        )
    return Unavailable(
        f"etcd could not serve the call ({failure}); nothing was changed: retry shortly",
        reason="ETCD_UNAVAILABLE",
        metadata={"etcd_code": failure.code},
    )


def _verdict(code: grpc.StatusCode, detail: str) -> EtcdFailure:
    lowered = detail.lower()
    not_sent = code in _REJECTED_CODES or any(text in lowered for text in _NOT_SENT_DETAILS)
    return EtcdFailure(
        code.name,
        detail,
        Applied.NO if not_sent else Applied.UNKNOWN,
        outage=code in _OUTAGE_CODES,
    )


def _rpc_error_of(error: BaseException) -> grpc.RpcError | None:
    """The ``grpc.RpcError`` behind ``error``: itself, or the one python3-etcd3 replaced."""
    seen: BaseException | None = error
    for _ in range(3):
        if seen is None:
            return None
        if isinstance(seen, grpc.RpcError) and callable(getattr(seen, "code", None)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _code_of(error: grpc.RpcError) -> grpc.StatusCode:
    try:
        code = error.code()
    except Exception:
        return grpc.StatusCode.UNKNOWN
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _detail_of(error: grpc.RpcError) -> str:
    try:
        detail = error.details()
    except Exception:
        return ""
    return str(detail or "")


def _code_of_client_error(error: BaseException) -> grpc.StatusCode | None:
    for cls, code in _CODE_OF_CLIENT_ERROR.items():
        if isinstance(error, cls):
            return code
    return None


__all__ = ["NO_ENDPOINT", "Applied", "EtcdFailure", "classify", "unavailable"]
