"""Record-level rules of the broker; copies and timestamps come from :mod:`dxpool.records`."""

from __future__ import annotations

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.records import copy, seconds, timestamp


def without_node(allocation: pb.HostAllocation | None, host: str, node: str) -> pb.HostAllocation:
    """The host's allocation minus every attachment and reservation of ``node`` (the
    rest of the record, such as a cordon, kept)."""
    result = pb.HostAllocation(host=host)
    if allocation is not None:
        result.CopyFrom(allocation)
        result.host = host
        del result.attachments[:]
        del result.reservations[:]
        result.attachments.extend(a for a in allocation.attachments if a.node != node)
        result.reservations.extend(r for r in allocation.reservations if r.node != node)
    return result


__all__ = ["copy", "seconds", "timestamp", "without_node"]
