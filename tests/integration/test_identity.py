"""Identity that persists: the first attach records a GPU's UUID and serial; later
attaches verify them, and a GPU that is not the one recorded is quarantined as suspect.
A real broker, etcd and agent over the simulated fabric."""

from __future__ import annotations

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.fabric._sim_types import SimGpuSpec, gpu_serial, gpu_uuid
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.conftest import (
    SimPool,
    Stubs,
    add_box,
    register_sim_box,
    wait_hosts_alive,
    wait_until,
)
from tests.integration.test_gpu_health import gpu_record
from tests.integration.test_node_lifecycle import compose, wait_state

GPU = "boxes/box1/gpus/0"


def test_the_first_attach_records_identity_and_later_attaches_carry_it(
    stubs: Stubs, sim_pool: SimPool, etcd_client: object, key_prefix: str
) -> None:
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    assert (gpu_record(stubs, GPU).uuid, gpu_record(stubs, GPU).serial) == ("", "")

    first = wait_state(stubs, compose(stubs, "H100:1").name, pb.NODE_STATE_READY)
    recorded = gpu_record(stubs, GPU)
    assert (recorded.uuid, recorded.serial) == (gpu_uuid("box1", 0), gpu_serial("box1", 0))
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=first.name))
    wait_state(stubs, first.name, pb.NODE_STATE_RELEASED)

    second = compose(stubs, "H100:1")
    store = Store(etcd_client, KeySchema(key_prefix))
    spec = store.get(store.keys.host_allocation("h1"))
    assert spec is not None
    [want] = [a for a in spec.value.attachments if a.node == second.name]
    assert (want.expected_uuid, want.expected_serial) == (recorded.uuid, recorded.serial)
    wait_state(stubs, second.name, pb.NODE_STATE_READY)


def test_a_gpu_whose_serial_changed_fails_its_attach_and_is_quarantined_as_suspect(
    stubs: Stubs, sim_pool: SimPool, etcd_client: object, key_prefix: str
) -> None:
    """The slot's GPU was swapped since its first attach: the inventory recorded another
    serial. The agent refuses the device, the node fails naming both serials, and the GPU
    is quarantined rather than freed for the next node."""
    register_sim_box(sim_pool, stubs, "box1", gpus=1)
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    store = Store(etcd_client, KeySchema(key_prefix))
    record = store.get(store.keys.gpu("box1", 0))
    assert record is not None
    earlier = pb.Gpu()
    earlier.CopyFrom(record.value)
    earlier.uuid = gpu_uuid("box1", 0)
    earlier.serial = "1650000000001"
    store.commit(
        Txn()
        .expect_revision(store.keys.gpu("box1", 0), record.mod_revision)
        .put(store.keys.gpu("box1", 0), earlier)
    )
    wait_until(lambda: gpu_record(stubs, GPU).serial == "1650000000001")

    node = wait_state(stubs, compose(stubs, "H100:1").name, pb.NODE_STATE_FAILED)

    assert "expected 1650000000001" in node.message
    suspect = gpu_record(stubs, GPU)
    assert suspect.state == pb.GPU_STATE_QUARANTINED
    assert suspect.message.startswith("suspect identity: ")
    assert gpu_serial("box1", 0) in suspect.message
    wait_until(
        lambda: sim_pool.fabric.mapping("box1", 0) is None,
        message="the refused device to be unmapped",
    )


def test_a_box_registered_with_the_wrong_model_has_every_attached_gpu_quarantined(
    stubs: Stubs, sim_pool: SimPool
) -> None:
    """The fabric holds A100s where the inventory says H100. One GPU's refusal arrives
    first (the other's attach is retried once); the node fails only once both outcomes
    are in, so both GPUs are quarantined and the next compose is not handed either."""
    sim_pool.fabric.add_box("box6", [SimGpuSpec("A100", 81920) for _ in range(2)])
    add_box(stubs, "box6", gpus=2, model="H100")
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    sim_pool.fabric.inject_fault("map", box="box6", slot=0, message="proxy busy")

    node = compose(stubs, "H100:2")
    assert {b.gpu for b in node.gpus} == {"boxes/box6/gpus/0", "boxes/box6/gpus/1"}
    failed = wait_state(stubs, node.name, pb.NODE_STATE_FAILED)

    for name in ("boxes/box6/gpus/0", "boxes/box6/gpus/1"):
        assert f"{name}: attach failed" in failed.message
        wait_until(
            lambda name=name: gpu_record(stubs, name).state == pb.GPU_STATE_QUARANTINED,
            message=f"{name} quarantined",
        )
        assert "reports model 'A100', expected 'H100'" in gpu_record(stubs, name).message
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    second = compose(stubs, "H100:2")
    assert {b.gpu for b in second.gpus} == {"boxes/box1/gpus/0", "boxes/box1/gpus/1"}
    wait_state(stubs, second.name, pb.NODE_STATE_READY)
