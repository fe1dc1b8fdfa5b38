"""Placement brought forward change by change answers as placement from scratch.

A journal-backed inventory (the interface the broker's placement index offers) goes
through random event sequences: GPUs taken and freed, boxes cordoned, added and removed,
hosts filling up, dying and coming back. After each step, placement on the new snapshot
(which starts from what it worked out for the one before) must answer exactly as a fresh
pipeline on the same records without a journal: the same placement, the same account of
what did not fit, the same explanation of every host.
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace

import immutables
import pytest

from dxpool.broker.placement import (
    BoxInfo,
    GpuInfo,
    HostInfo,
    Placement,
    PlacementRequest,
    Snapshot,
    default_pipeline,
)
from dxpool.fabric.latency import Place, TopologyLatencyModel
from dxpool.fabric.topology import Topology

STEPS = 30
RACKS = [("dc0", f"p{pod}", f"r{rack}") for pod in range(3) for rack in range(3)]


class Inventory:
    """Persistent maps of boxes, GPUs and hosts, and a journal of what each version
    changed, as the broker's placement index keeps them."""

    def __init__(self) -> None:
        self.boxes: immutables.Map[str, BoxInfo] = immutables.Map()
        self.gpus: immutables.Map[str, tuple[GpuInfo, ...]] = immutables.Map()
        self.hosts: immutables.Map[str, HostInfo] = immutables.Map()
        self.log: list[tuple[str | None, str | None]] = []

    def changed_since(
        self, version: int, until: int
    ) -> tuple[frozenset[str], frozenset[str]] | None:
        if not 0 <= version <= until <= len(self.log):
            return None
        boxes = {box for box, _ in self.log[version:until] if box is not None}
        hosts = {host for _, host in self.log[version:until] if host is not None}
        return frozenset(boxes), frozenset(hosts)

    def put_box(self, box: BoxInfo | None, box_id: str, gpus: tuple[GpuInfo, ...] | None) -> None:
        self.boxes = self.boxes.delete(box_id) if box is None else self.boxes.set(box_id, box)
        if box is None and box_id in self.boxes:
            self.boxes = self.boxes.delete(box_id)
        self.gpus = self.gpus.set(box_id, gpus) if gpus is not None else self.gpus.delete(box_id)
        self.log.append((box_id, None))

    def put_host(self, host: HostInfo) -> None:
        self.hosts = self.hosts.set(host.host, host)
        self.log.append((None, host.host))

    def snapshot(self) -> Snapshot:
        return Snapshot(self.boxes, self.hosts, self.gpus, version=len(self.log), journal=self)

    def alone(self) -> Snapshot:
        """The same records with no journal: placement starts from scratch."""
        return Snapshot(dict(self.boxes), dict(self.hosts), dict(self.gpus))


def make_box(box_id: str, rack: tuple[str, str, str], free: list[bool]) -> tuple[BoxInfo, tuple]:
    box = BoxInfo(box_id, Place(f"boxes/{box_id}", *rack), True)
    gpus = tuple(
        GpuInfo(f"boxes/{box_id}/gpus/{s}", box_id, s, "H100", 81920, f, True)
        for s, f in enumerate(free)
    )
    return box, gpus


def populate(rng: random.Random, inventory: Inventory) -> None:
    for index in range(rng.randint(6, 24)):
        box, gpus = make_box(f"b{index:02d}", rng.choice(RACKS), [rng.random() < 0.7] * 8)
        inventory.put_box(box, box.box, gpus)
    for index in range(rng.randint(4, 24)):
        place = Place(f"hosts/h{index:02d}", *rng.choice(RACKS))
        used = frozenset(s for s in range(8) if rng.random() < 0.3)
        labels = frozenset({("pool", rng.choice("ab"))})
        alive = rng.random() > 0.1
        held = rng.choice((0, 8, 24))
        host = HostInfo(
            f"h{index:02d}", place, 8, used, alive, labels, 32, 65536, held, held * 1024
        )
        inventory.put_host(host)


