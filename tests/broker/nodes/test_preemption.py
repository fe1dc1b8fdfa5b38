"""The preemption planner on hand-made pools: who may be taken, and at what cost.

Pure: snapshots are built here, placement is the broker's own ``place()``.
"""

from __future__ import annotations

from dxpool.broker.nodes.preemption import (
    LENT_CAPACITY,
    LOWER_PRIORITY,
    Ask,
    HeldGpu,
    HeldNode,
    Holder,
    eligibility,
    plan,
    usable_free,
    with_freed,
)
from dxpool.broker.placement import BoxInfo, GpuInfo, HostInfo, PlacementRequest, Snapshot
from dxpool.fabric.latency import Place, TopologyLatencyModel
from dxpool.fabric.topology import Topology

LATENCY = TopologyLatencyModel(Topology.default())


def pool(boxes: dict[str, int], hosts: dict[str, int], taken: dict[str, set[int]]) -> Snapshot:
    """Boxes of H100s (``taken``: slots not free), hosts with slot counts (slots used
    are filled in from the holders by the caller through ``used``)."""
    box_infos = {
        b: BoxInfo(b, Place(f"boxes/{b}", "s1", "p1", "r1"), schedulable=True) for b in boxes
    }
    gpus = {
        b: tuple(
            GpuInfo(f"boxes/{b}/gpus/{s}", b, s, "H100", 81920, s not in taken.get(b, set()), True)
            for s in range(n)
        )
        for b, n in boxes.items()
    }
    host_infos = {
        h: HostInfo(h, Place(f"hosts/{h}", "s1", "p1", "r1"), n, frozenset(), True)
        for h, n in hosts.items()
    }
    return Snapshot(boxes=box_infos, hosts=host_infos, gpus_by_box=gpus)


def holding(
    name: str,
    tenant: str,
    host: str,
    box: str,
    slots: range,
    *,
    priority: int = 0,
    min_gpus: int = 0,
    hours: float = 1.0,
    first_host_slot: int = 0,
) -> Holder:
    gpus = tuple(
        HeldGpu(f"boxes/{box}/gpus/{s}", box, s, "H100", first_host_slot + i)
        for i, s in enumerate(slots)
    )
    return Holder(
        f"nodes/{name}", tenant, priority, (HeldNode(f"nodes/{name}", host, gpus, min_gpus, hours),)
    )


def with_slots_used(snapshot: Snapshot, holders: list[Holder]) -> Snapshot:
    hosts = dict(snapshot.hosts)
    for holder in holders:
        for node in holder.nodes:
            info = hosts[node.host]
            used = info.used_slots | {g.host_slot for g in node.gpus}
            hosts[node.host] = HostInfo(info.host, info.place, info.slot_capacity, used, True)
    return Snapshot(boxes=snapshot.boxes, hosts=hosts, gpus_by_box=snapshot.gpus_by_box)


def ask(count: int, *, tenant: str = "owner", priority: int = 0, within: bool = True) -> Ask:
    return Ask((PlacementRequest("H100", count),), tenant, priority, within)


def test_who_may_be_taken() -> None:
    borrower = holding("b", "borrower", "h1", "x", range(2), priority=5)
    assert eligibility(ask(1), borrower) == LENT_CAPACITY
    assert eligibility(ask(1, within=False, priority=9), borrower) == LOWER_PRIORITY
    assert eligibility(ask(1, within=False, priority=5), borrower) is None
    assert eligibility(ask(1, tenant="borrower"), borrower) is None  # never its own


def test_an_elastic_borrower_is_shrunk_before_anyone_is_preempted() -> None:
    elastic = holding("el", "t1", "h1", "x", range(8), min_gpus=2, hours=0.1)
    rigid = holding("ri", "t2", "h2", "y", range(4), hours=0.1, first_host_slot=0)
    holders = [elastic, rigid]
    snapshot = with_slots_used(
        pool(
            {"x": 8, "y": 4}, {"h1": 8, "h2": 8, "h3": 8}, {"x": set(range(8)), "y": {0, 1, 2, 3}}
        ),
        holders,
    )
    found = plan(ask(4), holders, snapshot, LATENCY)
    assert found is not None
    assert [c.node for c in found.cuts] == ["nodes/el"]
    (cut,) = found.cuts
    assert len(cut.gpus) == 4 and not cut.whole
    taken = {b.gpu for p in found.placements for b in p.bindings}
    assert taken == set(cut.gpus)  # exactly what the request then gets


