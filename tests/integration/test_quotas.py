"""Tenant quotas against real etcd and real brokers over gRPC.

Hosts are written straight into etcd (a registration and a liveness key, no agent), so
composed nodes stay PENDING until released, failed by their attach deadline or lost with
their host: exactly the paths that charge and discharge a tenant's usage.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Txn
from tests.conftest import (
    SimPool,
    Stubs,
    add_box,
    pool_records,
    register_sim_box,
    wait_hosts_alive,
    wait_until,
)
from tests.integration.test_node_lifecycle import wait_state
from tests.patience import patient


def register_host(etcd_client: Any, keys: KeySchema, host_id: str, slots: int = 32) -> None:
    host = pb.Host(
        name=f"hosts/{host_id}",
        location=pb.Location(site="s1", pod="p1", rack="r1"),
        slot_capacity=slots,
    )
    etcd_client.put(keys.host(host_id), host.SerializeToString())
    etcd_client.put(keys.host_lease(host_id), b"")


def stored_tenant(etcd_client: Any, keys: KeySchema, tenant: str) -> pb.Tenant | None:
    value, _ = etcd_client.get(keys.tenant(tenant))
    return pb.Tenant.FromString(value) if value is not None else None


def stored_nodes(etcd_client: Any, keys: KeySchema) -> list[pb.VirtualNode]:
    return [
        pb.VirtualNode.FromString(v) for v, _ in etcd_client.get_prefix(keys.collection("nodes"))
    ]


def compose_request(gpus: str, tenant: str, **spec: Any) -> nodes_pb2.ComposeNodeRequest:
    model, _, count = gpus.partition(":")
    return nodes_pb2.ComposeNodeRequest(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model=model, count=int(count)), tenant=tenant, **spec)
    )


def set_quota(stubs: Stubs, tenant: str, **quota: Any) -> pb.Tenant:
    request = nodes_pb2.SetTenantQuotaRequest(
        name=f"tenants/{tenant}", quota=pb.TenantQuota(**quota)
    )
    return stubs.nodes.SetTenantQuota(request)


def get_tenant(stubs: Stubs, tenant: str) -> pb.Tenant:
    return stubs.nodes.GetTenant(nodes_pb2.GetTenantRequest(name=f"tenants/{tenant}"))


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info
    raise AssertionError("no ErrorInfo in the status")


def cached_gpus(broker: BrokerServer, tenant: str) -> int | None:
    record = broker.cache.get("tenants", tenant)
    return record.value.usage.gpus if record is not None else None


class HeldCommit:
    """A broker store's commit, held once: the first transaction that writes ``key``
    waits at its commit until ``go_on`` is set (``reached`` says it is there); every
    transaction that writes ``key`` is kept in ``seen``, in order."""

    def __init__(self, store: Any, key: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached, self.go_on = threading.Event(), threading.Event()
        self.seen: list[Txn] = []
        commit = store.commit

        def held_commit(txn: Txn) -> Any:
            if any(written == key for written, _ in txn.writes):
                self.seen.append(txn)
                if not self.reached.is_set():
                    self.reached.set()
                    assert self.go_on.wait(patient(30))
            return commit(txn)

        monkeypatch.setattr(store, "commit", held_commit)


@pytest.fixture
def keys(key_prefix: str) -> KeySchema:
    return KeySchema(key_prefix)


@pytest.fixture
def pool(broker: BrokerServer, stubs: Stubs, etcd_client: Any, keys: KeySchema) -> Stubs:
    """Two hosts of 32 slots; 16 H100s and 8 A100s."""
    for host in ("h1", "h2"):
        register_host(etcd_client, keys, host)
    add_box(stubs, "box1", gpus=8, model="H100")
    add_box(stubs, "box2", gpus=8, model="H100")
    add_box(stubs, "box3", gpus=8, model="A100")
    wait_until(lambda: len(broker.index.snapshot().hosts) == 2, message="hosts in the index")
    return stubs


def test_a_tenant_without_a_quota_is_unlimited_and_its_usage_counted(
    pool: Stubs, etcd_client: Any, keys: KeySchema
) -> None:
    assert stored_tenant(etcd_client, keys, "team-a") is None
    unknown = get_tenant(pool, "team-a")
    assert not unknown.HasField("quota") and unknown.usage == pb.TenantUsage()
    pool.nodes.ComposeNode(compose_request("H100:3", "team-a"))
    pool.nodes.ComposeNode(compose_request("A100:2", "team-a"))
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None and not stored.HasField("quota")
    assert stored.usage == pb.TenantUsage(gpus=5, nodes=2, gpus_by_model={"H100": 3, "A100": 2})
    assert get_tenant(pool, "team-a") == stored
    listed = pool.nodes.ListTenants(nodes_pb2.ListTenantsRequest())
    assert [t.name for t in listed.tenants] == ["tenants/team-a"]


def test_each_limit_refuses_with_quota_exceeded_naming_it(
    pool: Stubs, etcd_client: Any, keys: KeySchema
) -> None:
    set_quota(pool, "team-a", gpus=6, nodes=3, gpus_by_model={"H100": 4})
    pool.nodes.ComposeNode(compose_request("H100:3", "team-a"))

    with pytest.raises(grpc.RpcError) as by_model:
        pool.nodes.ComposeNode(compose_request("H100:2", "team-a"))
    assert by_model.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(by_model.value)
    assert info.reason == "QUOTA_EXCEEDED"
    assert dict(info.metadata) == {
        "tenant": "team-a",
        "limit": "gpus_by_model[H100]",
        "quota": "4",
        "usage": "3",
        "requested": "2",
    }
    assert "quota of 4 H100 GPUs" in by_model.value.details()
    assert "holds 3" in by_model.value.details()

    pool.nodes.ComposeNode(compose_request("A100:2", "team-a"))
    with pytest.raises(grpc.RpcError) as total:
        pool.nodes.ComposeNode(compose_request("A100:2", "team-a"))
    assert error_info(total.value).metadata["limit"] == "gpus"
    assert "quota of 6 GPUs" in total.value.details()

    pool.nodes.ComposeNode(compose_request("H100:1", "team-a"))
    with pytest.raises(grpc.RpcError) as node_limit:
        pool.nodes.ComposeNode(compose_request("A100:1", "team-a"))
    assert error_info(node_limit.value).metadata["limit"] == "nodes"
    # Another tenant is not limited by team-a's quota.
    pool.nodes.ComposeNode(compose_request("A100:1", "team-b"))
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None
    assert stored.usage == pb.TenantUsage(gpus=6, nodes=3, gpus_by_model={"H100": 4, "A100": 2})


def test_a_refused_compose_changes_nothing(pool: Stubs, etcd_client: Any, key_prefix: str) -> None:
    set_quota(pool, "team-a", gpus=1)
    before = pool_records(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeNode(compose_request("H100:2", "team-a"))
    assert error_info(refused.value).reason == "QUOTA_EXCEEDED"
    assert pool_records(etcd_client, key_prefix) == before


def test_any_model_request_is_charged_by_the_models_it_got(
    pool: Stubs, etcd_client: Any, keys: KeySchema
) -> None:
    set_quota(pool, "team-a", gpus_by_model={"A100": 0})
    node = pool.nodes.ComposeNode(compose_request(":2", "team-a"))
    assert {b.model for b in node.gpus} == {"H100"}  # best fit picks one model
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None and stored.usage.gpus_by_model == {"H100": 2}
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeNode(compose_request("A100:1", "team-a"))
    assert error_info(refused.value).metadata["limit"] == "gpus_by_model[A100]"


def test_bad_quotas_are_invalid_arguments(pool: Stubs, etcd_client: Any, key_prefix: str) -> None:
    before = pool_records(etcd_client, key_prefix)
    for name, quota in [
        ("tenants/team-a", pb.TenantQuota(gpus=-1)),
        ("tenants/team-a", pb.TenantQuota(nodes=10_000_000)),
        ("tenants/team-a", pb.TenantQuota(gpus_by_model={"H 100": 1})),
        ("tenants/team-a", pb.TenantQuota(gpus_by_model={"H100": -2})),
        ("tenants/Team_A", pb.TenantQuota(gpus=1)),
        ("team-a", pb.TenantQuota(gpus=1)),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            pool.nodes.SetTenantQuota(nodes_pb2.SetTenantQuotaRequest(name=name, quota=quota))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, quota)
    with pytest.raises(grpc.RpcError) as bad_tenant:
        pool.nodes.ComposeNode(compose_request("H100:1", "Team A"))
    assert bad_tenant.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.tenant" in bad_tenant.value.details()
    assert pool_records(etcd_client, key_prefix) == before


def test_a_quota_below_usage_stops_new_nodes_only(
    pool: Stubs, etcd_client: Any, keys: KeySchema
) -> None:
    nodes = [pool.nodes.ComposeNode(compose_request("H100:2", "team-a")) for _ in range(2)]
    set_quota(pool, "team-a", gpus=2)
    with pytest.raises(grpc.RpcError):
        pool.nodes.ComposeNode(compose_request("H100:1", "team-a"))
    for node in nodes:
        assert pool.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name)).state == (
            pb.NODE_STATE_PENDING
        )
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=nodes[0].name))
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=nodes[1].name))
    pool.nodes.ComposeNode(compose_request("H100:2", "team-a"))
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None and stored.usage.gpus == 2 and stored.quota.gpus == 2


def test_usage_returns_to_zero_after_release_and_force_release(
    pool: Stubs, etcd_client: Any, keys: KeySchema
) -> None:
    set_quota(pool, "team-a", gpus=16)
    first = pool.nodes.ComposeNode(compose_request("H100:4", "team-a"))
    second = pool.nodes.ComposeNode(compose_request("A100:2", "team-a"))
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=first.name))
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None
    assert stored.usage == pb.TenantUsage(gpus=2, nodes=1, gpus_by_model={"A100": 2})
    # Releasing again (idempotent) does not lower the usage twice.
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=first.name))
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=second.name, force=True))
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None and stored.usage == pb.TenantUsage()
    assert get_tenant(pool, "team-a").usage == pb.TenantUsage()


def test_usage_returns_to_zero_when_attaching_fails(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, keys: KeySchema
) -> None:
    broker = broker_factory(attach_timeout_s=0.5)
    channel = grpc.insecure_channel(broker.endpoint)
    stubs = Stubs(channel)
    register_host(etcd_client, keys, "h1")
    add_box(stubs, "box1", gpus=4)
    wait_until(lambda: broker.index.snapshot().hosts.get("h1") is not None, message="host")
    node = stubs.nodes.ComposeNode(compose_request("H100:2", "team-a"))
    assert get_tenant(stubs, "team-a").usage.gpus == 2
    wait_until(
        lambda: (
            stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name)).state
            == pb.NODE_STATE_FAILED
        ),
        message="the node to fail its attach deadline (no agent)",
    )
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None and stored.usage == pb.TenantUsage()
    # Releasing the FAILED node does not lower it again.
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None and stored.usage == pb.TenantUsage()
    channel.close()


def test_usage_returns_to_zero_after_host_loss(
    pool: Stubs, etcd_client: Any, keys: KeySchema
) -> None:
    node = pool.nodes.ComposeNode(compose_request("H100:3", "team-a", host="hosts/h1"))
    other = pool.nodes.ComposeNode(compose_request("H100:1", "team-a", host="hosts/h2"))
    assert get_tenant(pool, "team-a").usage.gpus == 4
    etcd_client.delete(keys.host_lease("h1"))  # its agent fell silent: its broker let go
    wait_until(
        lambda: (
            pool.nodes.GetNode(nodes_pb2.GetNodeRequest(name=node.name)).state == pb.NODE_STATE_LOST
        ),
        message="the node of the lost host to be LOST",
    )
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None
    assert stored.usage == pb.TenantUsage(gpus=1, nodes=1, gpus_by_model={"H100": 1})
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    pool.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=other.name))
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None and stored.usage == pb.TenantUsage()


def race(stubs: list[Stubs], calls: int, request: Callable[[int], Any]) -> collections.Counter[str]:
    """``calls`` ComposeNode calls from 16 threads over ``stubs``; outcomes by code or
    error reason."""

    def one(call: int) -> str:
        try:
            stubs[call % len(stubs)].nodes.ComposeNode(request(call))
            return "OK"
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return error_info(error).reason
            return error.code().name

    with ThreadPoolExecutor(16) as threads:
        return collections.Counter(threads.map(one, range(calls)))


def test_concurrent_composes_on_two_brokers_never_exceed_the_quota(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, keys: KeySchema
) -> None:
    brokers = [broker_factory(), broker_factory()]
    channels = [grpc.insecure_channel(b.endpoint) for b in brokers]
    stubs = [Stubs(c) for c in channels]
    for host in ("h1", "h2", "h3", "h4"):
        register_host(etcd_client, keys, host)
    for index in range(4):
        add_box(stubs[0], f"box{index}", gpus=8)
    for broker in brokers:
        wait_until(lambda b=broker: len(b.index.snapshot().hosts) == 4, message="hosts")
    set_quota(stubs[0], "team-a", gpus=10)
    set_quota(stubs[0], "team-b", nodes=3)

    def request(call: int) -> nodes_pb2.ComposeNodeRequest:
        # team-a asks for one GPU at a time, team-b for two.
        return (
            compose_request("H100:1", "team-a") if call % 2 else compose_request("H100:2", "team-b")
        )

    outcomes = race(stubs, 48, request)
    # 24 calls each: 10 of team-a's and 3 of team-b's fit (16 GPUs in all, 32 in the pool).
    assert outcomes == {"OK": 13, "QUOTA_EXCEEDED": 35}, outcomes

    gpus = [pb.Gpu.FromString(v) for v, _ in etcd_client.get_prefix(keys.collection("gpus"))]
    nodes = stored_nodes(etcd_client, keys)
    by_tenant = collections.Counter(n.spec.tenant for n in nodes)
    assert by_tenant == {"team-a": 10, "team-b": 3}
    assert sum(1 for g in gpus if g.node) == 16
    team_a, team_b = (stored_tenant(etcd_client, keys, t) for t in ("team-a", "team-b"))
    assert team_a is not None and team_a.usage == pb.TenantUsage(
        gpus=10, nodes=10, gpus_by_model={"H100": 10}
    )
    assert team_b is not None and team_b.usage == pb.TenantUsage(
        gpus=6, nodes=3, gpus_by_model={"H100": 6}
    )

    # Releases racing composes: usage never exceeds the quota and ends equal to what
    # the tenant's live nodes hold.
    team_a_nodes = [n.name for n in nodes if n.spec.tenant == "team-a"]

    def churn(call: int) -> str:
        if call < len(team_a_nodes):
            stubs[call % 2].nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=team_a_nodes[call]))
            return "released"
        try:
            stubs[call % 2].nodes.ComposeNode(compose_request("H100:1", "team-a"))
            return "OK"
        except grpc.RpcError as error:
            return error_info(error).reason

    with ThreadPoolExecutor(16) as threads:
        churned = collections.Counter(threads.map(churn, range(40)))
    assert churned["released"] == 10
    live = stored_nodes(etcd_client, keys)
    charged = [n for n in live if n.spec.tenant == "team-a" and n.state == pb.NODE_STATE_PENDING]
    assert len(charged) == churned["OK"] <= 10
    team_a = stored_tenant(etcd_client, keys, "team-a")
    assert team_a is not None and team_a.usage.gpus == len(charged)
    assert team_a.usage.nodes == len(charged)
    for channel in channels:
        channel.close()


@pytest.fixture
def two_brokers(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, keys: KeySchema
) -> Iterator[tuple[BrokerServer, Stubs, BrokerServer, Stubs]]:
    first, second = broker_factory(), broker_factory()
    channels = [grpc.insecure_channel(b.endpoint) for b in (first, second)]
    for host in ("h1", "h2"):
        register_host(etcd_client, keys, host)
    stubs = [Stubs(c) for c in channels]
    add_box(stubs[0], "box1", gpus=4, model="H100")
    add_box(stubs[0], "box2", gpus=4, model="A100")
    for broker in (first, second):
        wait_until(lambda b=broker: len(b.index.snapshot().hosts) == 2, message="hosts")
    yield first, stubs[0], second, stubs[1]
    for channel in channels:
        channel.close()


def test_a_compose_held_before_its_commit_is_refused_once_another_used_the_quota(
    two_brokers: tuple[BrokerServer, Stubs, BrokerServer, Stubs],
    etcd_client: Any,
    keys: KeySchema,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Broker A reads team-a's usage (0 of 1 GPU) and is held just before its commit;
    broker B composes for team-a on another host and another model meanwhile, so no GPU,
    slot or node is shared: only the tenant record's compare can stop A. When A goes
    on, its commit fails that compare, it reads the new usage and refuses."""
    first, first_stubs, second, second_stubs = two_brokers
    set_quota(first_stubs, "team-a", gpus=1)
    wait_until(
        lambda: second.cache.get("tenants", "team-a") is not None, message="quota at broker B"
    )
    gate = HeldCommit(first.store, keys.tenant("team-a"), monkeypatch)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(
            first_stubs.nodes.ComposeNode,
            compose_request("H100:1", "team-a", host="hosts/h1"),
        )
        assert gate.reached.wait(patient(30))
        winner = second_stubs.nodes.ComposeNode(
            compose_request("A100:1", "team-a", host="hosts/h2")
        )
        gate.go_on.set()
        with pytest.raises(grpc.RpcError) as refused:
            held.result(timeout=30)
    assert error_info(refused.value).reason == "QUOTA_EXCEEDED"
    nodes = stored_nodes(etcd_client, keys)
    assert [n.name for n in nodes] == [winner.name]
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None
    assert stored.usage == pb.TenantUsage(gpus=1, nodes=1, gpus_by_model={"A100": 1})
    gpus = [pb.Gpu.FromString(v) for v, _ in etcd_client.get_prefix(keys.collection("gpus"))]
    assert [g.name for g in gpus if g.node] == [winner.gpus[0].gpu]


