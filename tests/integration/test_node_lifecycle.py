"""A node's life end to end: real etcd, real broker over gRPC, host agents as processes."""

from __future__ import annotations

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until


def compose(stubs: Stubs, gpus: str = "H100:2", **spec: object) -> pb.VirtualNode:
    model, _, count = gpus.partition(":")
    return stubs.nodes.ComposeNode(
        nodes_pb2.ComposeNodeRequest(
            spec=pb.NodeSpec(gpus=pb.GpuRequest(model=model, count=int(count)), **spec)
        )
    )


def node_state(stubs: Stubs, name: str) -> int:
    return stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=name)).state


def wait_state(stubs: Stubs, name: str, state: int, timeout_s: float = 20) -> pb.VirtualNode:
    wait_until(
        lambda: node_state(stubs, name) == state,
        timeout_s,
        message=f"{name} to reach {pb.NodeState.Name(state)}",
    )
    return stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=name))


def gpus_in(stubs: Stubs, state: int) -> list[pb.Gpu]:
    return list(stubs.inventory.ListGpus(inventory_pb2.ListGpusRequest(state=state)).gpus)


def test_compose_ready_release_free(stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "box1")
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)

    node = compose(stubs, "H100:2")
    assert node.state == pb.NODE_STATE_PENDING
    assert node.host == "hosts/h1"
    assert len(node.gpus) == 2

    ready = wait_state(stubs, node.name, pb.NODE_STATE_READY)
    assert all(b.bdf and b.uuid.startswith("GPU-") for b in ready.gpus)
    attached = gpus_in(stubs, pb.GPU_STATE_ATTACHED)
    assert sorted(g.name for g in attached) == sorted(b.gpu for b in ready.gpus)
    assert all(g.node == node.name and g.uuid for g in attached)
    assert len(sim_pool.fabric.mappings("h1")) == 2

    released = stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    assert released.state == pb.NODE_STATE_RELEASING
    wait_state(stubs, node.name, pb.NODE_STATE_RELEASED)
    assert len(gpus_in(stubs, pb.GPU_STATE_FREE)) == 8
    assert sim_pool.fabric.mappings("h1") == {}
    again = stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    assert again.state == pb.NODE_STATE_RELEASED


def test_same_request_id_returns_same_node(stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "box1")
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    request = nodes_pb2.ComposeNodeRequest(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=3)), request_id="req-42"
    )
    first = stubs.nodes.ComposeNode(request)
    second = stubs.nodes.ComposeNode(request)
    assert first.name == second.name
    assert len(stubs.nodes.ListNodes(nodes_pb2.ListNodesRequest()).nodes) == 1
    assert len(gpus_in(stubs, pb.GPU_STATE_FREE)) == 5

    other = nodes_pb2.ComposeNodeRequest(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)), request_id="req-42"
    )
    with pytest.raises(grpc.RpcError) as error:
        stubs.nodes.ComposeNode(other)
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_attach_failure_fails_node_and_frees_gpus(stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "box1")
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    sim_pool.fabric.inject_fault("map", box="box1", count=1000, message="proxy table full")
    node = compose(stubs, "H100:1")
    failed = wait_state(stubs, node.name, pb.NODE_STATE_FAILED)
    assert "proxy table full" in failed.message
    wait_until(lambda: len(gpus_in(stubs, pb.GPU_STATE_FREE)) == 8, message="GPUs freed")
    sim_pool.fabric.clear_faults()
    assert wait_state(stubs, compose(stubs, "H100:1").name, pb.NODE_STATE_READY)


def test_attach_deadline_fails_node(broker_factory, sim_pool: SimPool) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory(attach_timeout_s=1.0)
    channel = grpc.insecure_channel(broker.endpoint)
    stubs = Stubs(channel)
    register_sim_box(sim_pool, stubs, "box1")
    sim_pool.start_agent("h1", map_delay_s=4.0)
    wait_hosts_alive(stubs)
    node = compose(stubs, "H100:1")
    failed = wait_state(stubs, node.name, pb.NODE_STATE_FAILED)
    assert "deadline" in failed.message
    wait_until(
        lambda: len(gpus_in(stubs, pb.GPU_STATE_FREE)) == 8,
        timeout_s=20,
        message="GPU freed after the late attach was undone",
    )
    assert sim_pool.fabric.mappings("h1") == {}
    channel.close()


