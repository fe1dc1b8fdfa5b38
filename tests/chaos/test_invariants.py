"""The chaos checker itself: hand-made bad states in a real etcd and a sim fabric.

Each test writes records the way a broken broker or agent would, reads them back with
:meth:`EtcdSnapshot.read` (one range read) and asserts the checker names the violation,
and the baseline tests assert that consistent states, including one produced by a real
broker and agent, report nothing. A checker that reports nothing can not pass these.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.fabric.sim import SimFabric, SimGpuSpec
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from tests.chaos.invariants import (
    EtcdSnapshot,
    FabricSnapshot,
    Violation,
    check_acknowledged,
    check_drained,
    check_fabric,
    check_fenced,
    check_records,
    check_settled,
    is_settled,
)

BOXES = ("b0", "b1")
HOSTS = ("h0", "h1")
GPUS_PER_BOX = 4


def gname(box: str, slot: int) -> str:
    return f"boxes/{box}/gpus/{slot}"


class PoolState:
    """Writes dxpool records into etcd as a broker would, without a broker."""

    def __init__(self, client: Any, schema: KeySchema, fabric: SimFabric) -> None:
        self.client = client
        self.schema = schema
        self.fabric = fabric
        self.allocations: dict[str, list[pb.DesiredAttachment]] = {}

    def put(self, key: str, message: Any) -> None:
        self.client.put(key, message.SerializeToString())

    def boxes(self) -> None:
        for box in BOXES:
            self.put(self.schema.box(box), pb.Box(name=f"boxes/{box}", gpu_count=GPUS_PER_BOX))
            for slot in range(GPUS_PER_BOX):
                self.gpu(box, slot)
        for host in HOSTS:
            self.put(self.schema.host(host), pb.Host(name=f"hosts/{host}", slot_capacity=8))
            self.client.put(self.schema.host_lease(host), b"")

    def gpu(
        self,
        box: str,
        slot: int,
        state: int = pb.GPU_STATE_FREE,
        *,
        node: str = "",
        host: str = "",
        host_slot: int = 0,
        generation: int = 1,
        message: str = "",
    ) -> None:
        self.put(
            self.schema.gpu(box, slot),
            pb.Gpu(
                name=gname(box, slot),
                box=f"boxes/{box}",
                slot=slot,
                model="H100",
                state=state,  # type: ignore[arg-type]
                node=f"nodes/{node}" if node else "",
                host=f"hosts/{host}" if host else "",
                host_slot=host_slot,
                generation=generation,
                message=message,
            ),
        )

    def node(
        self,
        node_id: str,
        host: str,
        gpus: Sequence[tuple[str, int, int]],
        state: int = pb.NODE_STATE_READY,
        *,
        gpu_state: int | None = pb.GPU_STATE_ATTACHED,
        allocate: bool = True,
        generation: int = 1,
    ) -> None:
        """A node with ``gpus`` as (box, slot, host_slot); by default its GPUs are owned
        by it in ``gpu_state`` and listed in the host's allocation."""
        node = pb.VirtualNode(
            name=f"nodes/{node_id}",
            host=f"hosts/{host}",
            state=state,  # type: ignore[arg-type]
            gpus=[pb.GpuBinding(gpu=gname(b, s), host_slot=hs) for b, s, hs in gpus],
        )
        self.put(self.schema.node(node_id), node)
        for box, slot, host_slot in gpus:
            if gpu_state is not None:
                self.gpu(
                    box,
                    slot,
                    gpu_state,
                    node=node_id,
                    host=host,
                    host_slot=host_slot,
                    generation=generation,
                )
            if allocate:
                self.allocate(host, node_id, box, slot, host_slot, generation)

    def allocate(
        self,
        host: str,
        node_id: str,
        box: str,
        slot: int,
        host_slot: int,
        generation: int = 1,
        *,
        release: bool = False,
    ) -> None:
        entries = self.allocations.setdefault(host, [])
        entries.append(
            pb.DesiredAttachment(
                gpu=gname(box, slot),
                host_slot=host_slot,
                node=f"nodes/{node_id}",
                generation=generation,
                release=release,
            )
        )
        self.put(
            self.schema.host_allocation(host),
            pb.HostAllocation(host=f"hosts/{host}", attachments=entries),
        )

    def snapshot(self) -> EtcdSnapshot:
        return EtcdSnapshot.read(self.client, self.schema)

    def fabric_snapshot(self) -> FabricSnapshot:
        snap = FabricSnapshot.read(self.fabric)
        assert snap is not None
        return snap

    def fabric_check(self) -> list[Violation]:
        before = self.snapshot()
        fabric = self.fabric_snapshot()
        after = self.snapshot()
        return check_fabric(before, fabric, after).violations


