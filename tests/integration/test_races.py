"""Interleavings forced on purpose: an agent held between reading its spec and acting.

The agent here runs in the test process over the simulated fabric, with a driver that
blocks in ``observe()`` on demand, so the test decides exactly what the broker does while
the agent is between its read of the desired state and its first write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.hostagent.agent import Agent
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.driver import AttachedGpu, AttachRequest, FabricDriver
from dxpool.hostagent.drivers.sim import make_sim_driver
from dxpool.names import GpuRef
from dxpool.store.client import connect
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.integration.test_node_lifecycle import compose, wait_state
from tests.patience import patient

GPU = GpuRef("box1", 0)


@dataclass
class HeldDriver:
    """A fabric driver whose ``observe`` blocks while ``armed``, and that records attaches."""

    inner: FabricDriver
    armed: bool = False
    arrived: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    attaches: list[AttachRequest] = field(default_factory=list)

    @property
    def capabilities(self) -> Any:
        return self.inner.capabilities

    def observe(self) -> dict[GpuRef, AttachedGpu]:
        if self.armed:
            self.arrived.set()
            assert self.go.wait(patient(30)), "the test never let the agent go"
        return self.inner.observe()

    def attach(self, request: AttachRequest) -> AttachedGpu:
        self.attaches.append(request)
        return self.inner.attach(request)

    def detach(self, gpu: GpuRef, *, force: bool = False) -> None:
        self.inner.detach(gpu, force=force)

    def scrub(self, gpu: GpuRef, *, force: bool = False) -> None:
        self.inner.scrub(gpu, force=force)


@pytest.fixture
def held_agent(sim_pool: SimPool) -> Iterator[tuple[Agent, HeldDriver]]:
    sim_pool.fabric.add_host("h1", 8)
    config = AgentConfig(
        host_id="h1",
        etcd_endpoints=sim_pool.etcd_endpoint,
        key_prefix=sim_pool.key_prefix,
        site="s1",
        pod="p1",
        rack="r1",
        sim_state_dir=sim_pool.state_dir / "fabric",
        lease_ttl_s=5,
        workers=1,
    )
    driver = HeldDriver(make_sim_driver(sim_pool.fabric, "h1", device_timeout_s=5))
    client = connect(sim_pool.etcd_endpoint)
    agent = Agent(config, driver, client)  # type: ignore[arg-type]
    agent.start()
    yield agent, driver
    driver.go.set()
    agent.stop()
    client.close()


def gpu_record(stubs: Stubs, gpu: GpuRef) -> pb.Gpu:
    from dxpool.api.v1 import inventory_pb2

    return stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=gpu.name))


def test_a_gpu_released_while_its_agent_is_held_is_never_mapped(
    stubs: Stubs, sim_pool: SimPool, held_agent: tuple[Agent, HeldDriver]
) -> None:
    """Defect: the agent read its spec, stalled in observe(), the node was released and
    the GPU freed; the agent then wrote ATTACHING from its stale view and mapped a FREE
    GPU. Now the claim compares the spec revision, fails, and nothing is mapped; and the
    GPU is not freed at all until the agent reports the release's outcome."""
    _agent, driver = held_agent
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    wait_hosts_alive(stubs)
    driver.armed = True

    node = compose(stubs, "H100:1")
    assert driver.arrived.wait(patient(10)), "the agent never picked up the GPU"
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_state(stubs, node.name, pb.NODE_STATE_RELEASING)
    time.sleep(1.0)  # the controller has had passes enough to free it, were it going to
    assert gpu_record(stubs, GPU).state == pb.GPU_STATE_DETACHING

    driver.armed = False
    driver.go.set()
    wait_state(stubs, node.name, pb.NODE_STATE_RELEASED)
    # Give the held worker time to act on its stale decision, if it were going to.
    wait_until(held_agent[0].idle, message="the agent to go idle")

    assert driver.attaches == []
    assert sim_pool.fabric.mapping("box1", 0) is None
    assert gpu_record(stubs, GPU).state == pb.GPU_STATE_FREE


def test_a_gpu_reassigned_while_its_old_agent_is_held_stays_with_the_new_host(
    stubs: Stubs, sim_pool: SimPool, held_agent: tuple[Agent, HeldDriver]
) -> None:
    """The same race, with another host asking for the GPU: it cannot have it while the
    held agent has not reported the release, and gets it once the agent resumes and
    reports; the held agent neither maps it nor claims it."""
    _agent, driver = held_agent
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    sim_pool.start_agent("h2")
    wait_hosts_alive(stubs, 2)
    driver.armed = True

    first = compose(stubs, "H100:1", host="hosts/h1")
    assert driver.arrived.wait(patient(10))
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=first.name))
    wait_state(stubs, first.name, pb.NODE_STATE_RELEASING)
    with pytest.raises(grpc.RpcError) as taken:
        compose(stubs, "H100:1", host="hosts/h2")
    assert taken.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    driver.armed = False
    driver.go.set()
    wait_state(stubs, first.name, pb.NODE_STATE_RELEASED)
    wait_until(held_agent[0].idle, message="the agent to go idle")
    second = compose(stubs, "H100:1", host="hosts/h2")
    wait_state(stubs, second.name, pb.NODE_STATE_READY)

    assert driver.attaches == []
    assert sim_pool.fabric.mapping("box1", 0)[0] == "h2"  # type: ignore[index]
    gpu = gpu_record(stubs, GPU)
    assert (gpu.state, gpu.node, gpu.host) == (pb.GPU_STATE_ATTACHED, second.name, "hosts/h2")


def test_a_box_cordoned_between_placement_and_commit_is_not_used(
    broker: Any, stubs: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    """A compose places once, then waits for its host's lock; the box it chose is
    cordoned meanwhile. The re-check under the lock sees it, so the node never lands on
    the cordoned box."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from dxpool.api.v1 import inventory_pb2
    from dxpool.store.keys import KeySchema
    from tests.conftest import add_box

    keys = KeySchema(key_prefix)
    host = pb.Host(
        name="hosts/h1", location=pb.Location(site="s1", pod="p1", rack="r1"), slot_capacity=8
    )
    etcd_client.put(keys.host("h1"), host.SerializeToString())
    etcd_client.put(keys.host_lease("h1"), b"")
    add_box(stubs, "box1", gpus=1)
    wait_until(lambda: broker.index.snapshot().hosts.get("h1") is not None, message="host")
    composer = broker.nodes._composer
    with ThreadPoolExecutor(1) as pool:
        with composer._host_locks.lock("h1"):
            composing = pool.submit(compose, stubs, "H100:1")
            wait_until(
                lambda: composer._host_locks.waiting("h1") > 0, message="compose at the lock"
            )
            stubs.inventory.CordonBox(inventory_pb2.CordonBoxRequest(name="boxes/box1"))
        with pytest.raises(grpc.RpcError) as refused:
            composing.result(timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert gpu_record(stubs, GPU).state == pb.GPU_STATE_FREE
