"""Scrub on release: a GPU returns to the pool only on the agent's explicit "scrubbed
clean" report, and a GPU that fails its scrub is quarantined, never FREE.

The first tests run a real agent with a broker that holds no GPU or node record: the test
writes the spec as a compose would and plays the rest of the broker's part itself, so it
can check what the agent does between reporting a failed scrub and the quarantine being
recorded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.fabric.sim import SimGpuSpec
from dxpool.hostagent.agent import Agent
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.drivers.sim import make_sim_driver
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.integration.test_gpu_health import gpu_record
from tests.integration.test_node_lifecycle import compose, wait_state

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer

GPU = "boxes/box1/gpus/0"


@pytest.fixture
def agent_store(
    sim_pool: SimPool, broker: BrokerServer, etcd_client: Any, key_prefix: str
) -> Iterator[tuple[Agent, Store]]:
    """An agent for h1 in this process, and a store to play the broker's part with."""
    sim_pool.fabric.add_host("h1", 8)
    sim_pool.fabric.add_box("box1", [SimGpuSpec("H100", 81920)])
    config = AgentConfig(
        host_id="h1",
        brokers=broker.agent_endpoint,
        site="s1",
        pod="p1",
        rack="r1",
        sim_state_dir=sim_pool.state_dir / "fabric",
        lease_ttl_s=5,
        resync_interval_s=0.2,
        detach_attempts=2,
        backoff_base_s=0.05,
        workers=1,
    )
    agent = Agent(config, make_sim_driver(sim_pool.fabric, "h1", device_timeout_s=5))
    agent.start()
    store = Store(etcd_client, KeySchema(key_prefix))
    yield agent, store
    agent.stop()


def entry(store: Store) -> pb.ObservedAttachment | None:
    record = store.get(store.keys.host_status("h1"))
    found = [a for a in record.value.attachments if a.gpu == GPU] if record else []
    return found[0] if found else None


def put_spec(store: Store, *attachments: pb.DesiredAttachment) -> None:
    spec = pb.HostAllocation(host="hosts/h1", attachments=attachments)
    store.commit(Txn().put(store.keys.host_allocation("h1"), spec))


def test_a_failed_scrub_keeps_entry_and_mapping_until_the_quarantine_is_recorded(
    sim_pool: SimPool, agent_store: tuple[Agent, Store]
) -> None:
    """The interleaving that freed failed GPUs: the agent reported the failure, then
    unmapped the GPU and removed its entry before the broker had read the report; the
    broker saw "no entry" and freed it. Now the agent, having reported SCRUB_FAILED,
    touches nothing while the spec still lists the release, however long the broker
    takes; only when the spec drops the GPU (the quarantine's transaction) does it
    detach it and remove the entry."""
    _agent, store = agent_store
    want = pb.DesiredAttachment(gpu=GPU, host_slot=0, node="nodes/n1", generation=1)
    put_spec(store, want)
    wait_until(lambda: (e := entry(store)) and e.phase == pb.ATTACHMENT_PHASE_ATTACHED)

    sim_pool.fabric.inject_fault("reset", box="box1", slot=0, count=10, message="FLR timed out")
    released = pb.DesiredAttachment()
    released.CopyFrom(want)
    released.release = True
    put_spec(store, released)
    wait_until(lambda: (e := entry(store)) and e.phase == pb.ATTACHMENT_PHASE_SCRUB_FAILED)
    reported = entry(store)
    assert reported is not None and "FLR timed out" in reported.message
    assert reported.generation == 1

    # The broker is held: several resyncs pass, and the agent keeps both.
    time.sleep(1.5)
    held = entry(store)
    assert held is not None and held.phase == pb.ATTACHMENT_PHASE_SCRUB_FAILED
    assert sim_pool.fabric.mapping("box1", 0) == ("h1", 0)

    # The quarantine is recorded: the GPU leaves the spec in the same transaction.
    put_spec(store)
    wait_until(lambda: entry(store) is None, message="the entry to go")
    assert sim_pool.fabric.mapping("box1", 0) is None


def test_a_clean_release_is_reported_before_the_entry_goes(
    sim_pool: SimPool, agent_store: tuple[Agent, Store]
) -> None:
    """RELEASED is written after the scrub and the detach and stays until the broker has
    freed the GPU (dropped it from the spec)."""
    _agent, store = agent_store
    want = pb.DesiredAttachment(gpu=GPU, host_slot=0, node="nodes/n1", generation=1)
    put_spec(store, want)
    wait_until(lambda: (e := entry(store)) and e.phase == pb.ATTACHMENT_PHASE_ATTACHED)
    released = pb.DesiredAttachment()
    released.CopyFrom(want)
    released.release = True
    put_spec(store, released)

    wait_until(lambda: (e := entry(store)) and e.phase == pb.ATTACHMENT_PHASE_RELEASED)
    reported = entry(store)
    assert reported is not None and reported.scrubbed
    assert sim_pool.fabric.mapping("box1", 0) is None
    time.sleep(0.6)
    assert entry(store) is not None  # kept while the spec lists the release

    put_spec(store)
    wait_until(lambda: entry(store) is None, message="the entry to go")


def test_a_gpu_failing_its_scrub_through_the_broker_is_quarantined_never_free(
    stubs: Stubs, sim_pool: SimPool, etcd_client: object, key_prefix: str
) -> None:
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    sim_pool.start_agent("h1", extra=("--detach-attempts", "2"))
    wait_hosts_alive(stubs)
    node = wait_state(stubs, compose(stubs, "H100:2").name, pb.NODE_STATE_READY)
    seen: list[int] = []
    store = Store(etcd_client, KeySchema(key_prefix))
    stop = threading.Event()

    def record_states() -> None:
        while not stop.is_set():
            found = store.get(store.keys.gpu("box1", 0))
            if found is not None and (not seen or seen[-1] != found.value.state):
                seen.append(found.value.state)
            time.sleep(0.002)

    watcher = threading.Thread(target=record_states, daemon=True)
    watcher.start()
    sim_pool.fabric.inject_fault("reset", box="box1", slot=0, count=10, message="FLR timed out")

    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_state(stubs, node.name, pb.NODE_STATE_RELEASED)
    wait_until(
        lambda: sim_pool.fabric.mapping("box1", 0) is None,
        message="the quarantined GPU to be detached",
    )
    stop.set()
    watcher.join()

    failed = gpu_record(stubs, GPU)
    assert failed.state == pb.GPU_STATE_QUARANTINED
    assert "FLR timed out" in failed.message
    assert pb.GPU_STATE_FREE not in seen
    assert gpu_record(stubs, "boxes/box1/gpus/1").state == pb.GPU_STATE_FREE