def test_agent_killed_mid_attach_converges(stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "box1")
    agent = sim_pool.start_agent("h1", map_delay_s=1.5)
    wait_hosts_alive(stubs)
    node = compose(stubs, "H100:2")
    wait_state(stubs, node.name, pb.NODE_STATE_ATTACHING, timeout_s=10)
    agent.kill()
    sim_pool.start_agent("h1")
    ready = wait_state(stubs, node.name, pb.NODE_STATE_READY, timeout_s=30)
    assert len(sim_pool.fabric.mappings("h1")) == 2
    assert len({b.bdf for b in ready.gpus}) == 2


def test_cordoned_box_is_not_used(stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "box1")
    register_sim_box(sim_pool, stubs, "box2")
    sim_pool.start_agent("h1", slots=16)
    wait_hosts_alive(stubs)
    stubs.inventory.CordonBox(inventory_pb2.CordonBoxRequest(name="boxes/box1", reason="maint"))
    node = compose(stubs, "H100:8")
    assert {b.gpu.split("/gpus/")[0] for b in node.gpus} == {"boxes/box2"}
    with pytest.raises(grpc.RpcError) as error:
        compose(stubs, "H100:1")
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as in_use:
        stubs.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/box2"))
    assert in_use.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stubs.inventory.UncordonBox(inventory_pb2.UncordonBoxRequest(name="boxes/box1"))
    assert compose(stubs, "H100:1").gpus[0].gpu.startswith("boxes/box1/")


def test_sixty_four_gpus_commit_in_one_transaction(stubs: Stubs, sim_pool: SimPool) -> None:
    for index in range(8):
        register_sim_box(sim_pool, stubs, f"box{index}")
    sim_pool.start_agent("h1", slots=64)
    wait_hosts_alive(stubs)
    node = compose(stubs, "H100:64")
    assert len(node.gpus) == 64
    assert len({b.host_slot for b in node.gpus}) == 64
    assert gpus_in(stubs, pb.GPU_STATE_FREE) == []
    wait_state(stubs, node.name, pb.NODE_STATE_READY, timeout_s=60)


def test_watch_streams_node_changes(stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "box1")
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    node = compose(stubs, "H100:1")
    seen = []
    stream = stubs.nodes.WatchNodes(nodes_pb2.WatchNodesRequest(name=node.name), timeout=20)
    for event in stream:
        seen.append(event.node.state)
        if event.node.state == pb.NODE_STATE_READY:
            stream.cancel()
            break
    assert seen[0] in (pb.NODE_STATE_PENDING, pb.NODE_STATE_ATTACHING, pb.NODE_STATE_READY)
    assert seen[-1] == pb.NODE_STATE_READY


def test_a_box_deleted_and_added_again_attaches_after_its_gpus_were_fenced(  # type: ignore[no-untyped-def]
    broker_factory, sim_pool: SimPool
) -> None:
    """Delete and add again is the remedy after a GPU is replaced; the box side still
    refuses every generation it fenced, so the new records must not start over at 0."""
    broker = broker_factory(fabric=f"sim:{sim_pool.state_dir / 'fabric'}")
    with grpc.insecure_channel(broker.endpoint) as channel:
        stubs = Stubs(channel)
        register_sim_box(sim_pool, stubs, "box6", gpus=2)
        sim_pool.start_agent("h1")
        wait_hosts_alive(stubs)
        for _ in range(3):  # several assignments: the generations climb above 1
            node = compose(stubs, "H100:2", host="hosts/h1")
            wait_state(stubs, node.name, pb.NODE_STATE_READY)
            stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name, force=True))
            wait_state(stubs, node.name, pb.NODE_STATE_RELEASED)
        fenced = max(g.generation for g in gpus_in(stubs, pb.GPU_STATE_FREE))
        assert fenced >= 3

        stubs.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/box6"))
        register_sim_box(sim_pool, stubs, "box6", gpus=2)

        node = compose(stubs, "H100:2", host="hosts/h1")
        settled = {pb.NODE_STATE_READY, pb.NODE_STATE_FAILED}
        wait_until(
            lambda: node_state(stubs, node.name) in settled, 60, message=f"{node.name} settled"
        )
        again = stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name))
        assert again.state == pb.NODE_STATE_READY, again.message
        assert all(g.generation > fenced for g in gpus_in(stubs, pb.GPU_STATE_ATTACHED))