def test_a_release_between_read_and_commit_is_not_lost(
    two_brokers: tuple[BrokerServer, Stubs, BrokerServer, Stubs],
    etcd_client: Any,
    keys: KeySchema,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Broker A reads team-a's usage (1 of 2) and is held before its commit; broker B
    releases team-a's node meanwhile. A's commit fails its compare and is made again
    on the lowered usage, so the usage ends at 1 (A's node), not 2."""
    first, first_stubs, _, second_stubs = two_brokers
    set_quota(first_stubs, "team-a", gpus=2)
    old = second_stubs.nodes.ComposeNode(compose_request("A100:1", "team-a", host="hosts/h2"))
    wait_until(lambda: cached_gpus(first, "team-a") == 1, message="usage at broker A")
    gate = HeldCommit(first.store, keys.tenant("team-a"), monkeypatch)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(
            first_stubs.nodes.ComposeNode,
            compose_request("H100:1", "team-a", host="hosts/h1"),
        )
        assert gate.reached.wait(patient(30))
        second_stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=old.name))
        gate.go_on.set()
        node = held.result(timeout=30)
    assert len(gate.seen) >= 2  # the first commit lost its compare
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None
    assert stored.usage == pb.TenantUsage(gpus=1, nodes=1, gpus_by_model={"H100": 1})
    assert node.charged and node.spec.tenant == "team-a"


