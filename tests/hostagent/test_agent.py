"""The agent against broker processes: when the broker it holds its session with
freezes (SIGSTOP: connections stay open, nothing answers), the agent leaves it for
another broker, keeps its host alive, and follows the spec written meanwhile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.fabric.sim import SimFabric
from dxpool.hostagent.agent import Agent
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.drivers.sim import make_sim_driver
from dxpool.store.embedded import EmbeddedEtcd, free_ports
from dxpool.store.keys import KeySchema
from tests.conftest import wait_until


class BrokerProcess:
    """``python -m dxpool.broker`` on free loopback ports."""

    def __init__(self, etcd: str, prefix: str, log: Path) -> None:
        port, agent_port = free_ports(2)
        self.endpoint = f"127.0.0.1:{port}"
        self.agent_endpoint = f"127.0.0.1:{agent_port}"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "dxpool.broker", "--etcd", etcd, "--prefix", prefix,
                 "--listen", self.endpoint, "--agent-listen", self.agent_endpoint,
                 "--insecure", "--log-level", "WARNING"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    def wait_serving(self) -> None:
        with grpc.insecure_channel(self.endpoint) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            wait_until(serving, timeout_s=60, message="the broker to serve")

    def stop(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)
        self.process.kill()
        self.process.wait(10)


@pytest.fixture
def brokers(
    etcd_server: EmbeddedEtcd, key_prefix: str, tmp_path: Path
) -> Iterator[list[BrokerProcess]]:
    started = [
        BrokerProcess(etcd_server.endpoint, key_prefix, tmp_path / f"broker{i}.log")
        for i in range(2)
    ]
    for broker in started:
        broker.wait_serving()
    yield started
    for broker in started:
        broker.stop()


@pytest.fixture
def agent(brokers: list[BrokerProcess], tmp_path: Path) -> Iterator[Agent]:
    fabric = SimFabric.create(tmp_path / "fabric", boxes={}, hosts={})
    fabric.add_host("h1", 8)
    config = AgentConfig(
        host_id="h1",
        brokers=",".join(b.agent_endpoint for b in brokers),
        site="s1",
        pod="p1",
        rack="r1",
        sim_state_dir=tmp_path / "fabric",
        lease_ttl_s=3,
        workers=1,
        backoff_max_s=1,
    )
    agent = Agent(config, make_sim_driver(fabric, "h1", device_timeout_s=5))
    agent.start()
    yield agent
    agent.stop()


def test_the_agent_leaves_a_frozen_broker_and_follows_the_spec(
    agent: Agent, brokers: list[BrokerProcess], etcd_client: Any, key_prefix: str
) -> None:
    keys = KeySchema(key_prefix)
    session = agent.link.session
    assert session is not None
    frozen = next(b for b in brokers if b.agent_endpoint == session.endpoint)
    other = next(b for b in brokers if b is not frozen)
    os.kill(frozen.process.pid, signal.SIGSTOP)
    try:
        response = etcd_client.put(
            keys.host_allocation("h1"), pb.HostAllocation(host="hosts/h1").SerializeToString()
        )
        revision = int(response.header.revision)
        gone: list[float] = []
        sessions_seen: set[str] = set()

        def adopted() -> bool:
            if etcd_client.get(keys.host_lease("h1"))[0] is None:
                gone.append(time.monotonic())
            current = agent.link.session
            if current is not None:
                sessions_seen.add(current.endpoint)
            return agent.desired.spec_revision == revision

        wait_until(adopted, timeout_s=30, message="the spec written while its broker froze")
        # Only the other broker can have served the spec; once it is adopted a loaded
        # machine may already have moved the agent on again, so the session is not read
        # once at the end but watched throughout.
        current = agent.link.session
        if current is not None:
            sessions_seen.add(current.endpoint)
        assert other.agent_endpoint in sessions_seen
        assert gone == []  # the host stayed alive throughout
    finally:
        os.kill(frozen.process.pid, signal.SIGCONT)
