"""The node controller against a real etcd, driven pass by pass (its thread not started)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.cache import Cache
from dxpool.broker.controller import GPUS_PER_TXN, NodeController
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn


@pytest.fixture
def parts(etcd_client, key_prefix: str) -> Iterator[tuple[Store, Cache, NodeController]]:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    store = Store(etcd_client, schema)
    cache = Cache(etcd_client, schema)
    cache.start()
    yield store, cache, NodeController(store, cache)
    cache.stop()
    store.health.close()


def detaching(store: Store, host: str, slots: range) -> int:
    """GPUs of box b1 DETACHING from ``host`` (its agent reports none of them any more),
    written in one transaction; returns its revision."""
    txn = Txn()
    for slot in slots:
        gpu = pb.Gpu(
            name=f"boxes/b1/gpus/{slot}",
            model="H100",
            state=pb.GPU_STATE_DETACHING,
            host=f"hosts/{host}",
            host_slot=slot,
            generation=1,
        )
        txn.put(store.keys.gpu("b1", slot), gpu)
    return store.commit(txn).revision


def test_a_hosts_detached_gpus_are_freed_in_one_transaction(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    assert cache.wait_for_revision(detaching(store, "h1", range(8)), 10)

    controller.sweep()

    records = [store.get(store.keys.gpu("b1", slot)) for slot in range(8)]
    assert all(r is not None and r.value.state == pb.GPU_STATE_FREE for r in records)
    assert len({r.mod_revision for r in records if r is not None}) == 1


def test_more_gpus_than_one_transaction_holds_are_freed_in_chunks(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    count = GPUS_PER_TXN + 4
    assert cache.wait_for_revision(detaching(store, "h1", range(count)), 10)

    controller.sweep()

    records = [store.get(store.keys.gpu("b1", slot)) for slot in range(count)]
    assert all(r is not None and r.value.state == pb.GPU_STATE_FREE for r in records)
    assert len({r.mod_revision for r in records if r is not None}) == 2


def test_a_gpu_still_reported_by_its_agent_is_not_freed(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    status = pb.HostStatus(
        host="hosts/h1",
        attachments=[
            pb.ObservedAttachment(
                gpu="boxes/b1/gpus/3", phase=pb.ATTACHMENT_PHASE_DETACHING, generation=1
            )
        ],
    )
    store.commit(Txn().put(store.keys.host_status("h1"), status))
    assert cache.wait_for_revision(detaching(store, "h1", range(8)), 10)

    controller.sweep()

    states = {
        slot: r.value.state
        for slot in range(8)
        if (r := store.get(store.keys.gpu("b1", slot))) is not None
    }
    assert states[3] == pb.GPU_STATE_DETACHING
    assert all(states[s] == pb.GPU_STATE_FREE for s in range(8) if s != 3)


def test_an_attach_the_agent_reports_failed_fails_the_node_with_a_warning_event(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    gpu = pb.Gpu(
        name="boxes/b1/gpus/0",
        box="boxes/b1",
        model="H100",
        state=pb.GPU_STATE_ATTACHING,
        node="nodes/n1",
        host="hosts/h1",
        generation=3,
    )
    node = pb.VirtualNode(
        name="nodes/n1",
        host="hosts/h1",
        state=pb.NODE_STATE_PENDING,
        gpus=[pb.GpuBinding(gpu=gpu.name)],
    )
    node.attach_deadline.seconds = 2**40  # far away: only the agent's report can fail it
    node.events.add(type="Normal", reason="Composed", message="composed")
    status = pb.HostStatus(
        host="hosts/h1",
        attachments=[
            pb.ObservedAttachment(
                gpu=gpu.name,
                generation=3,
                phase=pb.ATTACHMENT_PHASE_FAILED,
                message="proxy map refused",
            )
        ],
    )
    txn = Txn().put(store.keys.gpu("b1", 0), gpu).put(store.keys.node("n1"), node)
    txn.put(store.keys.host_status("h1"), status)
    assert cache.wait_for_revision(store.commit(txn).revision, 10)

    controller.sweep()

    stored = store.get(store.keys.node("n1"))
    assert stored is not None and stored.value.state == pb.NODE_STATE_FAILED
    events = [(e.type, e.reason) for e in stored.value.events]
    assert events == [("Normal", "Composed"), ("Warning", "AttachFailed")]
    assert "proxy map refused" in stored.value.events[-1].message
