"""A fleet of simulated host agents against several brokers: what a connected agent costs.

Starts a private etcd (fsync on), ``--brokers`` broker processes (plaintext, insecure
mode: the authorization path is covered by the test suite, not measured here) and
``--workers`` fleet processes, which connect ``--agents`` simulated agents in all, each
over a connection of its own to the brokers' agent ports (it knows all and tries them
in its host's order, as ``dxpool agent`` does: ``broker_order``). A simulated agent
speaks the agent service as
``dxpool agent`` does: a hello, a heartbeat every interval the broker asks for (a third
of the default 10 s liveness TTL), and, for every spec the broker pushes, a ReportStatus
that claims the spec's GPUs ATTACHED on that spec's revision; on a broken session it
tries the next broker with exponential backoff and jitter. It has no hardware and no
reconcile loop: what is measured is the brokers' side.

Then, measuring each broker process's CPU (share of one core) and RSS:

1. **connect**: until every agent holds a session;
2. **idle**: ``--seconds`` with every agent connected and heartbeating;
3. **churn**: ``--seconds`` while ``--churn`` of the agents (1%) change state every
   second: this process writes their hosts' spec records into etcd as a compose would,
   the brokers push them, the agents report the new status (an etcd write each);
4. **broker kill**: SIGKILL the first broker; the time until every agent holds a
   session again (through the others, which take the liveness records over), the
   fewest live hosts seen meanwhile (the killed broker's records go when its lease
   expires and come back as its agents reconnect), and the hellos the other brokers
   refused meanwhile, by reason (``BROKER_BUSY``: more than ``MAX_OPENING`` at once).

Prints the figures; ``bench/RESULTS.md`` records them. Everything shares the machine:
etcd, the brokers and the fleet processes (which cost far more CPU than the brokers,
since each simulated agent is a Python coroutine with its own connection).

``--ttl`` sets the agents' liveness TTL (heartbeats every third of it); on a small,
shared machine a longer one keeps the fleet processes from starving the brokers.

Usage: python bench/agent_fleet.py [--agents 12500] [--brokers 3] [--workers 4] [--ramp 1000]
       [--seconds 30] [--churn 0.01] [--ttl 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from etcd3 import transactions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from bench.broker_metrics import broker_samples
from dxpool.api.v1 import agent_pb2, agent_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.hostagent.link import broker_order
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, free_ports
from dxpool.store.keys import KeySchema

PREFIX = "/dxpool-fleet/"
KEYS = KeySchema(PREFIX)
ATTACHED = pb.ATTACHMENT_PHASE_ATTACHED
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0


def host_id(index: int) -> str:
    return f"h{index:05d}"


# -- the fleet process -------------------------------------------------------------------


@dataclass
class Fleet:
    """The agents of one fleet process and what they saw."""

    total: int
    connected: int = 0
    sessions: int = 0
    reports: int = 0
    stale: int = 0
    report_ms: list[float] = field(default_factory=list)
    all_connected_at: float | None = None

    def emit(self, **values: Any) -> None:
        print(json.dumps(values), flush=True)

    def session_started(self) -> None:
        self.connected += 1
        self.sessions += 1
        if self.connected == self.total:
            self.all_connected_at = time.monotonic()
            self.emit(all_connected_at=self.all_connected_at, sessions=self.sessions)

    def session_ended(self) -> None:
        if self.connected == self.total:
            self.emit(dropped_at=time.monotonic())
        self.connected -= 1


def status_for(spec: agent_pb2.HostSpec) -> pb.HostStatus:
    return pb.HostStatus(
        attachments=[
            pb.ObservedAttachment(
                gpu=a.gpu, generation=a.generation, phase=ATTACHED, host_slot=a.host_slot
            )
            for a in spec.allocation.attachments
        ]
    )


async def report(
    stub: agent_pb2_grpc.AgentServiceStub,
    host: str,
    session: str,
    spec: agent_pb2.HostSpec,
    fleet: Fleet,
) -> None:
    started = time.perf_counter()
    try:
        await stub.ReportStatus(
            agent_pb2.ReportStatusRequest(
                host=f"hosts/{host}",
                session=session,
                status=status_for(spec),
                spec_revision=spec.spec_revision,
            ),
            timeout=30,
        )
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
            fleet.stale += 1
        return
    fleet.reports += 1
    fleet.report_ms.append((time.perf_counter() - started) * 1000)


async def session(
    channel: grpc.aio.Channel, host: str, token: str, ttl_ms: int, fleet: Fleet
) -> None:
    """One session, from hello to its end (returns when the broker ends it, raises on
    errors)."""
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    call = stub.Connect()
    await call.write(
        agent_pb2.ConnectRequest(
            hello=agent_pb2.AgentHello(
                host=pb.Host(name=f"hosts/{host}", slot_capacity=8),
                token=token,
                liveness_ttl_ms=ttl_ms,
                status_known=True,  # a simulated agent keeps no status of its own
            )
        )
    )
    first = await asyncio.wait_for(call.read(), 60)
    if first is grpc.aio.EOF or first.WhichOneof("kind") != "welcome":  # type: ignore[attr-defined]
        raise ConnectionError("no welcome")
    welcome = first.welcome
    interval = welcome.heartbeat_interval_ms / 1000
    fleet.session_started()

    async def beat() -> None:
        sequence = 0
        await asyncio.sleep(random.uniform(0, interval))  # spread the fleet's heartbeats
        while True:
            sequence += 1
            await call.write(
                agent_pb2.ConnectRequest(heartbeat=agent_pb2.AgentHeartbeat(sequence=sequence))
            )
            await asyncio.sleep(interval)

    beating = asyncio.create_task(beat())
    reports: set[asyncio.Task[None]] = set()
    try:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:  # type: ignore[attr-defined]
                return
            if message.WhichOneof("kind") == "spec" and message.spec.HasField("allocation"):
                task = asyncio.create_task(report(stub, host, welcome.session, message.spec, fleet))
                reports.add(task)
                task.add_done_callback(reports.discard)
    finally:
        beating.cancel()
        fleet.session_ended()


async def agent(index: int, brokers: list[str], ttl_ms: int, fleet: Fleet) -> None:
    host = host_id(index)
    token = f"fleet-{host}-{random.getrandbits(48):x}"
    order = broker_order(f"hosts/{host}", brokers)
    failures = 0
    attempt = 0
    while True:
        endpoint = order[attempt % len(order)]
        attempt += 1
        channel = grpc.aio.insecure_channel(
            endpoint, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        started = time.monotonic()
        try:
            await session(channel, host, token, ttl_ms, fleet)
        except (grpc.aio.AioRpcError, ConnectionError, TimeoutError):
            pass
        finally:
            await channel.close()
        failures = 0 if time.monotonic() - started > 1.0 else failures + 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2**failures) if failures else 0.0
        await asyncio.sleep(backoff + random.uniform(0, 0.5))


async def run_fleet(first: int, count: int, brokers: list[str], rate: float, ttl_ms: int) -> None:
    """``count`` agents from ``first`` on, started at ``rate`` a second; reports what
    they see every 2 s on stdout, and ends when its parent does."""
    parent = os.getppid()
    fleet = Fleet(total=count)

    async def emit_progress() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(2.0)
            samples, fleet.report_ms = fleet.report_ms, []
            fleet.emit(
                connected=fleet.connected,
                sessions=fleet.sessions,
                reports=fleet.reports,
                stale=fleet.stale,
                report_ms=[round(ms, 2) for ms in samples],
            )

    progress = asyncio.create_task(emit_progress())
    tasks = []
    for offset in range(count):
        tasks.append(asyncio.create_task(agent(first + offset, brokers, ttl_ms, fleet)))
        if offset % 50 == 49:
            await asyncio.sleep(50 / rate)
    await progress


# -- the measuring process ----------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Usage:
    cpu: float  # share of one core
    rss_mib: float


def usage_over(pids: list[int], seconds: float) -> list[Usage]:
    before = [cpu_seconds(pid) for pid in pids]
    time.sleep(seconds)
    return [
        Usage((cpu_seconds(pid) - cpu) / seconds, rss_mib(pid))
        for pid, cpu in zip(pids, before, strict=True)
    ]


class Worker:
    """One fleet process and the latest line it printed."""

    def __init__(self, args: list[str], log: Path) -> None:
        with open(log, "ab") as errors:
            self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=errors, text=True)
        self.latest: dict[str, Any] = {}
        self.report_ms: list[float] = []
        self.all_connected: list[float] = []
        self.dropped: list[float] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            values = json.loads(line)
            if "all_connected_at" in values:
                self.all_connected.append(values["all_connected_at"])
            elif "dropped_at" in values:
                self.dropped.append(values["dropped_at"])
            else:
                self.latest = values
                self.report_ms.extend(values.get("report_ms", []))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def wait_for(
    what: str,
    condition: Callable[[], bool],
    timeout_s: float,
    progress: Callable[[], str] | None = None,
) -> float:
    started = time.monotonic()
    shown = started
    while not condition():
        now = time.monotonic()
        if now - started > timeout_s:
            raise RuntimeError(f"not within {timeout_s:g}s: {what}")
        if progress is not None and now - shown >= 15:
            print(f"  {now - started:5.0f} s: {progress()}", flush=True)
            shown = now
        time.sleep(0.1)
    return time.monotonic() - started


def fleet_progress(workers: list[Worker]) -> Callable[[], str]:
    def describe() -> str:
        connected = sum(w.latest.get("connected", 0) for w in workers)
        sessions = sum(w.latest.get("sessions", 0) for w in workers)
        return f"{connected} agents in session, {sessions} sessions opened"

    return describe


def live_hosts(client: Any) -> int:
    return sum(1 for _ in client.get_prefix(KEYS.collection("hostleases"), keys_only=True))


def churn(client: Any, agents: int, share: float, seconds: float, stop: threading.Event) -> int:
    """Every second, write the spec of ``share`` of the hosts (round robin), as composes
    and releases would: one GPU wanted, then none; in transactions of up to 25 records,
    so a slow etcd does not hold the rate back. Returns the records written."""
    per_second = max(1, round(agents * share))
    written = 0
    turn = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop.is_set():
        began = time.monotonic()
        puts = []
        for _ in range(per_second):
            index = turn % agents
            host = host_id(index)
            spec = pb.HostAllocation(host=f"hosts/{host}")
            if (turn // agents) % 2 == 0:
                spec.attachments.add(
                    gpu=f"boxes/b{index:05d}/gpus/0", host_slot=0, node=f"nodes/n-{host}",
                    generation=turn // agents + 1,
                )  # fmt: skip
            puts.append(transactions.Put(KEYS.host_allocation(host), spec.SerializeToString()))
            turn += 1
        for start in range(0, len(puts), 25):
            client.transaction(compare=[], success=puts[start : start + 25], failure=[])
        written += len(puts)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
    return written


def status_writes(metrics_port: int) -> float:
    try:
        samples = broker_samples(metrics_port)
    except OSError:
        return 0.0
    return sum(
        s.value
        for s in samples
        if s.name == "dxpool_agent_status_writes_total" and s.labels.get("result") == "OK"
    )


def refusals(metrics_ports: list[int]) -> dict[str, float]:
    """Hellos the brokers on ``metrics_ports`` refused so far, by reason."""
    counts: dict[str, float] = {}
    for port in metrics_ports:
        try:
            samples = broker_samples(port)
        except OSError:
            continue
        for s in samples:
            if s.name == "dxpool_agent_sessions_refused_total":
                reason = s.labels.get("reason", "")
                counts[reason] = counts.get(reason, 0.0) + s.value
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=12_500)
    parser.add_argument("--brokers", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--churn", type=float, default=0.01, help="share changing per second")
    parser.add_argument(
        "--ramp", type=float, default=1000.0, help="new sessions a second while connecting"
    )
    parser.add_argument(
        "--ttl", type=float, default=0.0, help="agents' liveness TTL, s (0: the broker's default)"
    )
    parser.add_argument("--fleet", nargs=5, help=argparse.SUPPRESS)  # FIRST COUNT BROKERS RATE TTL
    args = parser.parse_args()
    if args.brokers < 2 and not args.fleet:
        parser.error("--brokers must be at least 2: one is killed, the others take its agents")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
    if args.fleet:
        first, count, brokers, rate, ttl_ms = args.fleet
        asyncio.run(run_fleet(int(first), int(count), brokers.split(","), float(rate), int(ttl_ms)))
        return

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # so everything started is stopped

    signal.signal(signal.SIGTERM, interrupted)
    measure(args)


Brokers = list[tuple[subprocess.Popen[bytes], str, int]]


def start_brokers(count: int, etcd: str, work: Path) -> Brokers:
    """``count`` broker processes, each with its agent endpoint and metrics port."""
    brokers = []
    for index in range(count):
        port, agent_port, metrics_port = free_ports(3)
        with open(work / f"broker{index}.log", "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "dxpool.broker", "--etcd", etcd,
                 "--prefix", PREFIX, "--listen", f"127.0.0.1:{port}",
                 "--agent-listen", f"127.0.0.1:{agent_port}", "--insecure",
                 "--metrics-port", str(metrics_port), "--log-level", "WARNING"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        brokers.append((process, f"127.0.0.1:{agent_port}", metrics_port))
    for _, endpoint, _ in brokers:
        channel = grpc.insecure_channel(endpoint)
        grpc.channel_ready_future(channel).result(timeout=60)
        channel.close()
    return brokers


def kill_and_reconnect(
    victim: subprocess.Popen[bytes], workers: list[Worker], client: Any
) -> tuple[float, int]:
    """SIGKILL ``victim``; seconds until every agent is in session again, and the fewest
    live hosts seen meanwhile."""
    fewest = [live_hosts(client)]
    watching = threading.Event()

    def watch_hosts() -> None:
        while not watching.is_set():
            fewest.append(live_hosts(client))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_hosts)
    watcher.start()
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    try:
        wait_for(
            "every agent back in session",
            lambda: all(any(t > killed_at for t in w.all_connected) for w in workers),
            600,
            fleet_progress(workers),
        )
    finally:
        watching.set()
        watcher.join()
    back = max(min(t for t in w.all_connected if t > killed_at) for w in workers)
    return back - killed_at, min(fewest)


def print_usage(name: str, values: list[Usage], first: int = 0) -> None:
    for index, use in enumerate(values, start=first):
        print(f"{name:6} broker{index}  CPU {use.cpu * 100:5.1f}%  RSS {use.rss_mib:7.1f} MiB")


def start_fleet(
    agents: int, count: int, brokers: Brokers, work: Path, ramp: float, ttl_s: float
) -> list[Worker]:
    """``count`` fleet processes sharing ``agents`` agents, starting ``ramp`` sessions a
    second in all."""
    agent_ports = ",".join(endpoint for _, endpoint, _ in brokers)
    share = -(-agents // count)
    workers = []
    for index in range(count):
        first, size = index * share, min(share, agents - index * share)
        rate, ttl_ms = str(ramp / count), str(round(ttl_s * 1000))
        command = [sys.executable, __file__, "--fleet", str(first), str(size), agent_ports]
        command += [rate, ttl_ms]
        workers.append(Worker(command, work / f"fleet{index}.log"))
    return workers


def measure_churn(
    args: argparse.Namespace,
    brokers: Brokers,
    workers: list[Worker],
    client: Any,
    stop: threading.Event,
) -> tuple[list[Usage], int, float]:
    """The brokers' usage while ``args.churn`` of the hosts change state every second;
    the spec records written and the status writes the brokers stored."""
    before = sum(status_writes(port) for _, _, port in brokers)
    for worker in workers:
        worker.report_ms.clear()
    churned: list[int] = []
    writer = threading.Thread(
        target=lambda: churned.append(churn(client, args.agents, args.churn, args.seconds, stop))
    )
    writer.start()
    busy = usage_over([process.pid for process, _, _ in brokers], args.seconds)
    writer.join()
    time.sleep(2)  # the last reports land
    writes = sum(status_writes(port) for _, _, port in brokers) - before
    return busy, churned[0], writes


def connect_fleet(
    args: argparse.Namespace, brokers: Brokers, work: Path, workers: list[Worker]
) -> tuple[float, float, int]:
    """Start the fleet (into ``workers``) and wait until every agent holds a session;
    the seconds that took, the brokers' CPU ms meanwhile and the sessions opened."""
    pids = [process.pid for process, _, _ in brokers]
    cpu_at_start = sum(cpu_seconds(pid) for pid in pids)
    began = time.monotonic()
    workers += start_fleet(args.agents, args.workers, brokers, work, args.ramp, args.ttl)
    ttl = f"{args.ttl:g} s" if args.ttl else "the default"
    print(
        f"{args.agents} agents, {args.brokers} brokers, {args.workers} fleet processes, "
        f"liveness TTL {ttl}, ramp {args.ramp:g} sessions/s"
    )
    wait_for(
        "every agent in session",
        lambda: all(w.all_connected for w in workers),
        900,
        fleet_progress(workers),
    )
    connect_s = time.monotonic() - began
    opened = max(args.agents, sum(w.latest.get("sessions", 0) for w in workers))
    return connect_s, (sum(cpu_seconds(pid) for pid in pids) - cpu_at_start) * 1000, opened


