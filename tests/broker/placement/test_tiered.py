"""Choosing per host class on a tiered latency model gives exactly the pair-by-pair answer.

The tree latency model ranks boxes for a whole class of hosts at once; placement then
walks those rankings instead of asking for every (host, box) pair. Everything it answers
(placement, every candidate's explanation, every unsatisfied line) must be what the
pair-by-pair path answers with the same model seen only through ``round_trip``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from dxpool.broker.placement import (
    BoxInfo,
    GpuInfo,
    HostInfo,
    PlacementRequest,
    Snapshot,
    place,
)
from dxpool.broker.placement import tiered as tiered_rules
from dxpool.broker.placement.framework import BoxSupply, Take
from dxpool.broker.placement.selection import most_in_one_switch, options, propose, switch_of
from dxpool.broker.placement.status import SUCCESS, Status
from dxpool.broker.placement.tiered import FEW_TIGHTEST, TieredChooser
from dxpool.fabric.latency import LatencyEstimate, Place, TopologyLatencyModel
from dxpool.fabric.topology import Topology

CASES = 120

# Uneven switch latencies, so racks of one pod (and pods of one site) are not all alike,
# plus placed names and locations the topology does not know (unplaced endpoints).
TOPOLOGY = """
proxy_ns: 600
links: {rack_ns: 250, pod_ns: 500, site_ns: 1000, inter_site_ns: 40000}
sites:
  - name: s0
    site_ns: 1200
    pods:
      - name: p0
        racks: [{name: r0, rack_ns: 300}, {name: r1}, {name: r2, rack_ns: 200}]
      - name: p1
        pod_ns: 450
      - name: p2
  - name: s1
    rack_ns: 275
places:
  hosts: {h3: {site: s1, pod: p0, rack: r0}}
  boxes: {b2: {site: s0, pod: p0, rack: r2}}
"""

SITES = ("s0", "s1", "s9")
PODS = ("p0", "p1", "p2")
RACKS = ("r0", "r1", "r2", "r3")


class PairByPair:
    """The same model seen only through ``round_trip``: placement goes pair by pair."""

    def __init__(self, model: TopologyLatencyModel) -> None:
        self._model = model

    def round_trip(self, host: Place, box: Place) -> LatencyEstimate:
        return self._model.round_trip(host, box)


class CountingModel(TopologyLatencyModel):
    """The tree model, counting how often placement asks for a pair or a ranking."""

    pairs = 0
    rankings = 0

    def round_trip(self, host: Place, box: Place) -> LatencyEstimate:
        self.pairs += 1
        return super().round_trip(host, box)

    def ranking(self, host_class: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        self.rankings += 1
        return super().ranking(host_class)


def where(rng: random.Random) -> tuple[str, str, str]:
    if rng.random() < 0.08:
        return "", "", ""  # unplaced
    return rng.choice(SITES), rng.choice(PODS), rng.choice(RACKS)


def random_case(rng: random.Random) -> tuple[Snapshot, PlacementRequest]:
    boxes: dict[str, BoxInfo] = {}
    gpus: dict[str, tuple[GpuInfo, ...]] = {}
    for index in range(rng.randint(1, 24)):
        box = f"b{index}"
        boxes[box] = BoxInfo(box, Place(f"boxes/{box}", *where(rng)), rng.random() > 0.1)
        model = rng.choice(("H100", "H100", "A100"))
        gpus[box] = tuple(
            GpuInfo(f"boxes/{box}/gpus/{slot}", box, slot, model, 81920, rng.random() > 0.4, True)
            for slot in range(rng.randint(0, 8))
        )
    hosts: dict[str, HostInfo] = {}
    for index in range(rng.randint(1, 12)):
        host = f"h{index}"
        used = frozenset(slot for slot in range(8) if rng.random() < 0.3)
        place = Place(f"hosts/{host}", *where(rng))
        hosts[host] = HostInfo(host, place, rng.choice((4, 8)), used, rng.random() > 0.1)
    request = PlacementRequest(
        rng.choice(("H100", "", "a100")),
        rng.choice((1, 1, 2, 3, 4, 6, 8, 12)),
        host=rng.choice((None, None, None, *hosts)),
        max_latency_ns=rng.choice((0, 0, 0, 3_500, 5_000, 9_000, 90_000)),
    )
    return Snapshot(boxes, hosts, gpus), request


FEW_RACKS = (("s0", "p0", "r0"), ("s0", "p0", "r1"), ("s0", "p1", "r0"), ("s1", "p0", "r2"))


def with_switch(
    case: tuple[Snapshot, PlacementRequest], rng: random.Random
) -> tuple[Snapshot, PlacementRequest]:
    """The case with its boxes packed into a few racks (some unplaced), asking for switch
    affinity for a node that often needs several boxes, sometimes spread over them."""
    snapshot, request = case
    boxes = {}
    for box_id, box in snapshot.boxes.items():
        rack = ("", "", "") if rng.random() < 0.08 else rng.choice(FEW_RACKS)
        boxes[box_id] = replace(box, place=Place(box.place.name, *rack))
    request = replace(
        request,
        count=rng.choice((2, 3, 5, 6, 8)),
        same_switch=True,
        max_gpus_per_box=rng.choice((0, 0, 2)),
    )
    return Snapshot(boxes, snapshot.hosts, snapshot.gpus_by_box), request


@pytest.fixture(scope="module")
def topology() -> Topology:
    return Topology.from_yaml(TOPOLOGY)


@pytest.fixture(params=["listed", "unlisted", "untracked"])
def tier_listing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test as it is; again with every ranking tier taken as a large one (not
    listed, its first fitting box found in the chooser's order of every class's first
    fitting box, carried along advance()); and again with every walk that looks at more
    than one class resting on every class (its memo dropped by any change)."""
    if request.param == "unlisted":
        monkeypatch.setattr(tiered_rules, "LARGE_TIER", 0)
    if request.param == "untracked":
        monkeypatch.setattr(tiered_rules, "MAX_EXAMINED", 1)
    return str(request.param)


