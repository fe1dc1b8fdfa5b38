"""A pool of real processes for chaos runs: etcd, brokers and host agents on a sim fabric.

:class:`ChaosPool` starts an etcd cluster (:class:`dxpool.store.embedded.EtcdCluster`), creates a
simulated fabric (``SimFabric.create``), starts ``broker_count`` brokers
(``python -m dxpool.broker``, the process ``dxpool broker`` runs), registers the boxes
through the broker API (``dxpool.client.Client.create_box``) and starts one host agent
per host (``python -m dxpool.hostagent --driver sim``), all on loopback with short
liveness TTLs. Agents reach the pool only through the brokers' agent ports, every
broker's, each agent starting with another one, so killing a broker moves agents over.
Every process is a :class:`ManagedProcess`, which faults kill, pause and restart.

Brokers get the box side of the fabric (``--fabric sim:DIR``), which their leader uses
to fence the GPUs of lost hosts. Extra broker arguments can come from
``$DXPOOL_CHAOS_BROKER_ARGS`` (shell words).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.client import Client
from dxpool.fabric.sim import LOCK_FILE, SimFabric, SimGpuSpec
from dxpool.store.client import connect
from dxpool.store.embedded import EtcdCluster, free_ports
from dxpool.store.keys import KeySchema

GPU_MODEL = "H100"
GPU_MEMORY_MIB = 81920
LOG_TAIL_BYTES = 4000
# A refused connection puts a channel into gRPC's reconnect backoff (1 s, growing): poll
# a starting broker at the interval wait_serving sleeps instead.
POLL_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def die_with_parent() -> list[str]:
    """A command prefix that makes a child get SIGKILL when the thread that started it
    ends (``setpriv --pdeathsig``; it execs, so the pid stays the child's), so a run that
    is itself killed leaves no etcd, broker or agent behind. Empty where setpriv is
    missing. Start children only from threads that outlive them."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


@dataclass(frozen=True)
class PoolConfig:
    """Shape and timing of the pool. Defaults keep CPU use modest on two cores."""

    boxes: int = 2
    gpus_per_box: int = 8
    hosts: int = 4
    slots_per_host: int = 8
    brokers: int = 2
    etcd_members: int = 1
    lease_ttl_s: float = 2.0
    # After a leader change or an etcd outage the leader waits this long for agents to
    # reconnect before it declares a host lost: short, so the fencing bound holds.
    reconnect_grace_s: float = 2.0
    attach_timeout_s: float = 8.0
    map_delay_s: float = 0.05
    resync_interval_s: float = 2.0
    prefix: str = "/dxpool-chaos/"

    @property
    def total_gpus(self) -> int:
        return self.boxes * self.gpus_per_box


class ManagedProcess:
    """A child process that can be SIGKILLed, SIGSTOPped, resumed and started again with
    the same command line. Output goes to ``log_path`` (appended across restarts).

    The child gets SIGKILL when the thread that started it ends (see
    :func:`die_with_parent`).

    ``down`` is True from :meth:`kill` or :meth:`pause` until :meth:`start` or
    :meth:`resume`: a process that is not running while not ``down`` has died by itself.
    """

    def __init__(self, name: str, args: list[str], log_path: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.down = False
        self.paused = False
        self.starts = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts + 1}: {shlex.join(self.args)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [*die_with_parent(), *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        self.starts += 1
        self.down = False
        self.paused = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def kill(self) -> None:
        """SIGKILL and reap (a paused process dies too)."""
        self.down = True
        self.paused = False
        if self.running:
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP: the process keeps its sockets and leases but does nothing. Returns once
        every thread of it has stopped: the signal is asynchronous, and a thread still
        running could, for instance, take a lock its caller is about to release."""
        if self.running:
            assert self.process is not None
            self.process.send_signal(signal.SIGSTOP)
            self.paused = True
            self.down = True
            deadline = time.monotonic() + timeout_s
            while not _all_threads_stopped(self.process.pid):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not stop within {timeout_s:g}s")
                time.sleep(0.001)

    def resume(self) -> None:
        if self.running and self.paused:
            assert self.process is not None
            self.process.send_signal(signal.SIGCONT)
        self.paused = False
        self.down = False

    def terminate(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (after SIGCONT), then SIGKILL."""
        self.down = True
        if not self.running:
            return
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, size: int = LOG_TAIL_BYTES) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[-size:].decode(errors="replace")


class Broker(ManagedProcess):
    """One ``python -m dxpool.broker`` on fixed loopback ports: the public one and the
    agent port."""

    def __init__(
        self, name: str, args: list[str], log_path: Path, port: int, agent_port: int
    ) -> None:
        super().__init__(name, args, log_path)
        self.port = port
        self.agent_port = agent_port

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def agent_endpoint(self) -> str:
        return f"127.0.0.1:{self.agent_port}"

    def wait_serving(self, timeout_s: float = 30.0) -> None:
        """Wait until gRPC health says SERVING; RuntimeError if the process exits."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.endpoint, options=POLL_CHANNEL_OPTIONS) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if not self.running:
                    raise RuntimeError(f"broker {self.name} exited:\n{self.log_tail()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"broker {self.name} not serving after {timeout_s}s")


class Agent(ManagedProcess):
    """One ``python -m dxpool.hostagent`` for host ``host`` (an id, not ``hosts/...``)."""

    def __init__(self, name: str, args: list[str], log_path: Path, host: str) -> None:
        super().__init__(name, args, log_path)
        self.host = host


def broker_fabric_args(state_dir: Path) -> list[str]:
    """Arguments that give a broker the fabric's box side, plus
    ``$DXPOOL_CHAOS_BROKER_ARGS``."""
    return [
        "--fabric",
        f"sim:{state_dir}",
        *shlex.split(os.environ.get("DXPOOL_CHAOS_BROKER_ARGS", "")),
    ]


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T) or gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for task in tasks:
        try:
            state = (task / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


class ChaosPool:
    """The processes and the fabric of one chaos run, under ``root``."""

    def __init__(self, root: Path, config: PoolConfig) -> None:
        self.root = root
        self.config = config
        self.schema = KeySchema(config.prefix)
        self.etcd = EtcdCluster(
            config.etcd_members, root / "etcd", unsafe_no_fsync=True, launcher=die_with_parent()
        )
        self.fabric_dir = root / "fabric"
        self.fabric: SimFabric | None = None
        self.brokers: list[Broker] = []
        self.agents: list[Agent] = []

    @property
    def box_ids(self) -> list[str]:
        return [f"box{i}" for i in range(self.config.boxes)]

    @property
    def host_ids(self) -> list[str]:
        return [f"h{i}" for i in range(self.config.hosts)]

    @property
    def endpoints(self) -> list[str]:
        return [broker.endpoint for broker in self.brokers]

    def processes(self) -> list[ManagedProcess]:
        return [*self.brokers, *self.agents]

    def start(self) -> ChaosPool:
        cfg = self.config
        self.root.mkdir(parents=True, exist_ok=True)
        self.etcd.start()
        spec = SimGpuSpec(GPU_MODEL, GPU_MEMORY_MIB)
        self.fabric = SimFabric.create(
            self.fabric_dir,
            boxes={box: [spec] * cfg.gpus_per_box for box in self.box_ids},
            hosts={host: cfg.slots_per_host for host in self.host_ids},
        )
        ports = free_ports(2 * cfg.brokers)
        for index in range(cfg.brokers):
            self.brokers.append(self._broker(index, ports[2 * index], ports[2 * index + 1]))
        for broker in self.brokers:
            broker.start()
        for broker in self.brokers:
            broker.wait_serving()
        with Client(self.brokers[0].endpoint, timeout_s=10) as client:
            for index, box in enumerate(self.box_ids):
                client.create_box(
                    box,
                    gpus=cfg.gpus_per_box,
                    model=GPU_MODEL,
                    memory_mib=GPU_MEMORY_MIB,
                    location=("s1", "p1", f"r{index % 2}"),
                )
        for index, host in enumerate(self.host_ids):
            agent = self._agent(host, rack=f"r{index % 2}")
            self.agents.append(agent)
            agent.start()
        self.wait_hosts_alive(self.host_ids)
        return self

    def _broker(self, index: int, port: int, agent_port: int) -> Broker:
        args = [
            sys.executable,
            "-m",
            "dxpool.broker",
            "--etcd",
            self.etcd.endpoints,
            "--prefix",
            self.config.prefix,
            "--listen",
            f"127.0.0.1:{port}",
            "--agent-listen",
            f"127.0.0.1:{agent_port}",
            "--host-reconnect-grace",
            f"{self.config.reconnect_grace_s:g}s",
            "--attach-timeout",
            str(self.config.attach_timeout_s),
            "--log-level",
            "WARNING",
            "--insecure",
            *broker_fabric_args(self.fabric_dir),
        ]
        return Broker(f"broker{index}", args, self.root / f"broker{index}.log", port, agent_port)

    def _agent(self, host: str, rack: str) -> Agent:
        cfg = self.config
        brokers = [b.agent_endpoint for b in self.brokers]  # each agent spreads itself
        args = [
            sys.executable,
            "-m",
            "dxpool.hostagent",
            "--host",
            host,
            "--broker",
            ",".join(brokers),
            "--driver",
            "sim",
            "--sim-state",
            str(self.fabric_dir),
            "--slots",
            str(cfg.slots_per_host),
            "--site",
            "s1",
            "--pod",
            "p1",
            "--rack",
            rack,
            "--lease-ttl",
            str(cfg.lease_ttl_s),
            "--map-delay",
            str(cfg.map_delay_s),
            "--resync-interval",
            str(cfg.resync_interval_s),
            "--backoff-max",
            "2",
            "--startup-timeout",
            "600",
            # A killed and restarted agent takes its live session over, as in production.
            "--state-dir",
            str(self.root / f"agent-{host}-state"),
            "--log-level",
            "WARNING",
        ]
        return Agent(f"agent-{host}", args, self.root / f"agent-{host}.log", host)

    @contextlib.contextmanager
    def fabric_quiet(self) -> Iterator[None]:
        """Hold the simulated fabric's exclusive lock for the block.

        Pause an agent inside it: a process stopped while it holds the lock would freeze
        the whole simulated fabric (every host and the checker), which a frozen host
        cannot do to real proxies. ``pause`` returns only once every thread has stopped,
        so none can take the lock between the SIGSTOP and the release here (a stopped
        process has to run to take it).
        """
        fd = os.open(self.fabric_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def agent(self, host: str) -> Agent:
        return next(a for a in self.agents if a.host == host)

    @contextlib.contextmanager
    def etcd_client(self) -> Iterator[Any]:
        client = connect(self.etcd.endpoints, timeout_s=3.0, retry_after_s=0.2)
        try:
            yield client
        finally:
            client.close()

    def wait_hosts_alive(self, hosts: list[str], timeout_s: float = 60.0) -> None:
        """Wait until every host in ``hosts`` has its liveness record (its agent holds a
        session with a broker)."""
        deadline = time.monotonic() + timeout_s
        with self.etcd_client() as client:
            while time.monotonic() < deadline:
                try:
                    alive = [
                        h for h in hosts if client.get(self.schema.host_lease(h))[0] is not None
                    ]
                except Exception:
                    alive = []
                if len(alive) == len(hosts):
                    return
                time.sleep(0.2)
        raise RuntimeError(f"hosts {hosts} did not all register within {timeout_s}s")

    def sessions_on(self, broker: Broker) -> list[str]:
        """The hosts whose liveness record names ``broker`` (its agent's session is
        there). A broker's id is ``HOST/PID/RANDOM``; an unreadable etcd gives none."""
        pid = broker.pid
        if pid is None:
            return []
        held = []
        try:
            with self.etcd_client() as client:
                for host in self.host_ids:
                    value = client.get(self.schema.host_lease(host))[0]
                    if value is not None and f"/{pid}/" in pb.HostLiveness.FromString(value).broker:
                        held.append(host)
        except Exception:
            return []
        return held

    def stop(self) -> None:
        """Stop every process, agents first, then brokers, then etcd."""
        for process in [*self.agents, *self.brokers]:
            process.terminate()
        self.etcd.stop()


__all__ = ["Agent", "Broker", "ChaosPool", "ManagedProcess", "PoolConfig"]
