"""Faults a chaos run injects, each a small class with ``inject`` and ``heal``.

Every fault records when it was injected and healed and when the pool had recovered
from it (:class:`FaultRecord`), so the report can say how long recovery took:

=====================  ==================================================  =====================
kind                   inject / heal                                       recovered when
=====================  ==================================================  =====================
``broker_kill``        SIGKILL the broker holding the most agent sessions  a compose is
                       / start it again on its port                        acknowledged by it
``agent_kill``         SIGKILL a host agent / start it again               a node pinned to the
                                                                           host is READY
``agent_partition``    SIGSTOP an agent for longer than its lease TTL      the host's GPUs are
                       (a host that is lost, then comes back) / SIGCONT    fenced (``fenced_s``)
                                                                           and reclaimed; a
                                                                           pinned node is READY
                                                                           after SIGCONT
``etcd_kill``          SIGKILL an etcd member (a follower in a 3-member    a compose is
                       cluster; the only member otherwise) / restart it    acknowledged
``etcd_leader_kill``   SIGKILL the etcd leader (3 members) / restart it    a compose is
                                                                           acknowledged
``stalled_watch``      open WatchNodes streams that are never read /       a fresh watch on the
                       cancel them                                         broker delivers its
                                                                           events while they
                                                                           are still stalled
``cancel_watches``     open and cancel WatchNodes streams in a burst       a fresh watch
                                                                           delivers its events
=====================  ==================================================  =====================

Recovery times count from injection. ``broker_kill`` counts until the killed broker
itself acknowledges a compose (the other broker serves meanwhile); it also reports
``agents_moved_s`` (every agent the broker held has a session on another broker) and
``victim_host_ready_s`` (a node pinned to one of those hosts is READY: its agent's
status writes go through the broker that stays), and raises ``NOT_RECOVERED`` when one
of those hosts' nodes became LOST - a broker kill must never lose a host; ``agent_kill``
composes a node pinned to the host after the restart and counts until it is READY.
``stalled_watch`` also reports ``watch_after_heal_s``. ``agent_partition`` also reports
``lease_lost_s``, ``fenced_s`` (no live node, no attaching/attached/detaching GPU, no
box-side mapping left on the host) and ``reclaimed_s`` (every GPU the host held when it
stopped is FREE or was given to a node again), and raises ``FENCE_TIMEOUT`` when the
host is not fenced within the fencing bound after etcd dropped its lease, while its agent
is stopped. Before stopping the agent it composes a node pinned to the host, so there is
always something to fence.
"""

from __future__ import annotations

import abc
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import grpc

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.client import Client
from dxpool.errors import DxpoolError
from dxpool.store.embedded import EtcdCluster
from tests.chaos.harness import ChaosPool
from tests.chaos.invariants import (
    UNFENCED_GPU_STATES,
    EtcdSnapshot,
    FabricSnapshot,
    Kind,
    Violation,
    check_fenced,
)
from tests.chaos.workload import OpLog, code_name

PROBE_TIMEOUT_S = 45.0


@dataclass
class FaultRecord:
    """One injected fault. Times are ``time.monotonic()``; ``marks`` holds extra
    milestones (e.g. ``fenced``) as seconds after injection."""

    kind: str
    target: str
    injected_at: float = 0.0
    healed_at: float | None = None
    recovered_at: float | None = None
    marks: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.injected_at

    def mark(self, name: str, at: float) -> None:
        self.marks.setdefault(name, round(at - self.injected_at, 3))

    def to_json(self, start: float) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "injected_s": round(self.injected_at - start, 3),
            "healed_s": None if self.healed_at is None else round(self.healed_at - start, 3),
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 3),
            **{f"{name}_s": value for name, value in sorted(self.marks.items())},
            "notes": self.notes,
        }


@dataclass
class FaultContext:
    """What faults share with the run: the pool, the client log, the fencing bound, the
    monitor's latest snapshot, and where to report violations found outside the
    monitor's own checks."""

    pool: ChaosPool
    log: OpLog
    fence_bound_s: float
    latest: Callable[[], EtcdSnapshot | None]
    report: Callable[[list[Violation]], None]