def step(rng: random.Random, inventory: Inventory) -> None:
    """One random change, as a cache event would bring it."""
    kind = rng.randrange(6)
    box_ids = sorted(inventory.gpus)
    host_ids = sorted(inventory.hosts)
    if kind == 0 and box_ids:  # GPUs taken or freed
        box_id = rng.choice(box_ids)
        gpus = tuple(replace(g, free=rng.random() < 0.5) for g in inventory.gpus[box_id])
        inventory.put_box(inventory.boxes.get(box_id), box_id, gpus)
    elif kind == 1 and box_ids:  # cordoned or uncordoned
        box_id = rng.choice(box_ids)
        box = inventory.boxes.get(box_id)
        if box is not None:
            changed = replace(box, schedulable=not box.schedulable)
            inventory.put_box(changed, box_id, inventory.gpus[box_id])
    elif kind == 2:  # a new box
        box_id = f"n{len(inventory.log):03d}"
        box, gpus = make_box(box_id, rng.choice(RACKS), [rng.random() < 0.8 for _ in range(8)])
        inventory.put_box(box, box_id, gpus)
    elif kind == 3 and len(box_ids) > 1:  # a box removed
        inventory.put_box(None, rng.choice(box_ids), None)
    elif kind == 4 and host_ids:  # a host's slots change
        host = inventory.hosts[rng.choice(host_ids)]
        used = frozenset(s for s in range(8) if rng.random() < 0.4)
        labels = frozenset({("pool", rng.choice("ab"))})
        held = rng.choice((0, 8, 24))
        changed = replace(
            host, used_slots=used, labels=labels, used_cpu_cores=held, used_memory_mib=held * 1024
        )
        inventory.put_host(changed)
    elif host_ids:  # a host dies or comes back
        host = inventory.hosts[rng.choice(host_ids)]
        inventory.put_host(replace(host, alive=not host.alive))


@pytest.mark.parametrize("seed", range(40))
def test_placement_brought_forward_answers_as_placement_from_scratch(seed: int) -> None:
    rng = random.Random(seed)
    inventory = Inventory()
    populate(rng, inventory)
    model = TopologyLatencyModel(Topology.default())
    pipeline = default_pipeline()  # keeps what it worked out between snapshots
    requests = [
        PlacementRequest("H100", count, max_latency_ns=bound)
        for count in (1, 2, 8)
        for bound in (0, 0, 5_000)
    ]
    for _ in range(STEPS):
        for _ in range(rng.randint(1, 3)):
            step(rng, inventory)
        snapshot = inventory.snapshot()
        pinned = replace(rng.choice(requests), host=rng.choice(sorted(inventory.hosts)))
        for request in [*requests, pinned]:  # a pin starts from the same request unpinned
            live = pipeline.run(request, snapshot, model)
            fresh = default_pipeline().run(request, inventory.alone(), model)
            assert live.placement == fresh.placement
            assert live.unsatisfied == fresh.unsatisfied
            assert live.candidates == fresh.candidates


def test_an_older_snapshot_after_a_newer_one_still_answers_for_itself() -> None:
    rng = random.Random(1)
    inventory = Inventory()
    populate(rng, inventory)
    model = TopologyLatencyModel(Topology.default())
    pipeline = default_pipeline()
    request = PlacementRequest("H100", 2)
    older = inventory.snapshot()
    older_records = inventory.alone()
    for _ in range(10):
        step(rng, inventory)
    pipeline.run(request, inventory.snapshot(), model)  # the newest is remembered
    again = pipeline.run(request, older, model)
    assert again.placement == default_pipeline().run(request, older_records, model).placement


def test_decisions_run_on_a_snapshot_while_the_next_is_brought_forward_from_it() -> None:
    """One thread keeps placing on the newest snapshot published (adding to what its
    preparation remembers) while another brings the pipeline forward from that same
    preparation to the next snapshot: each decision answers as placement from scratch on
    its own snapshot (preparations are copied on write, never changed under a reader)."""
    import threading

    rng = random.Random(5)
    inventory = Inventory()
    populate(rng, inventory)
    model = TopologyLatencyModel(Topology.default())
    pipeline = default_pipeline()
    requests = [PlacementRequest("H100", 1), PlacementRequest("H100", 2)]
    versions: list[tuple[Snapshot, dict[PlacementRequest, object]]] = []
    for _ in range(60):
        step(rng, inventory)
        alone = inventory.alone()
        expected = {r: default_pipeline().run(r, alone, model).placement for r in requests}
        versions.append((inventory.snapshot(), expected))
    published = [versions[0]]
    failures: list[str] = []
    done = threading.Event()

    def place_on_the_newest() -> None:
        while not done.is_set():
            snapshot, expected = published[-1]
            for request in requests:
                if pipeline.run(request, snapshot, model).placement != expected[request]:
                    failures.append(f"reader at version {snapshot.version}")

    reader = threading.Thread(target=place_on_the_newest)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, inside the steps that matter
    reader.start()
    try:
        for snapshot, expected in versions:
            for request in requests:
                if pipeline.run(request, snapshot, model).placement != expected[request]:
                    failures.append(f"writer at version {snapshot.version}")
            published.append((snapshot, expected))
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert failures == []


