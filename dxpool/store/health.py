"""Whether etcd answers, as the calls of one process see it.

:class:`EtcdHealth` is a two-state machine, REACHABLE and UNREACHABLE, fed by the outcome
of every etcd call (:meth:`~EtcdHealth.begin` before the call, then
:meth:`~EtcdHealth.succeeded` or :meth:`~EtcdHealth.failed`). Contracts:

* Only failures that mean an outage (see :mod:`dxpool.store.errors`) make etcd
  UNREACHABLE; a success makes it REACHABLE again.
* An outcome changes the state only if its call began after the last change, so a slow
  call that started before an outage cannot declare etcd reachable again, and a call that
  failed before a recovery cannot declare it lost again.
* Each change is logged once (a warning when lost, an info line when back) and passed to
  the listeners; a failing call logs nothing of its own.
* While UNREACHABLE a probe thread calls ``probe`` with a bounded exponential backoff
  (at most ``max_probe_interval_s`` apart), so recovery is noticed promptly even when no
  request arrives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import tenacity

from dxpool.store.errors import EtcdFailure, classify

log = logging.getLogger(__name__)

HealthListener = Callable[[bool], None]


class EtcdHealth:
    """Reachability of etcd for one client. Thread-safe."""

    def __init__(
        self,
        probe: Callable[[], object],
        *,
        name: str = "etcd",
        min_probe_interval_s: float = 0.05,
        max_probe_interval_s: float = 0.5,
    ) -> None:
        self._probe = probe
        self._name = name
        self._min_probe_s = min_probe_interval_s
        self._max_probe_s = max_probe_interval_s
        self._lock = threading.Lock()
        self._epoch = 0
        self._reachable = True
        self._changed_at = time.monotonic()
        self._last_failure: EtcdFailure | None = None
        self._listeners: list[HealthListener] = []
        self._closed = threading.Event()
        self._prober: threading.Thread | None = None

    # -- reading ---------------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        with self._lock:
            return self._reachable

    @property
    def last_failure(self) -> EtcdFailure | None:
        """The failure that made etcd UNREACHABLE (kept after recovery, for messages)."""
        with self._lock:
            return self._last_failure

    def unreachable_for_s(self) -> float:
        """Seconds since etcd became UNREACHABLE; 0 while it is REACHABLE."""
        with self._lock:
            return 0.0 if self._reachable else time.monotonic() - self._changed_at

    def subscribe(self, listener: HealthListener) -> None:
        """Call ``listener(reachable)`` after every change (in the changing thread)."""
        with self._lock:
            self._listeners.append(listener)

    # -- feeding ---------------------------------------------------------------------

    def begin(self) -> int:
        """A token for a call about to start; pass it to ``succeeded``/``failed``."""
        with self._lock:
            return self._epoch

    def succeeded(self, token: int) -> None:
        self._change(token, reachable=True, failure=None)

    def failed(self, token: int, failure: EtcdFailure) -> None:
        """Record a failed call; only an outage changes the state."""
        if failure.outage:
            self._change(token, reachable=False, failure=failure)

    def _change(self, token: int, *, reachable: bool, failure: EtcdFailure | None) -> None:
        with self._lock:
            if self._reachable == reachable or token != self._epoch or self._closed.is_set():
                return
            self._epoch += 1
            self._reachable = reachable
            lasted = time.monotonic() - self._changed_at
            self._changed_at = time.monotonic()
            if failure is not None:
                self._last_failure = failure
            listeners = list(self._listeners)
            if not reachable and (self._prober is None or not self._prober.is_alive()):
                self._prober = threading.Thread(
                    target=self._probe_until_reachable, name=f"{self._name}-probe", daemon=True
                )
                self._prober.start()
        if reachable:
            log.info(
                "etcd reachable again",
                extra={"client": self._name, "unreachable_s": round(lasted, 3)},
            )
        else:
            log.warning("etcd unreachable", extra={"client": self._name, "error": str(failure)})
        for listener in listeners:
            try:
                listener(reachable)
            except Exception:
                log.exception("etcd health listener failed")

    def _probe_until_reachable(self) -> None:
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda reachable: not reachable),
            wait=tenacity.wait_exponential(multiplier=self._min_probe_s, max=self._max_probe_s)
            + tenacity.wait_random(0, self._min_probe_s),
            stop=tenacity.stop_when_event_set(self._closed),
            sleep=self._sleep,
            retry_error_callback=lambda state: False,
        )
        retrying(self._probe_once)

    def _sleep(self, seconds: float) -> None:
        self._closed.wait(seconds)

    def _probe_once(self) -> bool:
        """One probe; True once etcd is REACHABLE (by this probe or by any other call)."""
        token = self.begin()
        if self.reachable:
            return True
        try:
            self._probe()
        except Exception as error:
            failure = classify(error)
            if failure is None:
                log.exception("etcd probe failed unexpectedly", extra={"client": self._name})
            return False
        self.succeeded(token)
        return True

    def close(self) -> None:
        """Stop probing; later outcomes are ignored."""
        self._closed.set()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout=5)


__all__ = ["EtcdHealth", "HealthListener"]
