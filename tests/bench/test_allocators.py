"""The trace benchmarks' clusters: dxpool's real placement, the baselines and the bound."""

from __future__ import annotations

import pytest

from bench.traces.allocator import Cause, Grant, Resources, allocate_gang, gang_members
from bench.traces.mostfree import MostFreeModel
from bench.traces.onepool import OnePool, ReservedPool
from bench.traces.pool import DecisionTimes, DxpoolPool, PoolLayout, boxes_of
from bench.traces.servers import FixedServers


def pool(host_slots: list[int], gpus: int = 16, **options: bool) -> DxpoolPool:
    return DxpoolPool("test", PoolLayout(boxes_of({"H100": gpus}), host_slots), **options)


def test_boxes_of_fills_boxes_of_eight_per_model() -> None:
    assert boxes_of({"T4": 10, "A10": 2}) == [("A10", 2), ("T4", 8), ("T4", 2)]


def test_gang_members_are_full_nodes_then_the_rest() -> None:
    assert gang_members(4) == [4]
    assert gang_members(16) == [8, 8]
    assert gang_members(12) == [8, 4]
    with pytest.raises(ValueError, match="at least one GPU"):
        gang_members(0)


def test_fixed_servers_take_the_tightest_server_that_fits() -> None:
    servers = FixedServers("s", [8, 4, 2])
    first = servers.allocate(2)
    assert isinstance(first, Grant) and first.key == (2, 2, Resources())  # the 2-GPU server
    assert servers.allocate(3) == Grant((1, 3, Resources()), 3)  # 4 free beats 8 free
    assert servers.allocate(8) == Grant((0, 8, Resources()), 8)
    assert servers.allocated == 13
    assert servers.allocate(2) is Cause.CAPACITY  # 1 GPU left in all
    servers.release(first)
    assert servers.allocate(3) is Cause.FRAGMENTATION  # 3 free, at most 2 on one server


def test_the_pool_places_through_the_index_and_takes_back_what_it_granted() -> None:
    cluster = pool([8, 8])
    grant = cluster.allocate(8)
    assert isinstance(grant, Grant)
    assert cluster.allocated == 8
    assert sorted(cluster.free_slot_counts()) == [0, 8]
    cluster.release(grant)
    assert cluster.allocated == 0
    assert cluster.free_slot_counts() == [8, 8]
    # Every GPU and slot is free again: the whole pool can be taken twice over.
    assert isinstance(cluster.allocate(8), Grant)
    assert isinstance(cluster.allocate(8), Grant)


@pytest.mark.parametrize("verify", [False, True])
def test_the_pool_says_why_it_refuses(verify: bool) -> None:
    cluster = pool([4, 4, 4, 4], gpus=8, verify_refusals=verify)
    assert cluster.allocate(5) is Cause.FRAGMENTATION  # 8 GPUs, 16 slots, no host of 5
    assert isinstance(cluster.allocate(3), Grant)
    assert isinstance(cluster.allocate(3), Grant)
    assert cluster.allocate(3) is Cause.CAPACITY  # 2 GPUs left
    small = pool([1, 1], gpus=8, verify_refusals=verify)
    assert small.allocate(3) is Cause.HOST_SLOTS  # 8 GPUs, only 2 slots in all


def test_a_gang_that_cannot_be_placed_whole_gives_back_its_members() -> None:
    cluster = pool([8, 8, 8], gpus=16)
    assert allocate_gang(cluster, [8, 8, 8]) is Cause.CAPACITY  # the third member fails
    assert cluster.allocated == 0
    assert cluster.free_slot_counts() == [8, 8, 8]
    grants = allocate_gang(cluster, [8, 8])
    assert isinstance(grants, list) and len(grants) == 2
    assert {grant.key.host for grant in grants} == {"h00000", "h00001"}  # type: ignore[attr-defined]


def test_every_decision_is_timed_and_percentiles_read_the_sorted_samples() -> None:
    cluster = pool([8, 8])
    for _ in range(3):
        cluster.allocate(1)
    assert len(cluster.times.samples) == 3
    assert len(cluster.times.cpu) == 3 and all(t >= 0 for t in cluster.times.cpu)
    times = DecisionTimes([0.003, 0.001, 0.002, 0.004], [0.002, 0.001, 0.001, 0.003])
    assert times.percentile(0.5) == 0.003
    assert times.percentile(0.99) == 0.004
    assert times.percentile(0.5, of_cpu=True) == 0.002
    assert DecisionTimes().percentile(0.5) == 0.0


