"""The host's status record, ``hoststatus/{host}``, owned by its agent.

The agent is the only writer of the record. It keeps the record in memory, keyed by GPU,
and writes the whole record on every change (under a lock, so writes are ordered). The
broker treats a GPU without an entry as detached, so callers remove an entry only once
the GPU is off the host.

Every write is one etcd transaction with two guards:

* **lease** - the host's liveness key must be held by *this* agent's lease, so an agent
  whose lease expired (a partitioned or frozen host) or a second agent started for the
  same host can never overwrite the status;
* **claim** - a write that claims a GPU (an entry for a GPU the spec wants: ATTACHING,
  ATTACHED, FAILED) also compares the ``mod_revision`` of the spec record the caller read.
  If the broker changed the spec since (e.g. released the node), the write fails with
  :class:`StaleSpecError` and nothing is written: the agent never claims, and so never
  maps, a GPU on the strength of a spec that is no longer current. Together with the
  broker freeing a GPU only by a transaction that compares this record, no interleaving
  frees a GPU a host may still map.

The record also carries the round trips the agent measured to boxes
(``round_trips``, for the broker's measured latency model, see
:mod:`dxpool.fabric.measured`); they are written with the lease guard only, never claim
anything, and every later write of the record keeps them.

The in-memory copy changes only when a write succeeds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import resources_pb2
from dxpool.errors import InvalidArgument
from dxpool.names import GpuRef, host_name, parse_gpu
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn

log = logging.getLogger(__name__)


class StatusWriteRefusedError(Exception):
    """etcd refused a status write because a guard failed; nothing was written."""


class StaleSpecError(StatusWriteRefusedError):
    """The spec changed since the caller read it: read it again before claiming a GPU."""


class NotRegisteredError(StatusWriteRefusedError):
    """This agent does not hold the host's liveness lease (expired, or another agent)."""


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

    ``lease_id`` returns the agent's current liveness lease (None before registration).
    :meth:`put` and :meth:`remove` write the record before they return. They raise
    :class:`StaleSpecError` / :class:`NotRegisteredError` when a guard fails, and what the
    etcd client raises when etcd cannot be reached; in every failure the in-memory copy
    is left as it was. A change that leaves the record as last written does not write.
    """

    def __init__(
        self,
        store: Store | Any,
        keys: KeySchema,
        host_id: str,
        lease_id: Callable[[], int | None],
    ) -> None:
        """``store``: the agent's :class:`Store` (or an etcd client to build one on)."""
        self._store = store if isinstance(store, Store) else Store(store, keys)
        self._key = keys.host_status(host_id)
        self._lease_key = keys.host_lease(host_id)
        self._spec_key = keys.host_allocation(host_id)
        self._host = host_name(host_id)
        self._lease_id = lease_id
        self._entries: dict[GpuRef, resources_pb2.ObservedAttachment] = {}
        self._round_trips: tuple[resources_pb2.RoundTripSample, ...] = ()
        self._in_sync = False  # True when etcd holds exactly self._entries
        self._lock = threading.Lock()

    def load(self) -> None:
        """Replace the in-memory copy with the record in etcd (e.g. after a restart)."""
        found = self._store.get(self._key)
        record = found.value if found is not None else resources_pb2.HostStatus()
        entries: dict[GpuRef, resources_pb2.ObservedAttachment] = {}
        for entry in record.attachments:
            try:
                entries[parse_gpu(entry.gpu)] = entry
            except InvalidArgument as error:
                log.warning("status entry dropped", extra={"gpu": entry.gpu, "error": str(error)})
        with self._lock:
            self._entries = entries
            self._round_trips = tuple(record.round_trips)
            self._in_sync = found is not None and len(entries) == len(record.attachments)

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

    def entries(self) -> list[resources_pb2.ObservedAttachment]:
        """Copies of every entry, in GPU order."""
        with self._lock:
            found = [self._entries[gpu] for gpu in sorted(self._entries)]
        copies = []
        for entry in found:
            copy = resources_pb2.ObservedAttachment()
            copy.CopyFrom(entry)
            copies.append(copy)
        return copies

    def put(
        self, entry: resources_pb2.ObservedAttachment, *, spec_revision: int | None = None
    ) -> None:
        """Set the entry of ``entry.gpu`` (stamping its update time) and write the record.

        ``spec_revision``: the spec record's ``mod_revision`` the caller acted on; give
        it for every entry that claims a GPU the spec wants, so the write fails with
        :class:`StaleSpecError` if the spec changed since.
        """
        gpu = parse_gpu(entry.gpu)
        with self._lock:
            current = self._entries.get(gpu)
            if current is not None and same_report(current, entry) and self._in_sync:
                return
            stored = resources_pb2.ObservedAttachment()
            stored.CopyFrom(entry)
            stored.update_time.CopyFrom(now_timestamp())
            self._write_locked({**self._entries, gpu: stored}, spec_revision)

    def remove(self, gpu: GpuRef) -> None:
        """Drop ``gpu``'s entry and write the record. A no-op when there is none."""
        with self._lock:
            if gpu not in self._entries and self._in_sync:
                return
            entries = dict(self._entries)
            entries.pop(gpu, None)
            self._write_locked(entries, None)

    def round_trips(self) -> list[resources_pb2.RoundTripSample]:
        """Copies of the round trips last written (or loaded)."""
        with self._lock:
            return [_copy_sample(sample) for sample in self._round_trips]

    def set_round_trips(self, samples: list[resources_pb2.RoundTripSample]) -> None:
        """Replace the reported round trips (one per box) and write the record; a no-op
        when they are what was last written. Raises :class:`NotRegisteredError` when the
        lease guard fails, leaving the in-memory copy as it was."""
        report = tuple(_copy_sample(sample) for sample in samples)
        with self._lock:
            if report == self._round_trips and self._in_sync:
                return
            self._write_locked(dict(self._entries), None, report)

    def _write_locked(
        self,
        entries: dict[GpuRef, resources_pb2.ObservedAttachment],
        spec_revision: int | None,
        round_trips: tuple[resources_pb2.RoundTripSample, ...] | None = None,
    ) -> None:
        lease_id = self._lease_id()
        if lease_id is None:
            raise NotRegisteredError(f"{self._host} is not registered; status not written")
        samples = self._round_trips if round_trips is None else round_trips
        record = resources_pb2.HostStatus(
            host=self._host,
            attachments=[entries[gpu] for gpu in sorted(entries)],
            update_time=now_timestamp(),
            round_trips=samples,
        )
        txn = Txn().expect_lease(self._lease_key, lease_id)
        if spec_revision is not None:
            txn.expect_revision(self._spec_key, spec_revision).read_on_failure(self._spec_key)
        txn.put(self._key, record)
        self._in_sync = False
        result = self._store.commit(txn)
        if not result.succeeded:
            current = result.current.get(self._spec_key)
            if spec_revision is not None and (current.mod_revision if current else 0) != (
                spec_revision
            ):
                raise StaleSpecError(
                    f"the spec of {self._host} changed since revision {spec_revision}"
                )
            raise NotRegisteredError(
                f"{self._host}'s liveness key is not held by this agent's lease {lease_id}"
            )
        self._entries = entries
        self._round_trips = samples
        self._in_sync = True


def _copy_sample(sample: resources_pb2.RoundTripSample) -> resources_pb2.RoundTripSample:
    copy = resources_pb2.RoundTripSample()
    copy.CopyFrom(sample)
    return copy


__all__ = [
    "NotRegisteredError",
    "StaleSpecError",
    "StatusStore",
    "StatusWriteRefusedError",
    "now_timestamp",
    "same_report",
]