@pytest.mark.parametrize("seed", range(12))
def test_affinity_and_spread_brought_forward_answer_as_from_scratch(seed: int) -> None:
    rng = random.Random(1000 + seed)
    inventory = Inventory()
    populate(rng, inventory)
    model = TopologyLatencyModel(Topology.default())
    pipeline = default_pipeline()
    requests = [
        PlacementRequest("H100", 4, same_box=True),
        PlacementRequest("H100", 8, same_box=True, max_latency_ns=5_000),
        PlacementRequest("H100", 3, max_gpus_per_box=1),
        PlacementRequest("", 6, max_gpus_per_box=2),
        PlacementRequest("H100", 2, host_selector=frozenset({("pool", "a")})),
        PlacementRequest("H100", 2, cpu_cores=16, host_memory_mib=16384),
        PlacementRequest("H100", 7, same_switch=True),
        PlacementRequest("H100", 6, same_switch=True, max_latency_ns=5_000),
        PlacementRequest("", 5, same_switch=True, max_gpus_per_box=2),
    ]
    for _ in range(STEPS):
        for _ in range(rng.randint(1, 3)):
            step(rng, inventory)
        snapshot = inventory.snapshot()
        for request in requests:
            live = pipeline.run(request, snapshot, model)
            fresh = default_pipeline().run(request, inventory.alone(), model)
            assert live.placement == fresh.placement
            assert live.unsatisfied == fresh.unsatisfied
            assert live.candidates == fresh.candidates
            if live.placement is not None:
                boxes = [binding.box for binding in live.placement.bindings]
                most = max(boxes.count(box) for box in boxes)
                if request.same_box:
                    assert len(set(boxes)) == 1
                if request.same_switch:
                    racks = {snapshot.boxes[box].place for box in boxes}
                    assert len({(p.site, p.pod, p.rack) for p in racks}) == 1
                if request.max_gpus_per_box:
                    assert most <= request.max_gpus_per_box


def commit(inventory: Inventory, placement: Placement) -> None:
    """What a compose's commit does to the records: the placement's GPUs taken, its host
    slots used."""
    taken = {(binding.box, binding.slot) for binding in placement.bindings}
    for box_id in sorted({box for box, _ in taken}):
        gpus = tuple(
            replace(g, free=False) if (box_id, g.slot) in taken else g
            for g in inventory.gpus[box_id]
        )
        inventory.put_box(inventory.boxes[box_id], box_id, gpus)
    host = inventory.hosts[placement.host]
    used = host.used_slots | {binding.host_slot for binding in placement.bindings}
    inventory.put_host(replace(host, used_slots=frozenset(used)))


@pytest.mark.parametrize("seed", range(12))
def test_composes_one_after_another_answer_as_placement_from_scratch(seed: int) -> None:
    """Placements committed one after another (mostly 1-GPU, which moves the tightest
    box every time), with a random event now and then: each decision, read from the
    groups' kept scores, answers as a fresh pipeline, explanation included."""
    rng = random.Random(100 + seed)
    inventory = Inventory()
    for index in range(rng.randint(12, 30)):
        box, gpus = make_box(f"b{index:02d}", rng.choice(RACKS), [True] * 8)
        inventory.put_box(box, box.box, gpus)
    for index in range(rng.randint(8, 30)):
        place = Place(f"hosts/h{index:02d}", *rng.choice(RACKS))
        inventory.put_host(HostInfo(f"h{index:02d}", place, 8, frozenset(), True))
    model = TopologyLatencyModel(Topology.default())
    pipeline = default_pipeline()
    for turn in range(60):
        if rng.random() < 0.15:
            step(rng, inventory)
        count = rng.choice((1, 1, 1, 2, 3))
        request = PlacementRequest("H100", count)
        if turn % 4 == 3:  # switch affinity, large enough to need several boxes
            request = PlacementRequest("H100", rng.choice((5, 6, 8)), same_switch=True)
        live = pipeline.run(request, inventory.snapshot(), model)
        fresh = default_pipeline().run(request, inventory.alone(), model)
        assert live.placement == fresh.placement, f"turn {turn}"
        assert live.unsatisfied == fresh.unsatisfied
        if turn % 10 == 0:
            assert live.candidates == fresh.candidates
        if live.placement is not None:
            commit(inventory, live.placement)


