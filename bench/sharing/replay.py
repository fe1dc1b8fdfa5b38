"""Replay a job trace through the broker's queue, loaning and preemption logic, with a
clock of our own: loaning against hard quotas, two tenants.

The pool is :class:`~bench.sharing.pool.ReplayPool`: the broker's cache, placement index
and placement (``place()`` through the gang placer, which holds choices as the broker
does), with no etcd and no agents. What decides is the broker's own code, called as
the leader's dispatcher calls it: the queue order (:func:`~dxpool.broker.state.queue_order.
ordered`), the loaning terms and quota checks (:func:`~dxpool.broker.nodes.loaning.terms`,
:func:`~dxpool.broker.nodes.tenants.breach`, usage moved by
:func:`~dxpool.broker.nodes.tenants.charged`), the preemption planner
(:func:`~dxpool.broker.nodes.preemption.plan`, shrink first, then least cost), lending
paused while an owner reclaims, and GPUs kept for a request that preempts. The replay
adds only time: a notice's grace (``--grace``), a detach and scrub (``--detach``), a job's
progress, checkpoints.

Two tenants share the pool:

* **inference**, guaranteed ``--inference-share`` of the pool, runs services of
  ``--inference-node`` GPUs whose number follows a diurnal curve (from ``--low`` to
  ``--high`` of its guarantee, lowest at midnight of the trace's clock): every five
  minutes services are added (queued, priority 10) or the newest released;
* **training**, guaranteed the rest, runs the trace's jobs: a job of up to 8 GPUs is one
  node (elastic down to half its GPUs when it has 2 or more, EDL-style), a larger one a
  gang of 8-GPU members (never elastic). A job's work is its GPUs times its duration,
  done at a rate of the GPUs it holds (a shrunk job runs slower); a preempted job loses
  what it did since its last checkpoint (``--checkpoint``) and waits again, keeping its
  place by age.

**Loaning**: training may borrow idle inference capacity without limit (``borrow_limit``
unset); its nodes beyond its guarantee are preemptible, and an inference service within
its guarantee that finds nothing free takes them back. **Hard quotas**: each tenant is
capped at its guarantee (``borrow_limit`` 0), nothing is preempted.

Figures, over the replay window: cluster GPU utilisation (time average of GPUs held),
queueing delay per tenant (arrival to first start) p50/p99, training job completion
time, preemptions (jobs taken, shrinks, GPU-hours lost to checkpoints), and the
inference tenant's time to get its guarantee back (arrival to start of the services
that had to reclaim lent GPUs).

``--timeline HOURS`` samples the queue every HOURS of the replay's clock (:class:`Sample`):
GPUs held per tenant, the training load offered (had every job started on arrival), how
many jobs wait and why the last pass left them waiting, and the passes made and their
time; with it, a queue that grows can be told apart as a load beyond the pool (offered
above what is held, jobs waiting for quota or capacity) or as a slow pass.

Usage: python -m bench.sharing.replay [--trace philly|openb|both] [--days 14]
       [--gpus 1024] [--inference-share 0.5] [--grace 30] [--detach 10]
       [--openb-load 1.0] [--timeline HOURS]
"""

from __future__ import annotations

import argparse
import heapq
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script, too

from bench.sharing.pool import ReplayPool
from bench.sharing.traces import TraceError, TraceJob, openb, philly, traces_dir
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes import loaning
from dxpool.broker.nodes.preemption import Ask, Holder, plan
from dxpool.broker.nodes.tenants import breach, charged
from dxpool.broker.placement import PlacementRequest
from dxpool.broker.state.queue_order import Waiting, ordered

INFERENCE = "inference"
TRAINING = "training"
DAY_S = 86400.0
TICK_S = 300.0


@dataclass
class Job:
    name: str
    tenant: str
    arrival: float
    members: list[int]
    work: float  # GPU-seconds left; inf for a service
    priority: int
    elastic_min: int = 0
    duration: float = math.inf  # as the trace gives it (run on all its GPUs)
    state: str = "waiting"
    nodes: list[str] = field(default_factory=list)
    held: int = 0
    since: float = 0.0  # when ``held`` last changed (progress accounting)
    started: float = 0.0  # when it last started running
    first_start: float | None = None
    borrowed: bool = False
    version: int = 0
    noticed: bool = False
    reclaimed: bool = False  # had to take lent GPUs back to start
    awaiting_until: float = 0.0  # GPUs promised by its victims are free by then
    finished: float | None = None
    entry: Waiting = field(init=False)  # as the queue order sees it

    def __post_init__(self) -> None:
        self.entry = Waiting(self.name, self.tenant, self.priority, self.arrival, self.gpus)

    @property
    def gpus(self) -> int:
        return sum(self.members)


