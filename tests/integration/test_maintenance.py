"""Host cordons and drains and box drains through a real broker, etcd and host agents
over the simulated fabric."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.control.sharing_duties import SharingSettings
from dxpool.broker.nodes import compose_commit
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.integration.test_loaning import get, reasons, request, wait_node
from tests.integration.test_quotas import error_info

FAST = SharingSettings(interval_s=0.2, coalesce_s=0.01)


@pytest.fixture
def pool(
    broker_factory: Callable[..., BrokerServer], sim_pool: SimPool
) -> Iterator[tuple[BrokerServer, Stubs, SimPool]]:
    """A broker, boxes box1 and box2 of 4 H100s, hosts h1 and h2 of 8 slots."""
    broker = broker_factory(sharing=FAST, preemption_grace_s=0.0)
    channel = grpc.insecure_channel(broker.endpoint)
    stubs = Stubs(channel)
    register_sim_box(sim_pool, stubs, "box1", gpus=4)
    register_sim_box(sim_pool, stubs, "box2", gpus=4)
    sim_pool.start_agent("h1", slots=8)
    sim_pool.start_agent("h2", slots=8)
    wait_hosts_alive(stubs, 2, timeout_s=90)
    wait_until(lambda: len(broker.index.snapshot().hosts) == 2, timeout_s=90, message="hosts")
    yield broker, stubs, sim_pool
    channel.close()


def host(stubs: Stubs, name: str) -> pb.Host:
    return stubs.inventory.GetHost(inventory_pb2.GetHostRequest(name=name))


def box(stubs: Stubs, name: str) -> pb.Box:
    return stubs.inventory.GetBox(inventory_pb2.GetBoxRequest(name=name))


def test_a_cordoned_host_takes_no_new_node_and_keeps_its_own(
    pool: tuple[BrokerServer, Stubs, SimPool],
) -> None:
    _, stubs, _ = pool
    kept = stubs.nodes.ComposeNode(request(1, "", host="hosts/h1"))
    cordoned = stubs.inventory.CordonHost(
        inventory_pb2.CordonHostRequest(name="hosts/h1", reason="bad fan")
    )
    assert cordoned.unschedulable and cordoned.cordon_reason == "bad fan"
    assert not cordoned.HasField("drain")
    for _ in range(3):
        assert stubs.nodes.ComposeNode(request(1, "")).host == "hosts/h2"
    with pytest.raises(grpc.RpcError) as refused:
        stubs.nodes.ComposeNode(request(1, "", host="hosts/h1"))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert get(stubs, kept.name).state in (
        pb.NODE_STATE_PENDING,
        pb.NODE_STATE_ATTACHING,
        pb.NODE_STATE_READY,
    )
    back = stubs.inventory.UncordonHost(inventory_pb2.UncordonHostRequest(name="hosts/h1"))
    assert not back.unschedulable
    assert stubs.nodes.ComposeNode(request(1, "", host="hosts/h1")).host == "hosts/h1"
    status = stubs.inventory.GetPoolStatus(inventory_pb2.GetPoolStatusRequest())
    assert status.hosts_cordoned == 0


def test_unknown_hosts_and_a_moving_host_drain_are_refused(
    pool: tuple[BrokerServer, Stubs, SimPool],
) -> None:
    _, stubs, _ = pool
    with pytest.raises(grpc.RpcError) as missing:
        stubs.inventory.CordonHost(inventory_pb2.CordonHostRequest(name="hosts/nope"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as moving:
        stubs.inventory.DrainHost(
            inventory_pb2.DrainHostRequest(name="hosts/h1", policy=pb.DRAIN_POLICY_MOVE)
        )
    assert moving.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(moving.value).reason == "INVALID_POLICY"
    assert not host(stubs, "hosts/h1").unschedulable


def test_a_compose_placed_before_the_cordon_does_not_land_on_the_host(
    pool: tuple[BrokerServer, Stubs, SimPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compose is held after its placement chose h1 and before it stages its commit;
    h1 is cordoned meanwhile. Staging finds the cordon in the allocation record it would
    compare, and the compose places again, on h2."""
    _, stubs, _ = pool
    real = compose_commit.ComposeCommitter._stage
    armed, reached, go_on = threading.Event(), threading.Event(), threading.Event()

    def held(self: Any, job: Any, group: Any) -> Any:
        if armed.is_set() and not reached.is_set():
            reached.set()
            assert go_on.wait(90)
        return real(self, job, group)

    monkeypatch.setattr(compose_commit.ComposeCommitter, "_stage", held)
    stubs.nodes.ComposeNode(request(1, "", host="hosts/h1"))  # h1 the tighter: chosen next
    armed.set()
    with ThreadPoolExecutor(1) as executor:
        composing = executor.submit(stubs.nodes.ComposeNode, request(4, ""))
        assert reached.wait(90)
        stubs.inventory.CordonHost(inventory_pb2.CordonHostRequest(name="hosts/h1"))
        go_on.set()
        node = composing.result(120)
    assert node.host == "hosts/h2"


