"""Lent capacity taken back: notices, grace, shrink and preemption through real brokers,
etcd and host agents over the simulated fabric (which scrub and report released GPUs as
a real agent does).

Two tenants share the pool: ``owner`` is guaranteed 4 GPUs, ``borrower`` is guaranteed
none and borrows what is idle. The races named by the design are forced by holding one
party between its read and its commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.control.controller import NodeController
from dxpool.broker.control.notices import Notices
from dxpool.broker.control.sharing_duties import SharingSettings
from dxpool.broker.state.stm import TxnView
from dxpool.store.keys import KeySchema
from tests.chaos.invariants import EtcdSnapshot, check_records
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.integration.test_quotas import error_info, get_tenant, set_quota

FAST = SharingSettings(interval_s=0.2, coalesce_s=0.01)


def request(
    gpus: int, tenant: str, *, queue: bool = False, grace: int | None = None, **spec: Any
) -> nodes_pb2.ComposeNodeRequest:
    node_spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=gpus), tenant=tenant, **spec)
    if grace is not None:
        node_spec.preemption_grace_s = grace
    return nodes_pb2.ComposeNodeRequest(spec=node_spec, queue=queue)


def get(stubs: Stubs, name: str) -> pb.VirtualNode:
    return stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=name))


def wait_node(stubs: Stubs, name: str, state: int, timeout_s: float = 90) -> pb.VirtualNode:
    wait_until(
        lambda: get(stubs, name).state == state,
        timeout_s,
        message=f"{name} {pb.NodeState.Name(state)}",
    )
    return get(stubs, name)


def reasons(node: pb.VirtualNode) -> list[str]:
    return [event.reason for event in node.events]


def release(stubs: Stubs, name: str) -> None:
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=name))


@dataclass
class Pool:
    leader: BrokerServer
    stubs: Stubs
    other: BrokerServer
    other_stubs: Stubs


@pytest.fixture
def pool(broker_factory: Callable[..., BrokerServer], sim_pool: SimPool) -> Iterator[Pool]:
    """Two brokers (the first leads), one box of 8 H100s, hosts h1 and h2 of 8 slots."""
    leader = broker_factory(sharing=FAST)
    assert leader.election.wait_until_leader(30)
    other = broker_factory(sharing=FAST)
    channels = [grpc.insecure_channel(b.endpoint) for b in (leader, other)]
    stubs = [Stubs(c) for c in channels]
    register_sim_box(sim_pool, stubs[0], "box1", gpus=8)
    sim_pool.start_agent("h1", slots=8)
    sim_pool.start_agent("h2", slots=8)
    wait_hosts_alive(stubs[0], 2, timeout_s=90)
    for broker in (leader, other):
        wait_until(
            lambda b=broker: len(b.index.snapshot().hosts) == 2, timeout_s=90, message="hosts"
        )
    set_quota(stubs[0], "owner", guaranteed_gpus=4)
    set_quota(stubs[0], "borrower", guaranteed_gpus=0)
    for broker in (leader, other):
        wait_until(
            lambda b=broker: b.cache.get("tenants", "borrower") is not None,
            timeout_s=90,
            message="q",
        )
    yield Pool(leader, stubs[0], other, stubs[1])
    for channel in channels:
        channel.close()


def test_borrowed_nodes_are_marked_and_counted(pool: Pool) -> None:
    guaranteed = pool.stubs.nodes.ComposeNode(request(2, "owner"))
    borrowed = pool.stubs.nodes.ComposeNode(request(3, "borrower"))
    beyond = pool.stubs.nodes.ComposeNode(request(3, "owner"))  # 2 + 3 > 4: borrowed too
    assert not guaranteed.preemptible
    assert borrowed.preemptible and beyond.preemptible
    owner = get_tenant(pool.stubs, "owner").usage
    assert (owner.gpus, owner.borrowed_gpus, owner.borrowed_nodes) == (5, 3, 1)
    for node in (guaranteed, borrowed, beyond):
        release(pool.stubs, node.name)
    wait_until(
        lambda: get_tenant(pool.stubs, "owner").usage == pb.TenantUsage(), timeout_s=90, message="0"
    )
    assert get_tenant(pool.stubs, "borrower").usage == pb.TenantUsage()


def test_the_owner_takes_its_guarantee_back_after_the_borrowers_notice(pool: Pool) -> None:
    borrowed = pool.stubs.nodes.ComposeNode(request(8, "borrower", grace=1))
    wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    with pytest.raises(grpc.RpcError) as refused:
        pool.stubs.nodes.ComposeNode(request(4, "owner"))
    assert error_info(refused.value).reason == "NO_CAPACITY"
    waiting = pool.stubs.nodes.ComposeNode(request(4, "owner", queue=True))
    assert waiting.state == pb.NODE_STATE_QUEUED
    noticed = wait_until(
        lambda: (n := get(pool.stubs, borrowed.name)).HasField("preemption") and n,
        timeout_s=90,
        message="the borrower's notice",
    )
    assert isinstance(noticed, pb.VirtualNode)
    assert noticed.preemption.by == waiting.name
    assert noticed.state == pb.NODE_STATE_READY  # it keeps running during its grace
    assert "PreemptionNotice" in reasons(noticed)
    queued = get(pool.stubs, waiting.name)
    assert list(queued.queue.preempting) == [borrowed.name]
    assert queued.queue.reclaiming
    gone = wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_RELEASED)
    assert "Preempted" in reasons(gone)
    placed = wait_node(pool.stubs, waiting.name, pb.NODE_STATE_READY)
    assert not placed.preemptible
    assert get_tenant(pool.stubs, "borrower").usage == pb.TenantUsage()
    assert get_tenant(pool.stubs, "owner").usage.gpus == 4


def test_an_elastic_borrower_is_shrunk_instead_of_preempted(pool: Pool) -> None:
    borrowed = pool.stubs.nodes.ComposeNode(request(8, "borrower", grace=0, min_gpus=2))
    wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    waiting = pool.stubs.nodes.ComposeNode(request(4, "owner", queue=True))
    placed = wait_node(pool.stubs, waiting.name, pb.NODE_STATE_READY)
    shrunk = wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    assert len(shrunk.gpus) == 4
    assert not {b.gpu for b in shrunk.gpus} & {b.gpu for b in placed.gpus}
    assert "Preempted" in reasons(shrunk)
    usage = get_tenant(pool.stubs, "borrower").usage
    assert (usage.gpus, usage.borrowed_gpus, usage.nodes) == (4, 4, 1)


def test_lending_is_paused_while_an_owner_reclaims(pool: Pool) -> None:
    borrowed = pool.stubs.nodes.ComposeNode(request(8, "borrower", grace=30))
    wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    waiting = pool.stubs.nodes.ComposeNode(request(4, "owner", queue=True))
    wait_until(
        lambda: get(pool.stubs, waiting.name).queue.reclaiming, timeout_s=90, message="reclaiming"
    )
    # a box arrives; the borrower may not take it while the owner reclaims
    register_sim_box_via(pool, "box2")
    with pytest.raises(grpc.RpcError) as refused:
        pool.other_stubs.nodes.ComposeNode(request(1, "borrower"))
    assert error_info(refused.value).reason in ("LENDING_PAUSED", "NO_CAPACITY")
    placed = wait_node(pool.stubs, waiting.name, pb.NODE_STATE_READY)
    assert {b.gpu.split("/")[1] for b in placed.gpus} == {"box2"}
    # the request was served from the new box: the borrower's notice is withdrawn
    kept = wait_until(
        lambda: not (n := get(pool.stubs, borrowed.name)).HasField("preemption") and n,
        timeout_s=90,
        message="notice withdrawn",
    )
    assert isinstance(kept, pb.VirtualNode)
    assert kept.state == pb.NODE_STATE_READY and "PreemptionCancelled" in reasons(kept)
    assert pool.other_stubs.nodes.ComposeNode(request(1, "borrower")).preemptible


_sim_pools: dict[int, SimPool] = {}


def register_sim_box_via(pool: Pool, box: str) -> None:
    sim = _sim_pools[id(pool)]
    register_sim_box(sim, pool.stubs, box, gpus=8)


@pytest.fixture(autouse=True)
def _remember_sim(request: pytest.FixtureRequest) -> Iterator[None]:
    if "pool" in request.fixturenames:
        pool_value = request.getfixturevalue("pool")
        _sim_pools[id(pool_value)] = request.getfixturevalue("sim_pool")
    yield
    _sim_pools.clear()


# -- races -----------------------------------------------------------------------------


def test_a_release_and_a_reclaim_of_the_same_gpus_let_them_go_once(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader carries out the borrower's due notice and is held between reading the
    node and committing its release; the borrower releases the node itself through the
    other broker meanwhile. The leader's commit fails its compare, it reads the node
    RELEASING and leaves it: each GPU is let go once (one detach, one free), and the
    owner gets them."""
    real = Notices._carry_out_in
    reached, go_on = threading.Event(), threading.Event()

    def held(self: Notices, view: TxnView, node_id: str) -> str | None:
        outcome = real(self, view, node_id)
        if outcome == "released" and not reached.is_set():
            reached.set()
            assert go_on.wait(90)
        return outcome

    monkeypatch.setattr(Notices, "_carry_out_in", held)
    borrowed = pool.stubs.nodes.ComposeNode(request(8, "borrower", grace=0))
    ready = wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    generations = _generations(pool, ready)
    waiting = pool.stubs.nodes.ComposeNode(request(4, "owner", queue=True))
    assert reached.wait(90)
    released = pool.other_stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=borrowed.name))
    assert released.state == pb.NODE_STATE_RELEASING
    go_on.set()
    gone = wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_RELEASED)
    assert "Preempted" not in reasons(gone)
    assert reasons(gone).count("Releasing") == 1
    placed = wait_node(pool.stubs, waiting.name, pb.NODE_STATE_READY)
    for gpu, generation in _generations(pool, placed).items():
        assert generation == generations[gpu] + 1  # given once more, to the owner
    assert get_tenant(pool.stubs, "borrower").usage == pb.TenantUsage()


