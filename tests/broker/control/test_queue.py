"""Queued composes against a real etcd and real brokers over gRPC.

Hosts are written straight into etcd (a registration and a liveness key, no agent), so
admitted nodes stay PENDING: what is tested is the queue (order, positions, reasons,
deadlines, cancels) and admission (one compare-and-swap on the QUEUED record), with
capacity freed by registering a new box. The races the queue must survive are forced
by holding one party between its read and its commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.control import dispatcher
from dxpool.broker.control.dispatcher import Dispatcher
from dxpool.broker.control.sharing_duties import SharingSettings
from dxpool.broker.nodes import admission, tenants
from dxpool.broker.nodes.admission import ADMITTED, GONE, Admitter
from dxpool.broker.nodes.compose_gate import ComposeGate
from dxpool.store.keys import KeySchema
from tests.conftest import Stubs, add_box, wait_until
from tests.integration.test_quotas import (
    compose_request,
    error_info,
    register_host,
    set_quota,
    stored_nodes,
)

FAST = SharingSettings(interval_s=0.2, coalesce_s=0.01)


@pytest.fixture
def keys(key_prefix: str) -> KeySchema:
    return KeySchema(key_prefix)


@pytest.fixture
def queued_broker(broker_factory: Callable[..., BrokerServer]) -> BrokerServer:
    return broker_factory(sharing=FAST)


@pytest.fixture
def pool(queued_broker: BrokerServer, etcd_client: Any, keys: KeySchema) -> Iterator[Stubs]:
    """One host of 32 slots, one box of 4 H100s."""
    channel = grpc.insecure_channel(queued_broker.endpoint)
    stubs = Stubs(channel)
    register_host(etcd_client, keys, "h1")
    add_box(stubs, "box1", gpus=4, model="H100")
    wait_until(lambda: len(queued_broker.index.snapshot().hosts) == 1, timeout_s=90, message="host")
    yield stubs
    channel.close()


def queued(gpus: str, tenant: str = "", **fields: Any) -> nodes_pb2.ComposeNodeRequest:
    request = compose_request(gpus, tenant)
    request.queue = True
    for key, value in fields.items():
        if key in ("priority", "min_gpus"):
            setattr(request.spec, key, value)
        else:
            setattr(request, key, value)
    return request


def get(stubs: Stubs, name: str) -> pb.VirtualNode:
    return stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=name))


def wait_node(stubs: Stubs, name: str, state: int, timeout_s: float = 90) -> pb.VirtualNode:
    wait_until(
        lambda: get(stubs, name).state == state,
        timeout_s,
        message=f"{name} {pb.NodeState.Name(state)}",
    )
    return get(stubs, name)


def test_a_queued_compose_that_fits_is_composed_at_once(pool: Stubs) -> None:
    node = pool.nodes.ComposeNode(queued("H100:2"))
    assert node.state == pb.NODE_STATE_PENDING
    assert len(node.gpus) == 2


def test_a_queued_compose_waits_then_is_placed_when_a_box_is_added(pool: Stubs) -> None:
    first = pool.nodes.ComposeNode(compose_request("H100:4", ""))
    waiting = pool.nodes.ComposeNode(queued("H100:3", request_id="q-1"))
    assert waiting.state == pb.NODE_STATE_QUEUED
    assert not waiting.host and not waiting.gpus
    shown = get(pool, waiting.name)
    assert shown.queue.position == 1
    assert "no placement" in shown.queue.reason or "no capacity" in shown.queue.reason
    assert [e.reason for e in shown.events] == ["Queued"]
    # a retry with the same request id returns the waiting node, not a second one
    again = pool.nodes.ComposeNode(queued("H100:3", request_id="q-1"))
    assert again.name == waiting.name
    add_box(pool, "box2", gpus=4, model="H100")
    placed = wait_node(pool, waiting.name, pb.NODE_STATE_PENDING)
    assert placed.host == "hosts/h1"
    assert {b.gpu.split("/")[1] for b in placed.gpus} == {"box2"}
    assert [e.reason for e in placed.events] == ["Queued", "Composed"]
    assert placed.queue.position == 0
    assert first.state == pb.NODE_STATE_PENDING


def test_without_queue_the_compose_is_refused_and_nothing_is_written(
    pool: Stubs, etcd_client: Any, keys: KeySchema
) -> None:
    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeNode(compose_request("H100:1", ""))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(stored_nodes(etcd_client, keys)) == 1


def test_a_queue_timeout_without_queue_is_invalid(pool: Stubs) -> None:
    request = compose_request("H100:1", "")
    request.queue_timeout_s = 5
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeNode(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_queue_is_ordered_by_priority_then_tenant_turns_then_age(pool: Stubs) -> None:
    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    names = []
    for tenant, priority in (("a", 0), ("a", 0), ("a", 0), ("b", 0), ("c", 5)):
        names.append(pool.nodes.ComposeNode(queued("H100:1", tenant, priority=priority)).name)
    listed = pool.nodes.ListQueue(nodes_pb2.ListQueueRequest())
    order = [entry.name for entry in listed.entries]
    a1, a2, a3, b1, c1 = names
    assert order == [c1, a1, b1, a2, a3]
    assert [entry.queue.position for entry in listed.entries] == [1, 2, 3, 4, 5]
    assert get(pool, b1).queue.position == 3
    only_a = pool.nodes.ListQueue(nodes_pb2.ListQueueRequest(tenant="a", page_size=2))
    assert [e.name for e in only_a.entries] == [a1, a2]
    rest = pool.nodes.ListQueue(
        nodes_pb2.ListQueueRequest(tenant="a", page_size=2, page_token=only_a.next_page_token)
    )
    assert [e.name for e in rest.entries] == [a3]


def test_pool_status_counts_the_queue_per_tenant(pool: Stubs) -> None:
    from dxpool.api.v1 import inventory_pb2

    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    pool.nodes.ComposeNode(queued("H100:2", "a"))
    pool.nodes.ComposeNode(queued("H100:1", "a"))
    pool.nodes.ComposeNode(queued("H100:3", "b"))
    status = pool.inventory.GetPoolStatus(inventory_pb2.GetPoolStatusRequest())
    by_tenant = {q.tenant: (q.waiting, q.gpus) for q in status.queue}
    assert by_tenant == {"a": (2, 3), "b": (1, 3)}
    assert all(q.head_reason for q in status.queue)


def test_releasing_a_queued_node_cancels_it(pool: Stubs) -> None:
    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    waiting = pool.nodes.ComposeNode(queued("H100:1"))
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=waiting.name))
    wait_node(pool, waiting.name, pb.NODE_STATE_RELEASED)
    add_box(pool, "box2", gpus=4, model="H100")
    assert not pool.nodes.ListQueue(nodes_pb2.ListQueueRequest()).entries
    assert get(pool, waiting.name).state == pb.NODE_STATE_RELEASED


def test_a_request_past_its_queue_timeout_fails(pool: Stubs) -> None:
    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    waiting = pool.nodes.ComposeNode(queued("H100:1", queue_timeout_s=1))
    failed = wait_node(pool, waiting.name, pb.NODE_STATE_FAILED)
    assert "queue timeout" in failed.message
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=waiting.name))
    wait_node(pool, waiting.name, pb.NODE_STATE_RELEASED)


def test_a_request_over_its_quota_waits_for_the_tenant_to_release(pool: Stubs) -> None:
    set_quota(pool, "a", gpus=2)
    held = pool.nodes.ComposeNode(compose_request("H100:2", "a"))
    waiting = pool.nodes.ComposeNode(queued("H100:1", "a"))
    assert waiting.state == pb.NODE_STATE_QUEUED
    wait_until(
        lambda: "quota" in get(pool, waiting.name).queue.reason,
        timeout_s=90,
        message="quota reason",
    )
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=held.name))
    placed = wait_node(pool, waiting.name, pb.NODE_STATE_PENDING)
    assert placed.charged


def test_a_request_its_quota_can_never_hold_is_refused_not_queued(
    pool: Stubs, etcd_client: Any, keys: KeySchema
) -> None:
    set_quota(pool, "a", gpus=2)
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeNode(queued("H100:3", "a"))
    assert error_info(refused.value).reason == "QUOTA_EXCEEDED"
    assert "never fit" in (refused.value.details() or "")
    assert not stored_nodes(etcd_client, keys)


# -- races -----------------------------------------------------------------------------


def test_a_queued_request_served_by_two_brokers_at_once_is_committed_once(
    pool: Stubs,
    queued_broker: BrokerServer,
    broker_factory: Callable[..., BrokerServer],
    etcd_client: Any,
    keys: KeySchema,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two admitters (two brokers that both believe they lead) place the same QUEUED
    node; the first is held between its placement and its commit while the second
    commits. The first's commit then fails its compare on the node record, it finds the
    node PENDING and leaves it: one node, each GPU owned once."""
    queued_broker.sharing_duties.stop()  # type: ignore[union-attr]  # admit by hand only
    other = broker_factory(sharing=SharingSettings(interval_s=3600))
    other.sharing_duties.stop()  # type: ignore[union-attr]
    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    waiting = pool.nodes.ComposeNode(queued("H100:2"))
    add_box(pool, "box2", gpus=4, model="H100")
    node_id = waiting.name.removeprefix("nodes/")
    for broker in (queued_broker, other):
        wait_until(
            lambda b=broker: b.cache.get("boxes", "box2") is not None, timeout_s=90, message="box2"
        )
    first = Admitter(queued_broker.composer, ComposeGate(queued_broker.cache))  # type: ignore[arg-type]
    second = Admitter(other.composer, ComposeGate(other.cache))  # type: ignore[arg-type]
    real = Admitter._admit_in
    reached, go_on = threading.Event(), threading.Event()

    def held(self: Admitter, view: Any, node: str, placement: Any) -> Any:
        result = real(self, view, node, placement)
        if self is first and not reached.is_set():
            reached.set()
            assert go_on.wait(90)
        return result

    def generations() -> dict[str, int]:
        stored = etcd_client.get_prefix(keys.collection("gpus"))
        return {g.name: g.generation for g in (pb.Gpu.FromString(v) for v, _ in stored)}

    registered = generations()
    monkeypatch.setattr(Admitter, "_admit_in", held)
    with ThreadPoolExecutor(1) as executor:
        held_admission = executor.submit(first.admit, node_id)
        assert reached.wait(90)
        assert second.admit(node_id).kind == ADMITTED
        go_on.set()
        assert held_admission.result(120).kind == GONE
    nodes = {n.name: n for n in stored_nodes(etcd_client, keys)}
    assert nodes[waiting.name].state == pb.NODE_STATE_PENDING
    gpus = [pb.Gpu.FromString(v) for v, _ in etcd_client.get_prefix(keys.collection("gpus"))]
    owned = [g.name for g in gpus if g.node == waiting.name]
    assert sorted(owned) == sorted(b.gpu for b in nodes[waiting.name].gpus)
    assert len(owned) == 2
    # one allocation each at most: a second commit would have moved a generation twice
    assert all(generation <= registered[name] + 1 for name, generation in generations().items())


