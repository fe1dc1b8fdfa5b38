"""The broker's garbage-collector policy: what lives long stays out of full collections.

The broker keeps its inventory (the cache's records, the placement index's views) and
what placement carries over between snapshots (:mod:`~dxpool.broker.placement.carry`)
for as long as it runs: at 100,000 GPUs, well over a million container objects. CPython
frees most garbage by reference counting; its cyclic collector exists for the rest, and
a full (generation 2) collection walks every tracked object that is not frozen. With
the long-lived state in generation 2, each full collection is a pause of hundreds of
milliseconds on whatever request runs at that moment (placement, on the compose path).

Freezing the inventory once after loading does not last: every compose replaces a few
records and moves placement's carried parts on, and after a while the objects that live
long are the ones made since the freeze. So the broker freezes again after every full
collection (:func:`freeze_survivors`): what survived it is, by then, reachable, and a
later full collection walks only what was allocated since. Its pause is bounded by the
allocation between two full collections, not by the size of the pool.

The cost, and the contract it puts on long-lived structures: a frozen object that later
becomes garbage is freed by reference counting as usual, but a *cycle* of frozen objects
is never collected. Long-lived broker state must therefore not form reference cycles
(placement's carried parts, the cache's records and the index's views hold none);
``tests/broker/test_collector.py`` checks that a steady stream of placements, commits and
releases leaves no cyclic garbage behind.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable


class _Policy:
    """The process's one policy: the callback stays installed while any caller wants it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0

    def hold(self) -> None:
        with self._lock:
            if self._holders == 0:
                gc.callbacks.append(_after_collection)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                gc.callbacks.remove(_after_collection)


_POLICY = _Policy()


def _after_collection(phase: str, info: dict[str, int]) -> None:
    """After a full collection, freezes what survived it (see the module docstring)."""
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


def freeze_survivors() -> Callable[[], None]:
    """Freezes every object tracked now, and again after each full collection, until
    the returned function is called (the policy is the process's: it stays while any
    caller has not called its function; calling one twice does nothing). Call it once
    the long-lived state is loaded.

    Freezing is not a collection: it moves the generations' lists into the permanent
    one, without walking the objects."""
    _POLICY.hold()
    gc.freeze()
    once = threading.Lock()

    def release() -> None:
        if once.acquire(blocking=False):  # the first call alone
            _POLICY.release()

    return release