@pytest.mark.parametrize("seed", range(CASES))
def test_the_tiered_path_answers_exactly_as_the_pair_by_pair_path(
    seed: int, topology: Topology, tier_listing: str
) -> None:
    snapshot, request = random_case(random.Random(seed))
    model = CountingModel(topology)
    tiered = place(request, snapshot, model)
    deciding_pairs = model.pairs  # the explanation, read below, may look at every host
    pairwise = place(request, snapshot, PairByPair(TopologyLatencyModel(topology)))
    assert tiered.placement == pairwise.placement
    assert tiered.unsatisfied == pairwise.unsatisfied
    assert tiered.candidates == pairwise.candidates
    if tiered.placement is not None:
        # never asked for every pair: per host at most its nearest box out of reach, or
        # the few boxes the tightest-single-box rule compares
        per_host = 1 if request.max_latency_ns else FEW_TIGHTEST
        assert deciding_pairs <= len(snapshot.hosts) * per_host


@pytest.mark.parametrize("seed", range(CASES))
def test_with_switch_affinity_the_tiered_path_answers_as_the_pair_by_pair_path(
    seed: int, topology: Topology, tier_listing: str
) -> None:
    rng = random.Random(seed)
    snapshot, request = with_switch(random_case(rng), rng)
    tiered = place(request, snapshot, TopologyLatencyModel(topology))
    pairwise = place(request, snapshot, PairByPair(TopologyLatencyModel(topology)))
    assert tiered.placement == pairwise.placement
    assert tiered.unsatisfied == pairwise.unsatisfied
    assert tiered.candidates == pairwise.candidates
    if tiered.placement is not None:
        boxes = {binding.box for binding in tiered.placement.bindings}
        assert len({switch_of(snapshot.boxes[box]) for box in boxes}) == 1


def test_the_switch_cases_exercise_both_outcomes_and_several_boxes(topology: Topology) -> None:
    placed = several = 0
    for seed in range(CASES):
        rng = random.Random(seed)
        snapshot, request = with_switch(random_case(rng), rng)
        result = place(request, snapshot, TopologyLatencyModel(topology))
        if result.placement is not None:
            placed += 1
            several += len({b.box for b in result.placement.bindings}) > 1
    assert CASES // 5 < placed < CASES - CASES // 5
    assert several >= CASES // 24  # any model takes one model first: fewer span boxes


def test_the_random_cases_exercise_both_outcomes(topology: Topology) -> None:
    placed = 0
    for seed in range(CASES):
        snapshot, request = random_case(random.Random(seed))
        placed += place(request, snapshot, TopologyLatencyModel(topology)).placement is not None
    assert CASES // 4 < placed < CASES - CASES // 10


