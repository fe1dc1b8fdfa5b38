"""The host's status record, ``hoststatus/{host}``, owned by its agent.

The agent is the only author of the record. It keeps the record in memory, keyed by GPU,
and writes the whole record on every change (under a lock, so writes are ordered). The
broker treats a GPU without an entry as detached, so callers remove an entry only once
the GPU is off the host.

Every write goes through a :class:`StatusWriter` - the agent's session with a broker
(:class:`~dxpool.hostagent.link.BrokerLink`), which writes it in one etcd transaction
with two guards:

* **session** - the host's liveness record must still name *this* agent's session, so
  an agent whose session ended (a partitioned or frozen host) or a second agent started
  for the same host can never overwrite the status (:class:`NotRegisteredError`);
* **claim** - a write that claims a GPU (an entry for a GPU the spec wants: ATTACHING,
  ATTACHED, FAILED) also compares the ``mod_revision`` of the spec record the caller read.
  If the broker changed the spec since (e.g. released the node), the write fails with
  :class:`StaleSpecError` and nothing is written: the agent never claims, and so never
  maps, a GPU on the strength of a spec that is no longer current. Together with the
  broker freeing a GPU only by a transaction that compares this record, no interleaving
  frees a GPU a host may still map.

The record also carries the round trips the agent measured to boxes
(``round_trips``, for the broker's measured latency model, see
:mod:`dxpool.fabric.measured`); they are written with the session guard only, never
claim anything, and every later write of the record keeps them.

The in-memory copy changes only when a write succeeds. Text from drivers and hardware
(messages, health reasons, identities) is cleaned to what the broker accepts
(:func:`dxpool.text.clean_text`), so an odd error message never gets a write refused.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import resources_pb2
from dxpool.errors import InvalidArgument
from dxpool.limits import MAX_STATUS_TEXT, MAX_TEXT
from dxpool.names import GpuRef, host_name, parse_gpu
from dxpool.text import clean_text

log = logging.getLogger(__name__)


class StatusWriteRefusedError(Exception):
    """A status write was refused because a guard failed; nothing was written."""


class StaleSpecError(StatusWriteRefusedError):
    """The spec changed since the caller read it: read it again before claiming a GPU."""


class NotRegisteredError(StatusWriteRefusedError):
    """This agent holds no live session for the host (none yet, ended, or taken over)."""


class StatusWriter(Protocol):
    """Writes a host's whole status record for its agent."""

    def write_status(self, record: resources_pb2.HostStatus, spec_revision: int) -> None:
        """Write ``record``; ``spec_revision`` (0: none) is the spec's mod_revision the
        claims in it were decided from. Raises :class:`StaleSpecError` or
        :class:`NotRegisteredError` when a guard fails (nothing written), and
        :class:`~dxpool.errors.Unavailable` when the outcome is not known."""
        ...


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
    """In-memory copy of one host's status record, written through a :class:`StatusWriter`.

    :meth:`put` and :meth:`remove` write the record before they return. They raise
    :class:`StaleSpecError` / :class:`NotRegisteredError` when a guard fails, and what
    the writer raises when the broker cannot be reached; in every failure the in-memory
    copy is left as it was. A change that leaves the record as last written does not
    write.
    """

    def __init__(self, writer: StatusWriter, host_id: str) -> None:
        self._writer = writer
        self._host = host_name(host_id)
        self._entries: dict[GpuRef, resources_pb2.ObservedAttachment] = {}
        self._round_trips: tuple[resources_pb2.RoundTripSample, ...] = ()
        self._in_sync = False  # True when the stored record is exactly self._entries
        self._lock = threading.Lock()

    def adopt(self, record: resources_pb2.HostStatus | None) -> None:
        """Replace the in-memory copy with ``record``, the record as stored (None: there
        is none), e.g. after a restart."""
        record = record if record is not None else resources_pb2.HostStatus()
        entries: dict[GpuRef, resources_pb2.ObservedAttachment] = {}
        for entry in record.attachments:
            try:
                entries[parse_gpu(entry.gpu)] = entry
            except InvalidArgument as error:
                log.warning("status entry dropped", extra={"gpu": entry.gpu, "error": str(error)})
        with self._lock:
            self._entries = entries
            self._round_trips = tuple(record.round_trips)
            self._in_sync = bool(record.host) and len(entries) == len(record.attachments)

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
            if current is not None and same_report(current, _cleaned(entry)) and self._in_sync:
                return
            stored = _cleaned(entry)
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
        session guard fails, leaving the in-memory copy as it was."""
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
        samples = self._round_trips if round_trips is None else round_trips
        record = resources_pb2.HostStatus(
            host=self._host,
            attachments=[entries[gpu] for gpu in sorted(entries)],
            update_time=now_timestamp(),
            round_trips=samples,
        )
        self._in_sync = False
        self._writer.write_status(record, spec_revision or 0)
        self._entries = entries
        self._round_trips = samples
        self._in_sync = True


def _cleaned(entry: resources_pb2.ObservedAttachment) -> resources_pb2.ObservedAttachment:
    """A copy of ``entry`` whose text the broker accepts (see the module docstring)."""
    copy = resources_pb2.ObservedAttachment()
    copy.CopyFrom(entry)
    copy.message = clean_text(copy.message, MAX_STATUS_TEXT)
    copy.health_reason = clean_text(copy.health_reason, MAX_STATUS_TEXT)
    for field in ("bdf", "uuid", "serial"):
        setattr(copy, field, clean_text(getattr(copy, field), MAX_TEXT))
    return copy


def _copy_sample(sample: resources_pb2.RoundTripSample) -> resources_pb2.RoundTripSample:
    copy = resources_pb2.RoundTripSample()
    copy.CopyFrom(sample)
    return copy


__all__ = [
    "NotRegisteredError",
    "StaleSpecError",
    "StatusStore",
    "StatusWriteRefusedError",
    "StatusWriter",
    "now_timestamp",
    "same_report",
]