def test_fixed_servers_need_the_cpu_and_memory_on_the_server_that_takes_the_gpus() -> None:
    servers = FixedServers("s", [2, 4, 4], cpus=[10, 8, 30], memory_mib=[100, 100, 50])
    first = servers.allocate(1, Resources(9, 60))
    assert isinstance(first, Grant) and first.key[0] == 0  # the tightest that has the CPU
    # server 0 has 1 CPU left, server 1 has 8, server 2 the CPU but 50 MiB
    assert servers.allocate(1, Resources(9, 60)) is Cause.FRAGMENTATION_MEMORY
    second = servers.allocate(1, Resources(9, 50))
    assert isinstance(second, Grant) and second.key[0] == 2
    assert servers.allocate(1, Resources(0, 120)) is Cause.FRAGMENTATION_MEMORY  # 140 in all
    assert servers.allocate(1, Resources(25, 0)) is Cause.FRAGMENTATION_CPU
    assert servers.allocate(1, Resources(40, 0)) is Cause.CPU  # 30 CPU free in all
    cpu_only = servers.allocate(0, Resources(5, 0))  # a CPU-only pod: fewest free GPUs
    assert isinstance(cpu_only, Grant) and cpu_only.key[0] == 2 and cpu_only.gpus == 0
    servers.release(cpu_only)
    servers.release(second)
    assert servers.allocate(1, Resources(25, 40)) == Grant((2, 1, Resources(25, 40)), 1)


def test_the_pool_needs_the_cpu_and_memory_on_the_host_it_places_on() -> None:
    layout = PoolLayout(
        boxes_of({"H100": 16}), [8, 8], host_cpus=[10, 40], host_memory_mib=[100, 400]
    )
    for verify in (False, True):
        cluster = DxpoolPool("test", layout, verify_refusals=verify)
        grant = cluster.allocate(2, Resources(20, 50))
        assert isinstance(grant, Grant) and grant.key.host == "h00001"  # type: ignore[attr-defined]
        assert cluster.allocate(1, Resources(31, 0)) is Cause.CPU  # 30 left in all
        assert cluster.allocate(1, Resources(25, 0)) is Cause.FRAGMENTATION_CPU
        assert cluster.allocate(1, Resources(5, 360)) is Cause.FRAGMENTATION_MEMORY
        cpu_only = cluster.allocate(0, Resources(5, 50))  # reserved by the harness
        assert isinstance(cpu_only, Grant) and cpu_only.key.host == "h00001"  # type: ignore[attr-defined]
        assert cluster.allocate(1, Resources(20, 0)) is Cause.FRAGMENTATION_CPU  # 10 + 15
        cluster.release(cpu_only)
        cluster.release(grant)
        assert isinstance(cluster.allocate(8, Resources(40, 400)), Grant)
        assert cluster.allocate(8, Resources(40, 0)) is Cause.CPU


def test_fixed_servers_take_only_servers_of_a_model_the_pod_may_use() -> None:
    servers = FixedServers("s", [2, 4, 8], models=["T4", "G2", "G2"])
    grant = servers.allocate(2, Resources(models=("G2",)))
    assert isinstance(grant, Grant) and grant.key[0] == 1  # the tightest G2 server
    assert servers.allocate(3, Resources(models=("T4",))) is Cause.MODEL  # 2 T4 in all
    anyone = servers.allocate(2, Resources())
    assert isinstance(anyone, Grant) and anyone.key[0] == 0  # any model: the tightest
    assert servers.allocate(9, Resources(models=("G2",))) is Cause.FRAGMENTATION  # 2 + 8


def test_most_free_model_takes_the_model_with_the_most_free_gpus() -> None:
    pool = MostFreeModel("m", {"A": 4, "B": 6, "C": 1}, [8, 8])
    first = pool.allocate(2, Resources(models=("A", "B")))
    assert isinstance(first, Grant) and first.key[1] == {"B": 2}
    second = pool.allocate(2, Resources(models=("A", "B")))
    assert isinstance(second, Grant) and second.key[1] == {"A": 2}  # 4 against 4: A
    assert pool.allocate(2, Resources(models=("C",))) is Cause.MODEL
    mixed = pool.allocate(7, Resources())  # no one model holds 7: most free first, mixed
    assert isinstance(mixed, Grant) and mixed.key[1] == {"B": 4, "A": 2, "C": 1}
    assert pool.allocated == 11
    pool.release(mixed)
    assert pool.allocate(3, Resources()) == Grant((0, {"B": 3}, Resources()), 3)


def test_most_free_model_takes_the_host_with_the_fewest_free_slots_that_holds_it() -> None:
    pool = MostFreeModel("m", {"A": 16}, [8, 8, 8], cpus=[4, 32, 32], memory_mib=[0, 0, 0])
    first = pool.allocate(2, Resources(cpu=8))
    assert isinstance(first, Grant) and first.key[0] == 1
    second = pool.allocate(1, Resources(cpu=8))
    assert isinstance(second, Grant) and second.key[0] == 1  # 6 free slots, the fewest
    cpu_only = pool.allocate(0, Resources(cpu=2))
    assert isinstance(cpu_only, Grant) and cpu_only.key[0] == 1
    assert pool.allocate(1, Resources(cpu=40)) is Cause.FRAGMENTATION_CPU  # 50 free in all
    assert pool.allocate(1, Resources(cpu=60)) is Cause.CPU