@pytest.fixture
def state(etcd_server: EmbeddedEtcd, key_prefix: str, tmp_path: Path) -> Iterator[PoolState]:
    client = connect(etcd_server.endpoint)
    fabric = SimFabric.create(
        tmp_path / "fabric",
        boxes={box: [SimGpuSpec("H100", 81920)] * GPUS_PER_BOX for box in BOXES},
        hosts=dict.fromkeys(HOSTS, 8),
    )
    pool = PoolState(client, KeySchema(key_prefix), fabric)
    pool.boxes()
    yield pool
    client.close()


def kinds(violations: list[Violation]) -> set[tuple[str, str]]:
    return {(str(v.kind), v.subject) for v in violations}


def ready_node(state: PoolState) -> None:
    """n1 READY on h0 with b0/0 at slot 0 and b1/1 at slot 1, mapped in the fabric."""
    state.node("n1", "h0", [("b0", 0, 0), ("b1", 1, 1)])
    state.fabric.map("b0", 0, "h0", 0)
    state.fabric.map("b1", 1, "h0", 1)


# -- baselines: consistent states report nothing ---------------------------------------------


def test_consistent_state_has_no_violations(state: PoolState) -> None:
    ready_node(state)
    state.node(
        "n2", "h1", [("b0", 2, 0)], pb.NODE_STATE_ATTACHING, gpu_state=pb.GPU_STATE_ATTACHING
    )
    state.fabric.map("b0", 2, "h1", 0)  # the agent mapped it before reporting
    # A released node keeps its bindings; its GPU went to n3 since.
    state.node("old", "h1", [("b0", 3, 1)], pb.NODE_STATE_RELEASED, gpu_state=None, allocate=False)
    state.node("n3", "h1", [("b0", 3, 1)], pb.NODE_STATE_PENDING, gpu_state=pb.GPU_STATE_ATTACHING)
    # Releasing: DETACHING and still mapped; its old slot 2 was given to n4's ATTACHING GPU.
    state.node("n4", "h0", [("b1", 2, 2)], pb.NODE_STATE_PENDING, gpu_state=pb.GPU_STATE_ATTACHING)
    state.node(
        "gone",
        "h0",
        [("b1", 3, 2)],
        pb.NODE_STATE_RELEASING,
        gpu_state=pb.GPU_STATE_DETACHING,
        allocate=False,
    )
    state.fabric.map("b1", 3, "h0", 2)
    snap = state.snapshot()
    assert check_records(snap) == []
    assert state.fabric_check() == []
    assert snap.gpu_counts() == {
        "FREE": 2,
        "ATTACHED": 2,
        "ATTACHING": 3,
        "DETACHING": 1,
        "total": 8,
    }


def test_real_broker_and_agent_state_has_no_violations(  # type: ignore[no-untyped-def]
    stubs, sim_pool, etcd_client, key_prefix: str
) -> None:
    from dxpool.api.v1 import nodes_pb2
    from tests.conftest import register_sim_box, wait_hosts_alive, wait_until
    from tests.patience import patient

    register_sim_box(sim_pool, stubs, "box1", gpus=4)
    sim_pool.start_agent("h1", slots=4)
    wait_hosts_alive(stubs)
    node = stubs.nodes.ComposeNode(
        nodes_pb2.ComposeNodeRequest(spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=2)))
    )
    get = nodes_pb2.GetNodeRequest(name=node.name)
    wait_until(lambda: stubs.nodes.GetNode(get).state == pb.NODE_STATE_READY, message="READY")
    schema = KeySchema(key_prefix)
    before = EtcdSnapshot.read(etcd_client, schema)
    fabric = FabricSnapshot.read(sim_pool.fabric)
    after = EtcdSnapshot.read(etcd_client, schema)
    assert fabric is not None and len(fabric.box_side) == 2
    assert check_records(after) == []
    assert check_fabric(before, fabric, after).violations == []
    assert check_acknowledged(after, {node.name: 0.0}, ()) == []
    assert is_settled(after)

    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_until(lambda: stubs.nodes.GetNode(get).state == pb.NODE_STATE_RELEASED, message="freed")
    # The agent reports what it detached on its own time after the node is RELEASED, so
    # the pool is drained once its report catches up, not at once.
    leftovers: list[object] = []

    def drained() -> bool:
        snap = EtcdSnapshot.read(etcd_client, schema)
        leftovers[:] = check_drained(snap, FabricSnapshot.read(sim_pool.fabric))
        leftovers.extend(check_settled(snap, ["hosts/h1"]))
        return not leftovers

    deadline = time.monotonic() + patient(60)
    while not drained() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers == []


