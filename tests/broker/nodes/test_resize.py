"""ResizeNode against a real broker and etcd, with host agents as processes over a
simulated fabric: grow and shrink in place, idempotency, a grow whose attach does not
finish, and resizes racing releases with the interleaving forced."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.store.keys import KeySchema
from tests.conftest import SimPool, Stubs, pool_records, register_sim_box, wait_until
from tests.integration.test_node_lifecycle import compose, wait_state


def resize(stubs: Stubs, name: str, gpu_count: int = 0, **fields: Any) -> pb.VirtualNode:
    return stubs.nodes.ResizeNode(
        nodes_pb2.ResizeNodeRequest(name=name, gpu_count=gpu_count, **fields)
    )


def gpu(stubs: Stubs, name: str) -> pb.Gpu:
    return stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=name))


def all_free_but(stubs: Stubs, kept: set[str]) -> bool:
    gpus = stubs.inventory.ListGpus(inventory_pb2.ListGpusRequest()).gpus
    return all((g.state == pb.GPU_STATE_FREE) == (g.name not in kept) for g in gpus)


@pytest.fixture
def ready(stubs: Stubs, sim_pool: SimPool) -> pb.VirtualNode:
    """A READY node of 2 H100s on h1 (6 slots), one box of 8 H100s."""
    register_sim_box(sim_pool, stubs, "box1", gpus=8)
    sim_pool.start_agent("h1", slots=6)
    wait_until(
        lambda: any(
            h.alive for h in stubs.inventory.ListHosts(inventory_pb2.ListHostsRequest()).hosts
        ),
        message="h1 alive",
    )
    return wait_state(stubs, compose(stubs, "H100:2").name, pb.NODE_STATE_READY)


def test_grow_attaches_new_gpus_in_place_and_the_node_is_ready_again(
    stubs: Stubs, sim_pool: SimPool, ready: pb.VirtualNode
) -> None:
    grown = resize(stubs, ready.name, 4)

    assert grown.state == pb.NODE_STATE_RESIZING
    assert [b.gpu for b in grown.gpus[:2]] == [b.gpu for b in ready.gpus]
    assert len({b.gpu for b in grown.gpus}) == 4
    done = wait_state(stubs, ready.name, pb.NODE_STATE_READY)
    assert len(done.gpus) == 4 and done.ready_time == ready.ready_time
    assert "grown to 4 GPUs" in done.message
    for binding in done.gpus:
        assert binding.phase == pb.ATTACHMENT_PHASE_ATTACHED and binding.bdf
        assert gpu(stubs, binding.gpu).state == pb.GPU_STATE_ATTACHED
        ref = binding.gpu.split("/")
        assert sim_pool.fabric.mapping(ref[1], int(ref[3]))[0] == "h1"  # type: ignore[index]
    assert len({b.host_slot for b in done.gpus}) == 4


def test_shrink_detaches_the_most_recently_added_or_the_named_gpus(
    stubs: Stubs, ready: pb.VirtualNode
) -> None:
    resize(stubs, ready.name, 4)
    grown = wait_state(stubs, ready.name, pb.NODE_STATE_READY)
    order = [b.gpu for b in grown.gpus]

    shrinking = resize(stubs, ready.name, 3)
    assert shrinking.state == pb.NODE_STATE_RESIZING
    assert [b.phase for b in shrinking.gpus] == [pb.ATTACHMENT_PHASE_ATTACHED] * 3 + [
        pb.ATTACHMENT_PHASE_DETACHING
    ]
    shrunk = wait_state(stubs, ready.name, pb.NODE_STATE_READY)
    assert [b.gpu for b in shrunk.gpus] == order[:3]
    assert all_free_but(stubs, set(order[:3]))  # READY again only once it was freed

    resize(stubs, ready.name, remove=[order[0]])
    named = wait_state(stubs, ready.name, pb.NODE_STATE_READY)
    assert [b.gpu for b in named.gpus] == order[1:3]
    assert all_free_but(stubs, set(order[1:3]))
    with pytest.raises(grpc.RpcError) as foreign:
        resize(stubs, ready.name, remove=[order[0]])
    assert foreign.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as empty:
        resize(stubs, ready.name, remove=order[1:3])
    assert empty.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The node still works: it releases as ever.
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=ready.name))
    wait_state(stubs, ready.name, pb.NODE_STATE_RELEASED)
    wait_until(lambda: all_free_but(stubs, set()), message="every GPU free")


def test_a_resize_retried_with_its_request_id_is_made_once(
    stubs: Stubs, ready: pb.VirtualNode, etcd_client: Any, key_prefix: str
) -> None:
    first = resize(stubs, ready.name, 3, request_id="grow-1")
    wait_state(stubs, ready.name, pb.NODE_STATE_READY)
    resize(stubs, ready.name, 2)  # someone shrinks it meanwhile (no request id)
    wait_state(stubs, ready.name, pb.NODE_STATE_READY)
    # The first request's key went with the next resize: a retry resizes to 3 again,
    # which is what was asked; with a key kept, it returns at once.
    keys = KeySchema(key_prefix)
    assert etcd_client.get(keys.request("grow-1"))[0] is None
    again = resize(stubs, ready.name, 3, request_id="grow-2")
    node_key = keys.node(ready.name.removeprefix("nodes/"))
    retried = resize(stubs, ready.name, 3, request_id="grow-2")
    assert retried.resize_request_id == "grow-2" and len(retried.gpus) == 3
    assert [b.gpu for b in retried.gpus] == [b.gpu for b in again.gpus]
    wait_state(stubs, ready.name, pb.NODE_STATE_READY)
    # Once READY, a retry still returns at once: it does not even compare sizes.
    written = etcd_client.get(node_key)[1].mod_revision
    assert resize(stubs, ready.name, 3, request_id="grow-2").resize_request_id == "grow-2"
    assert etcd_client.get(node_key)[1].mod_revision == written
    assert [b.gpu for b in again.gpus][:2] == [b.gpu for b in first.gpus][:2]
    with pytest.raises(grpc.RpcError) as reused:
        stubs.nodes.ComposeNode(
            nodes_pb2.ComposeNodeRequest(
                spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)),
                request_id="grow-2",
            )
        )
    assert reused.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_bad_resizes_change_nothing(
    stubs: Stubs, ready: pb.VirtualNode, etcd_client: Any, key_prefix: str
) -> None:
    before = pool_records(etcd_client, key_prefix)
    cases = [
        (dict(gpu_count=0), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(gpu_count=65), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(gpu_count=7), grpc.StatusCode.RESOURCE_EXHAUSTED),  # h1 has 6 slots
        (dict(remove=["boxes/box1/gpus/7", "boxes/box1/gpus/7"]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(remove=["nodes/x"]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(gpu_count=2, request_id="bad id"), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for fields, code in cases:
        with pytest.raises(grpc.RpcError) as refused:
            resize(stubs, ready.name, **fields)  # type: ignore[arg-type]
        assert refused.value.code() == code, fields
    with pytest.raises(grpc.RpcError) as missing:
        resize(stubs, "nodes/nope", 2)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as exhausted:
        resize(stubs, ready.name, 7)
    assert "grows on its own host only" in (exhausted.value.details() or "")
    assert pool_records(etcd_client, key_prefix) == before


def test_a_node_that_is_not_ready_is_not_resized(
    stubs: Stubs, sim_pool: SimPool, ready: pb.VirtualNode, etcd_client: Any, key_prefix: str
) -> None:
    agent = sim_pool.agents[0]
    os.kill(agent.process.pid, signal.SIGSTOP)  # briefly, well within its lease
    try:
        assert resize(stubs, ready.name, 3).state == pb.NODE_STATE_RESIZING
        before = pool_records(etcd_client, key_prefix)
        with pytest.raises(grpc.RpcError) as busy:
            resize(stubs, ready.name, 4)
        assert pool_records(etcd_client, key_prefix) == before
    finally:
        os.kill(agent.process.pid, signal.SIGCONT)
    assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "only a READY node can be resized" in (busy.value.details() or "")
    assert len(wait_state(stubs, ready.name, pb.NODE_STATE_READY).gpus) == 3


@pytest.fixture
def slow_pool(
    broker_factory: Callable[..., BrokerServer], sim_pool: SimPool
) -> Iterator[tuple[Stubs, SimPool]]:
    broker = broker_factory(attach_timeout_s=2.0)
    channel = grpc.insecure_channel(broker.endpoint)
    yield Stubs(channel), sim_pool
    channel.close()


def test_a_grow_that_does_not_attach_in_time_leaves_the_node_ready_as_it_was(
    slow_pool: tuple[Stubs, SimPool],
) -> None:
    """The agent freezes (within its lease) after the node is READY; the grow's deadline
    passes: the node is READY again with the GPUs it had, the added GPU goes back to the
    pool once the agent wakes and sees it is no longer wanted."""
    stubs, sim_pool = slow_pool
    register_sim_box(sim_pool, stubs, "box1", gpus=4)
    agent = sim_pool.start_agent("h1", slots=4, lease_ttl_s=15.0)
    wait_until(
        lambda: any(
            h.alive for h in stubs.inventory.ListHosts(inventory_pb2.ListHostsRequest()).hosts
        ),
        message="h1 alive",
    )
    node = wait_state(stubs, compose(stubs, "H100:1").name, pb.NODE_STATE_READY)
    os.kill(agent.process.pid, signal.SIGSTOP)
    try:
        grown = resize(stubs, node.name, 2)
        added = grown.gpus[1].gpu
        wait_until(
            lambda: (
                "grow failed"
                in stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name)).message
            ),
            timeout_s=10,
            message="the grow to be abandoned",
        )
    finally:
        os.kill(agent.process.pid, signal.SIGCONT)
    back = stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name))
    assert back.state == pb.NODE_STATE_READY
    assert [b.gpu for b in back.gpus] == [b.gpu for b in node.gpus]
    assert gpu(stubs, node.gpus[0].gpu).state == pb.GPU_STATE_ATTACHED
    wait_until(
        lambda: gpu(stubs, added).state == pb.GPU_STATE_FREE,
        timeout_s=15,
        message="the added GPU freed",
    )


# -- resize racing release ---------------------------------------------------------------


def test_a_release_between_a_grows_read_and_its_commit_wins_and_nothing_leaks(
    broker: BrokerServer,
    broker_factory: Callable[..., BrokerServer],
    stubs: Stubs,
    ready: pb.VirtualNode,
) -> None:
    """The grow has read the READY node and placed; before its transaction reaches etcd
    another broker releases the node. The grow's compare on the node fails, it runs
    again on the RELEASING node and refuses: no GPU is assigned to the released node."""
    other = Stubs(grpc.insecure_channel(broker_factory().endpoint))
    store = broker.nodes._resizer._store
    original = store.commit
    fired = threading.Event()

    def commit_after_a_release(txn: Any) -> Any:
        if not fired.is_set():
            fired.set()
            released = other.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=ready.name))
            assert released.state == pb.NODE_STATE_RELEASING
        return original(txn)

    store.commit = commit_after_a_release  # type: ignore[method-assign]
    try:
        with pytest.raises(grpc.RpcError) as refused:
            resize(stubs, ready.name, 4)
    finally:
        store.commit = original  # type: ignore[method-assign]
    assert fired.is_set()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "RELEASING" in (refused.value.details() or "")
    wait_state(stubs, ready.name, pb.NODE_STATE_RELEASED)
    wait_until(lambda: all_free_but(stubs, set()), message="every GPU free")


def test_a_release_waiting_while_a_grow_commits_releases_the_grown_node_whole(
    broker: BrokerServer,
    broker_factory: Callable[..., BrokerServer],
    stubs: Stubs,
    ready: pb.VirtualNode,
) -> None:
    """The release has looked the node up and waits at the host lock while another
    broker grows the node: the release's transaction then sees (or loses its compare
    to) the grow, releases the RESIZING node with every GPU, the added ones included,
    and all return to the pool."""
    other_broker = broker_factory()
    other = Stubs(grpc.insecure_channel(other_broker.endpoint))
    wait_until(
        lambda: other_broker.index.snapshot().hosts.get("h1") is not None,
        message="the other broker to see h1",
    )
    locks = broker.nodes._composer.host_locks
    with ThreadPoolExecutor(1) as executor:
        with locks.lock("h1"):
            releasing = executor.submit(
                stubs.nodes.ReleaseNode, nodes_pb2.ReleaseNodeRequest(name=ready.name)
            )
            wait_until(lambda: locks.waiting("h1") > 0, message="the release at the lock")
            grown = resize(other, ready.name, 4)
        released = releasing.result(timeout=30)
    assert grown.state == pb.NODE_STATE_RESIZING
    assert released.state == pb.NODE_STATE_RELEASING
    assert len(released.gpus) == 4
    wait_state(stubs, ready.name, pb.NODE_STATE_RELEASED)
    wait_until(lambda: all_free_but(stubs, set()), message="every GPU free")


def test_a_collected_node_takes_its_last_resize_request_id_with_it(
    broker_factory: Callable[..., BrokerServer],
    sim_pool: SimPool,
    etcd_client: Any,
    key_prefix: str,
) -> None:
    broker = broker_factory(retention_s=0.5)
    stubs = Stubs(grpc.insecure_channel(broker.endpoint))
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    sim_pool.start_agent("h1", slots=2)
    wait_until(
        lambda: any(
            h.alive for h in stubs.inventory.ListHosts(inventory_pb2.ListHostsRequest()).hosts
        ),
        message="h1 alive",
    )
    node = wait_state(stubs, compose(stubs, "H100:1").name, pb.NODE_STATE_READY)
    resize(stubs, node.name, 2, request_id="grow-then-go")
    wait_state(stubs, node.name, pb.NODE_STATE_READY)
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    request_key = KeySchema(key_prefix).request("grow-then-go")
    assert etcd_client.get(request_key)[0] == b"resize/" + node.name.encode()
    wait_until(
        lambda: etcd_client.get(request_key)[0] is None,
        timeout_s=20,
        message="the resize's request id to be collected with the node",
    )


@pytest.mark.parametrize("affinity", [pb.GPU_AFFINITY_BOX, pb.GPU_AFFINITY_SWITCH])
def test_a_node_with_box_or_switch_affinity_is_not_grown(
    stubs: Stubs, sim_pool: SimPool, affinity: int
) -> None:
    register_sim_box(sim_pool, stubs, "box1", gpus=8)
    sim_pool.start_agent("h1", slots=6)
    wait_until(
        lambda: any(
            h.alive for h in stubs.inventory.ListHosts(inventory_pb2.ListHostsRequest()).hosts
        ),
        message="h1 alive",
    )
    node = wait_state(stubs, compose(stubs, "H100:2", affinity=affinity).name, pb.NODE_STATE_READY)
    with pytest.raises(grpc.RpcError) as refused:
        resize(stubs, node.name, 3)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "box or switch affinity" in refused.value.details()
