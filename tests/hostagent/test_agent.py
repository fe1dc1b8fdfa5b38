"""The agent's spec watch against a three-member etcd cluster: it follows the spec when
the member it watches through freezes (SIGSTOP: connections stay open, nothing answers),
which a plain etcd watch never notices."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.fabric.sim import SimFabric
from dxpool.hostagent.agent import Agent
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.drivers.sim import make_sim_driver
from dxpool.store.client import connect
from dxpool.store.embedded import EtcdCluster
from dxpool.store.keys import KeySchema
from tests.conftest import wait_until


@pytest.fixture
def cluster_agent(etcd_cluster: EtcdCluster, tmp_path: Path, key_prefix: str) -> Iterator[Agent]:
    fabric = SimFabric.create(tmp_path / "fabric", boxes={}, hosts={})
    fabric.add_host("h1", 8)
    config = AgentConfig(
        host_id="h1",
        etcd_endpoints=etcd_cluster.endpoints,
        key_prefix=key_prefix,
        site="s1",
        pod="p1",
        rack="r1",
        sim_state_dir=tmp_path / "fabric",
        lease_ttl_s=10,
        workers=1,
    )
    client = connect(etcd_cluster.endpoints)
    agent = Agent(config, make_sim_driver(fabric, "h1", device_timeout_s=5), client)
    agent.start()
    yield agent
    agent.stop()
    client.close()


def test_the_spec_watch_leaves_a_frozen_member(
    cluster_agent: Agent, etcd_cluster: EtcdCluster, key_prefix: str
) -> None:
    agent = cluster_agent
    spec_key = KeySchema(key_prefix).host_allocation("h1")
    endpoint = agent.spec_watch_endpoint
    assert endpoint is not None
    watched = etcd_cluster.member(endpoint)
    others = [m for m in etcd_cluster.members if m is not watched]
    etcd_cluster.move_leader(others[0])  # freezing the watched member loses no leader
    writer = connect(others[0].endpoint)
    try:
        watched.pause()
        response = writer.put(spec_key, pb.HostAllocation(host="hosts/h1").SerializeToString())
        revision = int(response.header.revision)

        wait_until(
            lambda: agent.desired.spec_revision == revision,
            timeout_s=6,
            message="the agent to adopt the spec written while its member was frozen",
        )
        assert agent.spec_watch_endpoint != endpoint
    finally:
        watched.resume()
        writer.close()
