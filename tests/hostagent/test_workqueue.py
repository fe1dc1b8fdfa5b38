"""WorkQueue: dedup, one worker per key, per-key exponential backoff, shutdown."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from dxpool.hostagent.workqueue import ExponentialBackoff, WorkQueue


def make_queue(base_s: float = 0.05, max_s: float = 1.0) -> WorkQueue[str]:
    return WorkQueue(ExponentialBackoff(base_s, max_s))


def test_a_key_is_queued_once() -> None:
    queue = make_queue()
    for key in ("a", "b", "a", "a", "b"):
        queue.add(key)

    assert len(queue) == 2
    assert [queue.get(0.1), queue.get(0.1)] == ["a", "b"]
    assert queue.get(0.05) is None


def test_a_key_added_while_processing_waits_for_done() -> None:
    queue = make_queue()
    queue.add("a")
    assert queue.get(0.1) == "a"

    queue.add("a")
    queue.add("a")
    assert queue.get(0.05) is None  # not handed to a second worker

    queue.done("a")
    assert queue.get(0.1) == "a"
    queue.done("a")
    assert queue.get(0.05) is None


def test_no_key_is_processed_by_two_workers_at_once() -> None:
    queue = make_queue()
    keys = [f"gpu-{i}" for i in range(5)]
    active: set[str] = set()
    processed: Counter[str] = Counter()
    overlaps: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        while (key := queue.get()) is not None:
            with lock:
                if key in active:
                    overlaps.append(key)
                active.add(key)
            time.sleep(0.002)
            with lock:
                active.discard(key)
                processed[key] += 1
            queue.done(key)

    workers = [threading.Thread(target=worker) for _ in range(4)]
    for thread in workers:
        thread.start()
    for _ in range(40):
        for key in keys:
            queue.add(key)
        time.sleep(0.001)
    deadline = time.monotonic() + 5
    while (len(queue) or active) and time.monotonic() < deadline:
        time.sleep(0.01)
    queue.shutdown()
    for thread in workers:
        thread.join(5)

    assert overlaps == []
    assert set(processed) == set(keys)
    assert all(1 <= count <= 40 for count in processed.values())


def test_backoff_doubles_per_failure_up_to_the_cap() -> None:
    backoff = ExponentialBackoff(base_s=0.2, max_s=10.0)

    assert [backoff.delay(n) for n in range(8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0]
    assert backoff.delay(10_000) == 10.0


@pytest.mark.parametrize(("base_s", "max_s"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_backoff_rejects_bad_bounds(base_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="base_s"):
        ExponentialBackoff(base_s, max_s)


def test_rate_limited_keys_come_back_after_their_backoff() -> None:
    queue = make_queue(base_s=0.05, max_s=1.0)

    added = time.monotonic()
    assert queue.add_rate_limited("a") == pytest.approx(0.05)
    assert queue.add_rate_limited("a") == pytest.approx(0.1)
    assert queue.failures("a") == 2
    assert queue.add_rate_limited("b") == pytest.approx(0.05)  # counted per key

    # Whenever a key is handed out (at once on an idle machine, or at once after a stall on
    # a loaded one), it is no earlier than the shortest backoff after it was added.
    first = queue.get(10.0)
    assert first in {"a", "b"}
    assert time.monotonic() - added >= 0.05

    queue.forget("a")
    assert queue.failures("a") == 0
    assert queue.add_rate_limited("a") == pytest.approx(0.05)


def test_a_delayed_key_already_queued_is_not_handed_out_twice() -> None:
    queue = make_queue()
    queue.add_after("a", 0.02)
    queue.add("a")

    assert queue.get(0.1) == "a"
    time.sleep(0.05)
    assert queue.get(0.05) is None  # the delayed add folded into the key in progress
    queue.done("a")
    assert queue.get(0.1) == "a"


def test_shutdown_wakes_waiting_workers() -> None:
    queue = make_queue()
    results: list[str | None] = []
    waiter = threading.Thread(target=lambda: results.append(queue.get()))
    waiter.start()
    time.sleep(0.05)

    queue.shutdown()
    waiter.join(2)

    assert results == [None]
    queue.add("a")
    assert queue.get(0.01) is None
