"""A deleted node frees its name: once RELEASED, a compose (or a gang) may take the
name again at once instead of after the retention period. Real etcd, a real broker over
gRPC and a host agent over the simulated fabric."""

from __future__ import annotations

import threading

import grpc
import pytest

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.store.keys import KeySchema
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive
from tests.integration.test_node_lifecycle import wait_state
from tests.patience import patient


def compose_named(stubs: Stubs, name: str, request_id: str = "") -> pb.VirtualNode:
    return stubs.nodes.ComposeNode(
        nodes_pb2.ComposeNodeRequest(
            spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=2)),
            node_id=name,
            request_id=request_id,
        )
    )


def release(stubs: Stubs, name: str) -> None:
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=name))
    wait_state(stubs, name, pb.NODE_STATE_RELEASED, timeout_s=60)


@pytest.fixture
def pool(stubs: Stubs, sim_pool: SimPool) -> Stubs:
    register_sim_box(sim_pool, stubs, "box1")
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs, timeout_s=60)
    return stubs


def test_a_released_nodes_name_can_be_composed_again_at_once(
    pool: Stubs, etcd_client: object, key_prefix: str
) -> None:
    first = compose_named(pool, "rg1", request_id="first-request")
    wait_state(pool, first.name, pb.NODE_STATE_READY, timeout_s=60)
    release(pool, first.name)
    watched: list[nodes_pb2.NodeEvent] = []
    watch = pool.nodes.WatchNodes(nodes_pb2.WatchNodesRequest(name="nodes/rg1"), timeout=120)
    synced = threading.Event()

    def follow() -> None:
        for event in watch:
            watched.append(event)
            if event.type == nodes_pb2.NodeEvent.TYPE_SYNCED:
                synced.set()
            elif event.node.state == pb.NODE_STATE_PENDING:
                return

    follower = threading.Thread(target=follow)
    follower.start()
    assert synced.wait(patient(60))

    second = compose_named(pool, "rg1", request_id="second-request")
    assert second.name == "nodes/rg1"
    assert second.request_id == "second-request"
    assert second.state == pb.NODE_STATE_PENDING
    follower.join(60)
    watch.cancel()
    changes = [e for e in watched if e.type != nodes_pb2.NodeEvent.TYPE_SYNCED]
    # The watch ends on the new node. Changes are coalesced per name (WatchNodes' contract:
    # a watcher that falls behind gets each node's latest state), so a watcher slower than
    # the release's collection and the new compose may get the deletion folded into the
    # new node's change; one that keeps up gets the deletion first.
    last = changes[-1]
    assert last.type == nodes_pb2.NodeEvent.TYPE_CHANGED
    assert last.node.request_id == "second-request"
    assert [e.type for e in changes[1:-1]] in ([], [nodes_pb2.NodeEvent.TYPE_DELETED])
    # the released node's request id went with it, as after the retention period
    request_key = KeySchema(key_prefix).request("first-request")
    assert etcd_client.get(request_key)[0] is None  # type: ignore[attr-defined]
    wait_state(pool, "nodes/rg1", pb.NODE_STATE_READY, timeout_s=60)


def test_a_name_held_by_a_node_not_released_stays_taken(pool: Stubs) -> None:
    node = compose_named(pool, "rg2")
    wait_state(pool, node.name, pb.NODE_STATE_READY, timeout_s=60)
    with pytest.raises(grpc.RpcError) as error:
        compose_named(pool, "rg2")
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    with pytest.raises(grpc.RpcError) as releasing:
        compose_named(pool, "rg2")  # RELEASING: its GPUs are not back yet
    assert releasing.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_a_released_gangs_name_can_be_composed_again(pool: Stubs) -> None:
    members = [pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=2)) for _ in range(2)]
    request = nodes_pb2.ComposeGangRequest(members=members, gang_id="job")
    gang = pool.nodes.ComposeGang(request)
    for member in gang.nodes:
        wait_state(pool, member.name, pb.NODE_STATE_READY, timeout_s=60)
    pool.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name="gangs/job"))
    for member in gang.nodes:
        wait_state(pool, member.name, pb.NODE_STATE_RELEASED, timeout_s=60)
    again = pool.nodes.ComposeGang(request)
    assert [n.name for n in again.nodes] == ["nodes/job-0", "nodes/job-1"]
    assert all(n.state == pb.NODE_STATE_PENDING for n in again.nodes)