# -- safety: etcd records ------------------------------------------------------------------------


def test_gpu_claimed_by_two_live_nodes(state: PoolState) -> None:
    ready_node(state)
    # n2 also claims b0/0 although Gpu.node says n1: two tenants hold one GPU.
    state.put(
        state.schema.node("n2"),
        pb.VirtualNode(
            name="nodes/n2",
            host="hosts/h1",
            state=pb.NODE_STATE_READY,
            gpus=[pb.GpuBinding(gpu=gname("b0", 0), host_slot=0)],
        ),
    )
    found = kinds(check_records(state.snapshot()))
    assert ("DOUBLE_CLAIM", gname("b0", 0)) in found
    assert ("READY_NODE_GPU", "nodes/n2") in found
    assert ("READY_NODE_GPU", "nodes/n1") not in found


def test_gpu_claimed_by_a_degraded_node_too(state: PoolState) -> None:
    ready_node(state)
    # A DEGRADED node keeps its GPUs: its claims count like a READY node's.
    state.put(
        state.schema.node("n2"),
        pb.VirtualNode(
            name="nodes/n2",
            host="hosts/h1",
            state=pb.NODE_STATE_DEGRADED,
            gpus=[pb.GpuBinding(gpu=gname("b0", 0), host_slot=0)],
        ),
    )
    assert ("DOUBLE_CLAIM", gname("b0", 0)) in kinds(check_records(state.snapshot()))


def test_a_shrinks_detaching_binding_of_a_gpu_another_node_holds_is_no_claim(
    state: PoolState,
) -> None:
    ready_node(state)
    # n2 shrank off b0/0: the release path freed it and n1 took it; the controller has
    # not yet dropped n2's DETACHING binding.
    shrinking = pb.VirtualNode(
        name="nodes/n2",
        host="hosts/h1",
        state=pb.NODE_STATE_RESIZING,
        gpus=[pb.GpuBinding(gpu=gname("b0", 0), host_slot=0, phase=pb.ATTACHMENT_PHASE_DETACHING)],
    )
    state.put(state.schema.node("n2"), shrinking)
    assert ("DOUBLE_CLAIM", gname("b0", 0)) not in kinds(check_records(state.snapshot()))
    # the same binding not DETACHING is a claim: n2 believes it holds the GPU
    shrinking.gpus[0].phase = pb.ATTACHMENT_PHASE_ATTACHED
    state.put(state.schema.node("n2"), shrinking)
    assert ("DOUBLE_CLAIM", gname("b0", 0)) in kinds(check_records(state.snapshot()))


def test_ready_node_whose_gpu_was_freed(state: PoolState) -> None:
    ready_node(state)
    state.gpu("b1", 1)  # freed behind the READY node's back
    found = kinds(check_records(state.snapshot()))
    assert ("READY_NODE_GPU", "nodes/n1") in found
    # Still in h0's allocation: an agent would keep (or re-)attach a free GPU.
    assert ("ALLOCATION_MISMATCH", gname("b1", 1)) in found


def test_gpu_owned_by_missing_or_released_node(state: PoolState) -> None:
    state.gpu("b0", 0, pb.GPU_STATE_DETACHING, node="ghost", host="h0")
    state.node(
        "done",
        "h0",
        [("b0", 1, 1)],
        pb.NODE_STATE_RELEASED,
        gpu_state=pb.GPU_STATE_DETACHING,
        allocate=False,
    )
    state.node("n1", "h0", [("b0", 2, 2)], gpu_state=None, allocate=False)
    state.gpu("b0", 3, pb.GPU_STATE_DETACHING, node="n1", host="h0")  # n1 does not list it
    found = kinds(check_records(state.snapshot()))
    assert ("OWNER_MISSING", gname("b0", 0)) in found
    assert ("OWNER_RELEASED", gname("b0", 1)) in found
    assert ("OWNER_UNAWARE", gname("b0", 3)) in found