def test_draining_a_host_releases_its_nodes_after_their_notice(
    pool: tuple[BrokerServer, Stubs, SimPool],
) -> None:
    _, stubs, _ = pool
    on_h1 = [stubs.nodes.ComposeNode(request(2, "", host="hosts/h1", grace=1)) for _ in range(2)]
    on_h2 = stubs.nodes.ComposeNode(request(1, "", host="hosts/h2"))
    for node in (*on_h1, on_h2):
        wait_node(stubs, node.name, pb.NODE_STATE_READY)
    draining = stubs.inventory.DrainHost(
        inventory_pb2.DrainHostRequest(name="hosts/h1", reason="kernel upgrade")
    )
    assert draining.unschedulable and draining.drain.policy == pb.DRAIN_POLICY_RELEASE
    assert draining.drain.state == pb.DRAIN_STATE_DRAINING
    assert draining.drain.nodes_left == 2 and draining.drain.gpus_left == 4
    for node in on_h1:
        gone = wait_node(stubs, node.name, pb.NODE_STATE_RELEASED)
        assert {"PreemptionNotice", "Preempted"} <= set(reasons(gone))
        assert gone.preemption.by == "hosts/h1"
    drained = wait_until(
        lambda: (h := host(stubs, "hosts/h1")).drain.state == pb.DRAIN_STATE_DRAINED and h,
        timeout_s=90,
        message="h1 drained",
    )
    assert isinstance(drained, pb.Host)
    assert drained.drain.nodes_left == 0 and drained.drain.gpus_left == 0
    assert get(stubs, on_h2.name).state == pb.NODE_STATE_READY  # other hosts untouched
    undrained = stubs.inventory.UncordonHost(inventory_pb2.UncordonHostRequest(name="hosts/h1"))
    assert not undrained.unschedulable and not undrained.HasField("drain")


def test_draining_a_box_moves_gpus_onto_other_boxes_on_the_same_host(
    pool: tuple[BrokerServer, Stubs, SimPool],
) -> None:
    _, stubs, _ = pool
    stubs.inventory.CordonBox(inventory_pb2.CordonBoxRequest(name="boxes/box2"))
    node = stubs.nodes.ComposeNode(request(3, "", host="hosts/h1"))
    assert {b.gpu.split("/")[1] for b in node.gpus} == {"box1"}
    wait_node(stubs, node.name, pb.NODE_STATE_READY)
    stubs.inventory.UncordonBox(inventory_pb2.UncordonBoxRequest(name="boxes/box2"))
    draining = stubs.inventory.DrainBox(
        inventory_pb2.DrainBoxRequest(name="boxes/box1", reason="firmware")
    )
    assert draining.state == pb.BOX_STATE_CORDONED
    assert draining.drain.policy == pb.DRAIN_POLICY_MOVE
    assert draining.drain.nodes_left == 1
    moved = wait_until(
        lambda: (
            (n := get(stubs, node.name)).state == pb.NODE_STATE_READY
            and {b.gpu.split("/")[1] for b in n.gpus} == {"box2"}
            and n
        ),
        60,
        message="the node's GPUs moved to box2",
    )
    assert isinstance(moved, pb.VirtualNode)
    assert len(moved.gpus) == 3 and moved.host == "hosts/h1"
    assert "Released" not in reasons(moved)
    drained = wait_until(
        lambda: (b := box(stubs, "boxes/box1")).drain.state == pb.DRAIN_STATE_DRAINED and b,
        60,
        message="box1 drained",
    )
    assert isinstance(drained, pb.Box)
    ended = stubs.inventory.UncordonBox(inventory_pb2.UncordonBoxRequest(name="boxes/box1"))
    assert ended.state == pb.BOX_STATE_ACTIVE and not ended.HasField("drain")


def test_a_node_that_cannot_move_is_reported_and_a_release_drain_releases_it(
    pool: tuple[BrokerServer, Stubs, SimPool],
) -> None:
    _, stubs, _ = pool
    pinned = stubs.nodes.ComposeNode(request(2, "", host="hosts/h1", affinity=pb.GPU_AFFINITY_BOX))
    wait_node(stubs, pinned.name, pb.NODE_STATE_READY)
    where = pinned.gpus[0].gpu.split("/")[1]
    stubs.inventory.DrainBox(inventory_pb2.DrainBoxRequest(name=f"boxes/{where}"))
    blocked = wait_until(
        lambda: list(box(stubs, f"boxes/{where}").drain.blocked),
        timeout_s=90,
        message="a blocked node",
    )
    assert isinstance(blocked, list) and pinned.name in blocked[0]
    assert "affinity" in blocked[0]
    stubs.inventory.DrainBox(
        inventory_pb2.DrainBoxRequest(name=f"boxes/{where}", policy=pb.DRAIN_POLICY_RELEASE)
    )
    wait_node(stubs, pinned.name, pb.NODE_STATE_RELEASED)
    wait_until(
        lambda: box(stubs, f"boxes/{where}").drain.state == pb.DRAIN_STATE_DRAINED,
        timeout_s=90,
        message="drained",
    )
