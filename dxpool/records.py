"""Small helpers on stored records: deep copies and timestamps."""

from __future__ import annotations

import time
from typing import TypeVar

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

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
    """The stamp in seconds since the epoch. Does not check the stamp's range (a record
    written by another tool may hold any value; ``ToNanoseconds`` would raise)."""
    return stamp.seconds + stamp.nanos / 1e9


__all__ = ["copy", "seconds", "timestamp"]
