"""The node controller against a real etcd, driven pass by pass (its thread not started)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.controller import GPUS_PER_TXN, NodeController
from dxpool.broker.state.cache import Cache
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.conftest import wait_until


@pytest.fixture
def parts(etcd_client, key_prefix: str) -> Iterator[tuple[Store, Cache, NodeController]]:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    store = Store(etcd_client, schema)
    cache = Cache(etcd_client, schema)
    cache.start()
    yield store, cache, NodeController(store, cache)
    cache.stop()
    store.health.close()


def detaching(
    store: Store,
    host: str,
    slots: range,
    *,
    phase: pb.AttachmentPhase.ValueType = pb.ATTACHMENT_PHASE_RELEASED,
    reported: range | None = None,
    node: pb.VirtualNode | None = None,
) -> int:
    """GPUs of box b1 DETACHING from ``host``, each with its ``release`` attachment in the
    host's spec; the agent reports ``phase`` for the ``reported`` ones (default: all).
    With ``node``, the GPUs are its (and it is written too). Written in one transaction;
    returns its revision."""
    txn = Txn()
    spec = pb.HostAllocation(host=f"hosts/{host}")
    status = pb.HostStatus(host=f"hosts/{host}")
    for slot in slots:
        name = f"boxes/b1/gpus/{slot}"
        spec.attachments.add(gpu=name, host_slot=slot, node="nodes/n1", generation=1, release=True)
        if reported is None or slot in reported:
            status.attachments.add(gpu=name, generation=1, phase=phase, host_slot=slot)
    txn.put(store.keys.host_allocation(host), spec).put(store.keys.host_status(host), status)
    for slot in slots:
        gpu = pb.Gpu(
            name=f"boxes/b1/gpus/{slot}",
            model="H100",
            state=pb.GPU_STATE_DETACHING,
            host=f"hosts/{host}",
            host_slot=slot,
            generation=1,
            node=node.name if node is not None else "",
        )
        txn.put(store.keys.gpu("b1", slot), gpu)
    if node is not None:
        txn.put(store.keys.node(node.name.removeprefix("nodes/")), node)
    return store.commit(txn).revision


def releasing_node(slots: range) -> pb.VirtualNode:
    return pb.VirtualNode(
        name="nodes/n1",
        host="hosts/h1",
        state=pb.NODE_STATE_RELEASING,
        gpus=[pb.GpuBinding(gpu=f"boxes/b1/gpus/{slot}", host_slot=slot) for slot in slots],
    )


def test_a_released_nodes_last_gpus_are_freed_with_the_node_in_one_transaction(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    node = releasing_node(range(2))
    assert cache.wait_for_revision(detaching(store, "h1", range(2), node=node), 10)

    controller.sweep()

    released = store.get(store.keys.node("n1"))
    gpu = store.get(store.keys.gpu("b1", 0))
    assert released is not None and released.value.state == pb.NODE_STATE_RELEASED
    assert gpu is not None and gpu.value.state == pb.GPU_STATE_FREE
    assert released.mod_revision == gpu.mod_revision


def test_a_released_node_with_a_gpu_still_detaching_stays_releasing(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    node = releasing_node(range(2))
    assert cache.wait_for_revision(
        detaching(store, "h1", range(2), node=node, reported=range(1)), 10
    )

    controller.sweep()

    record = store.get(store.keys.node("n1"))
    assert record is not None and record.value.state == pb.NODE_STATE_RELEASING
    freed = store.get(store.keys.gpu("b1", 0))
    assert freed is not None and freed.value.state == pb.GPU_STATE_FREE


def test_a_hosts_detached_gpus_are_freed_in_one_transaction(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    assert cache.wait_for_revision(detaching(store, "h1", range(8)), 10)

    controller.sweep()

    records = [store.get(store.keys.gpu("b1", slot)) for slot in range(8)]
    assert all(r is not None and r.value.state == pb.GPU_STATE_FREE for r in records)
    assert len({r.mod_revision for r in records if r is not None}) == 1
    spec = store.get(store.keys.host_allocation("h1"))
    assert spec is not None and list(spec.value.attachments) == []
    assert spec.mod_revision == records[0].mod_revision  # the outcome and the spec together


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


def test_a_gpu_still_detaching_is_not_freed(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    assert cache.wait_for_revision(detaching(store, "h1", range(8)), 10)
    status = store.get(store.keys.host_status("h1"))
    assert status is not None
    updated = pb.HostStatus()
    updated.CopyFrom(status.value)
    updated.attachments[3].phase = pb.ATTACHMENT_PHASE_DETACHING
    assert cache.wait_for_revision(
        store.commit(Txn().put(store.keys.host_status("h1"), updated)).revision, 10
    )

    controller.sweep()

    states = {
        slot: r.value.state
        for slot in range(8)
        if (r := store.get(store.keys.gpu("b1", slot))) is not None
    }
    assert states[3] == pb.GPU_STATE_DETACHING
    assert all(states[s] == pb.GPU_STATE_FREE for s in range(8) if s != 3)


def in_use_node(store: Store, health: pb.GpuHealth.ValueType) -> int:
    """Node n1 READY on h1 with GPU b1/0 ATTACHED (generation 1), whose agent reports
    ``health`` for it; returns the revision of the write."""
    gpu = pb.Gpu(
        name="boxes/b1/gpus/0",
        model="H100",
        state=pb.GPU_STATE_ATTACHED,
        health=pb.GPU_HEALTH_HEALTHY,
        node="nodes/n1",
        host="hosts/h1",
        generation=1,
    )
    node = pb.VirtualNode(
        name="nodes/n1",
        host="hosts/h1",
        state=pb.NODE_STATE_READY,
        gpus=[pb.GpuBinding(gpu=gpu.name, phase=pb.ATTACHMENT_PHASE_ATTACHED)],
    )
    status = pb.HostStatus(
        host="hosts/h1",
        attachments=[
            pb.ObservedAttachment(
                gpu=gpu.name,
                generation=1,
                phase=pb.ATTACHMENT_PHASE_ATTACHED,
                health=health,
                health_reason="XID 79: GPU has fallen off the bus",
            )
        ],
    )
    txn = Txn().put(store.keys.gpu("b1", 0), gpu).put(store.keys.node("n1"), node)
    return store.commit(txn.put(store.keys.host_status("h1"), status)).revision


def test_an_unhealthy_report_degrades_the_node_and_marks_the_gpu(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    assert cache.wait_for_revision(in_use_node(store, pb.GPU_HEALTH_UNHEALTHY), 10)

    controller._reconcile_node("n1")

    gpu = store.get(store.keys.gpu("b1", 0))
    node = store.get(store.keys.node("n1"))
    assert gpu is not None and node is not None
    assert (gpu.value.health, gpu.value.health_reason) == (
        pb.GPU_HEALTH_UNHEALTHY,
        "XID 79: GPU has fallen off the bus",
    )
    assert gpu.value.state == pb.GPU_STATE_ATTACHED
    assert node.value.state == pb.NODE_STATE_DEGRADED
    assert "boxes/b1/gpus/0: XID 79" in node.value.message
    assert gpu.mod_revision == node.mod_revision  # one transaction


def test_a_release_between_the_health_read_and_its_commit_is_not_lost(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    """The health pass reads the GPU and node, then a release commits (GPU DETACHING,
    node RELEASING) before the pass commits. Its compare fails; it reads again, finds
    the node RELEASING and writes nothing: the release stands."""
    store, cache, controller = parts
    assert cache.wait_for_revision(in_use_node(store, pb.GPU_HEALTH_UNHEALTHY), 10)
    commit = store.commit
    released: list[int] = []

    def release_first(txn: Txn) -> object:
        if not released:
            gpu = store.get(store.keys.gpu("b1", 0))
            node = store.get(store.keys.node("n1"))
            assert gpu is not None and node is not None
            detaching = pb.Gpu()
            detaching.CopyFrom(gpu.value)
            detaching.state = pb.GPU_STATE_DETACHING
            releasing = pb.VirtualNode()
            releasing.CopyFrom(node.value)
            releasing.state = pb.NODE_STATE_RELEASING
            competing = Txn().put(store.keys.gpu("b1", 0), detaching)
            released.append(commit(competing.put(store.keys.node("n1"), releasing)).revision)
        return commit(txn)

    store.commit = release_first  # type: ignore[method-assign]
    controller._reconcile_node("n1")

    assert released, "the health pass never tried to commit"
    gpu = store.get(store.keys.gpu("b1", 0))
    node = store.get(store.keys.node("n1"))
    assert gpu is not None and node is not None
    assert gpu.value.state == pb.GPU_STATE_DETACHING
    assert node.value.state == pb.NODE_STATE_RELEASING
    assert gpu.mod_revision == released[0]  # nothing written over the release


def test_a_recovered_gpu_makes_a_degraded_node_ready(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    assert cache.wait_for_revision(in_use_node(store, pb.GPU_HEALTH_UNHEALTHY), 10)
    controller._reconcile_node("n1")
    status = store.get(store.keys.host_status("h1"))
    assert status is not None
    healthy = pb.HostStatus()
    healthy.CopyFrom(status.value)
    healthy.attachments[0].health = pb.GPU_HEALTH_HEALTHY
    healthy.attachments[0].health_reason = ""
    revision = store.commit(Txn().put(store.keys.host_status("h1"), healthy)).revision
    assert cache.wait_for_revision(revision, 10)

    controller._reconcile_node("n1")

    gpu = store.get(store.keys.gpu("b1", 0))
    node = store.get(store.keys.node("n1"))
    assert gpu is not None and node is not None
    assert gpu.value.health == pb.GPU_HEALTH_HEALTHY
    assert node.value.state == pb.NODE_STATE_READY


def test_a_gpu_without_a_reported_outcome_is_never_freed(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    """No entry is no outcome: an agent that reported a failure and then dropped the
    entry (the old protocol) must not get the GPU freed."""
    store, cache, controller = parts
    assert cache.wait_for_revision(detaching(store, "h1", range(2), reported=range(0)), 10)

    controller.sweep()

    for slot in range(2):
        record = store.get(store.keys.gpu("b1", slot))
        assert record is not None and record.value.state == pb.GPU_STATE_DETACHING
    spec = store.get(store.keys.host_allocation("h1"))
    assert spec is not None and len(spec.value.attachments) == 2


def test_a_failed_scrub_quarantines_the_gpu_and_drops_it_from_the_spec(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    revision = detaching(store, "h1", range(2), phase=pb.ATTACHMENT_PHASE_SCRUB_FAILED)
    assert cache.wait_for_revision(revision, 10)

    controller.sweep()

    for slot in range(2):
        record = store.get(store.keys.gpu("b1", slot))
        assert record is not None
        assert record.value.state == pb.GPU_STATE_QUARANTINED
        assert record.value.host == "hosts/h1"  # it may still be mapped there
        assert "release failed on hosts/h1" in record.value.message
    spec = store.get(store.keys.host_allocation("h1"))
    assert spec is not None and list(spec.value.attachments) == []


def attaching_node(store: Store, seen: pb.ObservedAttachment) -> int:
    """Node n1 ATTACHING on h1 with GPU b1/0 (generation 1, recorded UUID GPU-a and
    serial 111), its agent reporting ``seen``; returns the revision of the write."""
    gpu = pb.Gpu(
        name="boxes/b1/gpus/0",
        model="H100",
        state=pb.GPU_STATE_ATTACHING,
        uuid="GPU-a",
        serial="111",
        node="nodes/n1",
        host="hosts/h1",
        generation=1,
    )
    node = pb.VirtualNode(
        name="nodes/n1",
        host="hosts/h1",
        state=pb.NODE_STATE_ATTACHING,
        gpus=[pb.GpuBinding(gpu=gpu.name)],
    )
    node.attach_deadline.seconds = 2**40
    spec = pb.HostAllocation(host="hosts/h1")
    spec.attachments.add(gpu=gpu.name, host_slot=0, node="nodes/n1", generation=1)
    status = pb.HostStatus(host="hosts/h1", attachments=[seen])
    txn = Txn().put(store.keys.gpu("b1", 0), gpu).put(store.keys.node("n1"), node)
    txn.put(store.keys.host_allocation("h1"), spec)
    return store.commit(txn.put(store.keys.host_status("h1"), status)).revision


@pytest.mark.parametrize(
    ("seen", "why"),
    [
        (
            pb.ObservedAttachment(
                phase=pb.ATTACHMENT_PHASE_ATTACHED, uuid="GPU-b", serial="111", bdf="0000:41:00.0"
            ),
            "reports UUID GPU-b, recorded GPU-a",
        ),
        (
            pb.ObservedAttachment(
                phase=pb.ATTACHMENT_PHASE_ATTACHED, uuid="GPU-a", serial="222", bdf="0000:41:00.0"
            ),
            "reports serial 222, recorded 111",
        ),
        (
            pb.ObservedAttachment(
                phase=pb.ATTACHMENT_PHASE_FAILED,
                identity_mismatch=True,
                message="reports UUID GPU-c, expected GPU-a",
            ),
            "reports UUID GPU-c, expected GPU-a",
        ),
    ],
)
def test_a_gpu_with_another_identity_fails_its_node_and_is_quarantined_as_suspect(
    parts: tuple[Store, Cache, NodeController], seen: pb.ObservedAttachment, why: str
) -> None:
    store, cache, controller = parts
    seen.gpu, seen.generation = "boxes/b1/gpus/0", 1
    assert cache.wait_for_revision(attaching_node(store, seen), 10)

    controller._reconcile_node("n1")

    node = store.get(store.keys.node("n1"))
    gpu = store.get(store.keys.gpu("b1", 0))
    spec = store.get(store.keys.host_allocation("h1"))
    assert node is not None and gpu is not None and spec is not None
    assert node.value.state == pb.NODE_STATE_FAILED
    assert why in node.value.message
    assert gpu.value.state == pb.GPU_STATE_QUARANTINED
    assert gpu.value.message.startswith(f"suspect identity: {why}")
    assert (gpu.value.uuid, gpu.value.serial) == ("GPU-a", "111")  # the record stands
    assert list(spec.value.attachments) == []


def test_an_attach_failure_of_another_kind_releases_the_gpu(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    store, cache, controller = parts
    seen = pb.ObservedAttachment(
        gpu="boxes/b1/gpus/0", generation=1, phase=pb.ATTACHMENT_PHASE_FAILED, message="timeout"
    )
    assert cache.wait_for_revision(attaching_node(store, seen), 10)

    controller._reconcile_node("n1")

    gpu = store.get(store.keys.gpu("b1", 0))
    spec = store.get(store.keys.host_allocation("h1"))
    assert gpu is not None and spec is not None
    assert gpu.value.state == pb.GPU_STATE_DETACHING
    assert [a.release for a in spec.value.attachments] == [True]


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


def pending_node(store: Store, node_id: str, host: str, slot: int, deadline_s: int) -> int:
    """Node ``node_id`` PENDING on ``host`` with GPU b1/``slot`` ATTACHING and no report
    from the agent yet, due by ``deadline_s``; returns the revision of the write."""
    gpu = pb.Gpu(
        name=f"boxes/b1/gpus/{slot}",
        model="H100",
        state=pb.GPU_STATE_ATTACHING,
        node=f"nodes/{node_id}",
        host=f"hosts/{host}",
        generation=1,
    )
    node = pb.VirtualNode(
        name=f"nodes/{node_id}",
        host=f"hosts/{host}",
        state=pb.NODE_STATE_PENDING,
        gpus=[pb.GpuBinding(gpu=gpu.name)],
    )
    node.attach_deadline.seconds = deadline_s
    spec = pb.HostAllocation(host=f"hosts/{host}")
    spec.attachments.add(gpu=gpu.name, host_slot=0, node=node.name, generation=1)
    txn = Txn().put(store.keys.gpu("b1", slot), gpu).put(store.keys.node(node_id), node)
    return store.commit(txn.put(store.keys.host_allocation(host), spec)).revision


def test_a_tick_looks_only_at_attaching_nodes_whose_deadline_passed(
    parts: tuple[Store, Cache, NodeController],
) -> None:
    """Between full sweeps, a node in flight costs nothing until its attach deadline:
    the tick fails the overdue node and never looks at the one still within its time."""
    store, cache, _ = parts
    now = [1_000_000.0]
    assert cache.wait_for_revision(pending_node(store, "late", "h1", 0, 1_000_100), 10)
    assert cache.wait_for_revision(pending_node(store, "waiting", "h2", 1, 2**40), 10)
    controller = NodeController(
        store, cache, sweep_interval_s=0.02, full_sweep_interval_s=3600, clock=lambda: now[0]
    )
    looked_at: list[str] = []
    reconcile = controller._reconcile_node

    def recording(node_id: str) -> None:
        looked_at.append(node_id)
        reconcile(node_id)

    controller._reconcile_node = recording  # type: ignore[method-assign]
    controller.start()
    try:
        wait_until(lambda: {"late", "waiting"} <= set(looked_at), message="the first sweep")
        looked_at.clear()
        time.sleep(0.3)  # about 15 ticks with no deadline passed and no change
        assert looked_at == []

        now[0] = 1_000_101.0
        wait_until(
            lambda: (
                (r := store.get(store.keys.node("late"))) is not None
                and r.value.state == pb.NODE_STATE_FAILED
            ),
            message="the overdue node to fail",
        )
        assert "waiting" not in looked_at
        waiting = store.get(store.keys.node("waiting"))
        assert waiting is not None and waiting.value.state == pb.NODE_STATE_PENDING
    finally:
        controller.stop()
