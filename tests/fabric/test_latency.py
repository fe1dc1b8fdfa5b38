"""The tree latency model: round trips, paths, unplaced endpoints, places and caching."""

from __future__ import annotations

import time

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.fabric.latency import LatencyEstimate, LatencyModel, Place, TopologyLatencyModel
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
    started = time.perf_counter()
    for _ in range(2):  # the second pass is served from the cache
        total = sum(model.round_trip(h, b).round_trip_ns for h in hosts for b in boxes)
    elapsed = time.perf_counter() - started
    assert total > 0
    assert elapsed < 2.0, f"40,000 estimates took {elapsed:.2f} s"