@dataclass
class Settings:
    gpus: int = 1024
    inference_share: float = 0.5
    inference_node: int = 2
    low: float = 0.25
    high: float = 0.9
    grace_s: float = 30.0
    detach_s: float = 10.0
    checkpoint_s: float = 1800.0
    slots: int = 16


@dataclass
class Figures:
    mode: str
    trace: str
    window_days: float
    utilisation: float
    delays: dict[str, list[float]]
    never_started: dict[str, int]
    jct: list[float]
    finished: int
    preempted_jobs: int
    preempted_nodes: int
    shrinks: int
    lost_gpu_hours: float
    reclaim_waits: list[float]
    wall_s: float
    decisions: int
    passes: int = 0
    placements: int = 0
    plans: int = 0
    pass_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)


@dataclass(frozen=True)
class Sample:
    """The queue at one moment of a replay (``--timeline``): GPUs held per tenant, the
    waiting jobs per tenant and why the last pass left them waiting, the GPUs the
    training jobs that arrived and are not done would hold had each started on arrival
    (the offered load), and the passes made since the previous sample."""

    at: float
    held: dict[str, int]
    free: int
    waiting: dict[str, int]
    waiting_gpus: dict[str, int]
    reasons: dict[str, int]
    offered: int
    passes: int
    pass_s: float


@dataclass
class PassState:
    """What one pass of the replay's dispatcher keeps as it goes: GPUs promised to
    reclaiming services ahead, whether lending is paused and anything is lent out,
    shapes that found no placement, and asks the planner found no victims for (neither
    does better later in the pass: the pool only fills and candidates only go under
    notice as it goes)."""

    paused: bool
    lent_out: bool
    promised: int = 0
    failed: set[tuple[int, ...]] = field(default_factory=set)
    unplannable: set[tuple[str, int, tuple[int, ...]]] = field(default_factory=set)
    # loaning terms and quota verdicts by (tenant, GPUs[, nodes]): the tenants' usage
    # changes only when a job starts, which clears them
    terms: dict[tuple[str, int], loaning.LoanTerms] = field(default_factory=dict)
    over_quota: dict[tuple[str, int, int], bool] = field(default_factory=dict)