def test_one_preemption_that_covers_is_preferred_to_several_cheaper_ones() -> None:
    small1 = holding("s1", "t1", "h1", "x", range(0, 2), hours=0.1)
    small2 = holding("s2", "t1", "h2", "x", range(2, 4), hours=0.1)
    big = holding("big", "t2", "h3", "y", range(4), hours=5.0)
    holders = [small1, small2, big]
    snapshot = with_slots_used(
        pool(
            {"x": 4, "y": 4},
            {"h1": 2, "h2": 2, "h3": 4, "h4": 8},
            {"x": {0, 1, 2, 3}, "y": {0, 1, 2, 3}},
        ),
        holders,
    )
    found = plan(ask(4), holders, snapshot, LATENCY)
    assert found is not None
    assert [c.node for c in found.cuts] == ["nodes/big"]


def test_lowest_priority_then_fewest_gpu_hours_goes_first() -> None:
    high = holding("high", "t1", "h1", "x", range(4), priority=3, hours=0.1)
    old = holding("old", "t2", "h2", "y", range(4), priority=1, hours=9.0)
    young = holding("young", "t3", "h3", "z", range(4), priority=1, hours=1.0)
    holders = [high, old, young]
    snapshot = with_slots_used(
        pool(
            {"x": 4, "y": 4, "z": 4},
            {"h1": 4, "h2": 4, "h3": 4, "h4": 8},
            {"x": {0, 1, 2, 3}, "y": {0, 1, 2, 3}, "z": {0, 1, 2, 3}},
        ),
        holders,
    )
    found = plan(ask(4), holders, snapshot, LATENCY)
    assert found is not None
    assert [c.node for c in found.cuts] == ["nodes/young"]
    by_priority = plan(ask(4, within=False, priority=2), holders, snapshot, LATENCY)
    assert by_priority is not None
    assert [c.node for c in by_priority.cuts] == ["nodes/young"]


def test_several_holders_when_no_one_covers_and_the_unused_are_spared() -> None:
    a = holding("a", "t1", "h1", "x", range(0, 3), hours=0.1)
    b = holding("b", "t1", "h2", "x", range(3, 6), hours=0.2)
    c = holding("c", "t1", "h3", "x", range(6, 8), hours=0.3)
    holders = [a, b, c]
    snapshot = with_slots_used(
        pool({"x": 8}, {"h1": 3, "h2": 3, "h3": 2, "h4": 8}, {"x": set(range(8))}), holders
    )
    found = plan(ask(5), holders, snapshot, LATENCY)
    assert found is not None
    assert sorted(c.node for c in found.cuts) == ["nodes/a", "nodes/b"]
    assert found.freed == 6


def test_a_gang_is_taken_whole() -> None:
    members = tuple(
        HeldNode(f"nodes/g-{i}", f"h{i + 1}", (HeldGpu(f"boxes/x/gpus/{i}", "x", i, "H100", 0),))
        for i in range(2)
    )
    gang = Holder("gangs/g", "t1", 0, members)
    snapshot = with_slots_used(pool({"x": 2}, {"h1": 1, "h2": 1, "h3": 4}, {"x": {0, 1}}), [gang])
    found = plan(ask(1), [gang], snapshot, LATENCY)
    assert found is not None
    assert sorted(c.node for c in found.cuts) == ["nodes/g-0", "nodes/g-1"]
    assert all(c.whole for c in found.cuts)


def test_nothing_eligible_or_nothing_enough_plans_nothing() -> None:
    borrower = holding("b", "t1", "h1", "x", range(2))
    snapshot = with_slots_used(pool({"x": 2}, {"h1": 2, "h2": 8}, {"x": {0, 1}}), [borrower])
    assert plan(ask(2, within=False), [borrower], snapshot, LATENCY) is None  # same priority
    assert plan(ask(3), [borrower], snapshot, LATENCY) is None  # 2 GPUs are all there are
    assert plan(ask(2, tenant="t1"), [borrower], snapshot, LATENCY) is None


def test_with_freed_frees_gpus_and_host_slots() -> None:
    node = HeldNode("nodes/n", "h1", (HeldGpu("boxes/x/gpus/1", "x", 1, "H100", 3),))
    snapshot = pool({"x": 2}, {"h1": 4}, {"x": {1}})
    snapshot = Snapshot(
        boxes=snapshot.boxes,
        hosts={"h1": HostInfo("h1", snapshot.hosts["h1"].place, 4, frozenset({3}), True)},
        gpus_by_box=snapshot.gpus_by_box,
    )
    freed = with_freed(snapshot, [(node, node.gpus)])
    assert all(g.free for g in freed.gpus_by_box["x"])
    assert freed.hosts["h1"].used_slots == frozenset()
    assert usable_free(freed, ask(1)) == 2 and usable_free(snapshot, ask(1)) == 1
