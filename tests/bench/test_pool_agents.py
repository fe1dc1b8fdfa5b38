"""The scale benchmark's stand-in agents: the agent's reconciler over an in-memory driver,
for every host of a pool, against a real broker and etcd."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.pool_agents import MemoryDriver, PoolAgents
from bench.scale import load_hosts, settle
from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.hostagent.driver import AttachRequest
from dxpool.hostagent.errors import AttachConflictError
from dxpool.names import GpuRef
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store
from tests.conftest import Stubs, add_box, wait_hosts_alive

ONE_GPU = nodes_pb2.ComposeNodeRequest(spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)))


def test_memory_driver_attaches_with_a_stable_identity_and_detaches() -> None:
    driver = MemoryDriver()
    gpu = GpuRef("b1", 3)
    attached = driver.attach(AttachRequest(gpu, 2))
    assert attached.present and attached.driver == "nvidia"
    assert attached.identity is not None and attached.identity.uuid == "GPU-b1-3"
    assert driver.observe() == {gpu: attached}
    with pytest.raises(AttachConflictError):
        driver.attach(AttachRequest(gpu, 5))
    driver.detach(gpu)
    assert driver.observe() == {}


@pytest.fixture
def agents(etcd_client: object, key_prefix: str, stubs: Stubs) -> Iterator[PoolAgents]:
    store = Store(etcd_client, KeySchema(key_prefix))
    lease = etcd_client.lease(60)  # type: ignore[attr-defined]
    load_hosts(store, 2, lease)
    wait_hosts_alive(stubs, 2)
    agents = PoolAgents(etcd_client, KeySchema(key_prefix), workers=2)
    agents.start()
    yield agents
    agents.stop()
    lease.revoke()


def test_nodes_become_ready_and_released_gpus_are_freed(
    broker: BrokerServer, stubs: Stubs, agents: PoolAgents
) -> None:
    add_box(stubs, "b1", gpus=4)
    names = [stubs.nodes.ComposeNode(ONE_GPU).name for _ in range(3)]
    settle(broker.endpoint, timeout_s=20)
    for name in names:
        node = stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=name))
        assert node.state == pb.NODE_STATE_READY, node.message
    for name in names:
        stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=name))
    settle(broker.endpoint, timeout_s=20)
    for name in names:
        node = stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=name))
        assert node.state == pb.NODE_STATE_RELEASED, node.message
    status = stubs.inventory.GetPoolStatus(inventory_pb2.GetPoolStatusRequest())
    assert (status.models[0].free, status.models[0].in_use) == (4, 0)
