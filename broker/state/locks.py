"""Per-key mutual exclusion inside one process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class KeyedLocks:
    """``with locks.lock(key):`` holds a lock of that key only. Unused locks are dropped."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def lock(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def waiting(self, key: str) -> int:
        """How many callers hold or wait for ``key``'s lock, less the holder: waiters
        (for tests that must act while a caller is at the lock)."""
        with self._guard:
            _, users = self._locks.get(key, (None, 0))
        return max(users - 1, 0)