def measure_kill(
    brokers: Brokers, workers: list[Worker], client: Any
) -> tuple[float, int, dict[str, float]]:
    """Kill the first broker: the seconds until every agent is back in session, the
    fewest live hosts meanwhile and the hellos the others refused, by reason."""
    survivors = [port for _, _, port in brokers[1:]]
    refused_before = refusals(survivors)
    back_s, fewest = kill_and_reconnect(brokers[0][0], workers, client)
    refused = {
        reason: count - refused_before.get(reason, 0.0)
        for reason, count in refusals(survivors).items()
    }
    return back_s, fewest, refused


def measure(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="dxpool-fleet-"))
    etcd = EmbeddedEtcd(work / "etcd").start()
    brokers: Brokers = []
    workers: list[Worker] = []
    client = connect(etcd.endpoint, timeout_s=30)
    stop = threading.Event()
    try:
        brokers = start_brokers(args.brokers, etcd.endpoint, work)
        pids = [process.pid for process, _, _ in brokers]
        connect_s, connect_cpu_ms, opened = connect_fleet(args, brokers, work, workers)
        assert live_hosts(client) == args.agents
        idle = usage_over(pids, args.seconds)
        busy, churned, writes = measure_churn(args, brokers, workers, client, stop)
        reports = sorted(ms for w in workers for ms in w.report_ms)
        back_s, fewest, refused = measure_kill(brokers, workers, client)
        after = usage_over(pids[1:], args.seconds)
        fleet_cpu = usage_over([w.process.pid for w in workers], 5)
        print()
        print(f"connect         all {args.agents} agents in session after {connect_s:.1f} s")
        print(
            f"                brokers' CPU {connect_cpu_ms / 1000:.1f} s in all meanwhile, "
            f"{connect_cpu_ms / max(1, opened):.2f} ms per session opened (n={opened})"
        )
        print_usage("idle", idle)
        print_usage("churn", busy)
        print(
            f"churn           {churned / args.seconds:.0f} spec changes/s written, "
            f"{writes / args.seconds:.0f} status writes/s stored; ReportStatus "
            f"p50 {quantile(reports, 0.5):.1f} ms, p99 {quantile(reports, 0.99):.1f} ms "
            f"(n={len(reports)})"
        )
        print(f"broker kill     every agent back in session after {back_s:.2f} s")
        print(f"                fewest live hosts seen meanwhile: {fewest} of {args.agents}")
        shown = ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(refused.items()))
        print(f"                hellos the others refused meanwhile: {shown or 'none'}")
        print_usage("after", after, first=1)
        cpu = ", ".join(f"{u.cpu * 100:.0f}%" for u in fleet_cpu)
        print(f"fleet processes CPU {cpu} (RSS {sum(u.rss_mib for u in fleet_cpu):.0f} MiB)")
        print(f"logs: {work}")
    finally:
        stop.set()
        for worker in workers:
            worker.stop()
        for process, _, _ in brokers:
            if process.poll() is None:
                process.terminate()
                process.wait(30)
        client.close()
        etcd.stop()


if __name__ == "__main__":
    main()
