"""One chaos run, start to finish: pool, load, faults, checks, settle, drain, report.

Phases:

1. **warmup** — the pool starts, client workers begin their compose/wait/release loops.
2. **faults** — for ``seconds``, faults are injected one at a time from a seeded
   schedule (every kind once per round, in a shuffled order), each held, healed, and
   followed by a gap. The monitor checks safety on every snapshot meanwhile.
3. **settle** — load stops (workers release what they hold); the run waits until no node
   or GPU is in a transient state and every fault has recovered, up to ``settle_s``;
   then :func:`check_settled` (liveness) runs on the last snapshot.
4. **drain** — every node not RELEASED is released; the run waits up to ``drain_s``
   for all GPUs to be FREE and nothing mapped; :func:`check_drained` runs.
5. Client results with unexpected codes and faults that never recovered become
   violations too.

The seed fixes the schedule, the fault parameters and the load's choices; the
interleavings of real processes still differ from run to run.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.client import Client
from dxpool.errors import DxpoolError
from tests.chaos.faults import FAULTS, Fault, FaultContext, fault_kinds
from tests.chaos.harness import ChaosPool, PoolConfig
from tests.chaos.invariants import (
    FabricSnapshot,
    Kind,
    Violation,
    check_acknowledged,
    check_drained,
    check_fabric,
    check_records,
    check_settled,
    is_settled,
)
from tests.chaos.monitor import Monitor
from tests.chaos.report import ChaosReport, ViolationBook
from tests.chaos.sharing_load import set_quotas, sharing_summary, sharing_workers
from tests.chaos.workload import OpLog, Worker


@dataclass(frozen=True)
class RunConfig:
    seed: int = 20240611
    seconds: float = 75.0
    workers: int = 4
    # Workers of two tenants that share the pool (loaning, reclaim, shrink, preemption,
    # the queue); see tests/chaos/sharing_load.py.
    sharing_workers: int = 3
    warmup_s: float = 3.0
    gap_s: tuple[float, float] = (2.0, 4.0)
    check_interval_s: float = 1.0
    fence_bound_s: float = 6.0
    settle_s: float = 40.0
    drain_s: float = 30.0
    kinds: tuple[str, ...] = ()
    pool: PoolConfig = field(default_factory=PoolConfig)


class FaultSchedule:
    """Every kind once per round, each round in a seeded shuffled order."""

    def __init__(self, kinds: list[str], rng: random.Random) -> None:
        self.kinds = kinds
        self.rng = rng
        self._round: list[str] = []

    def next(self) -> str:
        if not self._round:
            self._round = list(self.kinds)
            self.rng.shuffle(self._round)
        return self._round.pop(0)


class ChaosRun:
    def __init__(self, root: Path, config: RunConfig) -> None:
        self.root = root
        self.config = config
        self.rng = random.Random(config.seed)
        self.pool = ChaosPool(root / "pool", config.pool)
        self.log = OpLog()
        self.book = ViolationBook()
        self.faults: list[Fault] = []
        self._faults_lock = threading.Lock()
        self.start = time.monotonic()
        self.phases: dict[str, float] = {}
        self.monitor: Monitor | None = None

    def _fault_list(self) -> list[Fault]:
        with self._faults_lock:
            return list(self.faults)

    def _now(self) -> float:
        return time.monotonic() - self.start

    def run(self) -> ChaosReport:
        cfg = self.config
        stop = threading.Event()
        workers: list[Worker] = []
        try:
            self.pool.start()
            self.phases["startup"] = round(self._now(), 1)
            self.monitor = Monitor(
                self.pool, self.log, self.book, self._fault_list, self.start, cfg.check_interval_s
            )
            self.monitor.start()
            workers = [
                Worker(i, self.pool.endpoints, self.log, stop, cfg.seed * 100 + i)
                for i in range(cfg.workers)
            ]
            if cfg.sharing_workers:
                set_quotas(self.pool.endpoints)
                workers += sharing_workers(
                    cfg.workers,
                    self.pool.endpoints,
                    self.log,
                    stop,
                    cfg.seed,
                    cfg.sharing_workers,
                )
            for worker in workers:
                worker.start()
            time.sleep(cfg.warmup_s)
            phase_start = self._now()
            self._inject_faults()
            self.phases["faults"] = round(self._now() - phase_start, 1)

            phase_start = self._now()
            self.monitor.phase = "settle"
            stop.set()
            for worker in workers:
                worker.join(60)
            self._settle()
            self.phases["settle"] = round(self._now() - phase_start, 1)

            phase_start = self._now()
            self.monitor.phase = "drain"
            self._drain()
            self.phases["drain"] = round(self._now() - phase_start, 1)
            return self._report(workers)
        finally:
            stop.set()
            if self.monitor is not None:
                self.monitor.stop()
            for fault in self._fault_list():
                fault.join(5)
            self.pool.stop()

    # -- faults ----------------------------------------------------------------------------

    def _inject_faults(self) -> None:
        cfg = self.config
        kinds = list(cfg.kinds) or fault_kinds(cfg.pool.etcd_members)
        schedule = FaultSchedule(kinds, self.rng)
        end = time.monotonic() + cfg.seconds
        assert self.monitor is not None
        monitor = self.monitor
        context = FaultContext(
            self.pool,
            self.log,
            cfg.fence_bound_s,
            lambda: monitor.latest,
            lambda found: self.book.add(found, monitor.phase, self._now()),
        )
        while time.monotonic() < end:
            kind = schedule.next()
            fault = FAULTS[kind](context, random.Random(self.rng.getrandbits(64)))
            with self._faults_lock:
                self.faults.append(fault)
            fault.inject()
            time.sleep(fault.hold_s)
            fault.heal()
            time.sleep(self.rng.uniform(*cfg.gap_s))

    # -- settle and drain --------------------------------------------------------------------

    def _settle(self) -> None:
        """Wait for quiet (no transient state, every fault recovered), then check
        liveness on the last snapshot."""
        assert self.monitor is not None
        deadline = time.monotonic() + self.config.settle_s
        snap = None
        while time.monotonic() < deadline:
            self.monitor.check_once()
            snap = self.monitor.latest
            if snap is not None and is_settled(snap) and all(f.done for f in self._fault_list()):
                break
            time.sleep(0.5)
        if snap is None:
            snap = self.monitor.read()
        running = [f"hosts/{a.host}" for a in self.pool.agents if a.running and not a.paused]
        self.book.add(check_settled(snap, running), "settle", self._now())
        for fault in self._fault_list():
            if fault.record.recovered_at is None:
                self.book.add(
                    [
                        Violation(
                            Kind.NOT_RECOVERED,
                            f"{fault.kind} {fault.record.target} @"
                            f"{fault.record.injected_at - self.start:.1f}s",
                            "; ".join(fault.record.notes)
                            or f"no recovery within the settle bound ({self.config.settle_s:g}s)",
                        )
                    ],
                    "settle",
                    self._now(),
                )

    def _drain(self) -> None:
        """Release every node that is not RELEASED, wait, and check nothing is left."""
        assert self.monitor is not None and self.pool.fabric is not None
        snap = self.monitor.read()
        live = [n for n, r in snap.nodes.items() if r.value.state != pb.NODE_STATE_RELEASED]
        with Client(self.pool.endpoints[0], timeout_s=5.0) as client:
            for name in live:
                try:
                    client.release_node(name)
                    self.log.result("drain_release", "OK")
                    self.log.release(name)
                except DxpoolError as error:
                    self.log.failure("drain_release", error, name)
        deadline = time.monotonic() + self.config.drain_s
        fabric = None
        while time.monotonic() < deadline:
            snap = self.monitor.read()
            fabric = FabricSnapshot.read(self.pool.fabric)
            if not check_drained(snap, fabric):
                break
            time.sleep(0.5)
        self.book.add(check_drained(snap, fabric), "drain", self._now())
        # Final safety pass on the quiet pool.
        before = self.monitor.read()
        fabric = FabricSnapshot.read(self.pool.fabric)
        after = self.monitor.read()
        final = check_records(after)
        if fabric is not None:
            final += check_fabric(before, fabric, after).violations
        final += check_acknowledged(after, self.log.acked_at(), self.log.released_nodes())
        self.book.add(final, "final", self._now())
        self._final_snapshot = after

    # -- report ------------------------------------------------------------------------------

    def _report(self, workers: list[Worker]) -> ChaosReport:
        cfg = self.config
        unexpected = Counter((e.op, e.code) for e in self.log.unexpected)
        examples = {(e.op, e.code): e for e in self.log.unexpected}
        self.book.add(
            [
                Violation(
                    Kind.UNEXPECTED_ERROR,
                    f"{op} {code}",
                    f"{count} call(s); e.g. at {examples[(op, code)].at - self.start:.1f}s "
                    f"{examples[(op, code)].subject}: {examples[(op, code)].message}",
                )
                for (op, code), count in sorted(unexpected.items())
            ],
            "workload",
            self._now(),
        )
        for worker in workers:
            if worker.crashed is not None:
                raise RuntimeError(f"{worker.name} crashed") from worker.crashed
        if self.monitor is not None and self.monitor.crashed is not None:
            raise RuntimeError("the monitor crashed") from self.monitor.crashed
        records = [f.record for f in self._fault_list()]
        snap = self._final_snapshot
        config = {
            "seed": cfg.seed,
            "seconds": cfg.seconds,
            "workers": cfg.workers,
            "sharing_workers": cfg.sharing_workers,
            "fence_bound_s": cfg.fence_bound_s,
            "etcd_members": cfg.pool.etcd_members,
            "brokers": cfg.pool.brokers,
            "hosts": cfg.pool.hosts,
            "gpus": cfg.pool.total_gpus,
            "lease_ttl_s": cfg.pool.lease_ttl_s,
            "logs": str(self.pool.root),
            "pool": asdict(cfg.pool),
        }
        report = ChaosReport(
            config=config,
            workload=self.log.snapshot(),
            faults=[r.to_json(self.start) for r in records],
            recovery=ChaosReport.recovery_of(records),
            checks=dict(self.monitor.stats) if self.monitor is not None else {},
            phases=self.phases,
            final={
                "revision": snap.revision,
                "gpus": snap.gpu_counts(),
                "nodes": snap.node_counts(),
                "sharing": sharing_summary(snap),
            },
            violations=[seen.to_json() for seen in self.book.entries()],
        )
        return report

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


__all__ = ["ChaosRun", "FaultSchedule", "RunConfig"]