def test_a_queue_head_whose_tenant_is_deleted_fails_and_the_next_is_served(
    pool: Stubs,
    queued_broker: BrokerServer,
    etcd_client: Any,
    keys: KeySchema,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeleteTenant is held between its check (no node, nothing waiting) and its commit;
    meanwhile the tenant's request is queued (the tenant already has a record with a uid,
    so queueing does not touch it). The delete commits; the tenant is made anew by a
    quota. The head of the queue must fail (never be charged to the new tenant), and the
    request behind it, of another tenant, is served."""
    set_quota(pool, "gone", gpus=8)
    set_quota(pool, "kept", gpus=8)
    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    checked, go_on = threading.Event(), threading.Event()
    real_transact = tenants.transact

    def held_transact(store: Any, cache: Any, body: Any, **kwargs: Any) -> Any:
        if kwargs.get("what", "").startswith("deleting") and not checked.is_set():

            def held_body(view: Any) -> Any:
                result = body(view)
                checked.set()
                assert go_on.wait(90)
                return result

            return real_transact(store, cache, held_body, **kwargs)
        return real_transact(store, cache, body, **kwargs)

    monkeypatch.setattr(tenants, "transact", held_transact)
    with ThreadPoolExecutor(1) as executor:
        deleting = executor.submit(
            pool.nodes.DeleteTenant, nodes_pb2.DeleteTenantRequest(name="tenants/gone")
        )
        assert checked.wait(90)
        head = pool.nodes.ComposeNode(queued("H100:2", "gone"))
        behind = pool.nodes.ComposeNode(queued("H100:2", "kept"))
        go_on.set()
        deleting.result(120)
    set_quota(pool, "gone", gpus=8)  # the tenant made anew: another uid
    # the head waits first, unless a queue pass has already failed it for its tenant
    waiting = [e.name for e in pool.nodes.ListQueue(nodes_pb2.ListQueueRequest()).entries]
    assert waiting in ([head.name, behind.name], [behind.name])
    add_box(pool, "box2", gpus=4, model="H100")
    failed = wait_node(pool, head.name, pb.NODE_STATE_FAILED)
    assert "was deleted while the request waited" in failed.message
    assert not failed.charged and not failed.gpus
    wait_node(pool, behind.name, pb.NODE_STATE_PENDING)
    fresh = pool.nodes.GetTenant(nodes_pb2.GetTenantRequest(name="tenants/gone"))
    assert fresh.usage == pb.TenantUsage()


def test_delete_tenant_is_refused_while_its_requests_wait(pool: Stubs) -> None:
    set_quota(pool, "a", gpus=8)
    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    pool.nodes.ComposeNode(queued("H100:2", "a"))
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.DeleteTenant(nodes_pb2.DeleteTenantRequest(name="tenants/a"))
    assert error_info(refused.value).reason == "TENANT_HAS_NODES"
    assert "queue" in (refused.value.details() or "")


def test_admission_fails_a_node_whose_tenant_uid_changed(
    pool: Stubs, queued_broker: BrokerServer
) -> None:
    """The uid check on the record the admission compares (unit level, no race)."""
    assert admission.tenant_changed("u1", None)
    assert admission.tenant_changed("u1", pb.Tenant(uid="u2"))
    assert not admission.tenant_changed("u1", pb.Tenant(uid="u1"))
    assert not admission.tenant_changed("", None)


def test_the_queue_survives_its_leader_and_is_served_by_the_next(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, keys: KeySchema
) -> None:
    """The queue is the QUEUED records in etcd: the leader that would serve a request
    stops; the other broker, leading next, serves it once capacity frees."""
    first = broker_factory(sharing=FAST)
    assert first.election.wait_until_leader(30)
    second = broker_factory(sharing=FAST)
    channel = grpc.insecure_channel(second.endpoint)
    stubs = Stubs(channel)
    try:
        register_host(etcd_client, keys, "h1")
        add_box(stubs, "box1", gpus=4, model="H100")
        wait_until(lambda: len(second.index.snapshot().hosts) == 1, timeout_s=90, message="host")
        stubs.nodes.ComposeNode(compose_request("H100:4", ""))
        waiting = stubs.nodes.ComposeNode(queued("H100:2"))
        assert waiting.state == pb.NODE_STATE_QUEUED
        first.stop(grace_s=0)
        assert second.election.wait_until_leader(30)
        add_box(stubs, "box2", gpus=4, model="H100")
        placed = wait_node(stubs, waiting.name, pb.NODE_STATE_PENDING, timeout_s=40)
        assert {b.gpu.split("/")[1] for b in placed.gpus} == {"box2"}
    finally:
        channel.close()


# -- what a pass costs -----------------------------------------------------------------


def by_hand(broker: BrokerServer, max_placements: int) -> Dispatcher:
    """A dispatcher over ``broker``'s own parts (its sharing duties stopped, so only
    the test serves the queue)."""
    gate = ComposeGate(broker.cache, broker.queue)
    return Dispatcher(
        broker.composer,  # type: ignore[arg-type]
        broker.queue,  # type: ignore[arg-type]
        gate,
        Admitter(broker.composer, gate),  # type: ignore[arg-type]
        broker.notices,  # type: ignore[arg-type]
        max_placements=max_placements,
    )


def test_requests_held_back_by_their_quota_do_not_use_up_a_pass(
    pool: Stubs, queued_broker: BrokerServer
) -> None:
    """More requests than a pass may place wait for their tenant's quota, ahead of
    another tenant's request (higher priority). Capacity frees; one pass must still
    reach and admit the request behind them: a quota check places nothing, so it does
    not count against the pass's bound."""
    queued_broker.sharing_duties.stop()  # type: ignore[union-attr]
    set_quota(pool, "a", gpus=1)
    pool.nodes.ComposeNode(compose_request("H100:1", "a"))
    pool.nodes.ComposeNode(compose_request("H100:3", ""))  # the pool is full
    held_back = [pool.nodes.ComposeNode(queued("H100:1", "a", priority=5)) for _ in range(3)]
    behind = pool.nodes.ComposeNode(queued("H100:1", "b"))
    assert behind.state == pb.NODE_STATE_QUEUED
    add_box(pool, "box2", gpus=4, model="H100")
    wait_until(
        lambda: queued_broker.cache.get("boxes", "box2") is not None, timeout_s=90, message="box2"
    )
    order = [e.name for e in queued_broker.queue.ordered()]
    assert order == [*(n.name for n in held_back), behind.name]
    assert by_hand(queued_broker, max_placements=2).serve() == 1
    assert get(pool, behind.name).state == pb.NODE_STATE_PENDING
    for node in held_back:
        shown = get(pool, node.name)
        assert shown.state == pb.NODE_STATE_QUEUED
        assert "quota" in shown.queue.reason


