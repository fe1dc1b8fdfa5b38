"""Critical XID events from NVML, waited for in a thread of their own.

The NVIDIA driver reports faults as XID events. :class:`XidWatcher` registers each GPU it
is asked to watch for ``nvmlEventTypeXidCriticalError`` in one NVML event set and waits on
it (``nvmlEventSetWait``) with a short timeout, so :meth:`XidWatcher.stop` returns
promptly. The latest XID that counts is kept per GPU UUID for the watcher's lifetime:
a fault stays visible until the agent restarts.

Not every XID is the GPU's fault. As NVIDIA's Kubernetes device plugin does, XIDs caused
by applications (13, 31, 43, 45, 68, 109) are logged and ignored; XIDs that leave the
GPU working but want attention (63: a row remap pending, 92: a high single-bit ECC rate)
degrade it; every other critical XID fails it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
DEGRADING_XIDS = frozenset({63, 92})
XID_MEANINGS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "row remapping pending",
    64: "row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
XID_EVENT_TYPE = 0x0000000000000008  # pynvml.nvmlEventTypeXidCriticalError
DEFAULT_WAIT_MS = 500


@dataclass(frozen=True)
class XidEvent:
    """One critical XID of one GPU, at wall-clock time ``at`` (seconds)."""

    uuid: str
    xid: int
    at: float

    @property
    def degrades_only(self) -> bool:
        return self.xid in DEGRADING_XIDS

    def describe(self) -> str:
        meaning = XID_MEANINGS.get(self.xid)
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        return f"XID {self.xid}{f' ({meaning})' if meaning else ''} at {when}"


class XidWatcher:
    """Waits for critical XID events of the GPUs given to :meth:`watch`.

    ``nvml`` is the pynvml module (or a stand-in with the same functions); NVML must be
    initialized while the watcher runs. Thread-safe.
    """

    def __init__(
        self,
        nvml: Any,
        *,
        wait_ms: int = DEFAULT_WAIT_MS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if wait_ms <= 0:
            raise ValueError(f"wait_ms must be > 0, got {wait_ms}")
        self._nvml = nvml
        self._wait_ms = wait_ms
        self._clock = clock
        self._lock = threading.Lock()
        self._event_set: Any = None
        self._registered: dict[str, bool] = {}  # uuid -> True if it reports XIDs
        self._latest: dict[str, XidEvent] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the waiting thread. Idempotent."""
        with self._lock:
            if self._thread is not None:
                return
            # Each thread gets a stop event of its own: a start() racing a stop() must
            # not clear the event the stopped thread is still to see.
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stop,), name="nvml-xid", daemon=True
            )
            self._thread.start()

    @property
    def running(self) -> bool:
        """True while the waiting thread runs."""
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread (within about one wait) and free the event set. Idempotent."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None:
            thread.join()
        self.reset()

    def reset(self) -> None:
        """Forget the event set and registrations (NVML was initialized anew); GPUs
        register again on their next :meth:`watch`. Recorded XIDs are kept."""
        with self._lock:
            event_set, self._event_set = self._event_set, None
            self._registered.clear()
        if event_set is not None:
            try:
                self._nvml.nvmlEventSetFree(event_set)
            except self._nvml.NVMLError as error:
                log.debug("nvml event set not freed", extra={"error": str(error)})

    def watch(self, uuid: str, handle: Any) -> bool:
        """Register the GPU ``uuid`` (NVML ``handle``) for XID events, once.

        True when it reports them; False when NVML does not support XID events for it
        (then no XID signal exists for this GPU). Other NVML errors propagate.
        """
        with self._lock:
            known = self._registered.get(uuid)
            if known is not None:
                return known
            if self._event_set is None:
                self._event_set = self._nvml.nvmlEventSetCreate()
            try:
                self._nvml.nvmlDeviceRegisterEvents(handle, XID_EVENT_TYPE, self._event_set)
            except self._nvml.NVMLError_NotSupported:
                self._registered[uuid] = False
                return False
            self._registered[uuid] = True
            return True

    def latest(self, uuid: str) -> XidEvent | None:
        """The latest XID of ``uuid`` that counts against its health, or None."""
        with self._lock:
            return self._latest.get(uuid)

    def wait_once(self, timeout_ms: int | None = None) -> XidEvent | None:
        """Wait up to ``timeout_ms`` (default: the watcher's wait) for one event and
        record it; None on a timeout or when nothing is registered yet."""
        with self._lock:
            event_set = self._event_set
        if event_set is None:
            self._stop.wait((timeout_ms or self._wait_ms) / 1000)
            return None
        try:
            data = self._nvml.nvmlEventSetWait(event_set, timeout_ms or self._wait_ms)
        except self._nvml.NVMLError_Timeout:
            return None
        return self._record(data)

    def _record(self, data: Any) -> XidEvent | None:
        if not int(data.eventType) & XID_EVENT_TYPE:
            return None
        uuid = _text(self._nvml.nvmlDeviceGetUUID(data.device))
        event = XidEvent(uuid=uuid, xid=int(data.eventData), at=self._clock())
        if event.xid in APPLICATION_XIDS:
            log.info("application xid ignored", extra={"uuid": uuid, "xid": event.xid})
            return event
        log.warning("gpu xid", extra={"uuid": uuid, "xid": event.xid, "what": event.describe()})
        with self._lock:
            self._latest[uuid] = event
        return event

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.wait_once()
            except self._nvml.NVMLError as error:
                log.warning("nvml event wait failed", extra={"error": str(error)})
                stop.wait(self._wait_ms / 1000)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


__all__ = ["APPLICATION_XIDS", "DEGRADING_XIDS", "XidEvent", "XidWatcher"]
