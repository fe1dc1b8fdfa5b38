"""The placement index keeps the objects placement remembers things by.

A real cache (fed the way the broker feeds it after reading etcd) drives the index; the
tests check which objects survive from one snapshot to the next.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.placement import PlacementRequest, place
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.placement_index import PlacementIndex
from dxpool.fabric.latency import TopologyLatencyModel
from dxpool.fabric.topology import Topology
from dxpool.limits import MAX_HOST_SLOTS
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Versioned

RACK = pb.Location(site="dc1", pod="p1", rack="r1")


class Feed:
    """Writes records into a cache with rising revisions, as reads from etcd would."""

    def __init__(self, cache: Cache, schema: KeySchema) -> None:
        self.cache = cache
        self.schema = schema
        self.revision = 0

    def put(self, key: str, value: object) -> None:
        self.revision += 1
        self.cache.apply_read(key, Versioned(value, self.revision, 1), self.revision)

    def box(self, box_id: str, state: int = pb.BOX_STATE_ACTIVE) -> None:
        self.put(
            self.schema.box(box_id), pb.Box(name=f"boxes/{box_id}", location=RACK, state=state)
        )

    def gpu(self, box_id: str, slot: int, state: int = pb.GPU_STATE_FREE, node: str = "") -> None:
        gpu = pb.Gpu(
            name=f"boxes/{box_id}/gpus/{slot}",
            box=f"boxes/{box_id}",
            slot=slot,
            model="H100",
            memory_mib=81920,
            state=state,
            node=node,
        )
        self.put(self.schema.gpu(box_id, slot), gpu)

    def host(self, host_id: str, slots: tuple[int, ...] = ()) -> None:
        self.put(
            self.schema.host(host_id),
            pb.Host(name=f"hosts/{host_id}", location=RACK, slot_capacity=8),
        )
        self.put(self.schema.host_lease(host_id), b"")
        self.allocate(host_id, slots)

    def allocate(self, host_id: str, slots: tuple[int, ...]) -> None:
        attachments = [pb.DesiredAttachment(host_slot=slot) for slot in slots]
        allocation = pb.HostAllocation(host=f"hosts/{host_id}", attachments=attachments)
        self.put(self.schema.host_allocation(host_id), allocation)


@pytest.fixture
def feed(etcd_client, key_prefix: str) -> Iterator[Feed]:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    feed = Feed(Cache(etcd_client, schema), schema)
    for box_id in ("b1", "b2"):
        feed.box(box_id)
        for slot in range(4):
            feed.gpu(box_id, slot)
    feed.host("h1")
    feed.host("h2", (0,))
    yield feed


@pytest.fixture
def index(feed: Feed) -> Iterator[PlacementIndex]:
    index = PlacementIndex(feed.cache)
    yield index
    index.close()


def test_the_same_snapshot_while_nothing_changes(feed: Feed, index: PlacementIndex) -> None:
    first = index.snapshot()
    assert index.snapshot() is first
    feed.gpu("b1", 0, state=pb.GPU_STATE_ATTACHING, node="nodes/n1")
    second = index.snapshot()
    assert second is not first
    assert not second.gpus_by_box["b1"][0].free


def test_changes_placement_cannot_see_keep_the_snapshot_and_version(
    feed: Feed, index: PlacementIndex
) -> None:
    feed.gpu("b1", 0, state=pb.GPU_STATE_ATTACHING, node="nodes/n1")
    snapshot, version = index.snapshot(), index.version
    feed.gpu("b1", 0, state=pb.GPU_STATE_ATTACHED, node="nodes/n1")  # still not free
    feed.box("b2")  # rewritten as it was
    feed.allocate("h2", (0,))  # the same slots
    assert index.version == version
    assert index.snapshot() is snapshot


def test_unchanged_records_keep_their_objects(feed: Feed, index: PlacementIndex) -> None:
    first = index.snapshot()
    feed.gpu("b1", 2, state=pb.GPU_STATE_ATTACHING, node="nodes/n1")
    feed.allocate("h1", (0,))
    feed.box("b2", state=pb.BOX_STATE_CORDONED)
    second = index.snapshot()
    assert second.gpus_by_box["b2"] is first.gpus_by_box["b2"]
    assert second.gpus_by_box["b1"] is not first.gpus_by_box["b1"]
    assert second.boxes["b1"] is first.boxes["b1"]
    assert not second.boxes["b2"].schedulable
    assert second.boxes["b2"].place is first.boxes["b2"].place
    assert second.hosts["h2"] is first.hosts["h2"]
    assert second.hosts["h1"].used_slots == frozenset({0})
    assert second.hosts["h1"].place is first.hosts["h1"].place


def test_placement_on_the_index_follows_the_inventory(feed: Feed, index: PlacementIndex) -> None:
    model = TopologyLatencyModel(Topology.default())
    request = PlacementRequest("H100", 4)
    first = place(request, index.snapshot(), model)
    assert first.placement is not None and first.placement.host == "h2"
    for slot in range(4):
        feed.gpu("b1", slot, state=pb.GPU_STATE_ATTACHING, node="nodes/n1")
    feed.allocate("h2", (0, 1, 2, 3, 4))
    second = place(request, index.snapshot(), model)
    assert second.placement is not None and second.placement.host == "h1"
    assert {binding.box for binding in second.placement.bindings} == {"b2"}


def test_host_capacity_is_bounded(feed: Feed, index: PlacementIndex) -> None:
    """A host record claiming 2^31-1 proxy slots must not make placement loop that long."""
    feed.put(
        feed.schema.host("h1"),
        pb.Host(name="hosts/h1", location=RACK, slot_capacity=2**31 - 1),
    )
    host = index.snapshot().hosts["h1"]
    assert host.slot_capacity == MAX_HOST_SLOTS
    assert len(host.free_slots()) == MAX_HOST_SLOTS


def test_the_journal_names_what_changed_between_two_versions(
    feed: Feed, index: PlacementIndex
) -> None:
    first = index.snapshot()
    feed.gpu("b1", 2, state=pb.GPU_STATE_ATTACHING, node="nodes/n1")
    feed.allocate("h1", (0,))
    feed.allocate("h1", (0,))  # the same slots: no new version
    second = index.snapshot()
    assert second.version == first.version + 2
    assert second.journal is index
    assert index.changed_since(first.version, second.version) == (
        frozenset({"b1"}),
        frozenset({"h1"}),
    )
    assert index.changed_since(second.version, second.version) == (frozenset(), frozenset())
    assert index.changed_since(second.version, second.version + 1) is None  # not yet


def test_the_journal_names_what_a_window_of_older_versions_changed(
    feed: Feed, index: PlacementIndex
) -> None:
    start = index.snapshot().version
    feed.gpu("b1", 2, state=pb.GPU_STATE_ATTACHING, node="nodes/n1")
    feed.allocate("h1", (0,))
    feed.gpu("b2", 0, state=pb.GPU_STATE_ATTACHING, node="nodes/n2")
    now = index.snapshot().version
    assert now == start + 3
    assert index.changed_since(start, start + 1) == (frozenset({"b1"}), frozenset())
    assert index.changed_since(start + 1, start + 2) == (frozenset(), frozenset({"h1"}))
    assert index.changed_since(start + 1, now) == (frozenset({"b2"}), frozenset({"h1"}))
    assert index.changed_since(start + 2, start + 2) == (frozenset(), frozenset())
    assert index.changed_since(start + 2, start + 1) is None  # a window backwards


def test_a_snapshot_stays_as_it_was_while_events_arrive(feed: Feed, index: PlacementIndex) -> None:
    first = index.snapshot()
    feed.gpu("b1", 0, state=pb.GPU_STATE_ATTACHING, node="nodes/n1")
    feed.allocate("h1", (0, 1))
    index.snapshot()
    assert first.gpus_by_box["b1"][0].free
    assert first.hosts["h1"].used_slots == frozenset()


def test_the_journal_forgets_beyond_its_length(feed: Feed) -> None:
    index = PlacementIndex(feed.cache, journal_length=2)
    try:
        start = index.snapshot().version
        for slot in range(3):
            feed.gpu("b2", slot, state=pb.GPU_STATE_ATTACHING, node="nodes/n2")
        now = index.snapshot().version
        assert index.changed_since(start, now) is None
        assert index.changed_since(now - 2, now) == (frozenset({"b2"}), frozenset())
    finally:
        index.close()


def test_host_cpu_and_memory_come_from_the_host_and_its_reservations(
    feed: Feed, index: PlacementIndex
) -> None:
    feed.put(
        feed.schema.host("h1"),
        pb.Host(name="hosts/h1", location=RACK, slot_capacity=8, cpu_cores=32, memory_mib=65536),
    )
    reservations = [
        pb.HostReservation(node="nodes/a", cpu_cores=8, memory_mib=16384),
        pb.HostReservation(node="nodes/b", cpu_cores=4, memory_mib=1024),
    ]
    feed.put(
        feed.schema.host_allocation("h1"),
        pb.HostAllocation(host="hosts/h1", reservations=reservations),
    )
    host = index.snapshot().hosts["h1"]
    assert (host.cpu_cores, host.memory_mib) == (32, 65536)
    assert (host.used_cpu_cores, host.used_memory_mib) == (12, 17408)
    request = PlacementRequest("H100", 1, cpu_cores=20, host_memory_mib=48128)
    model = TopologyLatencyModel(Topology.default())
    result = place(request, index.snapshot(), model)
    assert result.placement is not None and result.placement.host == "h1"
    too_many = place(PlacementRequest("H100", 1, cpu_cores=21), index.snapshot(), model)
    assert too_many.placement is None


def test_a_held_placement_looks_taken_until_let_go(feed: Feed, index: PlacementIndex) -> None:
    model = TopologyLatencyModel(Topology.default())
    request = PlacementRequest("H100", 1)
    before = index.snapshot()
    chosen = place(request, before, model).placement
    assert chosen is not None
    (binding,) = chosen.bindings
    assert index.hold(chosen)
    held = index.snapshot()
    assert held.version > before.version
    assert not held.gpus_by_box[binding.box][binding.slot].free
    assert binding.host_slot in held.hosts[chosen.host].used_slots
    assert not index.hold(chosen)  # a second compose with the same choice places again
    other = place(request, held, model).placement
    assert other is not None
    assert (other.bindings[0].box, other.bindings[0].slot) != (binding.box, binding.slot)
    assert index.hold(other)
    index.let_go(chosen)
    index.let_go(other)
    after = index.snapshot()
    assert after.gpus_by_box[binding.box][binding.slot].free
    assert after.hosts[chosen.host].used_slots == before.hosts[chosen.host].used_slots
    assert index.changed_since(before.version, after.version) == (
        frozenset({binding.box, other.bindings[0].box}),
        frozenset({chosen.host, other.host}),
    )
    assert place(request, after, model).placement == chosen


def test_a_hold_outlives_the_records_changing_under_it(feed: Feed, index: PlacementIndex) -> None:
    model = TopologyLatencyModel(Topology.default())
    chosen = place(PlacementRequest("H100", 1), index.snapshot(), model).placement
    assert chosen is not None
    (binding,) = chosen.bindings
    assert index.hold(chosen)
    feed.gpu(binding.box, binding.slot, state=pb.GPU_STATE_ATTACHING, node="nodes/n1")
    feed.allocate(chosen.host, (binding.host_slot,))
    index.let_go(chosen)  # the commit landed: the records now say what the hold said
    after = index.snapshot()
    assert not after.gpus_by_box[binding.box][binding.slot].free
    assert binding.host_slot in after.hosts[chosen.host].used_slots


def test_free_gpus_by_model_and_the_largest_host_are_kept_counted(
    feed: Feed, index: PlacementIndex
) -> None:
    """What a snapshot carries counted (free healthy GPUs of schedulable boxes by model,
    the CPU and memory of the largest host) is what counting its records gives, after
    GPUs taken and freed, holds, cordons, unhealthy GPUs and host changes."""
    import random

    from dxpool.broker.placement import Binding, Placement
    from dxpool.broker.placement.model import Snapshot, count_free_by_model

    def counted(snapshot: Snapshot) -> None:
        alone = Snapshot(snapshot.boxes, snapshot.hosts, snapshot.gpus_by_box)
        assert snapshot.free_by_model() == count_free_by_model(alone)
        assert snapshot.resource_scale() == alone.resource_scale()

    rng = random.Random(4)
    held: list[Placement] = []
    for step in range(60):
        kind = rng.randrange(5)
        box, slot = rng.choice(("b1", "b2")), rng.randrange(4)
        if kind == 0:
            feed.gpu(box, slot, state=pb.GPU_STATE_ATTACHING, node="nodes/n")
        elif kind == 1:
            feed.gpu(box, slot)
        elif kind == 2:
            feed.box(box, rng.choice((pb.BOX_STATE_ACTIVE, pb.BOX_STATE_CORDONED)))
        elif kind == 3:
            cpus = rng.choice((0, 32, 96))
            feed.put(
                feed.schema.host("h1"),
                pb.Host(
                    name="hosts/h1",
                    location=RACK,
                    slot_capacity=8,
                    cpu_cores=cpus,
                    memory_mib=cpus * 4096,
                ),
            )
        elif held and rng.random() < 0.5:
            index.let_go(held.pop())
        else:
            placement = Placement(
                "h1", (Binding(f"boxes/{box}/gpus/{slot}", box, slot, "H100", step % 8, 0),), 0
            )
            if index.hold(placement):
                held.append(placement)
        counted(index.snapshot())
    gpu = pb.Gpu(
        name="boxes/b2/gpus/0",
        box="boxes/b2",
        slot=0,
        model="A100",
        memory_mib=1,
        state=pb.GPU_STATE_FREE,
        health=pb.GPU_HEALTH_UNHEALTHY,
    )
    feed.put(feed.schema.gpu("b2", 0), gpu)
    counted(index.snapshot())
    feed.put(
        feed.schema.host("h2"),
        pb.Host(name="hosts/h2", location=RACK, slot_capacity=8, cpu_cores=128, memory_mib=7),
    )
    assert index.snapshot().resource_scale().cpu_cores == 128
    counted(index.snapshot())
