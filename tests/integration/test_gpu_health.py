"""A GPU that turns unhealthy after its attach, through a real broker, etcd and agent.

The agent runs over the simulated fabric, where a test marks a GPU unhealthy as a real
GPU would start reporting XIDs or ECC errors; the agent's next resync reports it, the
broker degrades the node, and the GPU is never handed out again until an operator
clears it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.names import parse_gpu
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.integration.test_node_lifecycle import compose, wait_state


def gpu_record(stubs: Stubs, name: str) -> pb.Gpu:
    return stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=name))


def clear(stubs: Stubs, name: str) -> pb.Gpu:
    request = inventory_pb2.ClearGpuHealthRequest(name=name, reason="replaced the riser")
    return stubs.inventory.ClearGpuHealth(request)


@pytest.fixture
def fencing_stubs(broker_factory: Callable[..., object], sim_pool: SimPool) -> Iterator[Stubs]:
    """A broker that can fence and scrub at the box side, so a quarantined GPU can be
    reclaimed."""
    broker = broker_factory(fabric=f"sim:{sim_pool.state_dir / 'fabric'}", leader_ttl_s=2.0)
    channel = grpc.insecure_channel(broker.endpoint)  # type: ignore[attr-defined]
    yield Stubs(channel)
    channel.close()


def test_a_gpu_failing_mid_life_degrades_its_node_and_is_not_handed_out_again(
    fencing_stubs: Stubs, sim_pool: SimPool
) -> None:
    stubs = fencing_stubs
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    node = compose(stubs, "H100:2")
    ready = wait_state(stubs, node.name, pb.NODE_STATE_READY)
    sick = parse_gpu(ready.gpus[0].gpu)
    well = ready.gpus[1].gpu
    assert gpu_record(stubs, sick.name).health == pb.GPU_HEALTH_HEALTHY

    sim_pool.fabric.set_health(sick.box, sick.slot, healthy=False)

    degraded = wait_state(stubs, node.name, pb.NODE_STATE_DEGRADED)
    assert sick.name in degraded.message
    record = gpu_record(stubs, sick.name)
    assert record.health == pb.GPU_HEALTH_UNHEALTHY
    assert record.health_reason == "marked unhealthy in the simulated fabric"
    assert record.state == pb.GPU_STATE_ATTACHED  # the node keeps it until released

    # While the agent still reports it unhealthy, an operator cannot clear it.
    with pytest.raises(grpc.RpcError) as refused:
        clear(stubs, sick.name)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "still reported unhealthy" in (refused.value.details() or "")

    # Released: the healthy GPU is scrubbed and freed; the sick one fails its scrub (it is
    # still unhealthy after the reset) and is quarantined, never FREE.
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_state(stubs, node.name, pb.NODE_STATE_RELEASED)
    assert gpu_record(stubs, well).state == pb.GPU_STATE_FREE
    quarantined = gpu_record(stubs, sick.name)
    assert quarantined.state == pb.GPU_STATE_QUARANTINED
    assert "unhealthy after a reset" in quarantined.message

    # The operator fixes it and reclaims it: fenced and scrubbed at the box side, then
    # FREE, but still marked unhealthy, so it is not handed out yet.
    sim_pool.fabric.set_health(sick.box, sick.slot, healthy=True)
    stubs.inventory.ReclaimGpu(inventory_pb2.ReclaimGpuRequest(name=sick.name))
    wait_until(
        lambda: gpu_record(stubs, sick.name).state == pb.GPU_STATE_FREE,
        message="the reclaimed GPU to be FREE",
    )
    assert gpu_record(stubs, sick.name).health == pb.GPU_HEALTH_UNHEALTHY
    with pytest.raises(grpc.RpcError) as exhausted:
        compose(stubs, "H100:2")
    assert exhausted.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    single = wait_state(stubs, compose(stubs, "H100:1").name, pb.NODE_STATE_READY)
    assert [b.gpu for b in single.gpus] == [well]
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=single.name))
    wait_state(stubs, single.name, pb.NODE_STATE_RELEASED)

    # Cleared, it is handed out again.
    cleared = clear(stubs, sick.name)
    assert (cleared.health, cleared.health_reason) == (pb.GPU_HEALTH_HEALTHY, "")
    assert "replaced the riser" in cleared.message
    assert clear(stubs, sick.name).health == pb.GPU_HEALTH_HEALTHY  # idempotent
    again = wait_state(stubs, compose(stubs, "H100:2").name, pb.NODE_STATE_READY)
    assert sick.name in [b.gpu for b in again.gpus]


def test_a_degraded_node_is_ready_again_once_its_gpu_recovers(
    stubs: Stubs, sim_pool: SimPool
) -> None:
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    node = compose(stubs, "H100:1")
    wait_state(stubs, node.name, pb.NODE_STATE_READY)

    sim_pool.fabric.set_health("box1", 0, healthy=False)
    wait_state(stubs, node.name, pb.NODE_STATE_DEGRADED)
    sim_pool.fabric.set_health("box1", 0, healthy=True)

    ready = wait_state(stubs, node.name, pb.NODE_STATE_READY)
    assert ready.message == "all GPUs healthy again"
    assert gpu_record(stubs, "boxes/box1/gpus/0").health == pb.GPU_HEALTH_HEALTHY


def test_clearing_an_unknown_gpu_is_not_found(stubs: Stubs) -> None:
    with pytest.raises(grpc.RpcError) as missing:
        clear(stubs, "boxes/nope/gpus/0")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