def test_gpu_fields_that_contradict_the_state(state: PoolState) -> None:
    state.gpu("b0", 0, pb.GPU_STATE_FREE, node="n1")
    state.gpu("b0", 1, pb.GPU_STATE_ATTACHED)
    state.gpu("b0", 2, pb.GPU_STATE_FENCING, node="n1")
    found = kinds(check_records(state.snapshot()))
    assert {("GPU_FIELDS", gname("b0", s)) for s in range(3)} <= found


def test_two_gpus_on_one_host_slot(state: PoolState) -> None:
    state.node("n1", "h0", [("b0", 0, 5)])
    state.node("n2", "h0", [("b1", 0, 5)])  # the same slot 5 of h0
    found = kinds(check_records(state.snapshot()))
    assert ("HOST_SLOT_TWICE", "hosts/h0 slot 5") in found


def test_gpu_in_two_hosts_allocations(state: PoolState) -> None:
    state.node("n1", "h0", [("b0", 0, 0)])
    state.allocate("h1", "n1", "b0", 0, 0)  # h1 is told to attach it too
    found = kinds(check_records(state.snapshot()))
    assert ("ALLOCATION_MISMATCH", gname("b0", 0)) in found


def test_a_release_entry_is_allowed_only_while_its_gpu_is_let_go(state: PoolState) -> None:
    state.node(
        "n1",
        "h0",
        [("b0", 0, 0), ("b0", 1, 1)],
        pb.NODE_STATE_RELEASING,
        gpu_state=pb.GPU_STATE_DETACHING,
        allocate=False,
    )
    state.allocate("h0", "n1", "b0", 0, 0, release=True)  # scrub and detach: fine
    state.gpu("b0", 2)  # FREE
    state.allocate("h0", "n1", "b0", 2, 2, release=True)  # freed, yet still listed
    found = kinds(check_records(state.snapshot()))
    assert ("ALLOCATION_MISMATCH", gname("b0", 0)) not in found
    assert ("ALLOCATION_MISMATCH", gname("b0", 2)) in found


def test_attaching_gpu_missing_from_allocation(state: PoolState) -> None:
    state.node(
        "n1",
        "h0",
        [("b0", 0, 0)],
        pb.NODE_STATE_PENDING,
        gpu_state=pb.GPU_STATE_ATTACHING,
        allocate=False,
    )
    found = kinds(check_records(state.snapshot()))
    assert ("ALLOCATION_MISMATCH", gname("b0", 0)) in found


def test_accounting_missing_and_unknown_gpus(state: PoolState) -> None:
    state.client.delete(state.schema.gpu("b1", 3))
    state.gpu("b1", 2, pb.GPU_STATE_UNSPECIFIED)
    state.gpu("b9", 0)  # no such box
    state.client.put(state.schema.node("bad"), b"\xff\xff not a protobuf")
    found = kinds(check_records(state.snapshot()))
    assert ("ACCOUNTING", gname("b1", 3)) in found
    assert ("ACCOUNTING", gname("b1", 2)) in found
    assert ("ACCOUNTING", gname("b9", 0)) in found
    assert ("RECORD_UNREADABLE", state.schema.node("bad")) in found


def test_acknowledged_compose_missing_from_etcd(state: PoolState) -> None:
    ready_node(state)
    snap = state.snapshot()
    acks = {"nodes/n1": 0.0, "nodes/lost": 0.0, "nodes/gone": 0.0, "nodes/later": 1e12}
    found = kinds(check_acknowledged(snap, acks, released={"nodes/gone"}))
    # n1 exists; gone was released (may be collected); later was acknowledged after the read.
    assert found == {("ACK_LOST", "nodes/lost")}


# -- safety: etcd against the fabric ------------------------------------------------------------


def test_free_gpu_still_mapped(state: PoolState) -> None:
    ready_node(state)
    state.fabric.map("b1", 3, "h1", 4)  # nobody owns b1/3
    assert kinds(state.fabric_check()) == {("FREE_GPU_MAPPED", gname("b1", 3))}


def test_gpu_mapped_to_another_host_or_slot(state: PoolState) -> None:
    state.node("n1", "h0", [("b0", 0, 0), ("b0", 1, 1)])
    state.fabric.map("b0", 0, "h1", 0)  # etcd says h0
    state.fabric.map("b0", 1, "h0", 3)  # etcd says slot 1
    found = kinds(state.fabric_check())
    assert ("MAPPED_TO_WRONG_HOST", gname("b0", 0)) in found
    assert ("MAPPED_AT_WRONG_SLOT", gname("b0", 1)) in found
    assert ("ATTACHED_NOT_MAPPED", gname("b0", 0)) in found
    assert ("ATTACHED_NOT_MAPPED", gname("b0", 1)) in found


