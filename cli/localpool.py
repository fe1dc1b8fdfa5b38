"""The embedded default pool behind ``dxpool up``: everything on one machine.

:class:`LocalPool` runs, in this order: a private etcd in ``<data-dir>/etcd``, a simulated
fabric in ``<data-dir>/fabric``, a broker in this process, and one host agent process per
host (``python -m dxpool.hostagent``, logs in ``<data-dir>/logs``); then it registers the
boxes through the client and waits until every host's agent is alive.

Hosts ``h1..hN`` and boxes ``box1..boxM`` are spread over the racks of one site, two racks
per pod, host ``hI`` and box ``boxI`` sharing rack ``rI``; so a host reaches one box through
its rack switch, another through the pod switch and the rest through the site switch, and
placement has latencies to choose between.

Restarting on the same data directory is safe: etcd keeps the inventory, the fabric keeps
its mappings, and registering a box that exists is not an error. ``stop`` is idempotent
and leaves no process behind: agents get SIGTERM (SIGKILL after a grace period), then the
broker and etcd stop.
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
from dxpool.client import Client
from dxpool.defaults import DEFAULT_ENDPOINT
from dxpool.errors import AlreadyExists, InvalidArgument, Unavailable
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import DEFAULT_PREFIX

if TYPE_CHECKING:
    from dxpool.broker.server import BrokerServer

log = logging.getLogger(__name__)

DEFAULT_LISTEN = DEFAULT_ENDPOINT
SITE = "dc1"
RACKS_PER_POD = 2
AGENT_STOP_GRACE_S = 10.0


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

    def __post_init__(self) -> None:
        for name in ("boxes", "gpus_per_box", "hosts", "slots", "gpu_memory_mib"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be 1 or more, got {getattr(self, name)}")
        if self.attach_delay_s < 0:
            raise InvalidArgument(f"attach delay must be 0 or more, got {self.attach_delay_s}")

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


@dataclass
class _Agent:
    host: str
    process: subprocess.Popen[bytes]
    log_path: Path
    reported_exit: bool = False


@dataclass
class LocalPool:
    """Starts and stops the pool described by ``spec``; see the module docstring."""

    spec: LocalPoolSpec
    python: str = sys.executable
    _etcd: EmbeddedEtcd | None = field(default=None, init=False)
    _broker: BrokerServer | None = field(default=None, init=False)
    _agents: list[_Agent] = field(default_factory=list, init=False)
    _endpoint: str = field(default="", init=False)

    @property
    def endpoint(self) -> str:
        """The broker's address once started."""
        return self._endpoint

    @property
    def logs_dir(self) -> Path:
        return self.spec.data_dir / "logs"

    def start(self) -> LocalPool:
        """Start everything; on any failure stop what was started and re-raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from dxpool.broker.server import BrokerConfig, BrokerServer

        spec = self.spec
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._etcd = EmbeddedEtcd(spec.data_dir / "etcd", log_path=self.logs_dir / "etcd.log")
        self._etcd.start()
        log.info("etcd started", extra={"endpoint": self._etcd.endpoint})
        fabric_dir = self._install_fabric()
        broker = BrokerServer(
            BrokerConfig(
                etcd_endpoints=self._etcd.endpoint,
                key_prefix=spec.key_prefix,
                listen=spec.listen,
                fabric=f"sim:{fabric_dir}",
            )
        )
        self._broker = broker
        broker.start()
        self._endpoint = broker.endpoint
        for index, host in enumerate(spec.host_ids, start=1):
            self._agents.append(self._start_agent(host, index, fabric_dir))
        with Client(self._endpoint) as client:
            self._register_boxes(client)
            self._wait_for_hosts(client)

    def _install_fabric(self) -> Path:
        """The simulated fabric's state directory, holding every box and host of the spec."""
        from dxpool.fabric.sim import SimFabric, SimGpuSpec, UnknownTarget

        spec = self.spec
        state_dir = spec.data_dir / "fabric"
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

    def _start_agent(self, host: str, index: int, fabric_dir: Path) -> _Agent:
        assert self._etcd is not None
        where = rack_location(index)
        log_path = self.logs_dir / f"agent-{host}.log"
        args = [
            self.python,
            "-m",
            "dxpool.hostagent",
            "--host",
            host,
            "--etcd",
            self._etcd.endpoint,
            "--prefix",
            self.spec.key_prefix,
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
        ]
        with open(log_path, "ab") as log_file:
            # A session of its own: a Ctrl-C at the terminal reaches only `dxpool up`,
            # which then stops the agents in order.
            process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        log.info("agent started", extra={"host": host, "pid": process.pid})
        return _Agent(host, process, log_path)

    def _register_boxes(self, client: Client) -> None:
        spec = self.spec
        for index, box in enumerate(spec.box_ids, start=1):
            try:
                client.create_box(
                    box,
                    gpus=spec.gpus_per_box,
                    model=spec.gpu_model,
                    memory_mib=spec.gpu_memory_mib,
                    location=rack_location(index),
                    request_id=f"dxpool-up-{box}",
                )
            except AlreadyExists:
                log.info("box already registered", extra={"box": box})

    def _wait_for_hosts(self, client: Client) -> None:
        wanted = {f"hosts/{h}" for h in self.spec.host_ids}
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while True:
            dead = self.exited_agents()
            if dead:
                raise RuntimeError(
                    f"host agent {dead[0].host} exited with {dead[0].process.returncode}; "
                    f"see {dead[0].log_path}"
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

    def exited_agents(self) -> list[_Agent]:
        """Agents whose process has ended."""
        return [a for a in self._agents if a.process.poll() is not None]

    def check(self, warn: Callable[[str], None]) -> None:
        """Report (once each) agents that exited while the pool runs."""
        for agent in self.exited_agents():
            if not agent.reported_exit:
                agent.reported_exit = True
                warn(
                    f"warning: host agent {agent.host} exited with "
                    f"{agent.process.returncode}; see {agent.log_path}"
                )

    def stop(self) -> None:
        """Stop agents, broker and etcd, in that order. Idempotent; never raises."""
        agents, self._agents = self._agents, []
        for agent in agents:
            _signal_group(agent.process, signal.SIGTERM)
        deadline = time.monotonic() + AGENT_STOP_GRACE_S
        for agent in agents:
            try:
                agent.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("agent did not stop; killing it", extra={"host": agent.host})
                _signal_group(agent.process, signal.SIGKILL)
                agent.process.wait()
        broker, self._broker = self._broker, None
        if broker is not None:
            try:
                broker.stop()
            except Exception:
                log.exception("broker did not stop cleanly")
        etcd, self._etcd = self._etcd, None
        if etcd is not None:
            etcd.stop()


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    """Signal the process's whole session (it leads its own), if it still runs."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)
