"""The tree latency model: round trips, paths, unplaced endpoints, places and caching."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.fabric.latency import (
    LatencyEstimate,
    LatencyModel,
    Place,
    TieredLatencyModel,
    TopologyLatencyModel,
)
from dxpool.fabric.topology import Topology

TOPOLOGY = """
proxy_ns: 600
links: {rack_ns: 250, pod_ns: 500, site_ns: 1000, inter_site_ns: 40000}
sites:
  - name: dc1
    site_ns: 1200
    pods:
      - name: p1
        racks:
          - {name: r1, rack_ns: 300}
          - {name: r2}
      - name: p2
  - name: dc2
places:
  hosts: {pinned: {site: dc1, pod: p1, rack: r2}}
  boxes: {moved: {site: dc2, pod: q1, rack: s1}}
"""


@pytest.fixture
def model() -> TopologyLatencyModel:
    return TopologyLatencyModel(Topology.from_yaml(TOPOLOGY))


def host(site: str = "", pod: str = "", rack: str = "", name: str = "hosts/h1") -> Place:
    return Place(name, site, pod, rack)


def box(site: str = "", pod: str = "", rack: str = "", name: str = "boxes/b1") -> Place:
    return Place(name, site, pod, rack)


def test_same_rack_crosses_only_the_rack_switch(model: TopologyLatencyModel) -> None:
    estimate = model.round_trip(host("dc1", "p1", "r1"), box("dc1", "p1", "r1"))
    assert estimate == LatencyEstimate(
        round_trip_ns=2 * (600 + 600 + 300),
        path=("proxy:hosts/h1", "rack:dc1/p1/r1", "proxy:boxes/b1"),
    )
    assert estimate.one_way_ns == 1500


def test_same_pod_crosses_both_racks_and_the_pod(model: TopologyLatencyModel) -> None:
    estimate = model.round_trip(host("dc1", "p1", "r1"), box("dc1", "p1", "r2"))
    assert estimate.round_trip_ns == 2 * (600 + 300 + 500 + 250 + 600)
    assert estimate.path == (
        "proxy:hosts/h1",
        "rack:dc1/p1/r1",
        "pod:dc1/p1",
        "rack:dc1/p1/r2",
        "proxy:boxes/b1",
    )


def test_same_site_crosses_the_site_core(model: TopologyLatencyModel) -> None:
    estimate = model.round_trip(host("dc1", "p1", "r1"), box("dc1", "p2", "x"))
    assert estimate.round_trip_ns == 2 * (600 + 300 + 500 + 1200 + 500 + 250 + 600)
    assert estimate.path[1:-1] == (
        "rack:dc1/p1/r1",
        "pod:dc1/p1",
        "site:dc1",
        "pod:dc1/p2",
        "rack:dc1/p2/x",
    )


def test_other_site_adds_the_inter_site_link(model: TopologyLatencyModel) -> None:
    estimate = model.round_trip(host("dc1", "p1", "r1"), box("dc2", "q", "s"))
    host_side = 300 + 500 + 1200
    box_side = 250 + 500 + 1000
    assert estimate.round_trip_ns == 2 * (600 + host_side + 40_000 + box_side + 600)
    assert estimate.path[1:-1] == (
        "rack:dc1/p1/r1",
        "pod:dc1/p1",
        "site:dc1",
        "inter-site",
        "site:dc2",
        "pod:dc2/q",
        "rack:dc2/q/s",
    )


def test_farther_is_slower(model: TopologyLatencyModel) -> None:
    origin = host("dc1", "p1", "r1")
    ladder = [box("dc1", "p1", "r1"), box("dc1", "p1", "r2"), box("dc1", "p2", "r"), box()]
    times = [model.round_trip(origin, target).round_trip_ns for target in ladder]
    assert times == sorted(times)
    assert len(set(times)) == len(times)


@pytest.mark.parametrize(
    "unplaced",
    [
        host(),  # empty location
        host("dc1", "p1", ""),  # incomplete
        host("dc9", "p1", "r1"),  # a site the explicit topology does not list
        host("dc1", "p1", "r7"),  # a rack pod p1 does not list
    ],
)
def test_an_unplaced_endpoint_is_assumed_in_another_site_behind_the_slowest_switches(
    model: TopologyLatencyModel, unplaced: Place
) -> None:
    estimate = model.round_trip(unplaced, box("dc1", "p1", "r1"))
    worst_side = 300 + 500 + 1200  # slowest rack, pod and site switches of the topology
    box_side = 300 + 500 + 1200
    assert estimate.round_trip_ns == 2 * (600 + worst_side + 40_000 + box_side + 600)
    assert estimate.path == (
        "proxy:hosts/h1",
        "unplaced:hosts/h1",
        "inter-site",
        "site:dc1",
        "pod:dc1/p1",
        "rack:dc1/p1/r1",
        "proxy:boxes/b1",
    )


def test_unplaced_on_both_sides_is_the_worst_case(model: TopologyLatencyModel) -> None:
    estimate = model.round_trip(host(), box())
    assert estimate.path == (
        "proxy:hosts/h1",
        "unplaced:hosts/h1",
        "inter-site",
        "unplaced:boxes/b1",
        "proxy:boxes/b1",
    )
    assert estimate.round_trip_ns == 2 * (600 + 2000 + 40_000 + 2000 + 600)


def test_places_override_the_record_location(model: TopologyLatencyModel) -> None:
    pinned = host("dc2", "a", "b", name="hosts/pinned")  # the topology puts it in dc1/p1/r2
    estimate = model.round_trip(pinned, box("dc1", "p1", "r2"))
    assert estimate.path == ("proxy:hosts/pinned", "rack:dc1/p1/r2", "proxy:boxes/b1")
    moved = box(name="boxes/moved")  # empty location, placed by the topology in dc2/q1/s1
    assert model.round_trip(host("dc2", "q1", "s1"), moved).path[1:-1] == ("rack:dc2/q1/s1",)
    # places are per kind: a host named like a placed box is not moved
    assert model.round_trip(host(name="hosts/moved"), moved).path[1] == "unplaced:hosts/moved"


def test_default_topology_places_every_complete_location() -> None:
    model = TopologyLatencyModel(Topology.default())
    estimate = model.round_trip(host("a", "b", "c"), box("a", "b", "c"))
    assert estimate.round_trip_ns == 2 * (600 + 250 + 600)


def test_place_of_a_stored_record() -> None:
    record = resources_pb2.Host(
        name="hosts/h7", location=resources_pb2.Location(site="dc1", pod="p1", rack="r1")
    )
    assert Place.of(record) == Place("hosts/h7", "dc1", "p1", "r1")
    assert Place.of(resources_pb2.Box(name="boxes/b2")) == Place("boxes/b2")


def test_the_model_implements_the_protocol_and_caches(model: TopologyLatencyModel) -> None:
    assert isinstance(model, LatencyModel)
    first = model.round_trip(host("dc1", "p1", "r1"), box("dc1", "p2", "x"))
    again = model.round_trip(host("dc1", "p1", "r1"), box("dc1", "p2", "x"))
    assert again is first


def test_many_pairs_are_cheap() -> None:
    model = TopologyLatencyModel(Topology.default())
    hosts = [host("s", f"p{i % 4}", f"r{i % 16}", name=f"hosts/h{i}") for i in range(200)]
    boxes = [box("s", f"p{i % 4}", f"r{i % 8}", name=f"boxes/b{i}") for i in range(100)]
    # How fast is bench/placement_bench.py's to say; here: the cache answers the same.
    passes = [
        sum(model.round_trip(h, b).round_trip_ns for h in hosts for b in boxes) for _ in range(2)
    ]
    assert passes[0] > 0 and passes[0] == passes[1]


# -- places hash once; the model ranks boxes by class --------------------------------


def test_a_place_hashes_by_its_fields_and_a_changed_copy_hashes_anew() -> None:
    place = Place("hosts/h1", "dc1", "p1", "r1")
    assert hash(place) == hash(Place("hosts/h1", "dc1", "p1", "r1"))
    moved = dataclasses.replace(place, rack="r2")
    assert moved == Place("hosts/h1", "dc1", "p1", "r2")
    assert hash(moved) == hash(Place("hosts/h1", "dc1", "p1", "r2"))
    assert {place: 1}[Place("hosts/h1", "dc1", "p1", "r1")] == 1
    assert "hash" not in repr(place)


def random_place(rng: random.Random, name: str) -> Place:
    if rng.random() < 0.1:
        return Place(name)
    site = rng.choice(("dc1", "dc2", "dc3"))
    return Place(name, site, rng.choice(("p1", "p2", "q1")), rng.choice(("r1", "r2", "r7", "s1")))


def test_the_model_is_tiered(model: TopologyLatencyModel) -> None:
    assert isinstance(model, TieredLatencyModel)


@pytest.mark.parametrize("seed", range(10))
def test_rankings_agree_with_round_trips(model: TopologyLatencyModel, seed: int) -> None:
    rng = random.Random(seed)
    names = ["pinned", "h1", "h2", "h3", "h4", "h5"]
    hosts = [random_place(rng, f"hosts/{name}") for name in names]
    boxes = [random_place(rng, f"boxes/{name}") for name in ("moved", "b1", "b2", "b3", "b4")]
    box_classes = [model.box_class(box) for box in boxes]
    for host in hosts:
        tiers = model.ranking(model.host_class(host))
        ranked = [number for _, numbers in tiers for number in numbers]
        assert len(ranked) == len(set(ranked))  # each class in one tier
        assert [ns for ns, _ in tiers] == sorted({ns for ns, _ in tiers})
        assert all(list(numbers) == sorted(numbers) for _, numbers in tiers)
        tier_of = {number: ns for ns, numbers in tiers for number in numbers}
        for box, number in zip(boxes, box_classes, strict=True):
            assert tier_of[number] == model.round_trip(host, box).round_trip_ns
            assert model.class_round_trip_ns(model.host_class(host), number) == tier_of[number]


class _PairByPair(TopologyLatencyModel):
    """The tree model made to rank by asking every pair of classes (an override, even
    one that changes nothing, may single out any pair)."""

    def _override(self, host_side: object, box_side: object) -> None:
        return None


@pytest.mark.parametrize("topology", [TOPOLOGY, None])
@pytest.mark.parametrize("seed", range(6))
def test_rankings_made_by_group_are_those_made_pair_by_pair(
    topology: str | None, seed: int
) -> None:
    tree = Topology.from_yaml(topology) if topology else Topology.default()
    grouped, pairwise = TopologyLatencyModel(tree), _PairByPair(tree)
    rng = random.Random(seed)
    for turn in range(40):  # classes keep appearing between rankings
        place = random_place(rng, f"boxes/b{turn}")
        assert grouped.box_class(place) == pairwise.box_class(place)
        origin = random_place(rng, f"hosts/h{turn}")
        number = grouped.host_class(origin)
        assert number == pairwise.host_class(origin)
        assert grouped.ranking(number) == pairwise.ranking(number)


def test_classes_are_racks_and_every_unplaced_endpoint_shares_one(
    model: TopologyLatencyModel,
) -> None:
    same = model.box_class(box("dc1", "p1", "r1", name="boxes/x"))
    assert model.box_class(box("dc1", "p1", "r1", name="boxes/y")) == same
    assert model.host_class(host("dc1", "p1", "r1")) == same
    assert model.box_class(box("dc1", "p1", "r2")) != same
    # the topology places boxes/moved in dc2/q1/s1 whatever its own location says
    assert model.box_class(box(name="boxes/moved")) == model.box_class(box("dc2", "q1", "s1"))
    unplaced = model.host_class(host())
    assert model.box_class(box("dc9", "p1", "r1")) == unplaced
    assert model.host_class(host("dc1", "p1", "r7")) == unplaced


def test_a_ranking_grows_with_classes_seen_after_it(model: TopologyLatencyModel) -> None:
    origin = model.host_class(host("dc1", "p1", "r1"))
    before = model.ranking(origin)
    later = model.box_class(box("dc1", "p2", "late"))
    after = model.ranking(origin)
    assert later not in {n for _, numbers in before for n in numbers}
    assert later in {n for _, numbers in after for n in numbers}
    assert model.ranking(origin) is after  # unchanged until another class appears


def test_a_copied_place_hashes_its_fields_anew() -> None:
    place = Place("hosts/h1", "dc1", "p1", "r1")
    assert b"_hash" not in pickle.dumps(place)
    copied = pickle.loads(pickle.dumps(place))
    assert copied == place and hash(copied) == hash(place)
