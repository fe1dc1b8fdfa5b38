"""The embedding API: an in-memory pool whose placement, commits and releases go through
the broker's cache, placement index and records."""

from __future__ import annotations

import gc
import threading

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.memory_pool import AntiAffinity, HostChoice, HostRequest, InMemoryPool
from dxpool.broker.placement import PlacementRequest
from dxpool.broker.placement.model import count_free_by_model
from dxpool.errors import Aborted, AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from dxpool.gc_policy import START, YOUNG_BATCH, CollectorPolicy, CollectorSettings
from dxpool.store import keys as k


def small_pool() -> InMemoryPool:
    pool = InMemoryPool(clock=lambda: 1000.0)
    pool.add_box("b1", "H100", 4)
    pool.add_box("b2", "A100", 8, memory_mib=40960)
    pool.add_host("h1", 8, cpu_cores=64, memory_mib=262144, labels={"zone": "a"})
    pool.add_host("h2", 8, cpu_cores=96, memory_mib=393216, labels={"zone": "b"})
    return pool


def record(pool: InMemoryPool, collection: str, name: str) -> object:
    found = pool.cache.get(collection, name)
    assert found is not None, name
    return found.value


def test_a_commit_writes_the_records_compose_writes() -> None:
    pool = small_pool()
    request = PlacementRequest("H100", 2, cpu_cores=16, host_memory_mib=32768)
    result = pool.place(request)
    assert result.placement is not None and result.placement.host == "h1"  # least room
    node = pool.commit("n1", request, result.placement, labels={"app": "db"})
    assert (node.name, node.host, node.state) == ("nodes/n1", "hosts/h1", pb.NODE_STATE_PENDING)
    assert [event.reason for event in node.events] == ["Composed"]
    assert node.spec.cpu_cores == 16 and dict(node.spec.labels) == {"app": "db"}
    for binding in result.placement.bindings:
        gpu = record(pool, k.GPUS, f"{binding.box}/{binding.slot}")
        assert isinstance(gpu, pb.Gpu)
        assert (gpu.state, gpu.node, gpu.host) == (pb.GPU_STATE_ATTACHING, "nodes/n1", "hosts/h1")
        assert gpu.host_slot == binding.host_slot and gpu.generation == 1
    allocation = record(pool, k.HOST_ALLOCATIONS, "h1")
    assert isinstance(allocation, pb.HostAllocation)
    assert sorted(a.host_slot for a in allocation.attachments) == [0, 1]
    assert [(r.node, r.cpu_cores, r.memory_mib) for r in allocation.reservations] == [
        ("nodes/n1", 16, 32768)
    ]
    assert record(pool, k.NODES, "n1") == node
    # placement sees what was committed: the next node takes other GPUs and slots
    again = pool.place(request)
    assert again.placement is not None
    taken = {(b.box, b.slot) for b in result.placement.bindings}
    assert not taken & {(b.box, b.slot) for b in again.placement.bindings}
    counts = pool.counts()
    assert (counts.gpus, counts.slots, counts.cpu_cores) == (10, 14, 144)
    assert counts.free_by_model == count_free_by_model(pool.snapshot()) == {"H100": 2, "A100": 8}


def test_a_release_gives_everything_back_as_the_controller_frees_it() -> None:
    pool = small_pool()
    before = pool.counts()
    node = pool.compose("n1", PlacementRequest("A100", 3, cpu_cores=8), labels={"app": "x"})
    pool.release("n1")
    assert pool.node("n1") is None and pool.cache.get(k.NODES, "n1") is None
    for binding in node.gpus:
        gpu = record(pool, k.GPUS, binding.gpu.removeprefix("boxes/").replace("/gpus/", "/"))
        assert isinstance(gpu, pb.Gpu)
        assert (gpu.state, gpu.node, gpu.host) == (pb.GPU_STATE_FREE, "", "")
    allocation = record(pool, k.HOST_ALLOCATIONS, node.host.removeprefix("hosts/"))
    assert isinstance(allocation, pb.HostAllocation)
    assert not allocation.attachments and not allocation.reservations
    assert pool.counts() == before
    assert pool.excluded_by([AntiAffinity({"app": "x"})]) == frozenset()
    with pytest.raises(NotFound):
        pool.release("n1")


