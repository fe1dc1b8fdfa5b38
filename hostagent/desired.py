"""The host's spec, ``hostalloc/{host}``, as the agent last read it.

The broker writes the record; the agent keeps the latest version in memory (fed by a list
and a watch) and reads it per GPU. Entries that cannot be acted on (a malformed GPU name,
a GPU listed twice) are logged and skipped, so one bad entry does not stop the others.
"""

from __future__ import annotations

import logging
import threading

from dxpool.api.v1 import resources_pb2
from dxpool.errors import InvalidArgument
from dxpool.names import GpuRef, host_name, parse_gpu

log = logging.getLogger(__name__)


class DesiredState:
    """Thread-safe map of GPU -> the attachment the broker wants for it on this host."""

    def __init__(self, host_id: str) -> None:
        self._host = host_name(host_id)
        self._by_gpu: dict[GpuRef, resources_pb2.DesiredAttachment] = {}
        self._revision = 0
        self._spec_revision = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def revision(self) -> int:
        """The etcd revision the current state was read at (0 before the first read)."""
        with self._lock:
            return self._revision

    @property
    def spec_revision(self) -> int:
        """The ``mod_revision`` of the spec record as adopted (0: no record)."""
        with self._lock:
            return self._spec_revision

    def replace(
        self,
        allocation: resources_pb2.HostAllocation | None,
        revision: int,
        spec_revision: int | None = None,
    ) -> set[GpuRef]:
        """Adopt ``allocation`` (None: the record is gone) read at ``revision``, the
        record's own ``mod_revision`` being ``spec_revision`` (default: ``revision``).

        Returns the GPUs whose desired attachment changed. A revision older than the one
        already adopted is ignored (returns an empty set), so a late watch event cannot
        undo a newer list.
        """
        wanted = self._parse(allocation) if allocation is not None else {}
        with self._lock:
            if revision < self._revision:
                return set()
            previous, self._by_gpu, self._revision = self._by_gpu, wanted, revision
            if allocation is None:
                self._spec_revision = 0
            else:
                self._spec_revision = revision if spec_revision is None else spec_revision
            self._changed.notify_all()
        return {gpu for gpu in set(previous) | set(wanted) if previous.get(gpu) != wanted.get(gpu)}

    def _parse(
        self, allocation: resources_pb2.HostAllocation
    ) -> dict[GpuRef, resources_pb2.DesiredAttachment]:
        if allocation.host and allocation.host != self._host:
            log.warning(
                "allocation names another host",
                extra={"expected": self._host, "found": allocation.host},
            )
        wanted: dict[GpuRef, resources_pb2.DesiredAttachment] = {}
        for attachment in allocation.attachments:
            try:
                gpu = parse_gpu(attachment.gpu)
            except InvalidArgument as error:
                log.warning("desired attachment skipped", extra={"error": error.message})
                continue
            if gpu in wanted:
                log.warning(
                    "gpu listed twice in allocation; last entry wins", extra={"gpu": gpu.name}
                )
            copy = resources_pb2.DesiredAttachment()
            copy.CopyFrom(attachment)
            wanted[gpu] = copy
        return wanted

    def get(self, gpu: GpuRef) -> resources_pb2.DesiredAttachment | None:
        """A copy of the attachment wanted for ``gpu``, or None when it is not wanted here."""
        return self.read(gpu)[0]

    def read(self, gpu: GpuRef) -> tuple[resources_pb2.DesiredAttachment | None, int]:
        """``gpu``'s wanted attachment (a copy, or None) and the ``mod_revision`` of the
        spec record it was read from, taken together: a status write that claims the
        GPU compares that revision, so it fails if the spec changed since."""
        with self._lock:
            attachment = self._by_gpu.get(gpu)
            spec_revision = self._spec_revision
        if attachment is None:
            return None, spec_revision
        copy = resources_pb2.DesiredAttachment()
        copy.CopyFrom(attachment)
        return copy, spec_revision

    def wait_for_change(self, spec_revision: int, timeout_s: float) -> bool:
        """Block until the adopted spec is no longer the one at ``spec_revision``; False
        on timeout."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._spec_revision != spec_revision, timeout=timeout_s
            )

    def gpus(self) -> set[GpuRef]:
        with self._lock:
            return set(self._by_gpu)


__all__ = ["DesiredState"]