def test_a_queue_of_one_shape_costs_one_placement_and_one_plan_per_pass(
    pool: Stubs, queued_broker: BrokerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many requests of one shape that find no capacity: a pass places the first, and
    asks the preemption planner once for them all (it found nothing for an equal ask on
    the same snapshot and candidates), yet tells every one why it waits."""
    queued_broker.sharing_duties.stop()  # type: ignore[union-attr]
    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    waiting = [pool.nodes.ComposeNode(queued("H100:2", "a")) for _ in range(5)]
    plans: list[object] = []
    real_plan = dispatcher.plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        plans.append(args[0])
        return real_plan(*args, **kwargs)

    placements: list[str] = []
    real_admit = Admitter.admit

    def counted_admit(self: Admitter, node_id: str) -> Any:
        outcome = real_admit(self, node_id)
        if outcome.placed:
            placements.append(node_id)
        return outcome

    monkeypatch.setattr(dispatcher, "plan", counted)
    monkeypatch.setattr(Admitter, "admit", counted_admit)
    assert by_hand(queued_broker, max_placements=64).serve() == 0
    assert len(placements) == 1
    assert len(plans) == 1
    for node in waiting:
        shown = get(pool, node.name)
        assert shown.state == pb.NODE_STATE_QUEUED
        assert "no capacity" in shown.queue.reason


def test_the_dispatcher_gives_the_collector_its_turn_after_an_admission(
    queued_broker: BrokerServer, pool: Stubs
) -> None:
    turns: list[str] = []
    between = queued_broker.collector.between

    def spy() -> str | None:
        turns.append(threading.current_thread().name)
        return between()

    queued_broker.collector.between = spy  # type: ignore[method-assign]
    pool.nodes.ComposeNode(compose_request("H100:4", ""))
    waiting = pool.nodes.ComposeNode(queued("H100:3"))
    assert waiting.state == pb.NODE_STATE_QUEUED
    add_box(pool, "box2", gpus=4, model="H100")
    wait_node(pool, waiting.name, pb.NODE_STATE_PENDING)
    wait_until(lambda: "sharing-duties" in turns, timeout_s=30, message="the dispatcher's turn")
