"""The checker thread of a chaos run: safety invariants on every snapshot.

Every ``interval_s`` it reads etcd, the fabric, and etcd again
(:func:`tests.chaos.invariants.check_fabric` needs the pair), runs every safety check,
notices processes that died without being killed, and hands each snapshot to the faults
still being watched (for recovery times and the fencing bound). A snapshot that cannot
be read (etcd down) is counted and skipped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from dxpool.store.client import connect
from tests.chaos.faults import Fault
from tests.chaos.harness import ChaosPool
from tests.chaos.invariants import (
    EtcdSnapshot,
    FabricSnapshot,
    Kind,
    Violation,
    check_acknowledged,
    check_fabric,
    check_records,
)
from tests.chaos.report import ViolationBook
from tests.chaos.workload import OpLog


class Monitor(threading.Thread):
    def __init__(
        self,
        pool: ChaosPool,
        log: OpLog,
        book: ViolationBook,
        faults: Callable[[], list[Fault]],
        start: float,
        interval_s: float = 1.0,
    ) -> None:
        super().__init__(name="chaos-monitor", daemon=True)
        self.pool = pool
        self.log = log
        self.book = book
        self.faults = faults
        self.start_time = start
        self.interval_s = interval_s
        self.phase = "faults"
        self.latest: EtcdSnapshot | None = None
        self.stats = {
            "snapshots": 0,
            "fabric_checks": 0,
            "inconclusive_gpus": 0,
            "unstable_fabric_reads": 0,
            "unreadable_snapshots": 0,
            "slowest_check_s": 0.0,
        }
        self._stop_event = threading.Event()
        self._check_lock = threading.Lock()  # the run's own checks share this thread's
        self._client: Any = connect(pool.etcd.endpoints, timeout_s=3.0, retry_after_s=0.2)
        self.crashed: BaseException | None = None

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(30)
        self._client.close()

    def run(self) -> None:
        try:
            while not self._stop_event.wait(self.interval_s):
                self.check_once()
        except BaseException as error:  # a bug in the checker: surface it
            self.crashed = error
            raise

    def read(self) -> EtcdSnapshot:
        return EtcdSnapshot.read(self._client, self.pool.schema)

    def check_once(self) -> None:
        """One round of safety checks; safe to call from other threads."""
        with self._check_lock:
            self._check_once()

    def _check_once(self) -> None:
        started = time.monotonic()
        assert self.pool.fabric is not None
        try:
            before = self.read()
            fabric = FabricSnapshot.read(self.pool.fabric)
            after = self.read()
        except Exception:
            self.stats["unreadable_snapshots"] += 1
            return
        self.latest = after
        self.stats["snapshots"] += 1
        found = check_records(after)
        if fabric is None:
            self.stats["unstable_fabric_reads"] += 1
        else:
            result = check_fabric(before, fabric, after)
            self.stats["fabric_checks"] += 1
            self.stats["inconclusive_gpus"] += result.inconclusive
            found += result.violations
        found += check_acknowledged(after, self.log.acked_at(), self.log.released_nodes())
        found += self._dead_processes()
        for fault in self.faults():
            if not fault.done:
                found += fault.observe(after, fabric, time.monotonic())
        self.book.add(found, self.phase, time.monotonic() - self.start_time)
        elapsed = time.monotonic() - started
        self.stats["slowest_check_s"] = round(max(self.stats["slowest_check_s"], elapsed), 3)

    def _dead_processes(self) -> list[Violation]:
        """Processes that exited without a fault killing them; they are started again so
        the run goes on, and reported."""
        found = []
        for process in self.pool.processes():
            if process.down or process.running or process.process is None:
                continue
            found.append(
                Violation(
                    Kind.PROCESS_DIED,
                    process.name,
                    f"exited with {process.exit_code} without being killed; log tail:\n"
                    + process.log_tail(1500),
                )
            )
            process.start()
        return found


__all__ = ["Monitor"]