def _generations(pool: Pool, node: pb.VirtualNode) -> dict[str, int]:
    """Each of the node's GPUs by name, with its generation now."""
    out = {}
    for binding in node.gpus:
        gpu = pool.stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=binding.gpu))
        out[binding.gpu] = gpu.generation
    return out


def test_a_notice_racing_a_release_is_not_given(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's notice is held after it read the victim and before its commit; the
    borrower releases the node meanwhile. The notice's commit fails its compare, the
    plan finds the node RELEASING and gives nothing: the released node never carries a
    notice, and the owner is served from the GPUs the release frees."""
    real = Notices._give
    reached, go_on = threading.Event(), threading.Event()

    def held(self: Notices, view: TxnView, cut: Any, requester: str, now: float) -> None:
        real(self, view, cut, requester, now)
        if not reached.is_set():
            reached.set()
            assert go_on.wait(90)

    monkeypatch.setattr(Notices, "_give", held)
    borrowed = pool.stubs.nodes.ComposeNode(request(8, "borrower", grace=30))
    wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    with ThreadPoolExecutor(1) as executor:
        queued = executor.submit(pool.stubs.nodes.ComposeNode, request(4, "owner", queue=True))
        assert reached.wait(90)
        release(pool.other_stubs, borrowed.name)
        go_on.set()
        waiting = queued.result(120)
    gone = wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_RELEASED)
    assert "PreemptionNotice" not in reasons(gone)
    assert not gone.HasField("preemption")
    wait_node(pool.stubs, waiting.name, pb.NODE_STATE_READY)


def test_a_borrower_shrinking_while_the_owners_compose_commits_on_its_host(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The borrower's shrink on h1 (a notice carried out) is held between reading the
    host's allocation and its commit; the owner composes on h1 meanwhile through the
    other broker (no lock is shared). The shrink's commit fails its compare on the
    allocation and runs again on top of the owner's: both land, no slot or GPU is given
    twice, and the waiting request is served once enough is freed (the borrower, at its
    minimum, is then preempted whole)."""
    set_quota(pool.stubs, "owner", guaranteed_gpus=8)
    wait_until(
        lambda: pool.other.cache.get("tenants", "owner").value.quota.guaranteed_gpus == 8,
        timeout_s=90,
        message="quota at the other broker",
    )
    real = Notices._carry_out_in
    reached, go_on = threading.Event(), threading.Event()

    def held(self: Notices, view: TxnView, node_id: str) -> str | None:
        outcome = real(self, view, node_id)
        if outcome == "shrunk" and not reached.is_set():
            reached.set()
            assert go_on.wait(90)
        return outcome

    monkeypatch.setattr(Notices, "_carry_out_in", held)
    borrowed = pool.stubs.nodes.ComposeNode(
        request(4, "borrower", grace=0, min_gpus=2, host="hosts/h1")
    )
    wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    waiting = pool.stubs.nodes.ComposeNode(request(6, "owner", queue=True))
    assert waiting.state == pb.NODE_STATE_QUEUED
    assert reached.wait(90)
    other = pool.other_stubs.nodes.ComposeNode(request(1, "owner", host="hosts/h1"))
    go_on.set()
    placed = wait_node(pool.stubs, waiting.name, pb.NODE_STATE_READY)
    beside = wait_node(pool.stubs, other.name, pb.NODE_STATE_READY)
    gone = wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_RELEASED)
    assert reasons(gone).count("Preempted") == 2  # shrunk to its minimum, then released
    gpus = [b.gpu for n in (placed, beside) for b in n.gpus]
    assert len(gpus) == len(set(gpus)) == 7
    h1_slots = [b.host_slot for n in (placed, beside) if n.host == "hosts/h1" for b in n.gpus]
    assert len(h1_slots) == len(set(h1_slots))
    owner = get_tenant(pool.stubs, "owner").usage
    assert (owner.gpus, owner.borrowed_gpus) == (7, 0)
    assert get_tenant(pool.stubs, "borrower").usage == pb.TenantUsage()


