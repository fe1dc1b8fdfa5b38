"""The agent as a separate process (``python -m dxpool.hostagent``) on a real etcd.

The test writes the host's spec the way the broker does and watches the status record,
the liveness key and the simulated fabric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.fabric.sim import SimFabric
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema

from .conftest import HOST, AgentProcess, wait_for

GPU = "boxes/b1/gpus/2"
Phase = resources_pb2.AttachmentPhase


class Etcd:
    """The records of host h1, read and written as the broker would."""

    def __init__(self, client: Any, keys: KeySchema) -> None:
        self.client = client
        self.keys = keys

    def set_desired(self, *attachments: resources_pb2.DesiredAttachment) -> None:
        record = resources_pb2.HostAllocation(host=f"hosts/{HOST}", attachments=attachments)
        self.client.put(self.keys.host_allocation(HOST), record.SerializeToString())

    def status(self) -> dict[str, resources_pb2.ObservedAttachment]:
        value, _ = self.client.get(self.keys.host_status(HOST))
        if value is None:
            return {}
        return {e.gpu: e for e in resources_pb2.HostStatus.FromString(value).attachments}

    def phase(self, gpu: str) -> int | None:
        entry = self.status().get(gpu)
        return entry.phase if entry is not None else None

    def alive(self) -> bool:
        return self.client.get(self.keys.host_lease(HOST))[0] is not None


@pytest.fixture
def etcd(etcd_server: EmbeddedEtcd, key_prefix: str) -> Iterator[Etcd]:
    client = connect(etcd_server.endpoint)
    yield Etcd(client, KeySchema(key_prefix))
    client.close()


def desired(generation: int = 1, host_slot: int = 1) -> resources_pb2.DesiredAttachment:
    return resources_pb2.DesiredAttachment(
        gpu=GPU, host_slot=host_slot, node="nodes/n1", generation=generation, model="H100"
    )


def started(agent: AgentProcess, etcd: Etcd) -> AgentProcess:
    wait_for(lambda: etcd.alive() or agent.process.poll() is not None, what="agent registration")
    assert agent.process.poll() is None, agent.log()
    return agent


def test_attach_then_detach_round_trip(
    start_agent: Callable[..., AgentProcess], etcd: Etcd, sim_fabric: SimFabric
) -> None:
    agent = started(start_agent(), etcd)

    etcd.set_desired(desired())
    wait_for(lambda: etcd.phase(GPU) == Phase.ATTACHMENT_PHASE_ATTACHED, what="ATTACHED")
    entry = etcd.status()[GPU]
    assert entry.bdf == "0000:42:00.0"
    assert entry.uuid == sim_fabric.identity(HOST, entry.bdf).uuid
    assert sim_fabric.mappings(HOST) == {1: ("b1", 2)}

    etcd.set_desired()
    wait_for(lambda: GPU not in etcd.status(), what="status entry removed")
    assert sim_fabric.mappings(HOST) == {}
    assert sim_fabric.devices(HOST) == []

    assert agent.terminate() == 0, agent.log()


def test_injected_map_fault_retries_then_fails(
    start_agent: Callable[..., AgentProcess], etcd: Etcd, sim_fabric: SimFabric
) -> None:
    sim_fabric.inject_fault("map", box="b1", slot=2, count=10, message="proxy table locked")
    started(start_agent(attach_attempts=3), etcd)

    etcd.set_desired(desired(generation=4))
    wait_for(lambda: etcd.phase(GPU) == Phase.ATTACHMENT_PHASE_FAILED, what="FAILED")

    entry = etcd.status()[GPU]
    assert entry.generation == 4
    assert "after 3 attempt(s)" in entry.message
    assert "proxy table locked" in entry.message
    assert sim_fabric.mappings(HOST) == {}


def test_sigterm_removes_the_liveness_key_at_once(
    start_agent: Callable[..., AgentProcess], etcd: Etcd
) -> None:
    agent = started(start_agent(lease_ttl=30), etcd)

    stopped_at = time.monotonic()
    assert agent.terminate() == 0, agent.log()

    assert not etcd.alive()
    assert time.monotonic() - stopped_at < 25  # below the 30 s TTL, even on a busy machine


def test_liveness_key_outlives_its_ttl_while_running_and_expires_after_sigkill(
    start_agent: Callable[..., AgentProcess], etcd: Etcd
) -> None:
    agent = started(start_agent(lease_ttl=2), etcd)
    time.sleep(3)  # longer than the TTL: the keep-alive holds the key
    assert etcd.alive()

    agent.kill()
    killed_at = time.monotonic()
    wait_for(lambda: not etcd.alive(), timeout_s=6, what="lease expiry")
    assert time.monotonic() - killed_at >= 1.0  # etcd, not the agent, removed it


@pytest.mark.parametrize(
    "slow_step",
    [{"map_delay": 1.5}, {"sim_hotplug_delay": 1.5}],
    ids=["during-proxy-mapping", "after-mapping-during-hotplug"],
)
def test_agent_killed_mid_attach_converges_after_restart(
    start_agent: Callable[..., AgentProcess],
    etcd: Etcd,
    sim_fabric: SimFabric,
    slow_step: dict[str, float],
) -> None:
    first = started(start_agent(**slow_step), etcd)
    etcd.set_desired(desired())
    wait_for(lambda: etcd.phase(GPU) == Phase.ATTACHMENT_PHASE_ATTACHING, what="ATTACHING")
    time.sleep(0.5)  # inside the slow step
    first.kill()

    started(start_agent(), etcd)
    wait_for(lambda: etcd.phase(GPU) == Phase.ATTACHMENT_PHASE_ATTACHED, what="ATTACHED")

    assert sim_fabric.mappings(HOST) == {1: ("b1", 2)}
    assert len(sim_fabric.devices(HOST)) == 1
    assert etcd.status()[GPU].bdf == "0000:42:00.0"


def test_resync_repairs_hardware_drift(
    start_agent: Callable[..., AgentProcess], etcd: Etcd, sim_fabric: SimFabric
) -> None:
    started(start_agent(), etcd)
    etcd.set_desired(desired())
    wait_for(lambda: etcd.phase(GPU) == Phase.ATTACHMENT_PHASE_ATTACHED, what="ATTACHED")

    sim_fabric.unmap("b1", 2, HOST)  # the mapping vanishes behind the agent's back

    wait_for(lambda: sim_fabric.mappings(HOST) == {1: ("b1", 2)}, what="re-attach by resync")
    wait_for(lambda: len(sim_fabric.devices(HOST)) == 1, what="device back on the bus")
    # The device is back before the agent has verified it and reported ATTACHED again.
    wait_for(lambda: etcd.phase(GPU) == Phase.ATTACHMENT_PHASE_ATTACHED, what="ATTACHED again")