def test_hosts_of_one_rack_are_chosen_for_once() -> None:
    rack = ("s", "p", "r")
    boxes = {f"b{i}": BoxInfo(f"b{i}", Place(f"boxes/b{i}", *rack), True) for i in range(3)}
    gpus = {
        box: tuple(
            GpuInfo(f"boxes/{box}/gpus/{s}", box, s, "H100", 1, True, True) for s in range(4)
        )
        for box in boxes
    }
    hosts = {
        f"h{i}": HostInfo(f"h{i}", Place(f"hosts/h{i}", *rack), 8, frozenset(), True)
        for i in range(10)
    }
    model = CountingModel(Topology.default())
    result = place(PlacementRequest("H100", 2), Snapshot(boxes, hosts, gpus), model)
    assert result.placement is not None
    assert (model.rankings, model.pairs) == (1, 0)


def test_a_model_that_fails_to_classify_a_host_is_asked_pair_by_pair(
    topology: Topology,
) -> None:
    class Unclassifiable(TopologyLatencyModel):
        def host_class(self, host: Place) -> int:
            if host.name == "hosts/h1":
                raise LookupError("no class")
            return super().host_class(host)

    for seed in range(20):
        snapshot, request = random_case(random.Random(seed))
        expected = place(request, snapshot, PairByPair(TopologyLatencyModel(topology)))
        assert place(request, snapshot, Unclassifiable(topology)) == expected


@dataclass(frozen=True)
class Supplies:
    """Random supplies (ordered by usable GPUs, box id) spread over racks."""

    boxes: tuple[BoxSupply, ...]

    @classmethod
    def make(cls, rng: random.Random) -> Supplies:
        made = []
        for index in range(rng.randint(1, 16)):
            box = BoxInfo(f"b{index:02d}", Place(f"boxes/b{index:02d}", *where(rng)), True)
            usable = tuple(
                GpuInfo(f"boxes/{box.box}/gpus/{s}", box.box, s, "H100", 1, True, True)
                for s in range(rng.randint(1, 8))
            )
            made.append(BoxSupply(box, usable))
        made.sort(key=lambda supply: (supply.available, supply.box.box))
        return cls(tuple(made))


@pytest.mark.parametrize("seed", range(40))
def test_the_chooser_makes_the_choices_propose_makes_from_every_link(
    seed: int, topology: Topology, tier_listing: str
) -> None:
    rng = random.Random(seed)
    supplies = Supplies.make(rng).boxes
    model = TopologyLatencyModel(topology)
    count = rng.randint(1, min(12, sum(supply.available for supply in supplies)))
    bound = rng.choice((None, 3_000, 5_000, 9_000, 50_000))
    same_switch = seed % 2 == 1
    if same_switch:  # boxes packed into a few racks, so switches hold several
        supplies = tuple(
            BoxSupply(replace(s.box, place=Place(s.box.place.name, *rng.choice(FEW_RACKS))), s.gpus)
            for s in supplies
        )
    chooser = TieredChooser(model, supplies, count, bound, same_switch=same_switch)
    for index in range(6):
        host = HostInfo(f"h{index}", Place(f"hosts/h{index}", *where(rng)), 16, frozenset(), True)
        every = [(model.round_trip(host.place, s.box.place).round_trip_ns, s) for s in supplies]
        links = [link for link in every if bound is None or link[0] <= bound]
        beyond = [link for link in every if bound is not None and link[0] > bound]
        reach = sum(supply.available for _, supply in links)
        proposals = propose(host, 16, count, list(links), same_switch=same_switch)
        expected = [(p.rule, p.takes) for p in proposals]
        choice = chooser.choose(host.place)
        assert choice.options == (expected if reach >= count else [])
        assert choice.reach == reach
        if same_switch and reach >= count and not expected:
            assert choice.switch == most_in_one_switch(links)
        assert choice.dropped == min(beyond, key=lambda link: link[0], default=None)


def test_options_merge_identical_choices_and_need_a_nearest_first_choice() -> None:
    supply = BoxSupply(
        BoxInfo("b1", Place("boxes/b1"), True),
        (GpuInfo("boxes/b1/gpus/0", "b1", 0, "H100", 1, True, True),),
    )
    nearest = (Take(supply, 1, 1_000),)
    assert options(1, nearest, (1_000, supply), (1_000, supply)) == [("nearest-first", nearest)]
    assert options(1, None, (1_000, supply), None) == []