@pytest.mark.parametrize("seed", range(12))
def test_a_live_supply_brought_forward_holds_what_one_built_from_scratch_holds(seed: int) -> None:
    """Its usable boxes (sorted only when read), their GPUs and the funnel, after each of
    a run of random changes, and the boxes each step reports leaving and coming."""
    from dxpool.broker.placement.live import LiveSupply

    rng = random.Random(200 + seed)
    inventory = Inventory()
    populate(rng, inventory)
    pipeline = default_pipeline()
    request = PlacementRequest("H100", 1)
    box_filters, gpu_filters = pipeline.box_filters, pipeline.gpu_filters
    snapshot = inventory.snapshot()
    live = LiveSupply.build(request, snapshot, box_filters, gpu_filters)
    assert live is not None
    for _ in range(STEPS):
        step(rng, inventory)
        after = inventory.snapshot()
        changed, _ = inventory.changed_since(snapshot.version, after.version) or ((), ())
        removed: list = []
        added: list = []
        advanced = live.advance(request, after, changed, box_filters, gpu_filters, removed, added)
        fresh = LiveSupply.build(request, after, box_filters, gpu_filters)
        if advanced is None or fresh is None:
            assert advanced is None and fresh is None
            return
        assert list(advanced.supply.boxes) == list(fresh.supply.boxes)
        assert advanced.supply.boxes == fresh.supply.boxes
        assert advanced.supply.usable == fresh.supply.usable
        assert advanced.supply.funnel == fresh.supply.funnel
        before = set(map(id, live.supply.boxes))
        now = set(map(id, advanced.supply.boxes))
        assert {id(b) for b in removed} == before - now
        assert {id(b) for b in added} == now - before
        live, snapshot = advanced, after


def resource_hosts(rng: random.Random, inventory: Inventory, count: int) -> None:
    """Hosts of several sizes (some declaring no CPU or memory), partly held."""
    for index in range(count):
        place = Place(f"hosts/r{index:02d}", *rng.choice(RACKS))
        cpus, memory = rng.choice(((0, 0), (16, 65536), (32, 131072), (64, 524288), (64, 0)))
        held = rng.randint(0, cpus)
        host = HostInfo(
            f"r{index:02d}",
            place,
            rng.choice((4, 8, 8, 16)),
            frozenset(s for s in range(8) if rng.random() < 0.3),
            rng.random() > 0.05,
            frozenset({("pool", rng.choice("ab"))}),
            cpus,
            memory,
            held,
            rng.randint(0, memory) if memory else 0,
        )
        inventory.put_host(host)


def hold_resources(rng: random.Random, inventory: Inventory) -> None:
    """A host's nodes come and go: what they hold of its CPU and memory changes."""
    host = inventory.hosts[rng.choice(sorted(inventory.hosts))]
    inventory.put_host(
        replace(
            host,
            used_cpu_cores=rng.randint(0, host.cpu_cores),
            used_memory_mib=rng.randint(0, host.memory_mib) if host.memory_mib else 0,
        )
    )


