"""Composes waiting for one host commit together, each keeping its compare-and-swap.

Every interleaving here is forced: the test holds the host's lock (as a compose that is
committing would) until the composes it sent are all queued behind it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import audit_pb2, audit_pb2_grpc, inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.nodes.compose_commit import within_limit
from dxpool.broker.state.stm import PLACE_ATTEMPTS
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.registration import host_record
from dxpool.limits import MAX_TXN_OPS
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.broker.commit_races import meddle_before_commits, rewrite_allocations, writing
from tests.broker.nodes.test_gang import reason
from tests.conftest import Stubs, add_box, wait_hosts_alive, wait_until
from tests.streaming import rpc_error

HOST = "h0"


def one_gpu(request_id: str = "") -> nodes_pb2.ComposeNodeRequest:
    return nodes_pb2.ComposeNodeRequest(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)), request_id=request_id
    )


@pytest.fixture
def store(etcd_client: Any, key_prefix: str) -> Store:
    return Store(etcd_client, KeySchema(key_prefix))


@pytest.fixture
def alive_host(store: Store, stubs: Stubs) -> Iterator[None]:
    """Host h0 (8 slots, rack r1) registered and alive, as its agent would make it."""
    lease = store.client.lease(60)
    config = AgentConfig(host_id=HOST, site="s1", pod="p1", rack="r1", slot_capacity=8)
    store.commit(
        Txn()
        .put(store.keys.host(HOST), host_record(config))
        .put(store.keys.host_lease(HOST), b"", lease=lease)
    )
    wait_hosts_alive(stubs)
    add_box(stubs, "b1", gpus=8, rack="r1")
    yield
    lease.revoke()


def compose_behind_the_lock(
    broker: BrokerServer, requests: list[nodes_pb2.ComposeNodeRequest]
) -> list[pb.VirtualNode]:
    """Send ``requests`` from one thread each while the test holds the host's lock, and
    let go once all of them wait for it; their answers, in order."""
    assert broker.composer is not None
    locks = broker.composer.host_locks
    answers: list[Any] = [None] * len(requests)

    def send(index: int) -> None:
        with grpc.insecure_channel(broker.endpoint) as channel:
            stub = Stubs(channel).nodes
            try:
                answers[index] = stub.ComposeNode(requests[index], timeout=30)
            except grpc.RpcError as error:
                answers[index] = error

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    with locks.lock(HOST):
        for thread in threads:
            thread.start()
        wait_until(lambda: locks.waiting(HOST) == len(requests), message="composes queued")
    for thread in threads:
        thread.join(30)
    for answer in answers:
        assert isinstance(answer, pb.VirtualNode), answer
    return answers


def node_revisions(store: Store, nodes: list[pb.VirtualNode]) -> list[int]:
    revisions = []
    for node in nodes:
        record = store.get(store.keys.node(node.name.removeprefix("nodes/")))
        assert record is not None
        revisions.append(record.mod_revision)
    return revisions


def test_composes_waiting_for_one_host_commit_in_one_transaction(
    broker: BrokerServer, stubs: Stubs, store: Store, alive_host: None
) -> None:
    nodes = compose_behind_the_lock(broker, [one_gpu(f"r{i}") for i in range(3)])
    assert len(set(node_revisions(store, nodes))) == 1  # one etcd transaction
    gpus = [node.gpus[0].gpu for node in nodes]
    slots = [node.gpus[0].host_slot for node in nodes]
    assert len(set(gpus)) == 3 and len(set(slots)) == 3
    allocation = store.get(store.keys.host_allocation(HOST))
    assert allocation is not None
    assert sorted(a.gpu for a in allocation.value.attachments) == sorted(gpus)
    # Each call's own audit record went in with its node.
    audit = audit_pb2_grpc.AuditServiceStub(stubs.channel)
    records = audit.ListAuditRecords(audit_pb2.ListAuditRecordsRequest()).records
    composed = sorted((r.target, r.request_id) for r in records if r.rpc.endswith("ComposeNode"))
    assert composed == sorted((node.name, node.request_id) for node in nodes)


def test_a_group_whose_compare_fails_commits_each_compose_alone(
    broker: BrokerServer,
    store: Store,
    alive_host: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another writer changes the host's allocation between the group's staging and its
    commit: the group's transaction fails, and each compose then commits on its own."""
    commits: list[int] = []
    real_commit: Callable[[Txn], Any] = broker.store.commit
    allocation_key = store.keys.host_allocation(HOST)

    def commit(txn: Txn) -> Any:
        writes_allocation = any(key == allocation_key for key, _ in txn.writes)
        if writes_allocation:
            commits.append(sum(1 for key, _ in txn.writes if "/nodes/" in key))
            if len(commits) == 1:  # the group: another broker writes the record first
                current = store.get(allocation_key)
                value = current.value if current is not None else pb.HostAllocation()
                store.commit(Txn().put(allocation_key, value))
        return real_commit(txn)

    monkeypatch.setattr(broker.store, "commit", commit)
    nodes = compose_behind_the_lock(broker, [one_gpu(), one_gpu()])
    assert commits == [2, 1, 1]  # the group of two, then each alone
    assert len(set(node_revisions(store, nodes))) == 2
    assert len({node.gpus[0].gpu for node in nodes}) == 2


