"""Pool gauges and RPC status counts, read from the Prometheus registry of a real broker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
import pytest
from prometheus_client import REGISTRY

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.state.pool_metrics import state_label
from dxpool.client import Client
from dxpool.errors import NotFound
from tests.conftest import SimPool, Stubs, register_sim_box, wait_until

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def client(broker: BrokerServer) -> Iterator[Client]:
    with Client(broker.endpoint) as client:
        yield client


def test_gauges_count_gpus_nodes_and_hosts(client: Client, stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "box1", gpus=4)
    sim_pool.start_agent("h1", slots=4)
    wait_until(lambda: any(h.alive for h in client.list_hosts()), message="h1 alive")

    node = client.wait_for_node(client.compose_node("H100:2").name, timeout_s=60)

    def attached_counted() -> bool:
        return sample("dxpool_gpus", model="H100", state="ATTACHED") == 2

    wait_until(attached_counted, message="two ATTACHED GPUs counted")
    assert sample("dxpool_gpus", model="H100", state="FREE") == 2
    assert sample("dxpool_nodes", state="READY") == 1
    assert sample("dxpool_hosts", liveness="alive") == 1
    assert sample("dxpool_hosts", liveness="dead") == 0
    assert sample("dxpool_cache_revision") > 0

    client.release_node(node.name)
    wait_until(
        lambda: (
            sample("dxpool_nodes", state="RELEASED") == 1
            and sample("dxpool_gpus", model="H100", state="FREE") == 4
        ),
        message="release counted",
    )
    assert sample("dxpool_nodes", state="READY") == 0
    # Every state label, gauge or counter, is a NodeState name without its prefix.
    node_states = {
        state_label(name, "NODE_STATE_") for name in pb.NodeState.DESCRIPTOR.values_by_name
    }
    transitions = {
        sample.labels["state"]
        for metric in REGISTRY.collect()
        if metric.name == "dxpool_node_transitions"
        for sample in metric.samples
    }
    assert {"READY", "RELEASED"} <= transitions <= node_states


def test_rpcs_are_counted_by_status_code(client: Client, stubs: Stubs) -> None:
    method = "InventoryService.GetBox"
    before_ok = sample("dxpool_rpc_total", method=method, code="OK")
    before_missing = sample("dxpool_rpc_total", method=method, code="NOT_FOUND")
    client.create_box("box1", gpus=2, model="H100", memory_mib=81920, location=("s1", "p1", "r1"))

    client.get_box("box1")
    with pytest.raises(NotFound):
        client.get_box("nope")

    assert sample("dxpool_rpc_total", method=method, code="OK") == before_ok + 1
    assert sample("dxpool_rpc_total", method=method, code="NOT_FOUND") == before_missing + 1


def test_state_labels_drop_the_enum_prefix() -> None:
    assert state_label("NODE_STATE_READY", "NODE_STATE_") == "READY"
    assert state_label("GPU_STATE_FREE", "GPU_STATE_") == "FREE"


def test_streams_are_counted_by_status_code(stubs: Stubs) -> None:
    method = "NodeService.WatchNodes"
    before = sample("dxpool_rpc_total", method=method, code="INVALID_ARGUMENT")
    with pytest.raises(grpc.RpcError) as error:
        next(iter(stubs.nodes.WatchNodes(nodes_pb2.WatchNodesRequest(start_revision=-1))))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_until(
        lambda: sample("dxpool_rpc_total", method=method, code="INVALID_ARGUMENT") == before + 1,
        message="refused watch counted",
    )