def test_a_placement_taken_meanwhile_is_not_committed() -> None:
    pool = small_pool()
    request = PlacementRequest("H100", 4)
    first = pool.place(request)
    assert first.placement is not None
    pool.commit("n1", request, first.placement)
    with pytest.raises(Aborted, match="place again"):
        pool.commit("n2", request, first.placement)  # the same GPUs, placed before n1
    assert pool.node("n2") is None
    assert pool.counts().gpus == 8
    with pytest.raises(AlreadyExists):
        pool.commit("n1", request, first.placement)


def test_cpu_or_memory_taken_meanwhile_is_not_committed() -> None:
    pool = InMemoryPool()
    pool.add_box("b1", "H100", 8)
    pool.add_host("h1", 8, cpu_cores=16, memory_mib=1024)
    request = PlacementRequest("H100", 1, cpu_cores=12)
    placed = pool.place(request).placement
    assert placed is not None
    pool.compose("n1", request)
    with pytest.raises(Aborted, match="CPU or memory"):
        pool.commit("n2", request, placed)


def test_anti_affinity_keeps_a_node_off_hosts_running_enough_of_a_selector() -> None:
    pool = small_pool()
    first = pool.compose("db1", PlacementRequest("", 1), labels={"app": "db", "tier": "1"})
    rule = AntiAffinity({"app": "db"})
    second = pool.compose(
        "db2", PlacementRequest("", 1), labels={"app": "db"}, anti_affinity=[rule]
    )
    assert second.host != first.host
    with pytest.raises(ResourceExhausted, match="excluded by the request"):
        pool.compose("db3", PlacementRequest("", 1), anti_affinity=[rule])
    two = AntiAffinity({"app": "db"}, limit=2)  # at most 2 per host, this one included
    assert pool.excluded_by([two]) == frozenset()
    third = pool.compose("db3", PlacementRequest("", 1), labels={"app": "db"}, anti_affinity=[two])
    assert pool.excluded_by([two]) == frozenset({third.host.removeprefix("hosts/")})
    both = AntiAffinity({"app": "db", "tier": "1"})
    assert pool.excluded_by([both]) == frozenset({first.host.removeprefix("hosts/")})
    assert pool.excluded_by([AntiAffinity({}, limit=3)]) == frozenset()
    assert pool.excluded_by([AntiAffinity({}, limit=2)]) == {third.host.removeprefix("hosts/")}
    with pytest.raises(InvalidArgument, match="limit 0"):
        AntiAffinity({"app": "db"}, limit=0)


def test_a_model_named_twice_is_placed_as_the_set_named_once() -> None:
    pool = small_pool()
    node = pool.compose("n1", PlacementRequest("V100|A100|a100|H100", 2))
    assert node.spec.gpus.model == "V100|A100|H100"
    assert {binding.model for binding in node.gpus} == {"A100"}  # 8 free against 4


def test_host_reservations_hold_cpu_and_memory_without_gpus() -> None:
    pool = small_pool()
    pool.compose("gpu", PlacementRequest("H100", 2))  # h1: 6 free slots, the fewest
    held = pool.reserve("cpu1", HostRequest(32, 65536), labels={"app": "etl"})
    assert isinstance(held, pb.VirtualNode) and held.host == "hosts/h1" and not held.gpus
    allocation = record(pool, k.HOST_ALLOCATIONS, "h1")
    assert isinstance(allocation, pb.HostAllocation)
    assert [(r.node, r.cpu_cores) for r in allocation.reservations] == [("nodes/cpu1", 32)]
    # placement sees it: h1 has 32 cores left
    wide = pool.place(PlacementRequest("H100", 1, cpu_cores=40))
    assert wide.placement is not None and wide.placement.host == "h2"
    refused = pool.reserve("cpu2", HostRequest(100))
    assert isinstance(refused, HostChoice) and refused.host is None
    assert refused.unsatisfied[0].startswith("host resources: 2 of 2 hosts lack 100 free CPU")
    off = pool.reserve("cpu3", HostRequest(8), anti_affinity=[AntiAffinity({"app": "etl"})])
    assert isinstance(off, pb.VirtualNode) and off.host == "hosts/h2"
    pool.release("cpu1")
    assert pool.counts().cpu_cores == 160 - 8