def test_two_calls_with_one_request_id_in_a_group_make_one_node(
    broker: BrokerServer, stubs: Stubs, alive_host: None
) -> None:
    first, second = compose_behind_the_lock(broker, [one_gpu("same"), one_gpu("same")])
    assert first.name == second.name
    listed = stubs.nodes.ListNodes(nodes_pb2.ListNodesRequest()).nodes
    assert [node.name for node in listed] == [first.name]
    # The GPU the second call placed and held is free again.
    status = stubs.inventory.GetPoolStatus(inventory_pb2.GetPoolStatusRequest())
    assert (status.models[0].free, status.models[0].in_use) == (7, 1)


def test_a_group_stays_within_etcds_operation_limit() -> None:
    def part(gpus: int) -> Txn:
        txn = Txn()
        for slot in range(gpus):
            key = f"/p/gpus/b/{slot}"
            txn.expect_revision(key, 1).put(key, b"").read_on_failure(key)
        return txn.expect_absent("/p/nodes/n").put("/p/nodes/n", b"").read_on_failure("/p/nodes/n")

    # Each part: gpus + 1 of each list; the group adds 2 compares, 1 write, 2 reads.
    assert within_limit([part(MAX_TXN_OPS - 3)])
    assert not within_limit([part(MAX_TXN_OPS - 2)])
    assert within_limit([part(62), part(62)])
    assert not within_limit([part(62), part(63)])


# -- a compose racing other writers (see tests/broker/commit_races.py) ----------------


def test_a_charged_compose_racing_a_change_of_its_tenant_adds_to_what_that_wrote(
    broker: BrokerServer,
    stubs: Stubs,
    store: Store,
    alive_host: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tenant's record is compared as the compose read it: another broker charging
    the tenant meanwhile fails the commit, and the compose charges on top of that."""
    tenant_key = store.keys.tenant("t1")
    store.commit(Txn().put(tenant_key, pb.Tenant(name="tenants/t1", uid="u1")))
    wait_until(lambda: broker.cache.get(k.TENANTS, "t1") is not None, message="tenant cached")

    def charge_elsewhere() -> None:
        current = store.get(tenant_key)
        assert current is not None
        tenant = pb.Tenant()
        tenant.CopyFrom(current.value)
        tenant.usage.gpus += 2
        tenant.usage.gpus_by_model["H100"] += 2
        tenant.usage.nodes += 1
        store.commit(Txn().put(tenant_key, tenant))

    commits = meddle_before_commits(
        broker.store, monkeypatch, writing(tenant_key), charge_elsewhere, times=1
    )
    request = one_gpu()
    request.spec.tenant = "t1"
    node = stubs.nodes.ComposeNode(request, timeout=30)
    assert node.charged
    assert len(commits) == 2  # the first lost its compare on the tenant's record
    stored = store.get(tenant_key)
    assert stored is not None
    usage = stored.value.usage
    assert (usage.gpus, dict(usage.gpus_by_model), usage.nodes) == (3, {"H100": 3}, 2)


def test_a_compose_that_loses_every_compare_is_aborted_and_writes_nothing(
    broker: BrokerServer,
    stubs: Stubs,
    store: Store,
    alive_host: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    commits = meddle_before_commits(
        broker.store,
        monkeypatch,
        writing(store.keys.host_allocation(HOST)),
        lambda: rewrite_allocations(store.client, store.keys, [HOST]),
        times=1000,
    )
    error = rpc_error(lambda: stubs.nodes.ComposeNode(one_gpu("r1"), timeout=60))
    assert error.code() == grpc.StatusCode.ABORTED
    assert reason(error) == "COMMIT_CONFLICT"
    assert f"after {PLACE_ATTEMPTS} attempts" in (error.details() or "")
    # Each attempt commits as placed, then once more re-placed on the same host under its
    # lock, before it places again.
    assert len(commits) == 2 * PLACE_ATTEMPTS
    assert not stubs.nodes.ListNodes(nodes_pb2.ListNodesRequest()).nodes
    assert store.get(store.keys.request("r1")) is None
    status = stubs.inventory.GetPoolStatus(inventory_pb2.GetPoolStatusRequest())
    assert (status.models[0].free, status.models[0].in_use) == (8, 0)
