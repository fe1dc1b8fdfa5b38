"""One log line per interval for events that a client can make happen at will."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["LogThrottle"]


class LogThrottle:
    """Lets one log line through per ``interval_s``; counts the ones held back, so the
    next line can say how many there were. Thread-safe."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next = 0.0
        self._held = 0

    def admit(self) -> int | None:
        """The number held back since the last admitted line, or None to hold this one."""
        with self._lock:
            now = self._clock()
            if now < self._next:
                self._held += 1
                return None
            held, self._held = self._held, 0
            self._next = now + self._interval_s
            return held