class Fault(abc.ABC):
    """Inject, hold for :attr:`hold_s`, heal; :meth:`observe` sees every snapshot the
    monitor takes until the fault has recovered, and may report violations."""

    kind: ClassVar[str]

    def __init__(self, ctx: FaultContext, rng: random.Random) -> None:
        self.ctx = ctx
        self.rng = rng
        self.record = FaultRecord(self.kind, "")
        self.hold_s = 1.0
        self._threads: list[threading.Thread] = []

    @abc.abstractmethod
    def inject(self) -> None: ...

    @abc.abstractmethod
    def heal(self) -> None: ...

    def observe(
        self, snap: EtcdSnapshot, fabric: FabricSnapshot | None, now: float
    ) -> list[Violation]:
        """Called by the monitor with each snapshot; default: nothing to check."""
        return []

    @property
    def done(self) -> bool:
        """Healed and recovered (no further observation needed)."""
        return self.record.healed_at is not None and self.record.recovered_at is not None

    def _background(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=f"{self.kind}-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


# -- probes ------------------------------------------------------------------------------------


def probe_pinned_ready(
    ctx: FaultContext, host: str, *, timeout_s: float = PROBE_TIMEOUT_S, release: bool = True
) -> tuple[float | None, str | None]:
    """Compose a 1-GPU node pinned to ``host`` until one is READY; release it unless
    asked not to. Returns (when it was READY, its name), (None, None) on timeout."""
    deadline = time.monotonic() + timeout_s
    endpoints = ctx.pool.endpoints
    attempt = 0
    while time.monotonic() < deadline:
        endpoint = endpoints[attempt % len(endpoints)]
        attempt += 1
        request_id = f"probe-{host}-{random.getrandbits(48):012x}"
        with Client(endpoint, timeout_s=5.0, max_attempts=2) as client:
            try:
                node = client.compose_node("H100:1", host=host, request_id=request_id)
            except DxpoolError as error:
                ctx.log.failure("probe_compose", error)
                time.sleep(0.5)
                continue
            ctx.log.result("probe_compose", "OK")
            ctx.log.ack(node.name, endpoint, request_id)
            ready_at: float | None = None
            try:
                got = client.wait_for_node(
                    node.name,
                    until=("READY", "FAILED", "LOST", "RELEASING", "RELEASED"),
                    timeout_s=max(0.5, deadline - time.monotonic()),
                )
                if got.state == pb.NODE_STATE_READY:
                    ready_at = time.monotonic()
                    ctx.log.became_ready(got)
                ctx.log.result("probe_wait", pb.NodeState.Name(got.state))
            except TimeoutError:
                ctx.log.result("probe_wait", "TIMEOUT")
            except DxpoolError as error:
                ctx.log.failure("probe_wait", error, node.name)
            if release or ready_at is None:
                release_until_done(ctx, node.name)
            if ready_at is not None:
                return ready_at, node.name
    return None, None


def release_until_done(ctx: FaultContext, name: str, timeout_s: float = 30.0) -> bool:
    """ReleaseNode on any broker until one accepts it."""
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while time.monotonic() < deadline:
        endpoint = ctx.pool.endpoints[attempt % len(ctx.pool.endpoints)]
        attempt += 1
        with Client(endpoint, timeout_s=5.0, max_attempts=2) as client:
            try:
                client.release_node(name)
            except DxpoolError as error:
                ctx.log.failure("probe_release", error, name)
                time.sleep(0.5)
                continue
        ctx.log.result("probe_release", "OK")
        ctx.log.release(name)
        return True
    return False


def probe_watch(endpoint: str, timeout_s: float = 5.0) -> bool:
    """A fresh WatchNodes stream delivers its first event within ``timeout_s``."""
    with grpc.insecure_channel(endpoint) as channel:
        call = nodes_pb2_grpc.NodeServiceStub(channel).WatchNodes(
            nodes_pb2.WatchNodesRequest(), timeout=timeout_s
        )
        try:
            for _event in call:
                return True
            return True  # an empty pool ends no stream; reaching here means it answered
        except grpc.RpcError:
            return False
        finally:
            call.cancel()  # type: ignore[no-untyped-call]


# -- process faults ------------------------------------------------------------------------


class BrokerKill(Fault):
    """SIGKILL the broker that holds the most agent sessions, so the agents must move:
    their hosts stay alive, and a node composed on one of them becomes READY through the
    broker that stays."""

    kind = "broker_kill"

    def inject(self) -> None:
        pool = self.ctx.pool
        held = {b.name: pool.sessions_on(b) for b in pool.brokers}
        most = max(len(hosts) for hosts in held.values())
        self.broker = self.rng.choice([b for b in pool.brokers if len(held[b.name]) == most])
        self.hosts = held[self.broker.name]
        self.record.target = f"{self.broker.name} ({len(self.hosts)} agents)"
        self.hold_s = self.rng.uniform(1.0, 3.0)
        before = self.ctx.latest()  # nodes LOST already are not this kill's doing
        self.lost: set[str] = {
            name
            for name, node in (before.nodes.items() if before is not None else ())
            if node.value.state == pb.NODE_STATE_LOST
        }
        self.record.injected_at = time.monotonic()
        self.broker.kill()
        if self.hosts:
            self._background(self._follow_agents, "agents")

    def _follow_agents(self) -> None:
        """Wait for the victim's agents to hold sessions elsewhere, then for a node on
        one of their hosts to become READY."""
        pool = self.ctx.pool
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while time.monotonic() < deadline:
            others = [b for b in pool.brokers if b is not self.broker and b.running]
            moved = {h for b in others for h in pool.sessions_on(b)}
            if set(self.hosts) <= moved:
                self.record.mark("agents_moved", time.monotonic())
                break
            time.sleep(0.2)
        else:
            self.record.notes.append("the killed broker's agents did not all move")
        ready_at, _ = probe_pinned_ready(self.ctx, self.rng.choice(self.hosts))
        if ready_at is not None:
            self.record.mark("victim_host_ready", ready_at)
        else:
            self.record.notes.append("no node on the killed broker's hosts became READY")

    def heal(self) -> None:
        self.broker.start()
        self.broker.wait_serving()
        self.record.healed_at = time.monotonic()

    def observe(
        self, snap: EtcdSnapshot, fabric: FabricSnapshot | None, now: float
    ) -> list[Violation]:
        if self.record.healed_at is not None and self.record.recovered_at is None:
            at = self.ctx.log.first_ack_after(self.record.healed_at, self.broker.endpoint)
            if at is not None:
                self.record.recovered_at = at
        lost = {
            name
            for name, node in snap.nodes.items()
            if node.value.state == pb.NODE_STATE_LOST
            and node.value.host.removeprefix("hosts/") in self.hosts
            and name not in self.lost
        }
        self.lost |= lost
        return [
            Violation(
                Kind.NOT_RECOVERED,
                name,
                f"{name}, on a host whose agent was on {self.broker.name}, became LOST after "
                "the broker was killed: its agent did not reach another broker in time",
                snap.revision,
            )
            for name in sorted(lost)
        ]


class AgentKill(Fault):
    kind = "agent_kill"

    def inject(self) -> None:
        self.agent = self.rng.choice(self.ctx.pool.agents)
        self.record.target = self.agent.name
        # Sometimes shorter than the lease TTL (the host never looks lost), sometimes longer.
        self.hold_s = self.rng.uniform(0.5, 2.5 * self.ctx.pool.config.lease_ttl_s)
        self.record.injected_at = time.monotonic()
        self.agent.kill()

    def heal(self) -> None:
        self.agent.start()
        self.record.healed_at = time.monotonic()
        self._background(self._probe, "probe")

    def _probe(self) -> None:
        ready_at, _ = probe_pinned_ready(self.ctx, self.agent.host)
        if ready_at is not None:
            self.record.recovered_at = ready_at
        else:
            self.record.notes.append("no node pinned to the host became READY after restart")


class AgentPartition(Fault):
    """SIGSTOP an agent past its lease: the host is lost while its process (and its view
    of the world) survives, then comes back as a possible zombie.

    A thread of its own polls the host's liveness key, so the fencing deadline counts
    from the moment etcd really dropped the lease (etcd may keep a lease longer, e.g.
    across a leader change), not from a guess. The fencing check runs once: on the first
    monitor snapshot past the deadline, or else just before SIGCONT, the heal waiting
    for the deadline if the lease went late. A lease etcd never dropped is noted, not
    reported: the broker cannot know the host is gone.
    """

    kind = "agent_partition"

    def __init__(self, ctx: FaultContext, rng: random.Random) -> None:
        super().__init__(ctx, rng)
        self.victim: str | None = None
        # GPUs on the host when it stopped -> their generation then.
        self.held: dict[str, int] = {}
        self.lease_lost_at: float | None = None
        self.fence_checked = False
        self._fence_lock = threading.Lock()
        self._resuming = threading.Event()

    def _pick_host(self) -> str:
        snap = self.ctx.latest()
        load = dict.fromkeys(self.ctx.pool.host_ids, 0)
        if snap is not None:
            for record in snap.gpus.values():
                host = record.value.host.removeprefix("hosts/")
                if host in load and record.value.state in UNFENCED_GPU_STATES:
                    load[host] += 1
        most = max(load.values())
        return self.rng.choice(sorted(h for h, n in load.items() if n == most))

    @property
    def host(self) -> str:
        return f"hosts/{self.agent.host}"

    def inject(self) -> None:
        ctx = self.ctx
        host = self._pick_host()
        self.agent = ctx.pool.agent(host)
        self.record.target = self.agent.name
        self.hold_s = ctx.pool.config.lease_ttl_s + ctx.fence_bound_s + 2.0
        _, self.victim = probe_pinned_ready(ctx, host, timeout_s=15.0, release=False)
        if self.victim is None:
            self.record.notes.append("could not place a READY node on the host before the stop")
        snap = ctx.latest()
        with ctx.pool.fabric_quiet():
            self.record.injected_at = time.monotonic()
            self.agent.pause()
        self._background(self._watch_lease, "lease")
        if snap is not None:
            self._hold(
                snap,
                {
                    name
                    for name, r in snap.gpus.items()
                    if r.value.host == self.host and r.value.state in UNFENCED_GPU_STATES
                },
            )
            self._hold(snap, self._victim_gpus(snap))

    def _watch_lease(self) -> None:
        key = self.ctx.pool.schema.host_lease(self.agent.host)
        with self.ctx.pool.etcd_client() as client:
            while not self._resuming.wait(0.2):
                try:
                    present = client.get(key)[0] is not None
                except Exception:
                    continue  # etcd unreachable: unknown, ask again
                if not present:
                    self.lease_lost_at = time.monotonic()
                    self.record.mark("lease_lost", self.lease_lost_at)
                    return

    def _hold(self, snap: EtcdSnapshot, names: set[str]) -> None:
        for name in names - self.held.keys():
            gpu = snap.gpu(name)
            if gpu is not None:
                self.held[name] = gpu.generation

    def _victim_gpus(self, snap: EtcdSnapshot | None) -> set[str]:
        if snap is None or self.victim is None:
            return set()
        node = snap.node(self.victim)
        return {b.gpu for b in node.gpus} if node is not None else set()

    def _deadline(self) -> float | None:
        lost = self.lease_lost_at
        return None if lost is None else lost + self.ctx.fence_bound_s

    def heal(self) -> None:
        deadline = self._deadline()
        if deadline is None:
            self.record.notes.append(
                f"etcd kept the host's lease for the whole stop "
                f"({time.monotonic() - self.record.injected_at:.1f}s); fencing not checked"
            )
        else:
            time.sleep(max(0.0, deadline + 0.5 - time.monotonic()))
            self._check_fence_now()
        self._resuming.set()
        self.agent.resume()
        self.record.healed_at = time.monotonic()
        self._background(self._after_heal, "after-heal")

    def _claim_fence_check(self) -> bool:
        """True for the one caller that gets to run the fencing check."""
        with self._fence_lock:
            if self.fence_checked:
                return False
            self.fence_checked = True
            return True

    def _check_fence_now(self) -> None:
        """The fencing check on a fresh read, for when no monitor snapshot came after the
        deadline (a slow read while etcd elected a leader)."""
        if not self._claim_fence_check():
            return
        assert self.ctx.pool.fabric is not None
        try:
            with self.ctx.pool.etcd_client() as client:
                snap = EtcdSnapshot.read(client, self.ctx.pool.schema)
            fabric = FabricSnapshot.read(self.ctx.pool.fabric)
        except Exception as error:
            self.record.notes.append(f"fencing not checked: etcd unreadable ({error!r})")
            return
        if fabric is None:
            self.record.notes.append("fencing not checked: the fabric kept changing")
            return
        self.ctx.report(self._fence_violations(snap, fabric))

    def _fence_violations(self, snap: EtcdSnapshot, fabric: FabricSnapshot) -> list[Violation]:
        lost = self.lease_lost_at or snap.taken_at
        return check_fenced(snap, fabric, self.host, snap.taken_at - lost)

    def _after_heal(self) -> None:
        if self.victim is not None:
            release_until_done(self.ctx, self.victim)
        ready_at, _ = probe_pinned_ready(self.ctx, self.agent.host)
        if ready_at is not None:
            self.record.mark("host_back", ready_at)
        else:
            self.record.notes.append("no node pinned to the host became READY after SIGCONT")

    def observe(
        self, snap: EtcdSnapshot, fabric: FabricSnapshot | None, now: float
    ) -> list[Violation]:
        record = self.record
        if not record.injected_at or snap.taken_at < record.injected_at:
            return []
        self._hold(snap, self._victim_gpus(snap))
        # Fenced counts only while the host is lost: once its agent is back, its GPUs may
        # legitimately be attached to it again.
        lost = self.host not in snap.leases and not self._resuming.is_set()
        if lost and fabric is not None and not check_fenced(snap, fabric, self.host, 0.0):
            record.mark("fenced", snap.taken_at)
        if self.held and self._reclaimed(snap):
            record.mark("reclaimed", snap.taken_at)
        if "reclaimed" in record.marks and "host_back" in record.marks:
            record.recovered_at = record.injected_at + max(
                record.marks["reclaimed"], record.marks["host_back"]
            )
        elif not self.held and "host_back" in record.marks:
            record.recovered_at = record.injected_at + record.marks["host_back"]
        deadline = self._deadline()
        if (
            fabric is not None
            and deadline is not None
            and snap.taken_at >= deadline
            and not self._resuming.is_set()
            and self._claim_fence_check()
        ):
            return self._fence_violations(snap, fabric)
        return []

    def _reclaimed(self, snap: EtcdSnapshot) -> bool:
        """Every held GPU is FREE, or was given out again since (a new generation, on
        any host: it went through FREE in between)."""
        for name, generation in self.held.items():
            gpu = snap.gpu(name)
            if gpu is None or gpu.state == pb.GPU_STATE_FREE or gpu.generation > generation:
                continue
            return False
        return True


class EtcdKill(Fault):
    """Kill an etcd member: a follower of three, or the only member (a full outage)."""

    kind = "etcd_kill"
    leader = False

    def inject(self) -> None:
        cluster = self.ctx.pool.etcd
        size = len(cluster.members)
        leader = _leader_index(cluster)
        if size == 1:
            self.index = 0
        elif self.leader:
            self.index = leader if leader is not None else self.rng.randrange(size)
        else:
            self.index = self.rng.choice([i for i in range(size) if i != leader])
        self.record.target = cluster.members[self.index].name + (
            " (leader)" if self.index == leader else ""
        )
        self.hold_s = self.rng.uniform(1.0, 3.0)
        self.record.injected_at = time.monotonic()
        cluster.members[self.index].kill()

    def heal(self) -> None:
        self.ctx.pool.etcd.members[self.index].start(timeout_s=30.0)
        self.record.healed_at = time.monotonic()

    def observe(
        self, snap: EtcdSnapshot, fabric: FabricSnapshot | None, now: float
    ) -> list[Violation]:
        record = self.record
        # With one member nothing commits until it is back: count from the restart, so a
        # compose acknowledged just after the kill (committed before it) does not count.
        since = record.injected_at if len(self.ctx.pool.etcd.members) > 1 else record.healed_at
        if record.recovered_at is None and since:
            at = self.ctx.log.first_ack_after(since)
            if at is not None:
                record.recovered_at = at
        return []


def _leader_index(cluster: EtcdCluster) -> int | None:
    """Which member leads, as the live members report it; None while none does."""
    try:
        return cluster.members.index(cluster.leader(timeout_s=2.0))
    except RuntimeError:
        return None


class EtcdLeaderKill(EtcdKill):
    kind = "etcd_leader_kill"
    leader = True


# -- watch faults ----------------------------------------------------------------------------


class StalledWatch(Fault):
    """WatchNodes clients that open a stream and never read it (a hung orchestrator).

    Recovered when, with the stalled streams still open, a fresh watch on the same broker
    delivers its events: one stuck client must not stall the broker for the others. After
    the heal a second probe checks the cancelled streams gave their watch slots back.
    """

    kind = "stalled_watch"
    streams = 8

    def inject(self) -> None:
        broker = self.rng.choice(self.ctx.pool.brokers)
        self.endpoint = broker.endpoint
        self.record.target = broker.name
        self.hold_s = self.rng.uniform(6.0, 10.0)
        self.record.injected_at = time.monotonic()
        self.channels = [grpc.insecure_channel(self.endpoint) for _ in range(self.streams)]
        self.calls = [
            nodes_pb2_grpc.NodeServiceStub(channel).WatchNodes(nodes_pb2.WatchNodesRequest())
            for channel in self.channels
        ]
        self._background(self._probe_during, "probe")

    def _probe_during(self) -> None:
        time.sleep(1.0)  # let the stalled streams fill their windows first
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while time.monotonic() < deadline:
            if probe_watch(self.endpoint):
                self.record.recovered_at = time.monotonic()
                return
            if self.record.healed_at is None:
                self.record.notes.append("a fresh watch failed while other streams stalled")
            time.sleep(0.5)
        self.record.notes.append("no watch on the broker delivered events")

    def heal(self) -> None:
        for call in self.calls:
            call.cancel()  # type: ignore[no-untyped-call]
        for channel in self.channels:
            channel.close()
        self.record.healed_at = time.monotonic()
        self._background(self._probe_after, "probe-after")

    def _probe_after(self) -> None:
        time.sleep(0.5)
        if probe_watch(self.endpoint):
            self.record.mark("watch_after_heal", time.monotonic())
        else:
            self.record.notes.append("no watch delivered events after the stalled ones ended")


class CancelWatches(Fault):
    """A burst of WatchNodes streams cancelled mid-flight, some before the first read.
    Recovered when a fresh watch on the broker delivers its events afterwards."""

    kind = "cancel_watches"
    rounds = 60

    def inject(self) -> None:
        broker = self.rng.choice(self.ctx.pool.brokers)
        self.endpoint = broker.endpoint
        self.record.target = broker.name
        self.hold_s = 0.0
        self.record.injected_at = time.monotonic()
        with grpc.insecure_channel(self.endpoint) as channel:
            stub = nodes_pb2_grpc.NodeServiceStub(channel)
            for round_ in range(self.rounds):
                call = stub.WatchNodes(nodes_pb2.WatchNodesRequest(), timeout=5.0)
                try:
                    if round_ % 2:
                        next(iter(call), None)
                except grpc.RpcError as error:
                    self.record.notes.append(f"watch {round_}: {code_name(error)}")
                call.cancel()  # type: ignore[no-untyped-call]
                time.sleep(0.02)

    def heal(self) -> None:
        self.record.healed_at = time.monotonic()
        self._background(self._probe, "probe")

    def _probe(self) -> None:
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while time.monotonic() < deadline:
            if probe_watch(self.endpoint):
                self.record.recovered_at = time.monotonic()
                return
            time.sleep(0.5)
        self.record.notes.append("no watch on the broker delivered events after the burst")


FAULTS: dict[str, type[Fault]] = {
    cls.kind: cls
    for cls in (
        BrokerKill,
        AgentKill,
        AgentPartition,
        EtcdKill,
        EtcdLeaderKill,
        StalledWatch,
        CancelWatches,
    )
}


def fault_kinds(etcd_members: int) -> list[str]:
    """The kinds a pool of that etcd size can suffer (leader kill needs three members)."""
    return [kind for kind in FAULTS if etcd_members > 1 or kind != "etcd_leader_kill"]


__all__ = ["FAULTS", "Fault", "FaultContext", "FaultRecord", "fault_kinds"]