def shapes(rng: random.Random, hosts: list[str]) -> list[PlacementRequest]:
    """Requests of many shapes: sizes, CPU and memory, excluded hosts, selectors, pins."""
    found = []
    for _ in range(10):
        excluded = frozenset(rng.sample(hosts, rng.choice((0, 0, 1, 3, len(hosts) // 2))))
        found.append(
            PlacementRequest(
                "H100",
                rng.choice((1, 1, 2, 3, 8)),
                cpu_cores=rng.choice((0, 0, 2, 8, 20, 40)),
                host_memory_mib=rng.choice((0, 0, 4096, 65536, 200_000)),
                exclude_hosts=excluded,
                host_selector=rng.choice((frozenset(), frozenset({("pool", "a")}))),
                host=rng.choice((None, None, None, None, rng.choice(hosts))),
                max_latency_ns=rng.choice((0, 0, 0, 5_000)),
            )
        )
    return found


@pytest.mark.parametrize("seed", range(16))
def test_requests_of_many_shapes_answer_as_placement_from_scratch(seed: int) -> None:
    """CPU, memory and excluded hosts checked at decision time on the parts the shapes
    share, and pins on their host alone, answer as a run over every host: the same
    placement (a tie going to the host with the least room), account and explanation."""
    rng = random.Random(300 + seed)
    inventory = Inventory()
    for index in range(rng.randint(8, 24)):
        box, gpus = make_box(f"b{index:02d}", rng.choice(RACKS), [rng.random() < 0.8] * 8)
        inventory.put_box(box, box.box, gpus)
    resource_hosts(rng, inventory, rng.randint(6, 30))
    model = TopologyLatencyModel(Topology.default())
    pipeline = default_pipeline()
    hosts = sorted(inventory.hosts)
    placed = 0
    for turn in range(STEPS):
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.5:
                hold_resources(rng, inventory)
            else:
                step(rng, inventory)
        snapshot = inventory.snapshot()
        for request in shapes(rng, hosts):
            live = pipeline.run(request, snapshot, model)
            fresh = default_pipeline().run(request, inventory.alone(), model)
            assert live.placement == fresh.placement, (turn, request)
            assert live.unsatisfied == fresh.unsatisfied
            if turn % 5 == 0:
                assert live.candidates == fresh.candidates
            placed += live.placement is not None
            if live.placement is not None and rng.random() < 0.3:
                commit(inventory, live.placement)
                snapshot = inventory.snapshot()
    assert placed > STEPS  # the shapes mostly fit: the decisions read the carried parts


def test_shapes_that_differ_in_host_fields_share_one_supply_and_one_host_grouping() -> None:
    """CPU, memory and excluded hosts are checked at decision time: a stream of shapes
    differing in them keeps one box side and one host grouping per size."""
    rng = random.Random(7)
    inventory = Inventory()
    for index in range(12):
        box, gpus = make_box(f"b{index:02d}", rng.choice(RACKS), [True] * 8)
        inventory.put_box(box, box.box, gpus)
    resource_hosts(rng, inventory, 20)
    model = TopologyLatencyModel(Topology.default())
    pipeline = default_pipeline()
    hosts = sorted(inventory.hosts)
    for turn in range(40):
        request = PlacementRequest(
            "H100",
            1 + turn % 2,
            cpu_cores=turn % 7,
            host_memory_mib=1024 * (turn % 5),
            exclude_hosts=frozenset(hosts[: turn % 4]),
        )
        result = pipeline.run(request, inventory.snapshot(), model)
        if result.placement is not None:
            commit(inventory, result.placement)
    carried = pipeline._carried
    assert len(carried.box_sides) == 2  # one per size
    assert len(carried.host_bases) == 1
    assert len(carried.tables) == 2


def test_a_supply_made_again_starts_its_choosers_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A supply dropped (here: room for one kept, two models asked in turn) and made
    again holds new objects for the boxes that did not change: the choosers made from
    the old one must start again rather than be brought forward by it (they would hold
    a box twice)."""
    from dxpool.broker.placement import carry

    monkeypatch.setattr(carry, "MAX_SUPPLIES", 1)
    rng = random.Random(11)
    inventory = Inventory()
    for index in range(8):
        box, gpus = make_box(f"b{index:02d}", rng.choice(RACKS), [True] * 8)
        if index % 2:
            gpus = tuple(replace(gpu, model="A100") for gpu in gpus)
        inventory.put_box(box, box.box, gpus)
    for index in range(6):
        place = Place(f"hosts/h{index:02d}", *rng.choice(RACKS))
        inventory.put_host(HostInfo(f"h{index:02d}", place, 16, frozenset(), True))
    model = TopologyLatencyModel(Topology.default())
    pipeline = default_pipeline()
    for turn in range(24):  # 36 of the 64 GPUs
        request = PlacementRequest(("H100", "A100")[turn % 2], 1 + turn % 3)
        live = pipeline.run(request, inventory.snapshot(), model)
        fresh = default_pipeline().run(request, inventory.alone(), model)
        assert live.placement == fresh.placement, turn
        assert live.placement is not None
        commit(inventory, live.placement)
