"""Small helpers on stored records: copies, timestamps, and record-level rules."""

from __future__ import annotations

import time
from typing import TypeVar

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import resources_pb2 as pb

M = TypeVar("M", bound=Message)


def copy(message: M) -> M:
    """A deep copy: records from the cache are shared and must never be mutated."""
    clone = type(message)()
    clone.CopyFrom(message)
    return clone


def timestamp(seconds: float | None = None) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int((time.time() if seconds is None else seconds) * 1e9))
    return stamp


def seconds(stamp: Timestamp) -> float:
    return float(stamp.ToNanoseconds()) / 1e9


def without_node(allocation: pb.HostAllocation | None, host: str, node: str) -> pb.HostAllocation:
    """The host's allocation minus every attachment that belongs to ``node``."""
    result = pb.HostAllocation(host=host)
    if allocation is not None:
        result.attachments.extend(a for a in allocation.attachments if a.node != node)
    return result
