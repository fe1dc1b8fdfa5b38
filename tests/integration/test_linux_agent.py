"""A node composed and released end to end through the Linux driver: a real broker over
gRPC and a real etcd, and an agent whose StepDriver runs SysfsPciBus on a fake kernel
tree, the command-hook mapper with a real hook program, and NvmlInspector on a fake
pynvml."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.hostagent.agent import Agent
from dxpool.hostagent.config import AgentConfig
from dxpool.names import parse_gpu
from tests.conftest import Stubs, wait_hosts_alive, wait_until
from tests.hostagent.linux_host import LinuxHost, uuid_for


@pytest.fixture
def linux_agent(tmp_path: Path, broker: BrokerServer) -> Iterator[tuple[Agent, LinuxHost]]:
    host = LinuxHost(tmp_path / "host")
    config = AgentConfig(
        host_id="h1",
        brokers=broker.agent_endpoint,
        site="s1",
        pod="p1",
        rack="r1",
        slot_capacity=host.slots,
        driver="linux",
        linux_ports=host.ports,
        proxy_hook=host.hook,
        sysfs_root=host.kernel.root,
        lease_ttl_s=5,
        resync_interval_s=1,
        backoff_base_s=0.05,
        backoff_max_s=0.5,
        workers=2,
    )
    agent = Agent(config, host.driver(device_timeout_s=5))
    agent.start()
    yield agent, host
    agent.stop()
    host.close()


def test_compose_and_release_through_the_linux_driver(
    stubs: Stubs, linux_agent: tuple[Agent, LinuxHost]
) -> None:
    _, host = linux_agent
    stubs.inventory.CreateBox(
        inventory_pb2.CreateBoxRequest(
            box_id="b1",
            box=pb.Box(location=pb.Location(site="s1", pod="p1", rack="r1")),
            gpus=[
                inventory_pb2.GpuSlotSpec(
                    slot=s, model="H100", memory_mib=81920, pci_id="10de:2330"
                )
                for s in range(4)
            ],
        )
    )
    wait_hosts_alive(stubs)

    node = stubs.nodes.ComposeNode(
        nodes_pb2.ComposeNodeRequest(spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=2)))
    )
    wait_until(
        lambda: (
            stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name)).state
            == pb.NODE_STATE_READY
        ),
        20,
        message="the node to become READY",
    )
    ready = stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name))

    mapped = host.mapped()
    assert sorted(g.name for g in mapped.values()) == sorted(b.gpu for b in ready.gpus)
    for binding in ready.gpus:
        gpu = parse_gpu(binding.gpu)
        assert binding.uuid == uuid_for(gpu)  # NVML's answer reached the node
        assert host.kernel.present(binding.bdf)
        assert host.kernel.link_name(f"bus/pci/devices/{binding.bdf}/driver") == "nvidia"
        assert mapped[binding.host_slot] == gpu
    attached = stubs.inventory.ListGpus(inventory_pb2.ListGpusRequest(state=pb.GPU_STATE_ATTACHED))
    assert {g.uuid for g in attached.gpus} == {b.uuid for b in ready.gpus}
    assert all(g.health == pb.GPU_HEALTH_HEALTHY for g in attached.gpus)

    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_until(
        lambda: (
            len(
                stubs.inventory.ListGpus(
                    inventory_pb2.ListGpusRequest(state=pb.GPU_STATE_FREE)
                ).gpus
            )
            == 4
        ),
        20,
        message="every GPU FREE again",
    )
    wait_until(  # the controller's next pass, after the GPUs it waited for are free
        lambda: (
            stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name)).state
            == pb.NODE_STATE_RELEASED
        ),
        10,
        message="the node to be RELEASED",
    )
    assert host.mapped() == {}
    assert not any(host.kernel.present(b.bdf) for b in ready.gpus)