def test_bad_calls_say_what_to_fix() -> None:
    pool = small_pool()
    with pytest.raises(AlreadyExists):
        pool.add_box("b1", "H100", 1)
    with pytest.raises(AlreadyExists):
        pool.add_host("h1", 8)
    with pytest.raises(InvalidArgument, match="a box holds 1 to 64 GPUs"):
        pool.add_box("b9", "H100", 0)
    with pytest.raises(InvalidArgument, match="set cpu_cores or host_memory_mib"):
        HostRequest(0)
    with pytest.raises(NotFound):
        pool.set_alive("h9", False)


def test_a_dead_host_is_not_chosen() -> None:
    pool = small_pool()
    pool.set_alive("h1", False)
    node = pool.compose("n1", PlacementRequest("H100", 1))
    assert node.host == "hosts/h2"
    only_h1 = PlacementRequest("H100", 1, exclude_hosts=frozenset({"h2"}))
    with pytest.raises(ResourceExhausted, match="not alive"):
        pool.compose("n2", only_h1)
    pool.set_alive("h1", True)
    assert pool.compose("n2", only_h1).host == "hosts/h1"


def test_placement_carries_its_work_over_on_the_pools_snapshots() -> None:
    """The pool's snapshots are the index's, versioned: a decision is read off what the
    pipeline carried over, as the broker's is."""
    from dxpool.broker.placement import default_pipeline

    pipeline = default_pipeline()
    pool = InMemoryPool(pipeline=pipeline)
    pool.add_box("b1", "H100", 8, location=("dc1", "p1", "r1"))
    pool.add_host("h1", 8, location=("dc1", "p1", "r1"))
    snapshot = pool.snapshot()
    assert snapshot.journal is pool.index and snapshot.version > 0
    for number in range(3):
        pool.compose(f"n{number}", PlacementRequest("H100", 1, cpu_cores=0))
    assert len(pipeline._carried.tables) == 1


class CollectorSpy(CollectorPolicy):
    """A collector policy that records each turn it is given, and whether another thread
    could use the pool at that moment (so the pool's lock was not held)."""

    def __init__(self, pool: InMemoryPool) -> None:
        super().__init__()
        self.pool = pool
        self.turns: list[bool] = []

    def between(self) -> str | None:
        other = threading.Thread(target=self.pool.counts)
        other.start()
        other.join(30)
        self.turns.append(not other.is_alive())
        return None


def test_a_collector_gets_its_turn_after_each_write_outside_the_pools_lock() -> None:
    pool = small_pool()
    spy = pool.collector = CollectorSpy(pool)
    request = PlacementRequest("H100", 2)
    result = pool.place(request)
    assert result.placement is not None
    assert spy.turns == [], "placing is not a write"
    pool.commit("n1", request, result.placement)
    pool.compose("n2", PlacementRequest("A100", 1))
    pool.reserve("r1", HostRequest(cpu_cores=4))
    pool.release("n1")
    assert spy.turns == [True, True, True, True]
    with pytest.raises(ResourceExhausted):
        pool.compose("n3", PlacementRequest("H100", 8))
    assert len(spy.turns) == 4, "nothing written, no turn"


def test_a_pool_with_a_started_policy_collects_between_writes_not_in_placement() -> None:
    found = gc.get_threshold()
    kinds: list[str] = []
    policy = CollectorPolicy(
        CollectorSettings(young_batch=1, reclaim_interval_s=0),
        lambda kind, seconds, frozen: kinds.append(kind),
    )
    pool = small_pool()
    pool.collector = policy
    policy.start()
    try:
        request = PlacementRequest("H100", 1)
        result = pool.place(request)
        assert kinds == [START]
        assert result.placement is not None
        pool.commit("n1", request, result.placement)
        assert kinds == [START, YOUNG_BATCH]
    finally:
        policy.stop()
        gc.unfreeze()
        gc.set_threshold(*found)