@pytest.mark.parametrize("seed", range(CASES))
def test_hosts_alike_are_proposed_for_once_and_decide_the_same(
    seed: int, topology: Topology
) -> None:
    """Hosts of one latency class with the same free slot count get the same proposals;
    only the first by id is looked at, and the decision is that of a run over all."""
    from dxpool.broker.placement.pipeline import _Run
    from dxpool.broker.placement.registry import default_pipeline

    rng = random.Random(seed)
    snapshot, request = random_case(rng)
    # Many hosts per rack, as in a real pool: the case the classes are for.
    hosts = dict(snapshot.hosts)
    for index in range(24):
        place = Place(f"hosts/x{index:02d}", *where(rng))
        hosts[f"x{index:02d}"] = HostInfo(f"x{index:02d}", place, 8, frozenset(), True)
    snapshot = Snapshot(snapshot.boxes, hosts, snapshot.gpus_by_box)
    model = TopologyLatencyModel(topology)
    pipeline = default_pipeline()
    by_class = _Run(pipeline, request, snapshot, model).result()
    every_host = _Run(pipeline, request, snapshot, model, share_classes=False).result()
    assert by_class.placement == every_host.placement
    assert by_class.unsatisfied == every_host.unsatisfied
    assert by_class.candidates == every_host.candidates


def test_a_score_that_tells_hosts_of_a_class_apart_makes_every_host_be_scored(
    topology: Topology,
) -> None:
    """A plugin without ``by_host_class`` (here: it prefers the highest host id) must see
    every host, or it could never pick one the classes would have skipped."""
    import dataclasses

    from dxpool.broker.placement.framework import Proposal, scale_to_best
    from dxpool.broker.placement.pipeline import WeightedScore
    from dxpool.broker.placement.registry import default_pipeline

    class LastHost:
        name = "last_host"

        def score(self, request: PlacementRequest, proposal: Proposal) -> float:
            return float(int(proposal.host.host.removeprefix("h")))

        def normalize(self, scores: list[float]) -> list[float]:
            return scale_to_best(scores)

    rack = ("s", "p", "r")
    boxes = {"b0": BoxInfo("b0", Place("boxes/b0", *rack), True)}
    gpus = {
        "b0": tuple(GpuInfo(f"boxes/b0/gpus/{s}", "b0", s, "H100", 1, True, True) for s in range(4))
    }
    hosts = {
        f"h{i}": HostInfo(f"h{i}", Place(f"hosts/h{i}", *rack), 8, frozenset(), True)
        for i in range(1, 6)
    }
    snapshot = Snapshot(boxes, hosts, gpus)
    base = default_pipeline()
    pipeline = dataclasses.replace(base, scores=(*base.scores, WeightedScore(LastHost(), 100.0)))

    result = pipeline.run(PlacementRequest("H100", 1), snapshot, TopologyLatencyModel(topology))

    assert result.placement is not None and result.placement.host == "h5"


