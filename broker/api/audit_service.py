"""AuditService: the audit log, read back (see ``broker/api/audit.py``)."""

from __future__ import annotations

import grpc

from dxpool.api.v1 import audit_pb2, audit_pb2_grpc
from dxpool.broker.api.audit import AuditLog
from dxpool.broker.api.rpc import handler
from dxpool.errors import FailedPrecondition


class AuditService(audit_pb2_grpc.AuditServiceServicer):
    """Serves ListAuditRecords; ``audit`` None means the broker keeps no audit log."""

    def __init__(self, audit: AuditLog | None) -> None:
        self._audit = audit

    @handler("AuditService.ListAuditRecords")
    def ListAuditRecords(
        self, request: audit_pb2.ListAuditRecordsRequest, context: grpc.ServicerContext
    ) -> audit_pb2.ListAuditRecordsResponse:
        if self._audit is None:
            raise FailedPrecondition(
                "this broker keeps no audit log (started with --audit-retention 0)",
                reason="AUDIT_OFF",
            )
        return self._audit.list(request)