class Replay:
    def __init__(
        self,
        jobs: list[TraceJob],
        settings: Settings,
        *,
        loaning_on: bool,
        end: float,
        sample_every: float | None = None,
    ):
        self.s = settings
        self.loaning_on = loaning_on
        self.end = end
        self.pool = ReplayPool(settings.gpus, slots=settings.slots)
        capacity = self.pool.capacity
        inference_guarantee = int(capacity * settings.inference_share)
        self.guarantee = {INFERENCE: inference_guarantee, TRAINING: capacity - inference_guarantee}
        self.tenants: dict[str, pb.Tenant] = {}
        for tenant, guaranteed in self.guarantee.items():
            quota = pb.TenantQuota(guaranteed_gpus=guaranteed)
            if not loaning_on or tenant == INFERENCE:
                quota.borrow_limit = 0
            self.tenants[tenant] = pb.Tenant(name=f"tenants/{tenant}", quota=quota)
        self.jobs: dict[str, Job] = {}
        self.waiting: set[str] = set()
        self.running: set[str] = set()
        self.services: set[str] = set()  # inference services not ended
        self.node_job: dict[str, str] = {}
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.now = 0.0
        self.area = 0.0  # GPU-seconds held, for utilisation
        self.last = 0.0
        self.preempted_jobs = 0
        self.preempted_nodes = 0
        self.shrinks = 0
        self.lost = 0.0
        self.decisions = 0
        self.placements = 0  # place() calls
        self.plans = 0  # preemption planner calls
        self.passes = 0
        self.pass_s = 0.0
        self.reasons: dict[str, str] = {}  # why the last pass left each waiting job waiting
        self.sample_every = sample_every
        self.samples: list[Sample] = []
        self.node_seq = 0
        for i, trace_job in enumerate(jobs):
            gpus = max(trace_job.gpus, 1)
            members = [gpus] if gpus <= 8 else [8] * math.ceil(gpus / 8)
            job = Job(
                f"nodes/t{i}",
                TRAINING,
                trace_job.arrival_s,
                members,
                float(sum(members)) * trace_job.duration_s,
                0,
                elastic_min=gpus // 2 if 2 <= gpus <= 8 else 0,
                duration=trace_job.duration_s,
            )
            self.jobs[job.name] = job
            self.push(job.arrival, "arrive", job.name)
        self.push(0.0, "tick", None)
        self.inference_seq = 0

    # -- events --------------------------------------------------------------------------

    def push(self, when: float, kind: str, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, payload))

    def run(self) -> None:
        handlers: dict[str, Callable[[object], None]] = {
            "arrive": self._arrive,
            "finish": self._finish,
            "tick": self._tick,
            "notice": self._notice,
            "detach": self._detach,
        }
        next_sample = 0.0 if self.sample_every else math.inf
        sampled = (0, 0.0)
        while self.events and self.events[0][0] <= self.end:
            when = self.events[0][0]
            while next_sample <= when:
                sampled = self._sample(next_sample, sampled)
                next_sample += self.sample_every or math.inf
            self._advance(when)
            while self.events and self.events[0][0] == when:
                _, _, kind, payload = heapq.heappop(self.events)
                handlers[kind](payload)
            began = time.perf_counter()
            self._dispatch()
            self.pass_s += time.perf_counter() - began
        self._advance(self.end)
        while next_sample <= self.end:
            sampled = self._sample(next_sample, sampled)
            next_sample += self.sample_every or math.inf

    def _sample(self, at: float, before: tuple[int, float]) -> tuple[int, float]:
        """Record the queue as the last pass left it; returns the pass counters."""
        held = {INFERENCE: 0, TRAINING: 0}
        for name in self.running:
            job = self.jobs[name]
            held[job.tenant] += job.held
        waiting = {INFERENCE: 0, TRAINING: 0}
        waiting_gpus = {INFERENCE: 0, TRAINING: 0}
        reasons: dict[str, int] = {}
        for name in self.waiting:
            job = self.jobs[name]
            waiting[job.tenant] += 1
            waiting_gpus[job.tenant] += job.gpus
            reason = self.reasons.get(name, "not looked at yet")
            reasons[reason] = reasons.get(reason, 0) + 1
        offered = sum(
            j.gpus
            for j in self.jobs.values()
            if j.tenant == TRAINING and j.arrival <= at < j.arrival + j.duration
        )
        self.samples.append(
            Sample(
                at,
                held,
                self.pool.free_usable(),
                waiting,
                waiting_gpus,
                reasons,
                offered,
                self.passes - before[0],
                self.pass_s - before[1],
            )
        )
        return self.passes, self.pass_s

    def _advance(self, when: float) -> None:
        self.area += self.pool.allocated * (when - self.last)
        self.last = when
        self.now = when

    def _arrive(self, payload: object) -> None:
        self.waiting.add(str(payload))

    def _tick(self, _: object) -> None:
        """Services follow the diurnal curve of the inference tenant's demand."""
        s = self.s
        phase = (1 - math.cos(2 * math.pi * (self.now % DAY_S) / DAY_S)) / 2
        target = self.guarantee[INFERENCE] * (s.low + (s.high - s.low) * phase)
        services = [self.jobs[name] for name in self.services]
        current = sum(j.gpus for j in services)
        while current + s.inference_node <= target:
            self.inference_seq += 1
            job = Job(
                f"nodes/i{self.inference_seq}",
                INFERENCE,
                self.now,
                [s.inference_node],
                math.inf,
                10,
            )
            self.jobs[job.name] = job
            self.waiting.add(job.name)
            self.services.add(job.name)
            current += job.gpus
        for job in sorted(services, key=lambda j: (j.state == "running", -j.arrival)):
            if current - job.gpus < target:
                break
            self._end(job)
            current -= job.gpus
        self.push(self.now + TICK_S, "tick", None)

    def _finish(self, payload: object) -> None:
        name, version = payload  # type: ignore[misc]
        job = self.jobs[name]
        if job.state == "running" and job.version == version:
            self._progress(job)
            self._end(job)

    def _end(self, job: Job) -> None:
        self.services.discard(job.name)
        self.running.discard(job.name)
        self.reasons.pop(job.name, None)
        if job.state == "waiting":
            self.waiting.discard(job.name)
        elif job.state == "running":
            for node in list(job.nodes):
                self._let_go(job, node, ())
            self._discharge(job, job.gpus if job.held == 0 else job.held, len(job.nodes) or 1)
        job.state = "done"
        job.finished = self.now
        job.nodes.clear()
        job.held = 0

    def _let_go(self, job: Job, node: str, gpus: tuple[str, ...]) -> int:
        host = self.pool.nodes[node].host
        leaving = self.pool.let_go(node, gpus)
        if node not in self.pool.nodes:
            job.nodes.remove(node)
        self.push(self.now + self.s.detach_s, "detach", (host, leaving))
        return len(leaving)

    def _detach(self, payload: object) -> None:
        host, gpus = payload  # type: ignore[misc]
        self.pool.detached(host, gpus)

    # -- tenants -----------------------------------------------------------------------------

    def _charge(self, job: Job, borrowed: bool) -> None:
        tenant = self.tenants[job.tenant]
        tenant.usage.CopyFrom(
            charged(tenant.usage, ["H100"] * job.gpus, nodes=len(job.members), borrowed=borrowed)
        )

    def _discharge(self, job: Job, gpus: int, nodes: int) -> None:
        tenant = self.tenants[job.tenant]
        tenant.usage.CopyFrom(
            charged(tenant.usage, ["H100"] * gpus, -1, nodes=nodes, borrowed=job.borrowed)
        )

    # -- progress ------------------------------------------------------------------------------

    def _progress(self, job: Job) -> None:
        job.work -= job.held * (self.now - job.since)
        job.since = self.now

    def _schedule_finish(self, job: Job) -> None:
        job.version += 1
        if math.isfinite(job.work) and job.held:
            self.push(self.now + max(job.work, 0.0) / job.held, "finish", (job.name, job.version))

    # -- the dispatcher ------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """One pass over the waiting jobs in queue order, as the broker's dispatcher
        makes it (admit what fits, reclaim for a service within its guarantee, keep the
        GPUs promised to a reclaiming service, pause lending meanwhile)."""
        if not self.waiting:
            return
        self.passes += 1
        # A tenant whose quota refuses even one GPU more admits nothing this pass.
        blocked = {
            name
            for name, record in self.tenants.items()
            if breach(name, record, ["H100"]) is not None
        }
        waiting = [self.jobs[n] for n in self.waiting]
        for job in waiting:
            if job.tenant in blocked:
                self.reasons[job.name] = "quota"
        waiting = [j for j in waiting if j.tenant not in blocked]
        if not waiting:
            return
        order = ordered(j.entry for j in waiting)
        state = PassState(
            paused=self.loaning_on
            and any(
                j.tenant == INFERENCE and (j.awaiting_until > self.now or self._reclaiming(j))
                for j in waiting
            ),
            lent_out=self.loaning_on and any(self.jobs[n].borrowed for n in self.running),
        )
        for entry in order:
            self.reasons[entry.name] = self._serve(self.jobs[entry.name], state)
            if not self.reasons[entry.name]:
                del self.reasons[entry.name]

    def _serve(self, job: Job, state: PassState) -> str:
        """Start ``job``, or have it reclaim, or leave it waiting; returns why it waits
        ("" when it started)."""
        record = self.tenants[job.tenant]
        if job.awaiting_until > self.now:
            state.promised += job.gpus
            return "its victims are letting go"
        free = self.pool.free_usable() - state.promised
        if free < job.gpus and not state.lent_out:
            return "capacity (fewer GPUs free)"  # and nothing to take back
        terms = state.terms.get((job.tenant, job.gpus))
        if terms is None:
            terms = state.terms[(job.tenant, job.gpus)] = loaning.terms(record, job.gpus)
        reclaim = self.loaning_on and terms.within_guarantee and state.lent_out
        if free < job.gpus and not reclaim:
            return "capacity (fewer GPUs free)"
        quota_key = (job.tenant, job.gpus, len(job.members))
        over = state.over_quota.get(quota_key)
        if over is None:
            over = state.over_quota[quota_key] = (
                breach(job.tenant, record, ["H100"] * job.gpus, nodes=len(job.members)) is not None
            )
        if over:
            return "quota"
        if terms.borrowed and state.paused:
            return "lending paused"
        shape = tuple(job.members)
        if free >= job.gpus and shape not in state.failed:
            self.decisions += 1
            self.placements += 1
            placements = self.pool.place([PlacementRequest("", n) for n in job.members])
            if placements is not None:
                self._start(job, placements, terms.borrowed)
                state.terms.clear()
                state.over_quota.clear()
                return ""
            state.failed.add(shape)
        ask = (job.tenant, job.priority, shape)
        if reclaim and ask not in state.unplannable:
            if self._reclaim(job):
                state.promised += job.gpus
                job.reclaimed = True
                return "its victims are letting go"
            state.unplannable.add(ask)
        return "capacity (no placement)"

    def _reclaiming(self, job: Job) -> bool:
        """An inference service within its guarantee that waits for capacity pauses
        lending (as ``QueueStatus.reclaiming`` does)."""
        if not self.loaning_on or job.tenant != INFERENCE:
            return False
        return loaning.terms(self.tenants[INFERENCE], job.gpus).within_guarantee

    def _start(self, job: Job, placements: list[object], borrowed: bool) -> None:
        self.waiting.discard(job.name)
        self.running.add(job.name)
        job.state = "running"
        job.borrowed = borrowed
        job.started = job.since = self.now
        if job.first_start is None:
            job.first_start = self.now
        for placement in placements:
            self.node_seq += 1
            node = f"{job.name}/{self.node_seq}"
            self.pool.commit(node, placement)  # type: ignore[arg-type]
            job.nodes.append(node)
            self.node_job[node] = job.name
        job.held = job.gpus
        self._charge(job, borrowed)
        self._schedule_finish(job)

    def _holders(self) -> list[Holder]:
        holders = []
        for job in (self.jobs[name] for name in sorted(self.running)):
            if not job.borrowed or job.noticed:
                continue
            hours = job.held * (self.now - job.started) / 3600.0
            nodes = tuple(
                self.pool.held_node(n, hours / max(len(job.nodes), 1), job.elastic_min)
                for n in job.nodes
            )
            name = job.nodes[0] if len(job.nodes) == 1 else f"gangs/{job.name}"
            holders.append(Holder(name, job.tenant, job.priority, nodes))
        return holders

    def _reclaim(self, job: Job) -> bool:
        ask = Ask(
            tuple(PlacementRequest("", n) for n in job.members), job.tenant, job.priority, True
        )
        self.decisions += 1
        self.plans += 1
        found = plan(ask, self._holders(), self.pool.snapshot(), self.pool.latency)
        if found is None:
            return False
        for cut in found.cuts:
            victim = self.jobs[self.node_job[cut.node]]
            victim.noticed = True
            self.push(self.now + self.s.grace_s, "notice", (cut.node, cut.gpus))
        job.awaiting_until = self.now + self.s.grace_s + self.s.detach_s
        return True

    def _notice(self, payload: object) -> None:
        node, gpus = payload  # type: ignore[misc]
        job_name = self.node_job.get(node)
        job = self.jobs[job_name] if job_name else None
        if job is None or job.state != "running" or node not in job.nodes:
            return
        job.noticed = False
        self._progress(job)
        if gpus and len(gpus) < job.held:
            self._let_go(job, node, tuple(gpus))
            job.held -= len(gpus)
            self._discharge(job, len(gpus), 0)
            self.shrinks += 1
            self._schedule_finish(job)
            return
        # the whole job goes: a gang loses every member
        since = self.now - job.started
        lost = job.held * (since % self.s.checkpoint_s)
        self.lost += lost
        job.work += lost
        self.preempted_jobs += 1
        self.preempted_nodes += len(job.nodes)
        held = job.held
        for member in list(job.nodes):
            self._let_go(job, member, ())
        self._discharge(job, held, len(job.members))
        job.held = 0
        job.nodes.clear()
        job.state = "waiting"
        job.version += 1
        self.running.discard(job.name)
        self.waiting.add(job.name)

    # -- figures ---------------------------------------------------------------------------------

    def figures(self, trace: str, wall_s: float) -> Figures:
        delays: dict[str, list[float]] = {INFERENCE: [], TRAINING: []}
        never: dict[str, int] = {INFERENCE: 0, TRAINING: 0}
        jct = []
        finished = 0
        reclaim_waits = []
        for job in self.jobs.values():
            if job.arrival > self.end:
                continue
            if job.first_start is None:
                never[job.tenant] += 1
                continue
            delays[job.tenant].append(job.first_start - job.arrival)
            if job.reclaimed:
                reclaim_waits.append(job.first_start - job.arrival)
            if job.tenant == TRAINING and job.finished is not None:
                finished += 1
                jct.append(job.finished - job.arrival)
        return Figures(
            "loaning" if self.loaning_on else "hard quotas",
            trace,
            self.end / DAY_S,
            self.area / (self.pool.capacity * self.end) if self.end else 0.0,
            delays,
            never,
            jct,
            finished,
            self.preempted_jobs,
            self.preempted_nodes,
            self.shrinks,
            self.lost / 3600.0,
            reclaim_waits,
            wall_s,
            self.decisions,
            self.passes,
            self.placements,
            self.plans,
            self.pass_s,
            self.samples,
        )


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered_values = sorted(values)
    return ordered_values[min(len(ordered_values) - 1, int(q * len(ordered_values)))]


def hm(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def table(results: list[Figures]) -> str:
    header = (
        "| trace | mode | GPU util | inference wait p50/p99 | training wait p50/p99 "
        "| training JCT p50 | jobs done | preempted jobs (nodes) | shrinks | GPU-h lost "
        "| guarantee back p50/p99/max (n) |"
    )
    lines = [header, "|" + "---|" * 11]
    for f in results:
        back = f.reclaim_waits
        lines.append(
            f"| {f.trace} | {f.mode} | {100 * f.utilisation:.1f}% "
            f"| {hm(pct(f.delays[INFERENCE], 0.5))} / {hm(pct(f.delays[INFERENCE], 0.99))} "
            f"| {hm(pct(f.delays[TRAINING], 0.5))} / {hm(pct(f.delays[TRAINING], 0.99))} "
            f"| {hm(statistics.median(f.jct)) if f.jct else '-'} | {f.finished} "
            f"| {f.preempted_jobs} ({f.preempted_nodes}) | {f.shrinks} | {f.lost_gpu_hours:.1f} "
            f"| {hm(pct(back, 0.5))} / {hm(pct(back, 0.99))} / {hm(max(back, default=0))} "
            f"({len(back)}) |"
        )
    return "\n".join(lines)


def timeline(figures: Figures) -> str:
    """The samples of one run as a table: where the queue stood, and why."""
    lines = [
        f"{figures.trace}, {figures.mode}: the queue over time",
        "| t | held inference/training | free | offered training | waiting inference/"
        "training (training GPUs) | why training waits | passes | pass time |",
        "|" + "---|" * 8,
    ]
    for sample in figures.samples:
        why = ", ".join(f"{n} {r}" for r, n in sorted(sample.reasons.items(), key=lambda i: -i[1]))
        lines.append(
            f"| {hm(sample.at)} | {sample.held[INFERENCE]}/{sample.held[TRAINING]} "
            f"| {sample.free} | {sample.offered} | {sample.waiting[INFERENCE]}/"
            f"{sample.waiting[TRAINING]} ({sample.waiting_gpus[TRAINING]}) | {why or '-'} "
            f"| {sample.passes} | {sample.pass_s:.1f}s |"
        )
    return "\n".join(lines)


def run_trace(
    name: str,
    jobs: list[TraceJob],
    settings: Settings,
    days: float,
    start_day: float = 0.0,
    sample_every: float | None = None,
) -> list[Figures]:
    """Replay the jobs arriving in ``days`` days from ``start_day`` (arrivals shifted to
    start there, on an empty pool), once with hard quotas and once with loaning;
    ``sample_every`` seconds, the queue is sampled (:class:`Sample`)."""
    end = days * DAY_S
    start = start_day * DAY_S
    window = [
        TraceJob(j.arrival_s - start, j.duration_s, j.gpus)
        for j in jobs
        if start <= j.arrival_s <= start + end
    ]
    results = []
    for loaning_on in (False, True):
        began = time.perf_counter()
        replay = Replay(window, settings, loaning_on=loaning_on, end=end, sample_every=sample_every)
        replay.run()
        figures = replay.figures(name, time.perf_counter() - began)
        results.append(figures)
        print(
            f"{name} {figures.mode}: {len(window)} jobs, {figures.passes} passes "
            f"({figures.pass_s:.0f}s), {figures.placements} placements, {figures.plans} "
            f"preemption plans, {figures.wall_s:.0f}s; never started: {figures.never_started}",
            file=sys.stderr,
            flush=True,
        )
        if figures.samples:
            print(timeline(figures), file=sys.stderr, flush=True)
    return results


def mean_demand(jobs: list[TraceJob], compress: float, window_s: float) -> float:
    """GPUs the jobs keep busy on average over ``window_s`` with arrivals ``compress``
    times closer together, if every job started on arrival."""
    busy = 0.0
    for job in jobs:
        arrival = job.arrival_s / compress
        if arrival < window_s:
            busy += max(job.gpus, 1) * min(job.duration_s, window_s - arrival)
    return busy / window_s


def compression(jobs: list[TraceJob], target: float, window_s: float) -> float:
    """The compression of arrivals that keeps ``target`` GPUs busy on average over the
    window (found by bisection; at least 1)."""
    low, high = 1.0, 10_000.0
    if mean_demand(jobs, low, window_s) >= target:
        return low
    for _ in range(60):
        middle = (low * high) ** 0.5
        if mean_demand(jobs, middle, window_s) < target:
            low = middle
        else:
            high = middle
    return high


def openb_density(folder: Path, target: float, window_s: float) -> tuple[int, float]:
    """How many copies of the openb pods, and how much their arrivals are compressed,
    so that started on arrival they would keep ``target`` GPUs busy on average over the
    window, compressing no more than to fit the trace's span into the window."""
    single = openb(folder, 1.0)
    span = max(job.arrival_s for job in single)
    most = max(1.0, span / window_s)
    for copies in range(1, 65):
        jobs = openb(folder, 1.0, copies)
        if mean_demand(jobs, most, window_s) >= target:
            return copies, compression(jobs, target, window_s)
    return 64, most


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", choices=["philly", "openb", "both"], default="both")
    parser.add_argument("--traces", default=None, help="the trace folder")
    parser.add_argument("--days", type=float, default=14.0, help="replay window")
    parser.add_argument(
        "--philly-start",
        type=float,
        default=20.0,
        help="day of the Philly trace the window starts (its first 19 days hold 70 jobs)",
    )
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--inference-share", type=float, default=0.5)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--detach", type=float, default=10.0)
    parser.add_argument("--checkpoint", type=float, default=1800.0)
    parser.add_argument(
        "--openb-load",
        type=float,
        default=1.0,
        help="openb arrivals are compressed so that, started on arrival, its jobs would "
        "keep this share of the training guarantee busy on average over the window",
    )
    parser.add_argument(
        "--timeline",
        type=float,
        default=None,
        metavar="HOURS",
        help="every HOURS of the replay's clock, print where the queue stands and why "
        "its jobs wait (to stderr)",
    )
    args = parser.parse_args(argv)
    sample_every = args.timeline * 3600.0 if args.timeline else None
    try:
        folder = traces_dir(args.traces)
    except TraceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = Settings(
        gpus=args.gpus,
        inference_share=args.inference_share,
        grace_s=args.grace,
        detach_s=args.detach,
        checkpoint_s=args.checkpoint,
    )
    results: list[Figures] = []
    if args.trace in ("philly", "both"):
        results += run_trace(
            "philly", philly(folder), settings, args.days, args.philly_start, sample_every
        )
    if args.trace in ("openb", "both"):
        target = args.openb_load * args.gpus * (1 - args.inference_share)
        copies, compress = openb_density(folder, target, args.days * DAY_S)
        print(f"openb: {copies} copies, arrivals compressed x{compress:.1f}", file=sys.stderr)
        jobs = openb(folder, compress, copies)
        results += run_trace(
            f"openb {copies}x, x{compress:.0f}", jobs, settings, args.days, 0.0, sample_every
        )
    print(
        f"pool {args.gpus} GPUs (hosts of 16 slots), inference guaranteed "
        f"{args.inference_share:.0%}, services of 2 GPUs following 25%..90% of it over a day; "
        f"grace {args.grace:g}s, detach {args.detach:g}s, checkpoints every {args.checkpoint:g}s; "
        f"window {args.days:g} days"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
