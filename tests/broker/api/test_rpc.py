from __future__ import annotations

import grpc
from google.rpc import error_details_pb2

from dxpool.broker.api.rpc import to_status
from dxpool.errors import NotFound


def test_status_carries_error_info() -> None:
    status = to_status(NotFound("node nodes/x does not exist", reason="NODE_NOT_FOUND"))
    assert status.code == grpc.StatusCode.NOT_FOUND
    assert status.details == "node nodes/x does not exist"
    from google.rpc import status_pb2

    ((key, value),) = [m for m in status.trailing_metadata if m[0] == "grpc-status-details-bin"]
    decoded = status_pb2.Status.FromString(value)
    info = error_details_pb2.ErrorInfo()
    decoded.details[0].Unpack(info)
    assert info.reason == "NODE_NOT_FOUND" and key
