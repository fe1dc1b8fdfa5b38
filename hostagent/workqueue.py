"""A keyed work queue for reconcile workers, after client-go's rate-limited work queue.

Contract:

* A key is queued at most once: adding a key that is already waiting is a no-op.
* A key is handed to one worker at a time: a key added while a worker processes it is
  queued again when that worker calls :meth:`WorkQueue.done`, never handed out before.
* :meth:`WorkQueue.add_rate_limited` re-queues a key after ``base * 2**failures`` seconds
  (capped at ``max``), counting failures per key until :meth:`WorkQueue.forget`.
* After :meth:`WorkQueue.shutdown`, :meth:`WorkQueue.get` returns None at once.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

_MAX_EXPONENT = 62  # 2**62 seconds is beyond any cap; keeps the float arithmetic finite


@dataclass(frozen=True)
class ExponentialBackoff:
    """Delay after ``failures`` failures: ``base_s * 2**failures``, at most ``max_s``."""

    base_s: float
    max_s: float

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.max_s < self.base_s:
            raise ValueError(
                f"backoff needs 0 < base_s <= max_s, got base_s={self.base_s}, max_s={self.max_s}"
            )

    def delay(self, failures: int) -> float:
        return min(self.base_s * 2.0 ** min(failures, _MAX_EXPONENT), self.max_s)


class WorkQueue(Generic[K]):
    """Deduplicating, per-key serialized work queue with delayed and rate-limited adds.

    Thread-safe. Workers loop ``key = get()`` ... ``done(key)``.
    """

    def __init__(self, backoff: ExponentialBackoff) -> None:
        self._backoff = backoff
        self._cond = threading.Condition()
        self._ready: deque[K] = deque()
        self._dirty: set[K] = set()  # queued, or to be queued again once processing ends
        self._processing: set[K] = set()
        self._waiting: list[tuple[float, int, K]] = []  # (due time, tie breaker, key)
        self._sequence = itertools.count()
        self._failures: dict[K, int] = {}
        self._shut_down = False

    def add(self, key: K) -> None:
        """Queue ``key`` now (a no-op if it is already queued)."""
        with self._cond:
            if not self._shut_down:
                self._add_locked(key)

    def _add_locked(self, key: K) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._ready.append(key)
            self._cond.notify()

    def add_after(self, key: K, delay_s: float) -> None:
        """Queue ``key`` once ``delay_s`` seconds have passed."""
        if delay_s <= 0:
            self.add(key)
            return
        with self._cond:
            if self._shut_down:
                return
            due = time.monotonic() + delay_s
            heapq.heappush(self._waiting, (due, next(self._sequence), key))
            self._cond.notify_all()

    def add_rate_limited(self, key: K) -> float:
        """Queue ``key`` after its backoff delay, count one more failure, return the delay."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = self._backoff.delay(failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """Reset ``key``'s failure count (after it succeeded)."""
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: K) -> int:
        """How many times ``key`` was re-queued with backoff since it was last forgotten."""
        with self._cond:
            return self._failures.get(key, 0)

    def get(self, timeout_s: float | None = None) -> K | None:
        """The next ready key, marked as processing; None on shutdown or after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._shut_down:
                    return None
                now = time.monotonic()
                self._promote_due_locked(now)
                if self._ready:
                    key = self._ready.popleft()
                    self._dirty.discard(key)
                    self._processing.add(key)
                    return key
                waits = [deadline - now] if deadline is not None else []
                if self._waiting:
                    waits.append(self._waiting[0][0] - now)
                if deadline is not None and deadline <= now:
                    return None
                self._cond.wait(max(min(waits), 0.0) if waits else None)

    def _promote_due_locked(self, now: float) -> None:
        while self._waiting and self._waiting[0][0] <= now:
            _, _, key = heapq.heappop(self._waiting)
            self._add_locked(key)

    def done(self, key: K) -> None:
        """Mark ``key`` processed; queue it again if it was added meanwhile."""
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty and not self._shut_down:
                self._ready.append(key)
                self._cond.notify()

    def shutdown(self) -> None:
        """Stop handing out keys; wakes every waiting :meth:`get`."""
        with self._cond:
            self._shut_down = True
            self._cond.notify_all()

    def busy(self) -> bool:
        """True while any key is queued, waiting out a backoff, or being processed."""
        with self._cond:
            return bool(self._ready or self._waiting or self._processing)

    def __len__(self) -> int:
        """Keys ready to be handed out now."""
        with self._cond:
            return len(self._ready)


__all__ = ["ExponentialBackoff", "WorkQueue"]