def test_a_release_held_at_its_commit_holds_up_its_tenant_s_composes_on_that_broker(
    broker: BrokerServer,
    pool: Stubs,
    etcd_client: Any,
    keys: KeySchema,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release of team-a's node is held just before its commit, and a compose for
    team-a on another host is sent to the same broker meanwhile. The compose waits for
    the release (both write team-a's usage record) rather than commit under it, so the
    release commits at its first attempt: releases never lose their compare to their
    own broker's composes of the tenant, however many there are."""
    set_quota(pool, "team-a", gpus=4)
    old = pool.nodes.ComposeNode(compose_request("A100:1", "team-a", host="hosts/h2"))
    wait_until(lambda: cached_gpus(broker, "team-a") == 1, message="usage in the cache")
    gate = HeldCommit(broker.store, keys.node(old.name.removeprefix("nodes/")), monkeypatch)
    with ThreadPoolExecutor(2) as threads:
        release = threads.submit(
            pool.nodes.ReleaseNode, nodes_pb2.ReleaseNodeRequest(name=old.name)
        )
        assert gate.reached.wait(patient(30))
        compose = threads.submit(
            pool.nodes.ComposeNode, compose_request("H100:1", "team-a", host="hosts/h1")
        )
        try:
            with pytest.raises(TimeoutError):
                compose.result(timeout=1.0)  # it waits for the release, not beside it
        finally:
            gate.go_on.set()
        assert release.result(timeout=30).state == pb.NODE_STATE_RELEASING
        node = compose.result(timeout=30)
    assert len(gate.seen) == 1  # the release never lost its compare
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None
    assert stored.usage == pb.TenantUsage(gpus=1, nodes=1, gpus_by_model={"H100": 1})
    assert node.charged and node.spec.tenant == "team-a"


def test_a_retried_compose_gets_its_node_even_with_the_quota_full(
    two_brokers: tuple[BrokerServer, Stubs, BrokerServer, Stubs],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node a request made fills the quota; the client retries the request on
    another broker whose watch has not brought the request id yet. The quota refusal
    looks the id up in etcd and answers with the node, not QUOTA_EXCEEDED."""
    _, first_stubs, second, second_stubs = two_brokers
    set_quota(first_stubs, "team-a", gpus=1)
    request = compose_request("H100:1", "team-a")
    request.request_id = "retry-1"
    node = first_stubs.nodes.ComposeNode(request)
    wait_until(lambda: cached_gpus(second, "team-a") == 1, message="usage at broker B")
    cache_get = second.cache.get
    hidden = []

    def lagging_get(collection: str, name: str) -> Any:
        if collection == "requests" and name == "retry-1" and not hidden:
            hidden.append(name)  # the first look, before placement: not seen yet
            return None
        return cache_get(collection, name)

    requests = second.cache.requests

    class LaggingRequests:
        """``cache.requests``, lagging as ``lagging_get`` does."""

        def get(self, name: str) -> Any:
            return lagging_get("requests", name) if name == "retry-1" else requests.get(name)

        def __getattr__(self, attr: str) -> Any:
            return getattr(requests, attr)

    monkeypatch.setattr(second.cache, "get", lagging_get)
    monkeypatch.setattr(second.cache, "requests", LaggingRequests())
    again = second_stubs.nodes.ComposeNode(request)
    assert hidden == ["retry-1"]
    assert again == node
    other = compose_request("H100:1", "team-a")
    other.request_id = "retry-2"
    with pytest.raises(grpc.RpcError) as refused:
        second_stubs.nodes.ComposeNode(other)
    assert error_info(refused.value).reason == "QUOTA_EXCEEDED"


def test_usage_through_a_real_lifecycle_ready_lost_fenced_released_collected(
    broker_factory: Callable[..., BrokerServer],
    sim_pool: SimPool,
    etcd_client: Any,
    keys: KeySchema,
) -> None:
    """With a host agent: a node reaches READY (still charged), its host is lost (the
    usage drops at once, while its GPUs are still fencing), the GPUs are freed, the node
    released and collected after retention; the usage stays 0 and the record stays."""
    broker = broker_factory(
        fabric=f"sim:{sim_pool.state_dir / 'fabric'}", retention_s=1.0, leader_ttl_s=2.0
    )
    channel = grpc.insecure_channel(broker.endpoint)
    stubs = Stubs(channel)
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    agent = sim_pool.start_agent("h1", lease_ttl_s=2.0)
    wait_hosts_alive(stubs)
    set_quota(stubs, "team-a", gpus=2)
    node = wait_state(
        stubs,
        stubs.nodes.ComposeNode(compose_request("H100:2", "team-a")).name,
        pb.NODE_STATE_READY,
    )
    assert node.charged
    assert get_tenant(stubs, "team-a").usage.gpus == 2
    agent.kill()
    wait_state(stubs, node.name, pb.NODE_STATE_LOST, timeout_s=15)
    assert get_tenant(stubs, "team-a").usage == pb.TenantUsage()
    wait_until(
        lambda: all(
            pb.Gpu.FromString(v).state == pb.GPU_STATE_FREE
            for v, _ in etcd_client.get_prefix(keys.collection("gpus"))
        ),
        message="the lost host's GPUs fenced and freed",
    )
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_until(
        lambda: not stored_nodes(etcd_client, keys), message="the released node to be collected"
    )
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None and stored.usage == pb.TenantUsage() and stored.quota.gpus == 2
    channel.close()
