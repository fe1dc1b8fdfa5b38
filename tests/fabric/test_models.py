"""Choosing a deployment's latency model from the topology YAML and broker flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from dxpool.errors import InvalidArgument
from dxpool.fabric.latency import Place, StaticLatency, TopologyLatencyModel
from dxpool.fabric.matrix import MatrixError, MatrixLatencyModel
from dxpool.fabric.measured import MeasuredLatency
from dxpool.fabric.models import LatencySettings, build_latency_source
from dxpool.fabric.topology import Topology, TopologyError


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_default_is_the_topology_model() -> None:
    source = build_latency_source(Topology.default(), LatencySettings())
    assert isinstance(source, StaticLatency) and source.name == "topology"
    assert type(source.current()) is TopologyLatencyModel


def test_the_topology_yaml_chooses_a_matrix_relative_to_itself(tmp_path: Path) -> None:
    write(tmp_path / "rtt.csv", "hosts,boxes,round_trip\ns1/p1/r1,s1/p1/r2,3us\n")
    topology_path = write(
        tmp_path / "topology.yaml", "latency:\n  model: matrix\n  matrix: rtt.csv\n"
    )
    topology = Topology.load(topology_path)
    settings = LatencySettings.from_topology_file(topology_path)
    assert settings == LatencySettings("matrix", tmp_path / "rtt.csv")
    source = build_latency_source(topology, settings)
    assert source.name == "matrix" and isinstance(source.current(), MatrixLatencyModel)
    estimate = source.current().round_trip(
        Place("hosts/h", "s1", "p1", "r1"), Place("boxes/b", "s1", "p1", "r2")
    )
    assert estimate.round_trip_ns == 3_000


def test_flags_win_over_the_yaml(tmp_path: Path) -> None:
    topology_path = write(tmp_path / "t.yaml", "latency: {model: measured, staleness: 2m}\n")
    settings = LatencySettings.from_topology_file(topology_path)
    assert settings == LatencySettings("measured", None, 120.0)
    assert settings.overridden(model="topology").model == "topology"
    matrix = tmp_path / "m.yaml"
    assert settings.overridden(matrix_path=matrix) == LatencySettings("matrix", matrix, 120.0)
    assert settings.overridden(staleness_s=5.0).staleness_s == 5.0


def test_the_measured_model_needs_place_lookups() -> None:
    settings = LatencySettings("measured")
    with pytest.raises(InvalidArgument, match="host and box lookups"):
        build_latency_source(Topology.default(), settings)
    source = build_latency_source(
        Topology.default(), settings, host_place=lambda _: None, box_place=lambda _: None
    )
    assert isinstance(source, MeasuredLatency) and source.staleness_s == 300.0


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("latency: 3", "latency: expected a mapping"),
        ("latency: {model: psychic}", "unknown latency model 'psychic'"),
        ("latency: {model: matrix}", "needs a matrix file"),
        ("latency: {modle: matrix}", "latency.modle: unknown key"),
        ("latency: {staleness: soon}", "latency.staleness: cannot parse duration"),
        ("latency: {staleness: 0s}", "must be a positive duration"),
    ],
)
def test_bad_latency_sections_are_topology_errors(
    tmp_path: Path, section: str, message: str
) -> None:
    path = write(tmp_path / "t.yaml", section + "\n")
    with pytest.raises(TopologyError) as raised:
        LatencySettings.from_topology_file(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert message in str(raised.value)


def test_a_bad_matrix_fails_the_build_with_its_file_and_entry(tmp_path: Path) -> None:
    matrix = write(tmp_path / "m.yaml", "round_trips: [{hosts: a, boxes: b, round_trip: -1}]\n")
    with pytest.raises(MatrixError, match=r"m\.yaml: round_trips\[0\]\.round_trip"):
        build_latency_source(Topology.default(), LatencySettings("matrix", matrix))
