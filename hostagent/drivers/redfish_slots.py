"""Which host slot each GPU of a zone-per-port host is presented at.

With a zone per host slot, the zone a GPU is in says its slot. With one zone per host
port (several GPUs in one zone), the zone says only *which* GPUs the host holds; the
slot each one was mapped for is the agent's own record, kept here: reserved before the
zone is changed, dropped when the GPU leaves the zone, and written to a file in the
agent's state directory so a restarted agent reports its GPUs where it put them. A GPU
found in the zone without a record (mapped by hand, or the file was lost) is given the
lowest free slot and recorded; one that finds no free slot is left unreported and
logged.

The zone stays the truth for *whether* the host holds a GPU: a record of a GPU the zone
does not hold is dropped on the next :meth:`SlotLedger.assign`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from dxpool.hostagent.errors import AttachConflictError, DriverError
from dxpool.names import GpuRef, parse_gpu

log = logging.getLogger(__name__)

LEDGER_FILE = "redfish-slots.json"


class SlotLedger:
    """Host slot -> GPU for one zone-per-port host with ``slots`` slots; persisted to
    ``path`` when given (else kept in memory). Safe for several threads."""

    def __init__(self, slots: int, path: Path | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self._slots = slots
        self._path = path
        self._lock = threading.Lock()
        self._by_slot: dict[int, GpuRef] = self._load()

    def reserve(self, gpu: GpuRef, host_slot: int) -> None:
        """Record ``gpu`` at ``host_slot`` before it is mapped. Raises a non-retryable
        :class:`DriverError` for a slot out of range, :class:`AttachConflictError` for one
        recorded for another GPU."""
        if not 0 <= host_slot < self._slots:
            raise DriverError(
                f"host slot {host_slot} is outside the port's {self._slots} slots",
                retryable=False,
            )
        with self._lock:
            holder = self._by_slot.get(host_slot)
            if holder is not None and holder != gpu:
                raise AttachConflictError(
                    f"host slot {host_slot} is being mapped for {holder.name}; pick a free slot"
                )
            for slot, known in list(self._by_slot.items()):
                if known == gpu and slot != host_slot:
                    del self._by_slot[slot]
            self._by_slot[host_slot] = gpu
            self._save()

    def release(self, gpu: GpuRef) -> None:
        """Forget ``gpu``'s slot (it left the zone, or its map failed)."""
        with self._lock:
            kept = {s: g for s, g in self._by_slot.items() if g != gpu}
            if kept != self._by_slot:
                self._by_slot = kept
                self._save()

    def slot_of(self, gpu: GpuRef) -> int | None:
        with self._lock:
            return next((s for s, g in self._by_slot.items() if g == gpu), None)

    def assign(
        self, in_zone: Iterable[GpuRef], *, keep: Iterable[GpuRef] = ()
    ) -> dict[int, GpuRef]:
        """Host slot -> GPU for the GPUs the zone holds now: records of GPUs gone from the
        zone are dropped (except those in ``keep``: maps under way), GPUs without a record
        get the lowest free slot."""
        present = list(dict.fromkeys(in_zone))
        pending = set(keep)
        with self._lock:
            kept = {s: g for s, g in self._by_slot.items() if g in present or g in pending}
            placed = set(kept.values())
            free = (s for s in range(self._slots) if s not in kept)
            for gpu in present:
                if gpu in placed:
                    continue
                slot = next(free, None)
                if slot is None:
                    log.warning(
                        "zone holds more GPUs than the port has slots; not reporting one",
                        extra={"gpu": gpu.name, "slots": self._slots},
                    )
                    continue
                kept[slot] = gpu
                log.info("gpu found in the port's zone; given a host slot",
                         extra={"gpu": gpu.name, "host_slot": slot})  # fmt: skip
            if kept != self._by_slot:
                self._by_slot = kept
                self._save()
            return {s: g for s, g in kept.items() if g in present}

    def _load(self) -> dict[int, GpuRef]:
        if self._path is None or not self._path.exists():
            return {}
        try:
            raw = json.loads(self._path.read_text(encoding="utf-8"))
            found = {int(slot): parse_gpu(name) for slot, name in raw["slots"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning(
                "redfish slot record unreadable; slots are given anew",
                extra={"path": str(self._path), "error": str(error)},
            )
            return {}
        return {s: g for s, g in found.items() if 0 <= s < self._slots}

    def _save(self) -> None:
        if self._path is None:
            return
        data = {"slots": {str(s): g.name for s, g in sorted(self._by_slot.items())}}
        partial = self._path.with_suffix(".tmp")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(data, indent=1), encoding="utf-8")
            os.replace(partial, self._path)
        except OSError as error:
            raise DriverError(
                f"cannot record the host slots of the port's GPUs in {self._path}: {error}"
            ) from error


__all__ = ["LEDGER_FILE", "SlotLedger"]
