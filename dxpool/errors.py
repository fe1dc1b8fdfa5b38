"""The dxpool exception tree and its mapping onto gRPC status codes.

Hierarchy::

    DxpoolError                   base of every error dxpool raises on purpose
    ├── InvalidArgument           the request is malformed; fix it and retry
    ├── NotFound                  a named resource does not exist
    ├── AlreadyExists             the resource (or request id) already exists
    ├── FailedPrecondition        the system is not in a state that allows the call
    ├── ResourceExhausted         nothing fits now; relax the request or wait
    ├── Aborted                   a concurrent change won; retry the call
    ├── Unavailable               a dependency (etcd, an agent) cannot be reached
    ├── Unauthenticated           the caller did not prove who it is (certificate, token)
    └── PermissionDenied          the caller's role may not make this call

Each class carries the gRPC code the broker answers with and a machine-readable
``reason`` (an ``ErrorInfo`` reason: UPPER_SNAKE_CASE). Messages say what to fix.
"""

from __future__ import annotations

import grpc

ERROR_DOMAIN = "dxpool.io"


class DxpoolError(Exception):
    """Base of the tree. ``code`` is the gRPC status the broker answers with."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"

    def __init__(
        self, message: str, *, reason: str | None = None, metadata: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata = dict(metadata or {})
        self.hint: str | None = None
        """What to do next, where the client could tell (a broker it could not reach)."""

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


class InvalidArgument(DxpoolError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class NotFound(DxpoolError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class AlreadyExists(DxpoolError):
    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(DxpoolError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class ResourceExhausted(DxpoolError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "NO_CAPACITY"


class Aborted(DxpoolError):
    code = grpc.StatusCode.ABORTED
    default_reason = "CONFLICT"


class Unavailable(DxpoolError):
    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class Unauthenticated(DxpoolError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(DxpoolError):
    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


ERRORS_BY_CODE: dict[grpc.StatusCode, type[DxpoolError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        Aborted,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
    )
}


def from_code(code: grpc.StatusCode, message: str, reason: str | None = None) -> DxpoolError:
    """Return the domain error for a gRPC status (``DxpoolError`` for unmapped codes)."""
    cls = ERRORS_BY_CODE.get(code, DxpoolError)
    error = cls(message, reason=reason)
    if cls is DxpoolError:
        error.code = code
    return error
