"""The XID watcher's thread life cycle (hostagent/xid.py), over the fake NVML."""

from __future__ import annotations

import threading

from dxpool.hostagent.xid import XidWatcher
from tests.hostagent.fake_nvml import FakeGpu, FakeNvml
from tests.patience import patient


def test_a_start_racing_a_stop_does_not_keep_the_stopped_thread_running() -> None:
    """stop() has taken the running thread and is joining it; before that thread wakes
    from its wait, another caller (a reconcile worker that initialized NVML anew)
    starts the watcher again. The stopped thread must still end, so stop() returns,
    and the new thread runs until it is stopped in turn."""
    watcher = XidWatcher(FakeNvml(), wait_ms=2000)
    # A registered GPU: the thread waits for events in NVML, up to wait_ms at a time.
    assert watcher.watch("GPU-1234", FakeGpu())
    watcher.start()
    first = watcher._thread
    assert first is not None
    stopper = threading.Thread(target=watcher.stop)
    stopper.start()
    # Hold here until stop() has taken the thread: it now joins while the thread waits.
    while watcher._thread is not None:
        pass
    watcher.start()
    stopper.join(patient(10.0))
    assert not stopper.is_alive(), "stop() never returned: the stopped thread kept running"
    assert not first.is_alive()
    assert watcher.running
    watcher.stop()
    assert not watcher.running
