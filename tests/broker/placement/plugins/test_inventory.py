"""PreFilters: requests the pool can never serve are UNRESOLVABLE, with what it holds."""

from __future__ import annotations

from dxpool.broker.placement.model import PlacementRequest
from dxpool.broker.placement.plugins.inventory import HostCapacity, PoolInventory
from dxpool.broker.placement.status import Code

from ..pools import Pool


def test_pool_inventory_counts_every_gpu_whatever_its_state() -> None:
    snapshot = Pool().box("b1", 1, busy=3).box("b2", 2, model="A100").snapshot()
    plugin = PoolInventory()
    assert plugin.pre_filter(PlacementRequest("h100", 4), snapshot).ok
    status = plugin.pre_filter(PlacementRequest("H100", 5), snapshot)
    assert status.code is Code.UNRESOLVABLE
    assert status.reasons == ("model H100: the pool holds 4 in all, 5 requested",)


def test_pool_inventory_lists_the_models_when_the_pool_has_none_of_the_model() -> None:
    snapshot = Pool().box("b1", 2).box("b2", 2, model="A100").box("b3", 1, model="L4").snapshot()
    status = PoolInventory().pre_filter(PlacementRequest("B200", 1), snapshot)
    assert status.reasons == (
        "model B200: the pool holds 0 in all, 1 requested; "
        "models in the pool: A100 2, H100 2, L4 1",
    )


def test_pool_inventory_counts_memory_and_any_model() -> None:
    snapshot = Pool().box("b1", 2, memory_mib=40960).box("b2", 1).snapshot()
    status = PoolInventory().pre_filter(PlacementRequest("", 2, min_memory_mib=81920), snapshot)
    assert status.reasons == ("gpus with >= 80GiB: the pool holds 1 in all, 2 requested",)
    assert PoolInventory().pre_filter(PlacementRequest("", 3), snapshot).ok


def test_host_capacity() -> None:
    snapshot = Pool().host("h1", 8, used=range(8)).host("h2", 4).snapshot()
    plugin = HostCapacity()
    assert plugin.pre_filter(PlacementRequest("", 8), snapshot).ok  # used slots may free up
    assert plugin.pre_filter(PlacementRequest("", 9), snapshot).reasons == (
        "host capacity: the largest host, hosts/h1, has 8 proxy slots, 9 needed",
    )
    pinned = plugin.pre_filter(PlacementRequest("", 5, host="h2"), snapshot)
    assert pinned.code is Code.UNRESOLVABLE
    assert pinned.reasons == ("host capacity: hosts/h2 has 4 proxy slots in all, 5 needed",)
    unknown = plugin.pre_filter(PlacementRequest("", 1, host="h9"), snapshot)
    assert unknown.reasons == ("host: hosts/h9 is not registered",)


def test_host_capacity_waits_for_hosts_to_register() -> None:
    status = HostCapacity().pre_filter(PlacementRequest("", 1), Pool().snapshot())
    assert status.code is Code.UNSCHEDULABLE
    assert status.reasons == ("hosts: no host is registered",)


def test_pool_inventory_counts_every_model_of_a_set() -> None:
    snapshot = Pool().box("b1", 2).box("b2", 2, model="A100").box("b3", 1, model="L4").snapshot()
    plugin = PoolInventory()
    assert plugin.pre_filter(PlacementRequest("H100|a100", 4, mixed_models=True), snapshot).ok
    status = plugin.pre_filter(PlacementRequest("H100|A100", 5, mixed_models=True), snapshot)
    assert status.reasons == ("models H100|A100: the pool holds 4 in all, 5 requested",)
    none = plugin.pre_filter(PlacementRequest("B200|GH200", 1), snapshot)
    assert none.reasons == (
        "models B200|GH200: the pool holds 0 in all, 1 requested; "
        "models in the pool: A100 2, H100 2, L4 1",
    )
