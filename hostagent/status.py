"""The host's status record, ``hoststatus/{host}``, owned by its agent.

The agent is the only writer of the record. It keeps the record in memory, keyed by GPU,
and writes the whole record on every change (under a lock, so writes are ordered). The
broker treats a GPU without an entry as detached, so callers remove an entry only once
the GPU is off the host.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import resources_pb2
from dxpool.errors import InvalidArgument
from dxpool.names import GpuRef, host_name, parse_gpu
from dxpool.store.keys import KeySchema

log = logging.getLogger(__name__)


def now_timestamp() -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    return stamp


def same_report(a: resources_pb2.ObservedAttachment, b: resources_pb2.ObservedAttachment) -> bool:
    """True when two entries say the same thing (their update times aside)."""
    a_copy = resources_pb2.ObservedAttachment()
    a_copy.CopyFrom(a)
    a_copy.ClearField("update_time")
    b_copy = resources_pb2.ObservedAttachment()
    b_copy.CopyFrom(b)
    b_copy.ClearField("update_time")
    return a_copy == b_copy


class StatusStore:
    """In-memory copy of one host's status record, written through to etcd.

    :meth:`put` and :meth:`remove` write the record before they return and raise what the
    etcd client raises when the write fails; the change stays in memory and goes out with
    the next write. A change that leaves the record as last written does not write.
    """

    def __init__(self, client: Any, keys: KeySchema, host_id: str) -> None:
        self._client = client
        self._key = keys.host_status(host_id)
        self._host = host_name(host_id)
        self._entries: dict[GpuRef, resources_pb2.ObservedAttachment] = {}
        self._in_sync = False  # True when etcd holds exactly self._entries
        self._lock = threading.Lock()

    def load(self) -> None:
        """Replace the in-memory copy with the record in etcd (e.g. after a restart)."""
        value, _ = self._client.get(self._key)
        record = resources_pb2.HostStatus()
        if value is not None:
            record.ParseFromString(value)
        entries: dict[GpuRef, resources_pb2.ObservedAttachment] = {}
        for entry in record.attachments:
            try:
                entries[parse_gpu(entry.gpu)] = entry
            except InvalidArgument as error:
                log.warning("status entry dropped", extra={"gpu": entry.gpu, "error": str(error)})
        with self._lock:
            self._entries = entries
            self._in_sync = value is not None and len(entries) == len(record.attachments)

    def get(self, gpu: GpuRef) -> resources_pb2.ObservedAttachment | None:
        """A copy of ``gpu``'s entry, or None."""
        with self._lock:
            entry = self._entries.get(gpu)
            if entry is None:
                return None
            copy = resources_pb2.ObservedAttachment()
            copy.CopyFrom(entry)
            return copy

    def gpus(self) -> set[GpuRef]:
        with self._lock:
            return set(self._entries)

    def put(self, entry: resources_pb2.ObservedAttachment) -> None:
        """Set the entry of ``entry.gpu`` (stamping its update time) and write the record."""
        gpu = parse_gpu(entry.gpu)
        with self._lock:
            current = self._entries.get(gpu)
            if current is not None and same_report(current, entry) and self._in_sync:
                return
            stored = resources_pb2.ObservedAttachment()
            stored.CopyFrom(entry)
            stored.update_time.CopyFrom(now_timestamp())
            self._entries[gpu] = stored
            self._write_locked()

    def remove(self, gpu: GpuRef) -> None:
        """Drop ``gpu``'s entry and write the record. A no-op when there is none."""
        with self._lock:
            if gpu not in self._entries and self._in_sync:
                return
            self._entries.pop(gpu, None)
            self._write_locked()

    def _write_locked(self) -> None:
        self._in_sync = False
        record = resources_pb2.HostStatus(
            host=self._host,
            attachments=[self._entries[gpu] for gpu in sorted(self._entries)],
            update_time=now_timestamp(),
        )
        self._client.put(self._key, record.SerializeToString())
        self._in_sync = True


__all__ = ["StatusStore", "now_timestamp", "same_report"]
