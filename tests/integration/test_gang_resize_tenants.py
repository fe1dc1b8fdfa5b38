"""Gangs and resizes together with tenants, host reservations, health and the release
protocol, through real brokers and etcd.

Gang tests write hosts straight into etcd (no agent), so members stay PENDING until
released; resize tests run host agents over the simulated fabric, which scrub and
report released GPUs as a real agent does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.names import parse_gpu
from dxpool.store.keys import KeySchema
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
from tests.integration.test_quotas import error_info, get_tenant, set_quota, stored_tenant


def register_host(etcd_client: Any, keys: KeySchema, host_id: str, **fields: Any) -> None:
    host = pb.Host(
        name=f"hosts/{host_id}",
        location=pb.Location(site="s1", pod="p1", rack="r1"),
        slot_capacity=8,
        **fields,
    )
    etcd_client.put(keys.host(host_id), host.SerializeToString())
    etcd_client.put(keys.host_lease(host_id), b"")


def member_spec(gpus: str, tenant: str = "team-a", **fields: Any) -> pb.NodeSpec:
    model, _, count = gpus.partition(":")
    return pb.NodeSpec(gpus=pb.GpuRequest(model=model, count=int(count)), tenant=tenant, **fields)


def compose_gang(stubs: Stubs, count: int, gpus: str, **fields: Any) -> nodes_pb2.Gang:
    request = nodes_pb2.ComposeGangRequest(members=[member_spec(gpus, **fields)] * count)
    return stubs.nodes.ComposeGang(request)


@pytest.fixture
def keys(key_prefix: str) -> KeySchema:
    return KeySchema(key_prefix)


@pytest.fixture
def pool(broker: BrokerServer, stubs: Stubs, etcd_client: Any, keys: KeySchema) -> Stubs:
    """Two hosts of 8 slots offering 8 CPU cores each; 16 H100s."""
    for host in ("h1", "h2"):
        register_host(etcd_client, keys, host, cpu_cores=8)
    add_box(stubs, "box1", gpus=8, model="H100")
    add_box(stubs, "box2", gpus=8, model="H100")
    wait_until(lambda: len(broker.index.snapshot().hosts) == 2, message="hosts in the index")
    return stubs


# -- gangs and tenants -------------------------------------------------------------------


def test_a_gang_is_charged_to_its_tenant_in_its_transaction_and_discharged_on_release(
    pool: Stubs, etcd_client: Any, keys: KeySchema, key_prefix: str
) -> None:
    set_quota(pool, "team-a", gpus=4, nodes=2)

    gang = compose_gang(pool, 2, "H100:2")

    assert all(n.charged and n.spec.tenant == "team-a" for n in gang.nodes)
    assert [[e.reason for e in n.events] for n in gang.nodes] == [["Composed"]] * 2
    stored = stored_tenant(etcd_client, keys, "team-a")
    assert stored is not None
    assert stored.usage == pb.TenantUsage(gpus=4, nodes=2, gpus_by_model={"H100": 4})
    before = pool_records(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as over:
        compose_gang(pool, 1, "H100:1")
    assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(over.value).reason == "QUOTA_EXCEEDED"
    assert pool_records(etcd_client, key_prefix) == before

    released = pool.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name=gang.name))

    assert {n.state for n in released.nodes} == {pb.NODE_STATE_RELEASING}
    assert get_tenant(pool, "team-a").usage == pb.TenantUsage()
    assert [e.reason for e in released.nodes[0].events] == ["Composed", "Releasing"]


def test_a_gang_that_fits_member_by_member_but_not_as_a_whole_writes_nothing(
    pool: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    set_quota(pool, "team-a", nodes=3, gpus_by_model={"H100": 8})
    before = pool_records(etcd_client, key_prefix)
    for count, gpus, limit in ((4, "H100:1", "nodes"), (3, "H100:3", "gpus_by_model[H100]")):
        with pytest.raises(grpc.RpcError) as over:
            compose_gang(pool, count, gpus)
        info = error_info(over.value)
        assert (info.reason, info.metadata["limit"]) == ("QUOTA_EXCEEDED", limit)
        assert pool_records(etcd_client, key_prefix) == before
    compose_gang(pool, 3, "H100:2")
    assert get_tenant(pool, "team-a").usage.nodes == 3


def test_concurrent_gangs_of_one_tenant_on_two_brokers_never_exceed_its_quota(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, keys: KeySchema
) -> None:
    brokers = [broker_factory(), broker_factory()]
    channels = [grpc.insecure_channel(b.endpoint) for b in brokers]
    stubs = [Stubs(c) for c in channels]
    for host in ("h1", "h2"):
        register_host(etcd_client, keys, host)
    add_box(stubs[0], "box1", gpus=8, model="H100")
    add_box(stubs[0], "box2", gpus=8, model="H100")
    set_quota(stubs[0], "team-a", gpus=6)
    try:
        for broker in brokers:
            wait_until(lambda b=broker: len(b.index.snapshot().hosts) == 2, message="hosts")
        start = threading.Barrier(2)

        def one(side: int) -> nodes_pb2.Gang | str:
            start.wait()
            try:
                return compose_gang(stubs[side], 2, "H100:2")
            except grpc.RpcError as error:
                return error_info(error).reason

        with ThreadPoolExecutor(2) as executor:
            outcomes = list(executor.map(one, (0, 1)))
        assert sorted(isinstance(o, nodes_pb2.Gang) for o in outcomes) == [False, True]
        assert "QUOTA_EXCEEDED" in outcomes
        stored = stored_tenant(etcd_client, keys, "team-a")
        assert stored is not None and stored.usage.gpus == 4 and stored.usage.nodes == 2
        charged = [
            n
            for n in (
                pb.VirtualNode.FromString(v)
                for v, _ in etcd_client.get_prefix(keys.collection("nodes"))
            )
            if n.charged
        ]
        assert sum(len(n.gpus) for n in charged) == 4
    finally:
        for channel in channels:
            channel.close()


def test_members_naming_two_tenants_charge_each_its_own(pool: Stubs) -> None:
    """Without authentication the spec's tenant is charged as given; members naming two
    tenants charge each its own members, checked and written in the one transaction."""
    gang = pool.nodes.ComposeGang(
        nodes_pb2.ComposeGangRequest(
            members=[member_spec("H100:1", "team-a"), member_spec("H100:2", "team-b")]
        )
    )
    assert [n.spec.tenant for n in gang.nodes] == ["team-a", "team-b"]
    assert get_tenant(pool, "team-a").usage.gpus == 1
    assert get_tenant(pool, "team-b").usage.gpus == 2


def test_gang_members_reserve_host_cpu_cores_each_on_top_of_the_others(
    pool: Stubs, etcd_client: Any, keys: KeySchema
) -> None:
    gang = compose_gang(pool, 2, "H100:1", cpu_cores=6)

    assert len({n.host for n in gang.nodes}) == 2  # 6 + 6 cores do not fit one host of 8
    for node in gang.nodes:
        raw, _ = etcd_client.get(keys.host_allocation(node.host.removeprefix("hosts/")))
        reservations = pb.HostAllocation.FromString(raw).reservations
        assert [(r.node, r.cpu_cores) for r in reservations] == [(node.name, 6)]
    with pytest.raises(grpc.RpcError) as full:
        compose_gang(pool, 1, "H100:1", cpu_cores=3)
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    pool.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name=gang.name))
    for host in ("h1", "h2"):
        raw, _ = etcd_client.get(keys.host_allocation(host))
        assert not pb.HostAllocation.FromString(raw).reservations


# -- resizes and tenants, health ---------------------------------------------------------


def resize(stubs: Stubs, name: str, gpu_count: int) -> pb.VirtualNode:
    return stubs.nodes.ResizeNode(nodes_pb2.ResizeNodeRequest(name=name, gpu_count=gpu_count))


@pytest.fixture
def charged_ready(stubs: Stubs, sim_pool: SimPool) -> pb.VirtualNode:
    """A READY node of 2 H100s charged to team-a (quota: 3 GPUs), on h1."""
    register_sim_box(sim_pool, stubs, "box1", gpus=6)
    sim_pool.start_agent("h1", slots=6)
    wait_hosts_alive(stubs)
    set_quota(stubs, "team-a", gpus=3)
    node = stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=member_spec("H100:2")))
    return wait_state(stubs, node.name, pb.NODE_STATE_READY)


def test_a_charged_node_grows_within_its_quota_and_shrinking_gives_the_gpus_back(
    stubs: Stubs, charged_ready: pb.VirtualNode, etcd_client: Any, key_prefix: str
) -> None:
    name = charged_ready.name
    before = pool_records(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as over:
        resize(stubs, name, 4)
    assert error_info(over.value).reason == "QUOTA_EXCEEDED"
    assert pool_records(etcd_client, key_prefix) == before

    assert resize(stubs, name, 3).state == pb.NODE_STATE_RESIZING
    assert get_tenant(stubs, "team-a").usage.gpus == 3
    grown = wait_state(stubs, name, pb.NODE_STATE_READY)
    assert len(grown.gpus) == 3

    shrinking = resize(stubs, name, 1)
    leaving = [b.gpu for b in shrinking.gpus if b.phase == pb.ATTACHMENT_PHASE_DETACHING]
    raw, _ = etcd_client.get(KeySchema(key_prefix).host_allocation("h1"))
    entries = {a.gpu: a.release for a in pb.HostAllocation.FromString(raw).attachments}
    assert all(entries.get(gpu) is True for gpu in leaving)  # kept, marked release
    shrunk = wait_state(stubs, name, pb.NODE_STATE_READY)
    assert len(shrunk.gpus) == 1
    assert get_tenant(stubs, "team-a").usage.gpus == 1
    for gpu in leaving:
        record = stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=gpu))
        assert record.state == pb.GPU_STATE_FREE
    reasons = [e.reason for e in shrunk.events]
    assert reasons[-4:] == ["Resizing", "Ready", "Resizing", "Ready"]

    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=name))
    assert get_tenant(stubs, "team-a").usage == pb.TenantUsage()


def test_a_degraded_node_is_not_resized(
    stubs: Stubs, sim_pool: SimPool, charged_ready: pb.VirtualNode
) -> None:
    sick = parse_gpu(charged_ready.gpus[0].gpu)
    sim_pool.fabric.set_health(sick.box, sick.slot, healthy=False)
    wait_state(stubs, charged_ready.name, pb.NODE_STATE_DEGRADED)

    for count in (3, 1):
        with pytest.raises(grpc.RpcError) as refused:
            resize(stubs, charged_ready.name, count)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "DEGRADED" in (refused.value.details() or "")
    assert get_tenant(stubs, "team-a").usage.gpus == 2
