"""Fixtures for the host agent tests: a simulated fabric, its driver, agent processes.

Agents talk to a real broker (the suite-wide ``broker`` fixture, over the one real etcd
of the session with a fresh key prefix per test); tests write the host's spec into etcd
as a broker's compose would and read what the broker wrote for the agent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dxpool.api.v1 import agent_pb2, resources_pb2
from dxpool.fabric.sim import SimFabric, SimGpuSpec
from dxpool.hostagent.driver import StepDriver
from dxpool.hostagent.drivers.sim import make_sim_driver
from dxpool.hostagent.link import BrokerLink
from tests.conftest import AgentProcess
from tests.patience import patient

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer

HOST = "h1"
HOST_SLOTS = 4


@pytest.fixture
def sim_fabric(tmp_path: Path) -> SimFabric:
    """Box b1: four H100; box b2: two A100; host h1 with four proxy slots."""
    return SimFabric.create(
        tmp_path / "simfabric",
        boxes={
            "b1": [SimGpuSpec("H100", 81920) for _ in range(4)],
            "b2": [SimGpuSpec("A100", 40960, pci_id="10de:20b0") for _ in range(2)],
        },
        hosts={HOST: HOST_SLOTS},
    )


@pytest.fixture
def sim_driver(sim_fabric: SimFabric) -> StepDriver:
    return make_sim_driver(sim_fabric, HOST, device_timeout_s=2.0)


def wait_for(predicate: Callable[[], object], *, timeout_s: float = 10.0, what: str) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test once
    ``timeout_s`` (at least :data:`tests.patience.PATIENCE_S`) has passed."""
    timeout_s = patient(timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def start_agent(
    tmp_path: Path, sim_fabric: SimFabric, broker: BrokerServer
) -> Iterator[Callable[..., AgentProcess]]:
    """Start agents for host h1 on ``sim_fabric``, connected to ``broker``; every one is
    killed at teardown.

    Keyword arguments become ``--option value`` flags (``map_delay=1.5`` ->
    ``--sim-map-delay 1.5``).
    """
    started: list[AgentProcess] = []

    def start(*, map_delay: float = 0.0, lease_ttl: float = 2.0, **options: object) -> AgentProcess:
        flags = {
            "host": HOST,
            "broker": broker.agent_endpoint,
            "driver": "sim",
            "sim-state-dir": str(sim_fabric.state_dir),
            "slot-capacity": HOST_SLOTS,
            "sim-map-delay": map_delay,
            "lease-ttl": lease_ttl,
            "resync-interval": 1.0,
            "backoff-base": 0.05,
            "backoff-max": 0.5,
            "device-timeout": 5.0,
            "log-level": "DEBUG",
        }
        flags.update({key.replace("_", "-"): value for key, value in options.items()})
        args = [sys.executable, "-m", "dxpool.hostagent"]
        for key, value in flags.items():
            args += [f"--{key}", str(value)]
        log_path = tmp_path / f"agent-{len(started)}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        agent = AgentProcess(process, log_path)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.kill()


@pytest.fixture
def open_link(broker: BrokerServer) -> Iterator[Callable[..., BrokerLink]]:
    """``open_link()``: a live session of host h1 (or ``host``) with ``broker``, as an
    agent's link holds it, for a status store to write through. Specs the broker pushes
    go to ``on_spec``. Each is stopped (its host released) at teardown."""
    links: list[BrokerLink] = []

    def open_one(
        host: str = HOST,
        *,
        token: str | None = None,
        ttl_s: float = 60.0,
        on_spec: Callable[[agent_pb2.HostSpec], None] = lambda spec: None,
    ) -> BrokerLink:
        def hello() -> agent_pb2.AgentHello:
            return agent_pb2.AgentHello(
                host=resources_pb2.Host(name=f"hosts/{host}", slot_capacity=HOST_SLOTS),
                token=token or f"token-{host}",
                liveness_ttl_ms=round(ttl_s * 1000),
            )

        link = BrokerLink([broker.agent_endpoint], f"hosts/{host}", hello, lambda w: None, on_spec)
        link.start()
        links.append(link)
        assert link.wait_connected(20), f"no session: {link.last_error}"
        return link

    yield open_one
    for link in links:
        link.stop(release=True)
