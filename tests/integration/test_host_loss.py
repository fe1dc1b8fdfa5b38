"""Host loss, fencing, force release, quarantine and garbage collection, end to end.

Real etcd, real brokers over gRPC, host agents as processes over one simulated fabric;
the broker fences through the same fabric's box side.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.integration.test_node_lifecycle import compose, wait_state

TTL_S = 2.0


@pytest.fixture
def fencing_stubs(broker_factory: Callable[..., object], sim_pool: SimPool) -> Iterator[Stubs]:
    broker = broker_factory(
        fabric=f"sim:{sim_pool.state_dir / 'fabric'}", retention_s=1.0, leader_ttl_s=2.0
    )
    channel = grpc.insecure_channel(broker.endpoint)  # type: ignore[attr-defined]
    yield Stubs(channel)
    channel.close()


def gpu(stubs: Stubs, name: str) -> pb.Gpu:
    return stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=name))


def test_a_lost_host_is_fenced_and_its_gpus_reclaimed(
    fencing_stubs: Stubs, sim_pool: SimPool
) -> None:
    stubs = fencing_stubs
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    agent = sim_pool.start_agent("h1", lease_ttl_s=TTL_S)
    wait_hosts_alive(stubs)
    node = wait_state(stubs, compose(stubs, "H100:2").name, pb.NODE_STATE_READY)
    generations = {b.gpu: gpu(stubs, b.gpu).generation for b in node.gpus}

    agent.kill()
    killed = time.monotonic()
    lost = wait_state(stubs, node.name, pb.NODE_STATE_LOST, timeout_s=TTL_S + 10)
    wait_until(
        lambda: all(gpu(stubs, b.gpu).state == pb.GPU_STATE_FREE for b in node.gpus),
        timeout_s=10,
        message="the lost host's GPUs to be fenced and freed",
    )
    reclaimed_s = time.monotonic() - killed

    assert "lost" in lost.message
    for slot in range(2):
        assert sim_pool.fabric.mapping("box1", slot) is None  # revoked at the box side
        name = f"boxes/box1/gpus/{slot}"
        assert sim_pool.fabric.scrubbed_generation("box1", slot) == generations[name]
    # Lease TTL, then at most one leader pass and the fabric calls (target: TTL + 2 s).
    assert reclaimed_s < TTL_S + 4, f"reclaimed after {reclaimed_s:.1f}s"
    released = stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    assert released.state in (pb.NODE_STATE_RELEASING, pb.NODE_STATE_RELEASED)
    wait_state(stubs, node.name, pb.NODE_STATE_RELEASED)


def test_a_partitioned_host_that_returns_cannot_reach_its_old_gpus(
    fencing_stubs: Stubs, sim_pool: SimPool
) -> None:
    stubs = fencing_stubs
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    frozen = sim_pool.start_agent("h1", lease_ttl_s=TTL_S)
    sim_pool.start_agent("h2", lease_ttl_s=TTL_S)
    wait_hosts_alive(stubs, 2)
    first = wait_state(stubs, compose(stubs, "H100:1", host="hosts/h1").name, pb.NODE_STATE_READY)

    os.kill(frozen.process.pid, signal.SIGSTOP)  # a partition: the process lives on
    try:
        wait_state(stubs, first.name, pb.NODE_STATE_LOST, timeout_s=TTL_S + 10)
        wait_until(
            lambda: gpu(stubs, "boxes/box1/gpus/0").state == pb.GPU_STATE_FREE,
            message="the GPU to be reclaimed",
        )
        second = wait_state(
            stubs, compose(stubs, "H100:1", host="hosts/h2").name, pb.NODE_STATE_READY
        )
    finally:
        os.kill(frozen.process.pid, signal.SIGCONT)

    # h1 comes back: it registers anew, finds nothing wanted of it, and must not
    # take the GPU back from h2.
    wait_hosts_alive(stubs, 2, timeout_s=TTL_S + 10)
    time.sleep(TTL_S)
    assert sim_pool.fabric.mapping("box1", 0)[0] == "h2"  # type: ignore[index]
    assert sim_pool.fabric.mappings("h1") == {}
    now = gpu(stubs, "boxes/box1/gpus/0")
    assert (now.state, now.node, now.host) == (pb.GPU_STATE_ATTACHED, second.name, "hosts/h2")
    assert stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=first.name)).state == (
        pb.NODE_STATE_LOST
    )


def test_force_release_of_a_hung_host_fences_without_its_agent(
    fencing_stubs: Stubs, sim_pool: SimPool
) -> None:
    stubs = fencing_stubs
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    hung = sim_pool.start_agent("h1", lease_ttl_s=30)  # its lease outlives the test
    wait_hosts_alive(stubs)
    node = wait_state(stubs, compose(stubs, "H100:2").name, pb.NODE_STATE_READY)

    os.kill(hung.process.pid, signal.SIGSTOP)
    try:
        plain = stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
        assert plain.state == pb.NODE_STATE_RELEASING
        time.sleep(1.0)  # a plain release waits for the agent, which is hung
        assert stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name)).state == (
            pb.NODE_STATE_RELEASING
        )
        stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name, force=True))
        wait_state(stubs, node.name, pb.NODE_STATE_RELEASED, timeout_s=10)
        assert sim_pool.fabric.mappings("h1") == {}
        assert all(gpu(stubs, b.gpu).state == pb.GPU_STATE_FREE for b in node.gpus)
    finally:
        os.kill(hung.process.pid, signal.SIGCONT)


def test_a_gpu_whose_detach_keeps_failing_is_quarantined(
    fencing_stubs: Stubs, sim_pool: SimPool
) -> None:
    stubs = fencing_stubs
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    sim_pool.start_agent("h1", extra=("--detach-attempts", "2"))
    wait_hosts_alive(stubs)
    node = wait_state(stubs, compose(stubs, "H100:1").name, pb.NODE_STATE_READY)
    sim_pool.fabric.inject_fault("unmap", box="box1", slot=0, count=1000)

    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))

    wait_until(
        lambda: gpu(stubs, "boxes/box1/gpus/0").state == pb.GPU_STATE_QUARANTINED,
        message="the GPU to be quarantined",
    )
    wait_state(stubs, node.name, pb.NODE_STATE_RELEASED)  # the node is not held up
    quarantined = gpu(stubs, "boxes/box1/gpus/0")
    assert "detach" in quarantined.message and quarantined.node == ""
    with pytest.raises(grpc.RpcError) as error:
        compose(stubs, "H100:1")  # never handed out again
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_reclaimed_gpu_is_fenced_before_it_is_given_out_again(
    fencing_stubs: Stubs, sim_pool: SimPool
) -> None:
    stubs = fencing_stubs
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    sim_pool.start_agent("h1", extra=("--detach-attempts", "2"))
    wait_hosts_alive(stubs)
    node = wait_state(stubs, compose(stubs, "H100:1").name, pb.NODE_STATE_READY)
    sim_pool.fabric.inject_fault("unmap", box="box1", slot=0, count=1000)
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_until(
        lambda: gpu(stubs, "boxes/box1/gpus/0").state == pb.GPU_STATE_QUARANTINED,
        message="the GPU to be quarantined",
    )
    assert sim_pool.fabric.mappings("h1") != {}  # the host still maps it

    reclaimed = stubs.inventory.ReclaimGpu(
        inventory_pb2.ReclaimGpuRequest(name="boxes/box1/gpus/0", reason="proxy replaced")
    )

    assert reclaimed.state in (pb.GPU_STATE_FENCING, pb.GPU_STATE_FREE)
    assert "proxy replaced" in reclaimed.message
    wait_until(
        lambda: gpu(stubs, "boxes/box1/gpus/0").state == pb.GPU_STATE_FREE,
        message="the reclaimed GPU to be fenced and freed",
    )
    assert sim_pool.fabric.mappings("h1") == {}  # revoked at the box side first
    again = wait_state(stubs, compose(stubs, "H100:1").name, pb.NODE_STATE_READY)
    assert [b.gpu for b in again.gpus] == ["boxes/box1/gpus/0"]


def test_only_a_quarantined_gpu_can_be_reclaimed(fencing_stubs: Stubs, sim_pool: SimPool) -> None:
    stubs = fencing_stubs
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    with pytest.raises(grpc.RpcError) as free:
        stubs.inventory.ReclaimGpu(inventory_pb2.ReclaimGpuRequest(name="boxes/box1/gpus/0"))
    assert free.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is FREE, not QUARANTINED" in (free.value.details() or "")
    assert gpu(stubs, "boxes/box1/gpus/0").state == pb.GPU_STATE_FREE
    with pytest.raises(grpc.RpcError) as missing:
        stubs.inventory.ReclaimGpu(inventory_pb2.ReclaimGpuRequest(name="boxes/box1/gpus/7"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_released_nodes_and_their_request_ids_are_collected(
    fencing_stubs: Stubs, sim_pool: SimPool
) -> None:
    stubs = fencing_stubs
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    request = nodes_pb2.ComposeNodeRequest(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)), request_id="job-1"
    )
    node = stubs.nodes.ComposeNode(request)
    wait_state(stubs, node.name, pb.NODE_STATE_READY)
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_state(stubs, node.name, pb.NODE_STATE_RELEASED)

    def gone() -> bool:
        try:
            stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name))
        except grpc.RpcError as error:
            return error.code() == grpc.StatusCode.NOT_FOUND
        return False

    wait_until(gone, timeout_s=10, message="the released node to be collected")
    again = stubs.nodes.ComposeNode(request)  # the request id is free again
    assert again.name != node.name