def test_gpus_a_shrink_freed_serve_the_owner_before_the_borrower_drops_their_bindings(
    pool: Pool, etcd_client: Any, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shrink frees its GPUs (the agent reported them scrubbed) in one transaction and
    the controller drops the node's DETACHING bindings in a later one. The controller is
    held before that second step while the owner's queued request is admitted onto the
    freed GPUs and attached: the borrower, still RESIZING, lists them DETACHING while
    their records name the owner. That is a node letting go, not a second claim: the
    checker finds no violation, each GPU is in one host allocation, and once the
    controller goes on the borrower is READY without them."""
    real = NodeController._advance_shrink
    go_on = threading.Event()

    def held(self: NodeController, *args: Any) -> str | None:
        if not go_on.is_set():
            return None  # as if its turn had not come yet
        return real(self, *args)

    monkeypatch.setattr(NodeController, "_advance_shrink", held)
    borrowed = pool.stubs.nodes.ComposeNode(request(8, "borrower", grace=0, min_gpus=2))
    wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    waiting = pool.stubs.nodes.ComposeNode(request(4, "owner", queue=True))
    placed = wait_node(pool.stubs, waiting.name, pb.NODE_STATE_READY)
    shrinking = get(pool.stubs, borrowed.name)
    assert shrinking.state == pb.NODE_STATE_RESIZING
    leaving = {b.gpu for b in shrinking.gpus if b.phase == pb.ATTACHMENT_PHASE_DETACHING}
    taken = {b.gpu for b in placed.gpus}
    assert taken <= leaving  # the interleaving happened: the owner holds what is leaving
    snapshot = EtcdSnapshot.read(etcd_client, KeySchema(key_prefix))
    assert check_records(snapshot) == []
    go_on.set()
    shrunk = wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    assert len(shrunk.gpus) == 4 and not {b.gpu for b in shrunk.gpus} & taken
    assert check_records(EtcdSnapshot.read(etcd_client, KeySchema(key_prefix))) == []


def test_node_plan_shows_what_would_be_preempted_and_respects_quota(pool: Pool) -> None:
    borrowed = pool.stubs.nodes.ComposeNode(request(8, "borrower", grace=30))
    wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    plan = pool.stubs.nodes.PlanNode(nodes_pb2.PlanNodeRequest(spec=request(4, "owner").spec))
    assert plan.host and len(plan.gpus) == 4 and not plan.preemptible
    assert [(p.node, p.tenant, p.reason) for p in plan.preemptions] == [
        (borrowed.name, "borrower", "lent capacity")
    ]
    assert not plan.preemptions[0].gpus  # not elastic: released whole
    assert any("borrowed node" in line for line in plan.unsatisfied)
    assert not get(pool.stubs, borrowed.name).HasField("preemption")  # a plan writes nothing
    borrowing = pool.stubs.nodes.PlanNode(
        nodes_pb2.PlanNodeRequest(spec=request(1, "borrower").spec)
    )
    assert not borrowing.preemptions and not borrowing.host  # nothing of lower priority
    set_quota(pool.stubs, "owner", guaranteed_gpus=4, gpus=2)
    wait_until(
        lambda: pool.leader.cache.get("tenants", "owner").value.quota.gpus == 2,
        timeout_s=90,
        message="quota",
    )
    refused = pool.stubs.nodes.PlanNode(nodes_pb2.PlanNodeRequest(spec=request(4, "owner").spec))
    assert not refused.host and not refused.preemptions
    assert any(line.startswith("quota: ") for line in refused.unsatisfied)
    pool.stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=borrowed.name))
    wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_RELEASED)
    lent = pool.stubs.nodes.PlanNode(nodes_pb2.PlanNodeRequest(spec=request(2, "borrower").spec))
    assert lent.host and lent.preemptible  # beyond its guarantee of 0: borrowed
    assert not pool.stubs.nodes.PlanNode(
        nodes_pb2.PlanNodeRequest(spec=request(2, "owner").spec)
    ).preemptible


def test_a_queued_gang_within_its_guarantee_takes_lent_capacity_back(pool: Pool) -> None:
    borrowed = pool.stubs.nodes.ComposeNode(request(8, "borrower", grace=0))
    wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_READY)
    member = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=2), tenant="owner")
    waiting = pool.stubs.nodes.ComposeGang(
        nodes_pb2.ComposeGangRequest(members=[member, member], gang_id="g", queue=True)
    )
    assert waiting.state == pb.GANG_STATE_QUEUED and not waiting.nodes
    composed = wait_until(
        lambda: (
            (g := pool.stubs.nodes.GetGang(nodes_pb2.GetGangRequest(name="gangs/g"))).state
            == pb.GANG_STATE_VALID
            and g
        ),
        60,
        message="the gang composed from reclaimed GPUs",
    )
    assert isinstance(composed, nodes_pb2.Gang) and len(composed.nodes) == 2
    gone = wait_node(pool.stubs, borrowed.name, pb.NODE_STATE_RELEASED)
    assert gone.preemption.by == "gangs/g"
    for node in composed.nodes:
        wait_node(pool.stubs, node.name, pb.NODE_STATE_READY)
    usage = get_tenant(pool.stubs, "owner").usage
    assert (usage.gpus, usage.nodes, usage.borrowed_gpus) == (4, 2, 0)