def test_the_pool_places_model_sets_by_the_most_free_model_and_reserves_cpu_only_pods() -> None:
    layout = PoolLayout(
        boxes_of({"A": 8, "B": 16}), [8, 8], host_cpus=[16, 64], host_memory_mib=[64, 256]
    )
    for verify in (False, True):
        cluster = DxpoolPool("test", layout, verify_refusals=verify)
        grant = cluster.allocate(2, Resources(4, 8, ("A", "B")))
        assert isinstance(grant, Grant)
        node = cluster.pool.node(grant.key.node)  # type: ignore[attr-defined]
        assert node is not None and {b.model for b in node.gpus} == {"B"}
        assert cluster.allocate(9, Resources(models=("A",))) is Cause.MODEL
        cpu_only = cluster.allocate(0, Resources(10, 8))
        assert isinstance(cpu_only, Grant) and cpu_only.gpus == 0
        assert cluster.pool.node(cpu_only.key.node).host == "hosts/h00000"  # type: ignore[attr-defined, union-attr]
        cluster.release(cpu_only)
        cluster.release(grant)
        assert cluster.allocated == 0


def test_one_pool_refuses_only_for_capacity() -> None:
    bound = OnePool("bound", 16)
    first = bound.allocate(8)
    assert isinstance(first, Grant)
    assert bound.allocate(7) == Grant(None, 7)
    assert bound.allocate(2) is Cause.CAPACITY  # 1 free
    assert bound.allocated == 15
    bound.release(first)
    assert bound.allocate(9) == Grant(None, 9)  # no server, host or box to fragment
    with pytest.raises(ValueError, match="GPUs only"):
        bound.allocate(1, Resources(cpu=2))
    with pytest.raises(ValueError, match="only 16 held"):
        bound.release(Grant(None, 17))


def test_a_reserved_pool_keeps_gpus_free_from_large_nodes_only() -> None:
    reserved = ReservedPool("reserve", 16, min_gpus=4, reserve=4)
    first = reserved.allocate(8)
    assert first == Grant(None, 8)  # 8 stay free
    assert reserved.allocate(4) == Grant(None, 4)  # 4 stay free: the reserve holds
    assert reserved.allocate(4) is Cause.CAPACITY  # would leave 0 of the 4 kept
    assert reserved.allocated == 12
    assert reserved.allocate(3) == Grant(None, 3)  # below 4 GPUs: the reserve is its own
    assert reserved.allocate(2) is Cause.CAPACITY  # 1 free: capacity
    assert reserved.allocate(1) == Grant(None, 1)
    reserved.release(first)
    assert reserved.allocate(4) == Grant(None, 4)  # 8 free: 4 stay
    with pytest.raises(ValueError, match="GPUs only"):
        reserved.allocate(4, Resources(cpu=2))
    assert reserved.allocated == 12  # the refused request took nothing


@pytest.mark.parametrize(("min_gpus", "reserve"), [(0, 4), (4, -1), (4, 16)])
def test_a_reserve_must_hold_back_some_nodes_and_keep_less_than_the_pool(
    min_gpus: int, reserve: int
) -> None:
    with pytest.raises(ValueError, match="keeps 0 to 15 of the pool's 16 GPUs"):
        ReservedPool("reserve", 16, min_gpus, reserve)


def test_a_pool_with_a_spare_slot_per_host_refuses_what_the_one_pool_bound_refuses() -> None:
    """With 9 slots per 8-GPU host no node is refused for fragmentation, so dxpool's
    placement refuses exactly the requests that capacity alone refuses."""
    requests = [1, 8, 2, 4, 8, 1, 8, 2, 1, 4, 8, 8, 1]
    dxpool, bound = pool([9, 9, 9, 9], gpus=32), OnePool("bound", 32)
    held: list[tuple[Grant, Grant]] = []
    for number, gpus in enumerate(requests):
        outcome, expected = dxpool.allocate(gpus), bound.allocate(gpus)
        assert isinstance(outcome, Cause) == isinstance(expected, Cause), (number, gpus)
        if isinstance(outcome, Grant) and isinstance(expected, Grant):
            held.append((outcome, expected))
        if number % 3 == 2 and held:  # release the oldest now and then
            mine, theirs = held.pop(0)
            dxpool.release(mine)
            bound.release(theirs)
        assert dxpool.allocated == bound.allocated
