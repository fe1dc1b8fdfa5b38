from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from dxpool.broker.api.rpc import page, to_status
from dxpool.errors import InvalidArgument, NotFound


def test_pages_walk_every_item_once() -> None:
    items = [(f"k{i:03d}", i) for i in range(25)]
    seen, token = [], ""
    while True:
        chunk, token = page(items, 10, token)
        seen.extend(chunk)
        if not token:
            break
    assert seen == list(range(25))


def test_page_token_survives_deletions() -> None:
    items = [(f"k{i}", i) for i in range(6)]
    first, token = page(items, 3, "")
    remaining = [item for item in items if item[1] != 3]
    second, _ = page(remaining, 3, token)
    assert first == [0, 1, 2] and second == [4, 5]


def test_garbage_page_token_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="next_page_token"):
        page([], 10, "not-a-token")


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