def test_mapped_in_a_state_that_allows_no_mapping(state: PoolState) -> None:
    state.gpu("b0", 0, pb.GPU_STATE_FAULTED, host="h0")
    state.fabric.map("b0", 0, "h0", 0)
    assert kinds(state.fabric_check()) == {("MAPPED_IN_STATE", gname("b0", 0))}


def test_fencing_and_quarantined_gpus_may_stay_mapped(state: PoolState) -> None:
    state.node(
        "n1",
        "h0",
        [("b0", 0, 0)],
        pb.NODE_STATE_LOST,
        gpu_state=pb.GPU_STATE_FENCING,
        allocate=False,
    )
    state.gpu("b0", 1, pb.GPU_STATE_QUARANTINED, host="h0", host_slot=1, message="scrub failed")
    state.fabric.map("b0", 0, "h0", 0)
    state.fabric.map("b0", 1, "h0", 1)
    assert state.fabric_check() == []
    assert check_records(state.snapshot()) == []


def test_record_changing_during_the_fabric_read_is_inconclusive(state: PoolState) -> None:
    state.fabric.map("b0", 0, "h0", 0)
    before = state.snapshot()  # b0/0 FREE here...
    fabric = state.fabric_snapshot()
    state.node("n1", "h0", [("b0", 0, 0)])  # ...and ATTACHED by the second read
    after = state.snapshot()
    result = check_fabric(before, fabric, after)
    assert result.violations == []
    assert result.inconclusive == 2  # the mapped GPU, and the ATTACHED one


class DivergingFabric:
    """A fabric whose host-side tables disagree with the box side (the sim keeps one
    table and cannot): b0/0 sits in both h0's and h1's tables."""

    def boxes(self) -> Mapping[str, Sequence[object]]:
        return {"b0": [object()] * 2}

    def hosts(self) -> Mapping[str, int]:
        return {"h0": 8, "h1": 8}

    def mapping(self, box: str, slot: int) -> tuple[str, int] | None:
        return ("h0", 0) if (box, slot) == ("b0", 0) else None

    def mappings(self, host: str) -> Mapping[int, tuple[str, int]]:
        return {0: ("b0", 0)} if host == "h0" else {3: ("b0", 0), 4: ("b0", 1)}


def test_gpu_on_two_hosts_in_the_fabric(state: PoolState) -> None:
    state.node("n1", "h0", [("b0", 0, 0)])
    fabric = FabricSnapshot.read(DivergingFabric())
    assert fabric is not None
    snap = state.snapshot()
    found = kinds(check_fabric(snap, fabric, snap).violations)
    assert ("GPU_ON_TWO_HOSTS", gname("b0", 0)) in found
    assert ("FABRIC_TABLES_DIVERGE", gname("b0", 0)) in found
    assert ("FABRIC_TABLES_DIVERGE", gname("b0", 1)) in found


# -- liveness -----------------------------------------------------------------------------


def test_unsettled_pool(state: PoolState) -> None:
    state.node(
        "n1", "h0", [("b0", 0, 0)], pb.NODE_STATE_ATTACHING, gpu_state=pb.GPU_STATE_ATTACHING
    )
    state.node(
        "f1",
        "h1",
        [("b0", 1, 0)],
        pb.NODE_STATE_FAILED,
        gpu_state=pb.GPU_STATE_DETACHING,
        allocate=False,
    )
    state.gpu("b0", 2, pb.GPU_STATE_QUARANTINED, host="h0")
    state.client.delete(state.schema.host_lease("h1"))
    state.node("r1", "h1", [("b1", 0, 1)])
    snap = state.snapshot()
    found = kinds(check_settled(snap, ["hosts/h0", "hosts/h1"]))
    assert ("NODE_NOT_SETTLED", "nodes/n1") in found
    assert ("GPU_NOT_SETTLED", gname("b0", 0)) in found
    assert ("GPU_NOT_SETTLED", gname("b0", 1)) in found
    assert ("TERMINAL_NODE_OWNS_GPU", gname("b0", 1)) in found
    assert ("QUARANTINED_WITHOUT_REASON", gname("b0", 2)) in found
    assert ("HOST_NOT_ALIVE", "hosts/h1") in found
    assert ("LIVE_NODE_ON_LOST_HOST", "nodes/r1") in found
    assert not is_settled(snap)


