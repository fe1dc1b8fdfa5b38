"""The broker's metrics say what happened: releases that change nothing are not counted,
the leader says it leads, and every metric names a method the same way."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import REGISTRY

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.state.metrics import method_label
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.integration.test_node_lifecycle import compose, wait_state


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def pool(stubs: Stubs, sim_pool: SimPool) -> Iterator[Stubs]:
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    yield stubs


def test_a_release_is_counted_once_however_often_it_is_asked_for(pool: Stubs) -> None:
    node = wait_state(pool, compose(pool, "H100:1").name, pb.NODE_STATE_READY)
    before = sample("dxpool_release_total")
    for _ in range(3):  # the first starts the release; the others change nothing
        pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_state(pool, node.name, pb.NODE_STATE_RELEASED)
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    assert sample("dxpool_release_total") - before == 1


def test_the_leader_says_it_leads(broker: BrokerServer) -> None:
    wait_until(broker.election.is_leader, message="the broker to lead")
    wait_until(lambda: sample("dxpool_leader") == 1, message="the leader gauge")


def test_every_metric_names_a_method_as_the_rpc_metrics_do() -> None:
    assert method_label("/dxpool.v1.NodeService/WatchNodes") == "NodeService.WatchNodes"
    assert method_label("/grpc.health.v1.Health/Watch") == "Health.Watch"
    assert method_label("NodeService.ComposeNode") == "NodeService.ComposeNode"


def test_streams_open_is_labelled_like_rpc_total(broker: BrokerServer) -> None:
    with grpc.insecure_channel(broker.endpoint) as channel:
        watch = Stubs(channel).nodes.WatchNodes(nodes_pb2.WatchNodesRequest(), timeout=60)
        next(watch)
        wait_until(
            lambda: sample("dxpool_streams_open", method="NodeService.WatchNodes") >= 1,
            message="the open watch counted under NodeService.WatchNodes",
        )
        watch.cancel()