@pytest.mark.parametrize("seed", range(40))
def test_an_advanced_chooser_chooses_as_one_built_from_scratch(
    seed: int, topology: Topology, tier_listing: str
) -> None:
    """advance() keeps choices whose racks did not change and finds the tightest box
    again when only it moved: after random changes to the supply, every host gets what
    a chooser built from the new supply gives it, in choose() and in parts()."""
    rng = random.Random(seed)
    model = TopologyLatencyModel(topology)
    supplies = list(Supplies.make(rng).boxes)
    count = rng.choice((1, 2, 3, 8))
    bound = rng.choice((None, None, 5_000, 9_000))
    hosts = [Place(f"hosts/h{i}", *where(rng)) for i in range(8)]
    chooser = TieredChooser(model, supplies, count, bound)
    for _ in range(12):
        answered = {}
        for host in hosts:  # fill the memo the next chooser starts from
            chooser.choose(host)
            answered[host] = (chooser.parts(host)[0], model.ranking(chooser.host_class(host)))
        removed: list[BoxSupply] = []
        added: list[BoxSupply] = []
        for _ in range(rng.randint(1, 3)):
            if supplies and rng.random() < 0.7:
                old = supplies.pop(rng.randrange(len(supplies)))
                removed.append(old)
                if rng.random() < 0.8:  # the same box with fewer or more usable GPUs
                    usable = tuple(
                        GpuInfo(
                            f"boxes/{old.box.box}/gpus/{s}", old.box.box, s, "H100", 1, True, True
                        )
                        for s in range(rng.randint(1, 8))
                    )
                    added.append(BoxSupply(old.box, usable))
            else:
                name = f"n{rng.randrange(10_000):04d}"
                if all(s.box.box != name for s in supplies):
                    box = BoxInfo(name, Place(f"boxes/{name}", *where(rng)), True)
                    gpus = tuple(
                        GpuInfo(f"boxes/{name}/gpus/{s}", name, s, "H100", 1, True, True)
                        for s in range(rng.randint(1, 8))
                    )
                    added.append(BoxSupply(box, gpus))
        supplies = sorted([*supplies, *added], key=lambda s: (s.available, s.box.box))
        chooser = chooser.advance(removed, added)
        fresh = TieredChooser(model, supplies, count, bound)
        # the tightest boxes, carried forward from the previous chooser's when they can be
        assert chooser._tightest_classes() == fresh._tightest_classes()
        assert chooser.few_tightest() == fresh.few_tightest()
        changed = chooser.changed_classes()
        for host in hosts:  # a class not named answers the first part as before, while
            # the model numbered no class since (the caller checks that part, see
            # carry.ClassTable.sync)
            first, ranking = answered[host]
            number = chooser.host_class(host)
            if changed is not None and number not in changed and model.ranking(number) is ranking:
                assert chooser.parts(host)[0] == first
        for host in hosts:
            expected = fresh.choose(host)
            assert chooser.choose(host) == expected
            base, apart = chooser.parts(host)
            tight = chooser.tightest_link(apart)
            whole = (
                [*base, ("tightest-single-box", (Take(tight[1], count, tight[0]),))]
                if tight
                else base
            )
            assert whole == expected.options


@pytest.mark.parametrize("pinned_is_full", [False, True])
def test_a_pinned_request_looks_at_its_host_alone(pinned_is_full: bool, topology: Topology) -> None:
    """The pin drops every other host and explains nothing of them, so a pinned run asks
    the host filters about the pinned host only, also when it cannot take the node (a
    compose re-placed on the host it waited for, which filled meanwhile); the decision,
    the unsatisfied lines and the per-host account stay those of a run over every host."""
    import dataclasses

    from dxpool.broker.placement.pipeline import _Run
    from dxpool.broker.placement.registry import default_pipeline

    asked: list[str] = []

    class Watching:
        name = "watching"

        def applies(self, request: PlacementRequest) -> bool:
            return True

        def filter_host(self, request: PlacementRequest, host: HostInfo) -> Status:
            asked.append(host.host)
            return SUCCESS

        def explain(self, request: PlacementRequest, failed: object, reached: int) -> str | None:
            return None

    boxes = {"b0": BoxInfo("b0", Place("boxes/b0", "s0", "p0", "r0"), True)}
    gpus = {
        "b0": tuple(GpuInfo(f"boxes/b0/gpus/{s}", "b0", s, "H100", 1, True, True) for s in range(8))
    }
    hosts = {
        f"h{i:02d}": HostInfo(
            f"h{i:02d}",
            Place(f"hosts/h{i:02d}", "s0", "p0", f"r{i % 3}"),
            2,
            frozenset({0, 1}) if (pinned_is_full and i == 7) else frozenset(),
            True,
        )
        for i in range(40)
    }
    snapshot = Snapshot(boxes, hosts, gpus)
    base = default_pipeline()
    pin, *others = base.host_filters
    pipeline = dataclasses.replace(base, host_filters=(pin, Watching(), *others))
    request = PlacementRequest("H100", 2, host="h07")
    model = TopologyLatencyModel(topology)
    pinned = _Run(pipeline, request, snapshot, model).result()
    assert asked == ["h07"]
    every_host = _Run(pipeline, request, snapshot, model, share_classes=False).result()
    assert pinned.placement == every_host.placement
    assert (pinned.placement is None) is pinned_is_full
    assert pinned.unsatisfied == every_host.unsatisfied
    assert pinned.candidates == every_host.candidates


