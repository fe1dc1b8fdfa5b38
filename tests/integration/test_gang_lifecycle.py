"""Gangs end to end: real etcd, a broker over gRPC, host agents as processes over one
simulated fabric, the broker fencing through the same fabric's box side."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.client import Client
from dxpool.errors import FailedPrecondition
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.integration.test_node_lifecycle import wait_state

TTL_S = 2.0


@pytest.fixture
def fencing_broker(broker_factory: Callable[..., object], sim_pool: SimPool) -> Iterator[str]:
    broker = broker_factory(fabric=f"sim:{sim_pool.state_dir / 'fabric'}", leader_ttl_s=2.0)
    yield broker.endpoint  # type: ignore[attr-defined]


def test_a_member_whose_host_dies_before_ready_is_lost_and_the_others_stay(
    fencing_broker: str, sim_pool: SimPool
) -> None:
    """Member 1's host attaches slowly and dies before its member is READY: member 1
    goes LOST (its GPU fenced and freed), member 0 stays READY. Waiting for the gang
    fails at once naming member 1; releasing the gang releases both."""
    channel = grpc.insecure_channel(fencing_broker)
    stubs = Stubs(channel)
    client = Client(fencing_broker, insecure=True)
    try:
        register_sim_box(sim_pool, stubs, "box1", gpus=2)
        sim_pool.start_agent("h1", lease_ttl_s=TTL_S)
        slow = sim_pool.start_agent("h2", lease_ttl_s=TTL_S, map_delay_s=60.0)
        wait_hosts_alive(stubs, 2)
        member = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1))
        gang = stubs.nodes.ComposeGang(
            nodes_pb2.ComposeGangRequest(
                members=[
                    pb.NodeSpec(gpus=member.gpus, host="hosts/h1"),
                    pb.NodeSpec(gpus=member.gpus, host="hosts/h2"),
                ],
                gang_id="job",
            )
        )
        first, second = (n.name for n in gang.nodes)
        wait_state(stubs, first, pb.NODE_STATE_READY)
        assert stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=second)).state in (
            pb.NODE_STATE_PENDING,
            pb.NODE_STATE_ATTACHING,
        )

        slow.kill()
        lost = wait_state(stubs, second, pb.NODE_STATE_LOST, timeout_s=TTL_S + 10)
        assert "lost" in lost.message
        now = client.get_gang("job")
        assert [n.state for n in now.nodes] == [pb.NODE_STATE_READY, pb.NODE_STATE_LOST]
        with pytest.raises(FailedPrecondition) as broken:
            client.wait_for_gang("job", timeout_s=5)
        assert "nodes/job-1" in broken.value.message
        assert "dxpool gang delete gangs/job" in broken.value.message
        lost_gpu = lost.gpus[0].gpu
        wait_until(
            lambda: (
                stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=lost_gpu)).state
                == pb.GPU_STATE_FREE
            ),
            timeout_s=10,
            message="the lost member's GPU to be fenced and freed",
        )

        client.release_gang("job")
        for name in (first, second):
            wait_state(stubs, name, pb.NODE_STATE_RELEASED)
        wait_until(
            lambda: all(
                g.state == pb.GPU_STATE_FREE
                for g in stubs.inventory.ListGpus(inventory_pb2.ListGpusRequest()).gpus
            ),
            message="every GPU free",
        )
        assert sim_pool.fabric.mapping("box1", 0) is None
        assert sim_pool.fabric.mapping("box1", 1) is None
    finally:
        client.close()
        channel.close()
