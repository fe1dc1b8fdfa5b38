"""The leader's sharing duties on one thread: serve the queue, carry out preemption
notices, drive drains, roll back abandoned gangs.

Like the other singleton duties (:mod:`dxpool.broker.control.duties`) they run only on the
elected leader, and only for efficiency: each change they make is a compare-and-swap,
so a deposed leader that still runs a step (two brokers that both believe they lead)
cannot commit anything twice.

The thread wakes on every cache change that may free capacity or change the queue
(nodes, GPUs, boxes, host liveness and allocations, tenants, gangs), lets a burst of
changes land (``coalesce_s``), and runs every step; it also runs them every
``interval_s`` (queue deadlines, notice deadlines, gangs whose broker went away).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dxpool.broker.state.cache import Cache
from dxpool.errors import Unavailable
from dxpool.store import keys as k

log = logging.getLogger(__name__)

_WAKING = frozenset(
    {k.NODES, k.GPUS, k.BOXES, k.HOST_LEASES, k.HOST_ALLOCATIONS, k.TENANTS, k.GANGS}
)


@dataclass(frozen=True)
class SharingSettings:
    interval_s: float = 1.0
    coalesce_s: float = 0.05


@dataclass(frozen=True)
class Step:
    """One duty: a name (for logs) and what to run."""

    name: str
    run: Callable[[], Any]


class SharingDuties:
    """Runs ``steps`` in order while ``is_leader()``; ``start``/``stop``/``run_once``."""

    def __init__(
        self,
        cache: Cache,
        is_leader: Callable[[], bool],
        steps: Sequence[Step],
        settings: SharingSettings = SharingSettings(),
    ) -> None:
        self._cache = cache
        self._is_leader = is_leader
        self._steps = list(steps)
        self._settings = settings
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        self._unsubscribe = self._cache.subscribe(self._on_change)
        self._thread = threading.Thread(target=self._loop, name="sharing-duties", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wake(self) -> None:
        self._wake.set()

    def _on_change(self, collection: str, name: str, record: object) -> None:
        if collection in _WAKING:
            self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._wake.wait(self._settings.interval_s) and self._settings.coalesce_s:
                self._stop.wait(self._settings.coalesce_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            if self._is_leader():
                self.run_once()

    def run_once(self) -> None:
        """Run every step once (whatever the leadership; the loop checks it)."""
        for step in self._steps:
            try:
                step.run()
            except Unavailable as error:
                log.debug(
                    "sharing duty deferred", extra={"step": step.name, "error": error.message}
                )
                return
            except Exception:
                log.exception("sharing duty failed", extra={"step": step.name})


__all__ = ["SharingDuties", "SharingSettings", "Step"]