def test_the_tightest_box_emptied_names_only_the_classes_whose_options_move(
    topology: Topology,
) -> None:
    """When the last GPU of the only box short of full goes, many classes hold the
    tightest box again (a box of 8): a class whose nearest single box is such a box
    answers as before and is not named, so a caller asks only the others again."""
    model = TopologyLatencyModel(topology)

    def box(name: str, rack: str, usable: int) -> BoxSupply:
        gpus = tuple(
            GpuInfo(f"boxes/{name}/gpus/{s}", name, s, "H100", 1, True, True) for s in range(usable)
        )
        return BoxSupply(BoxInfo(name, Place(f"boxes/{name}", "s1", "p0", rack), True), gpus)

    full = [box(f"b{index:02d}", f"r{index}", 8) for index in range(FEW_TIGHTEST + 4)]
    last = box("z0", "r0", 1)
    hosts = [Place(f"hosts/h{i}", "s1", "p0", f"r{i}") for i in range(FEW_TIGHTEST + 4)]
    before = TieredChooser(model, sorted([*full, last], key=lambda s: (s.available, s.box.box)), 1)
    assert before.few_tightest()
    answered = {host: before.parts(host)[0] for host in hosts}
    after = before.advance([last], [])
    assert not after.few_tightest()
    changed = after.changed_classes()
    assert changed is not None and len(changed) < len(hosts)
    fresh = TieredChooser(model, full, 1)
    for host in hosts:
        assert after.parts(host)[0] == fresh.parts(host)[0]
        if after.host_class(host) not in changed:
            assert after.parts(host)[0] == answered[host]


