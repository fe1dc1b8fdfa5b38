"""The operator's latency matrix: parsing with clear errors, lookup, fallback, tiers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dxpool.errors import InvalidArgument
from dxpool.fabric.latency import Place, TieredLatencyModel, TopologyLatencyModel
from dxpool.fabric.matrix import LatencyMatrix, MatrixError, MatrixLatencyModel
from dxpool.fabric.topology import Topology
from tests.fabric.tier_contract import assert_tier_contract, random_place

YAML = """
fallback: topology
round_trips:
  - {hosts: dc1/p1/r1, boxes: dc1/p1/r2, round_trip: 3.1us}
  - {hosts: dc1/p1, boxes: dc1/p2, round_trip: 6us}
  - {hosts: dc1, boxes: dc2, round_trip: 85us}
  - {hosts: dc1/p1/r1, boxes: dc1/p2, round_trip: 5000}
"""


def host(site: str, pod: str = "", rack: str = "") -> Place:
    return Place("hosts/h1", site, pod, rack)


def box(site: str, pod: str = "", rack: str = "") -> Place:
    return Place("boxes/b1", site, pod, rack)


@pytest.fixture
def model() -> MatrixLatencyModel:
    return MatrixLatencyModel(Topology.default(), LatencyMatrix.from_yaml(YAML))


def test_the_most_specific_entry_wins(model: MatrixLatencyModel) -> None:
    rack_pair = model.round_trip(host("dc1", "p1", "r1"), box("dc1", "p1", "r2"))
    assert rack_pair.round_trip_ns == 3_100
    assert rack_pair.path == ("proxy:hosts/h1", "matrix:dc1/p1/r1->dc1/p1/r2", "proxy:boxes/b1")
    # rack-to-pod beats pod-to-pod
    assert model.round_trip(host("dc1", "p1", "r1"), box("dc1", "p2", "r9")).round_trip_ns == 5_000
    assert model.round_trip(host("dc1", "p1", "r2"), box("dc1", "p2", "r9")).round_trip_ns == 6_000
    assert model.round_trip(host("dc1", "p7", "r1"), box("dc2", "p1", "r1")).round_trip_ns == 85_000


def test_entries_are_symmetric_by_default(model: MatrixLatencyModel) -> None:
    assert model.round_trip(host("dc1", "p1", "r2"), box("dc1", "p1", "r1")).round_trip_ns == 3_100
    assert model.round_trip(host("dc2", "p1", "r1"), box("dc1", "p1", "r1")).round_trip_ns == 85_000
    one_way = LatencyMatrix.from_yaml(YAML + "symmetric: false\n")
    directed = MatrixLatencyModel(Topology.default(), one_way)
    tree = TopologyLatencyModel(Topology.default())
    pair = (host("dc1", "p1", "r2"), box("dc1", "p1", "r1"))
    assert directed.round_trip(*pair) == tree.round_trip(*pair)


def test_a_listed_direction_beats_a_mirrored_one() -> None:
    matrix = LatencyMatrix.from_yaml(
        "round_trips:\n"
        "  - {hosts: dc1/p1/r1, boxes: dc1/p1/r2, round_trip: 3us}\n"
        "  - {hosts: dc1/p1/r2, boxes: dc1/p1/r1, round_trip: 4us}\n"
    )
    model = MatrixLatencyModel(Topology.default(), matrix)
    assert model.round_trip(host("dc1", "p1", "r1"), box("dc1", "p1", "r2")).round_trip_ns == 3_000
    assert model.round_trip(host("dc1", "p1", "r2"), box("dc1", "p1", "r1")).round_trip_ns == 4_000


def test_pairs_not_listed_fall_back_to_the_topology_or_a_fixed_round_trip(
    model: MatrixLatencyModel,
) -> None:
    tree = TopologyLatencyModel(Topology.default())
    same_rack = (host("dc1", "p1", "r1"), box("dc1", "p1", "r1"))
    assert model.round_trip(*same_rack) == tree.round_trip(*same_rack)
    unplaced = (host("dc1"), box("dc1", "p1", "r2"))
    assert model.round_trip(*unplaced) == tree.round_trip(*unplaced)
    fixed = MatrixLatencyModel(
        Topology.default(),
        LatencyMatrix.from_yaml(YAML + "fallback: 100us\n".replace("fallback: topology\n", "")),
    )
    assert fixed.round_trip(*same_rack).round_trip_ns == 100_000
    assert fixed.round_trip(*same_rack).path[1] == "matrix:fallback"


def test_csv_reads_the_same_as_yaml(tmp_path: Path) -> None:
    path = tmp_path / "rtt.csv"
    path.write_text(
        "hosts,boxes,round_trip\n# a comment\ndc1/p1/r1,dc1/p1/r2,3.1us\ndc1/p1,dc1/p2,6000\n"
    )
    matrix = LatencyMatrix.load(path)
    assert matrix.lookup(*_locations("dc1/p1/r1", "dc1/p1/r2")) == (
        3_100,
        "matrix:dc1/p1/r1->dc1/p1/r2",
    )
    assert matrix.lookup(*_locations("dc1/p2/r1", "dc1/p1/r1"))[0] == 6_000  # type: ignore[index]
    assert matrix.fallback_ns is None


def _locations(a: str, b: str):  # type: ignore[no-untyped-def]
    from dxpool.fabric.topology import Location

    return Location(*a.split("/")), Location(*b.split("/"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a mapping with round_trips"),
        ("round_trips: []", "round_trips: expected a non-empty list"),
        ("round_trips: [1]", "round_trips[0]: expected a mapping, got 1"),
        ("rtt: []", "rtt: unknown key; expected round_trips, fallback, symmetric"),
        (
            "round_trips: [{hosts: dc1, boxes: dc2}]",
            "round_trips[0]: expected exactly the keys hosts, boxes, round_trip (missing "
            "['round_trip'], unknown none)",
        ),
        (
            "round_trips: [{hosts: dc1/p1/r1/x, boxes: dc2, round_trip: 1us}]",
            "round_trips[0].hosts: expected SITE, SITE/POD or SITE/POD/RACK",
        ),
        (
            "round_trips: [{hosts: dc1//r1, boxes: dc2, round_trip: 1us}]",
            "round_trips[0].hosts: expected SITE, SITE/POD or SITE/POD/RACK",
        ),
        (
            "round_trips: [{hosts: dc1, boxes: 7, round_trip: 1us}]",
            "round_trips[0].boxes: expected SITE, SITE/POD or SITE/POD/RACK",
        ),
        (
            "round_trips: [{hosts: dc1, boxes: dc2, round_trip: 3 parsecs}]",
            "round_trips[0].round_trip: cannot parse duration '3 parsecs'",
        ),
        (
            "round_trips: [{hosts: dc1, boxes: dc2, round_trip: 0}]",
            "round_trips[0].round_trip: expected a round trip above 0 and at most 10s",
        ),
        (
            "round_trips: [{hosts: dc1, boxes: dc2, round_trip: 11s}]",
            "round_trips[0].round_trip: expected a round trip above 0 and at most 10s",
        ),
        (
            "round_trips: [{hosts: dc1, boxes: dc2, round_trip: 1us}, "
            "{hosts: dc1, boxes: dc2, round_trip: 2us}]",
            "round_trips[1]: duplicate entry for hosts dc1, boxes dc2",
        ),
        ("fallback: soon\nround_trips: [{hosts: a, boxes: b, round_trip: 1us}]", "fallback:"),
        ("symmetric: maybe\nround_trips: [{hosts: a, boxes: b, round_trip: 1us}]", "symmetric:"),
        ("round_trips: [", "invalid YAML at line 1"),
    ],
)
def test_yaml_errors_name_the_entry_and_what_to_write(text: str, message: str) -> None:
    with pytest.raises(MatrixError) as raised:
        LatencyMatrix.from_yaml(text, source="rtt.yaml")
    assert str(raised.value).startswith("rtt.yaml: ")
    assert message in str(raised.value)
    assert isinstance(raised.value, InvalidArgument) and raised.value.reason == "INVALID_MATRIX"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "line 1: expected the header hosts,boxes,round_trip"),
        ("host,box,rtt\n", "line 1: expected the header"),
        ("hosts,boxes,round_trip\n", "no entries after the header"),
        ("hosts,boxes,round_trip\ndc1,dc2\n", "line 2: expected 3 cells"),
        ("hosts,boxes,round_trip\n# c\ndc1,dc2,1us\ndc1,dc3\n", "line 4: expected 3 cells"),
        ("hosts,boxes,round_trip\ndc1,dc2,fast\n", "line 2.round_trip: cannot parse duration"),
    ],
)
def test_csv_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(MatrixError, match=r"rtt\.csv: ") as raised:
        LatencyMatrix.from_csv(text, source="rtt.csv")
    assert message in str(raised.value)


def test_files_of_unknown_type_or_missing_are_errors(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match="cannot read"):
        LatencyMatrix.load(tmp_path / "missing.yaml")
    other = tmp_path / "rtt.txt"
    other.write_text("x")
    with pytest.raises(MatrixError, match=r"name it \.yaml, \.yml or \.csv"):
        LatencyMatrix.load(other)


def test_a_rack_an_explicit_topology_lacks_is_an_error() -> None:
    topology = Topology.from_dict(
        {"sites": [{"name": "dc1", "pods": [{"name": "p1", "racks": [{"name": "r1"}]}]}]}
    )
    matrix = LatencyMatrix.from_yaml(
        "round_trips: [{hosts: dc1/p1/r1, boxes: dc1/p1/r9, round_trip: 3us}]"
    )
    with pytest.raises(MatrixError, match="dc1/p1/r9: the topology does not contain this rack"):
        matrix.check_against(topology)
    matrix.check_against(Topology.default())


def test_classes_stay_racks_and_the_tier_contract_holds(model: MatrixLatencyModel) -> None:
    assert isinstance(model, TieredLatencyModel)
    assert model.host_class(host("dc1", "p1", "r1")) == model.host_class(
        Place("hosts/other", "dc1", "p1", "r1")
    )
    rng = random.Random(7)
    hosts = [random_place(rng, f"hosts/h{i}") for i in range(40)]
    boxes = [random_place(rng, f"boxes/b{i}") for i in range(40)]
    assert_tier_contract(model, hosts, boxes)