def test_undrained_pool(state: PoolState) -> None:
    ready_node(state)
    state.gpu("b1", 3, pb.GPU_STATE_QUARANTINED, host="h1", message="detach kept failing")
    state.fabric.map("b1", 3, "h1", 7)  # quarantined: may stay mapped
    state.fabric.map("b1", 2, "h1", 6)  # free but mapped
    state.put(
        state.schema.host_status("h1"),
        pb.HostStatus(
            host="hosts/h1",
            attachments=[
                pb.ObservedAttachment(gpu=gname("b1", 2), phase=pb.ATTACHMENT_PHASE_ATTACHED)
            ],
        ),
    )
    found = kinds(check_drained(state.snapshot(), state.fabric_snapshot()))
    assert ("NODE_NOT_RELEASED", "nodes/n1") in found
    assert ("GPU_NOT_FREE", gname("b0", 0)) in found
    assert ("ALLOCATION_LEFT", gname("b1", 1)) in found
    assert ("MAPPING_LEFT", gname("b1", 2)) in found
    assert ("STATUS_LEFT", gname("b1", 2)) in found
    assert ("GPU_NOT_FREE", gname("b1", 3)) not in found
    assert ("MAPPING_LEFT", gname("b1", 3)) not in found


def test_lost_host_not_fenced(state: PoolState) -> None:
    ready_node(state)
    state.client.delete(state.schema.host_lease("h0"))
    found = check_fenced(state.snapshot(), state.fabric_snapshot(), "hosts/h0", 9.0)
    assert [(str(v.kind), v.subject) for v in found] == [("FENCE_TIMEOUT", "hosts/h0")]
    assert "nodes/n1" in found[0].detail and "box side still maps" in found[0].detail


def test_fenced_host_passes(state: PoolState) -> None:
    state.node(
        "n1",
        "h0",
        [("b0", 0, 0)],
        pb.NODE_STATE_LOST,
        gpu_state=pb.GPU_STATE_FENCING,
        allocate=False,
    )
    state.gpu("b0", 1, pb.GPU_STATE_QUARANTINED, host="h0", host_slot=1, message="revoke failed")
    state.fabric.map("b0", 1, "h0", 1)
    state.client.delete(state.schema.host_lease("h0"))
    assert check_fenced(state.snapshot(), state.fabric_snapshot(), "hosts/h0", 9.0) == []


# -- sharing: tenants' usage and preemption notices --------------------------------------------


def charge(state: PoolState, node_id: str, tenant: str, *, preemptible: bool) -> None:
    """Mark node ``node_id`` (written by :meth:`PoolState.node`) charged to ``tenant``."""
    raw, _ = state.client.get(state.schema.node(node_id))
    node = pb.VirtualNode.FromString(raw)
    node.spec.tenant = tenant
    node.charged = True
    node.preemptible = preemptible
    state.put(state.schema.node(node_id), node)


def test_a_tenant_usage_that_matches_its_nodes_is_consistent(state: PoolState) -> None:
    ready_node(state)
    charge(state, "n1", "t", preemptible=True)
    usage = pb.TenantUsage(gpus=2, nodes=1, borrowed_gpus=2, borrowed_nodes=1)
    state.put(state.schema.tenant("t"), pb.Tenant(name="tenants/t", usage=usage))
    assert not check_records(state.snapshot())


def test_a_tenant_usage_that_drifted_from_its_nodes_is_reported(state: PoolState) -> None:
    ready_node(state)
    charge(state, "n1", "t", preemptible=True)
    usage = pb.TenantUsage(gpus=2, nodes=1)  # the borrowed part was lost
    state.put(state.schema.tenant("t"), pb.Tenant(name="tenants/t", usage=usage))
    assert kinds(check_records(state.snapshot())) == {("TENANT_USAGE", "tenants/t")}


def test_a_notice_on_a_guaranteed_node_for_a_request_is_reported(state: PoolState) -> None:
    ready_node(state)
    raw, _ = state.client.get(state.schema.node("n1"))
    node = pb.VirtualNode.FromString(raw)
    node.preemption.by = "nodes/waiting"
    node.preemption.reason = "lent capacity"
    state.put(state.schema.node("n1"), node)
    assert kinds(check_records(state.snapshot())) == {("GUARANTEE_PREEMPTED", "nodes/n1")}
    node.preemption.by = "hosts/h0"  # a drain may give any node a notice
    state.put(state.schema.node("n1"), node)
    assert not check_records(state.snapshot())