def with_resources_and_sets(
    case: tuple[Snapshot, PlacementRequest], rng: random.Random
) -> tuple[Snapshot, PlacementRequest]:
    """The case with hosts that declare CPU and memory (some hold part of it, some declare
    nothing), asked for a model set or any model, with CPU, memory and excluded hosts:
    the scarcity order and the least-room tie on top of the tiered walk."""
    snapshot, request = case
    one_rack = rng.choice((None, ("s0", "p0", "r1"))) if snapshot.hosts else None
    hosts = {}
    for host_id, listed in snapshot.hosts.items():
        host = listed
        if one_rack is not None:  # hosts alike in latency: ties go by room
            host = replace(
                listed,
                place=Place(listed.place.name, *one_rack),
                slot_capacity=8,
                used_slots=frozenset(),
            )
        if rng.random() < 0.2:
            hosts[host_id] = host
            continue
        cpus, memory = rng.choice(((32, 131072), (64, 262144), (96, 393216)))
        hosts[host_id] = replace(
            host,
            cpu_cores=cpus,
            memory_mib=memory,
            used_cpu_cores=rng.choice((0, 0, cpus // 4, cpus // 2)),
            used_memory_mib=rng.choice((0, 0, memory // 8, memory // 2)),
        )
    request = replace(
        request,
        host=request.host if one_rack is None else None,
        model=rng.choice(("H100|A100", "a100|H100|A100", "", "A100|H100")),
        cpu_cores=rng.choice((0, 0, 8, 40)),
        host_memory_mib=rng.choice((0, 0, 65536)),
        exclude_hosts=frozenset(rng.sample(sorted(hosts), rng.randint(0, min(2, len(hosts))))),
    )
    return Snapshot(snapshot.boxes, hosts, snapshot.gpus_by_box), request


@pytest.mark.parametrize("seed", range(CASES))
def test_with_model_sets_host_resources_and_exclusions_the_tiered_path_answers_as_pair_by_pair(
    seed: int, topology: Topology, tier_listing: str
) -> None:
    rng = random.Random(7000 + seed)
    snapshot, request = with_resources_and_sets(random_case(rng), rng)
    tiered = place(request, snapshot, TopologyLatencyModel(topology))
    pairwise = place(request, snapshot, PairByPair(TopologyLatencyModel(topology)))
    assert tiered.placement == pairwise.placement
    assert tiered.unsatisfied == pairwise.unsatisfied
    assert tiered.candidates == pairwise.candidates


def test_the_resource_cases_exercise_both_outcomes_and_the_tie(topology: Topology) -> None:
    placed = tied = 0
    for seed in range(CASES):
        rng = random.Random(7000 + seed)
        snapshot, request = with_resources_and_sets(random_case(rng), rng)
        result = place(request, snapshot, TopologyLatencyModel(topology))
        if result.placement is not None:
            placed += 1
            kept = [c for c in result.candidates if c.feasible]
            tied += sum(c.score == kept[0].score for c in kept) > 1
    assert CASES // 5 < placed < CASES - CASES // 5
    assert tied >= 10


def test_a_far_tightest_box_follows_its_tier_and_names_only_the_classes_it_no_longer_fits(
    topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class whose tightest box is the least box of a large tier (the rest of the
    site) answers "that tier's least box" (a :class:`FarTightest`): when that box is
    taken and another of the same usable GPUs becomes the least, the class is not
    named and its answer is unchanged, yet every choice is a fresh chooser's. When the
    pool's fewest usable GPUs rise so that a nearer tier holds the tightest box, the
    class whose nearer tier holds one is named; the other keeps its answer."""
    monkeypatch.setattr(tiered_rules, "LARGE_TIER", 2)
    monkeypatch.setattr(tiered_rules, "FEW_TIGHTEST", 0)
    model = TopologyLatencyModel(topology)

    def box(name: str, pod: str, rack: str, usable: int) -> BoxSupply:
        gpus = tuple(
            GpuInfo(f"boxes/{name}/gpus/{s}", name, s, "H100", 1, True, True) for s in range(usable)
        )
        return BoxSupply(BoxInfo(name, Place(f"boxes/{name}", "s1", pod, rack), True), gpus)

    def ordered(supplies: list[BoxSupply]) -> list[BoxSupply]:
        return sorted(supplies, key=lambda s: (s.available, s.box.box))

    own = [box("a0", "p0", "r0", 8), box("c0", "p2", "r0", 8), box("c1", "p2", "r1", 3)]
    # f9 has as few usable GPUs as c1: the "pod" host's far tier's least box once the
    # fewest rise to 3, but c1 in its own pod is nearer
    rest = [
        *(box(f"f{index}", "p1", f"r{index}", 8) for index in range(4)),
        box("f9", "p1", "r3", 3),
    ]
    first, second = box("t1", "p1", "r1", 1), box("t2", "p1", "r2", 1)
    hosts = {
        "plain": Place("hosts/h0", "s1", "p0", "r0"),
        "pod": Place("hosts/h1", "s1", "p2", "r2"),
    }
    supplies = ordered([*own, *rest, first, second])
    chooser = TieredChooser(model, supplies, 1)
    for host in hosts.values():
        chooser.choose(host)
        base, apart = chooser.parts(host)
        assert isinstance(apart, tiered_rules.FarTightest)
        assert chooser.tightest_link(apart) == (apart.latency, first)
    answers = {name: chooser.parts(host) for name, host in hosts.items()}

    # the far least box is taken: the other box of one usable GPU is the least now
    chooser = chooser.advance([first], [])
    supplies = ordered([*own, *rest, second])
    changed = chooser.changed_classes()
    assert changed is not None
    fresh = TieredChooser(model, supplies, 1)
    for name, host in hosts.items():
        assert chooser.host_class(host) not in changed
        assert chooser.parts(host) == answers[name]
        assert chooser.choose(host) == fresh.choose(host)
        assert chooser.choose(host).options[-1][1][0].supply is second

    # no box of one usable GPU is left: the fewest is 3, which the "pod" host's own
    # pod holds (c1), nearer than the rest of the site (whose least, f9, has 3 too)
    chooser = chooser.advance([second], [])
    supplies = ordered([*own, *rest])
    changed = chooser.changed_classes()
    fresh = TieredChooser(model, supplies, 1)
    assert changed is not None
    assert chooser.host_class(hosts["pod"]) in changed
    assert chooser.host_class(hosts["plain"]) not in changed  # c1 is its far least now
    for host in hosts.values():
        assert chooser.choose(host) == fresh.choose(host)
        base, apart = chooser.parts(host)
        whole = base if apart is None else [*base, _tight(chooser, apart, 1)]
        assert whole == fresh.choose(host).options
    assert chooser.choose(hosts["pod"]).options[-1][1][0].supply.box.box == "c1"


def _tight(chooser: TieredChooser, apart: object, count: int) -> tuple[str, tuple[Take, ...]]:
    link = chooser.tightest_link(apart)  # type: ignore[arg-type]
    assert link is not None
    return ("tightest-single-box", (Take(link[1], count, link[0]),))


def test_a_far_tightest_box_beyond_another_large_tier_follows_that_tiers_fewest(
    topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A far tightest box in the farthest tier (another site and an unknown one), with the
    rest of the host's own site a large tier nearer to it: when that nearer tier's least
    box comes to hold fewer usable GPUs (still more than the fewest), the far answer
    stays, but once the fewest rise to that many the nearer tier holds the tightest box,
    and the class is named and answers it."""
    monkeypatch.setattr(tiered_rules, "LARGE_TIER", 1)
    monkeypatch.setattr(tiered_rules, "FEW_TIGHTEST", 0)
    model = TopologyLatencyModel(topology)

    def box(name: str, site: str, pod: str, rack: str, usable: int) -> BoxSupply:
        gpus = tuple(
            GpuInfo(f"boxes/{name}/gpus/{s}", name, s, "H100", 1, True, True) for s in range(usable)
        )
        return BoxSupply(BoxInfo(name, Place(f"boxes/{name}", site, pod, rack), True), gpus)

    def ordered(supplies: list[BoxSupply]) -> list[BoxSupply]:
        return sorted(supplies, key=lambda s: (s.available, s.box.box))

    own = box("a0", "s1", "p0", "r0", 8)
    site = [
        box("m1", "s1", "p1", "r0", 8),
        box("m2", "s1", "p1", "r1", 8),
        box("m3", "s1", "p2", "r0", 8),
    ]
    other = [
        box("t1", "s0", "p0", "r0", 1),
        box("t3", "s9", "p0", "r0", 3),
        box("x1", "s0", "p1", "r1", 8),
    ]
    host = Place("hosts/h0", "s1", "p0", "r0")
    chooser = TieredChooser(model, ordered([own, *site, *other]), 1)
    _, apart = chooser.parts(host)
    assert isinstance(apart, tiered_rules.FarTightest)
    assert chooser.tightest_link(apart) == (apart.latency, other[0])
    fewer = box("m1", "s1", "p1", "r0", 3)  # the rest of the site's least box: 3 usable
    chooser = chooser.advance([site[0]], [fewer])
    supplies = ordered([own, fewer, *site[1:], *other])
    assert chooser.choose(host) == TieredChooser(model, supplies, 1).choose(host)
    assert chooser.parts(host)[1] == apart  # t1 is still the tightest box
    chooser = chooser.advance([other[0]], [])  # t1 is taken: the fewest are 3
    supplies = ordered([own, fewer, *site[1:], *other[1:]])
    changed = chooser.changed_classes()
    assert changed is None or chooser.host_class(host) in changed
    expected = TieredChooser(model, supplies, 1).choose(host)
    assert expected.options[-1][1][0].supply is fewer  # nearer than t3, as few usable
    assert chooser.choose(host) == expected


@pytest.mark.parametrize("seed", range(10))
def test_with_few_tightest_boxes_parts_leaves_the_nearest_out_and_choose_adds_it(
    seed: int, topology: Topology
) -> None:
    """With few classes holding a box of the fewest usable GPUs, a walk does not go on
    for that rule: ``parts(nearest_few=False)`` gives the same first part as ``parts()``
    and no second part where that would be the nearest of the few, and ``choose()``,
    asked after ``parts()`` or first, gives what ``propose`` makes from every link."""
    rng = random.Random(seed)
    model = TopologyLatencyModel(topology)

    def box(name: str, usable: int) -> BoxSupply:
        gpus = tuple(
            GpuInfo(f"boxes/{name}/gpus/{s}", name, s, "H100", 1, True, True) for s in range(usable)
        )
        return BoxSupply(BoxInfo(name, Place(f"boxes/{name}", *where(rng)), True), gpus)

    supplies = sorted(
        [*(box(f"t{index}", 1) for index in range(2)), *(box(f"f{i}", 8) for i in range(6))],
        key=lambda s: (s.available, s.box.box),
    )
    kept, fresh = TieredChooser(model, supplies, 1), TieredChooser(model, supplies, 1)
    assert kept.few_tightest()
    for index in range(12):
        host = HostInfo(f"h{index}", Place(f"hosts/h{index}", *where(rng)), 16, frozenset(), True)
        base, far = kept.parts(host.place, nearest_few=False)
        whole_base, whole = kept.parts(host.place)
        assert base == whole_base
        if not isinstance(whole, tiered_rules.FarTightest):
            assert far is None
        links = [(model.round_trip(host.place, s.box.place).round_trip_ns, s) for s in supplies]
        expected = [(p.rule, p.takes) for p in propose(host, 16, 1, links)]
        assert kept.choose(host.place).options == expected
        assert fresh.choose(host.place).options == expected
