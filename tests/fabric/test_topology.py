"""Topology: YAML parsing, latency inheritance, listing rules and error paths."""

from __future__ import annotations

from pathlib import Path

import pytest

import dxpool.fabric
from dxpool.errors import InvalidArgument
from dxpool.fabric.topology import (
    LinkLatencies,
    Location,
    SiteSpec,
    SwitchLatencies,
    Topology,
    TopologyError,
)

EXAMPLE = Path(dxpool.fabric.__file__).parent / "examples" / "topology.yaml"

LAYERED = """
proxy_ns: 700
links: {rack_ns: 250, pod_ns: 500, site_ns: 1000, inter_site_ns: 40000}
sites:
  - name: dc1
    site_ns: 1200
    rack_ns: 260
    pods:
      - name: p1
        racks:
          - {name: r1, rack_ns: 300}
          - {name: r2}
      - name: p2
        pod_ns: 450
  - name: dc2
places:
  hosts: {h1: {site: dc1, pod: p1, rack: r1}}
  boxes: {b1: {site: dc2, pod: any, rack: where}}
"""


def test_default_accepts_every_complete_location_at_default_latencies() -> None:
    topology = Topology.default()
    assert not topology.explicit
    assert topology.proxy_ns == 600
    assert topology.links == LinkLatencies(250, 500, 1000, 40_000)
    assert topology.switches(Location("x", "y", "z")) == SwitchLatencies(250, 500, 1000)


@pytest.mark.parametrize(
    "location", [Location(), Location("dc1", "p1", ""), Location("", "p", "r")]
)
def test_incomplete_location_is_not_contained(location: Location) -> None:
    assert Topology.default().switches(location) is None
    assert not Topology.default().contains(location)


def test_overrides_apply_to_their_element_and_everything_below() -> None:
    topology = Topology.from_yaml(LAYERED)
    assert topology.proxy_ns == 700
    # rack r1 overrides itself; site dc1's rack_ns reaches r2 through pod p1
    assert topology.switches(Location("dc1", "p1", "r1")) == SwitchLatencies(300, 500, 1200)
    assert topology.switches(Location("dc1", "p1", "r2")) == SwitchLatencies(260, 500, 1200)
    # p2 lists no racks: any rack, with the pod's own pod_ns and the site's rack_ns
    assert topology.switches(Location("dc1", "p2", "anything")) == SwitchLatencies(260, 450, 1200)
    # dc2 lists no pods: any pod and rack at the link defaults
    assert topology.switches(Location("dc2", "q", "r")) == SwitchLatencies(250, 500, 1000)


def test_listing_levels_reject_unlisted_children() -> None:
    topology = Topology.from_yaml(LAYERED)
    assert topology.explicit
    assert topology.switches(Location("dc3", "p1", "r1")) is None
    assert topology.switches(Location("dc1", "p9", "r1")) is None
    assert topology.switches(Location("dc1", "p1", "r9")) is None


def test_places_are_read_by_resource_id() -> None:
    topology = Topology.from_yaml(LAYERED)
    assert topology.host_place("h1") == Location("dc1", "p1", "r1")
    assert topology.box_place("b1") == Location("dc2", "any", "where")
    assert topology.host_place("b1") is None
    assert topology.box_place("h1") is None


def test_worst_case_is_the_slowest_switch_of_each_tier() -> None:
    assert Topology.from_yaml(LAYERED).worst_case() == SwitchLatencies(300, 500, 1200)
    assert Topology.default().worst_case() == SwitchLatencies(250, 500, 1000)


def test_the_example_file_loads_and_places_its_resources() -> None:
    topology = Topology.load(EXAMPLE)
    assert topology.explicit
    assert {site.name for site in topology.sites} == {"dc1", "dc2"}
    assert topology.host_place("host-2") == Location("dc1", "p1", "r2")
    assert topology.switches(Location("dc1", "p1", "r2")) == SwitchLatencies(300, 500, 1200)
    assert topology.switches(Location("dc1", "p2", "r1")) == SwitchLatencies(250, 400, 1200)


def test_constructor_validates_like_the_parser() -> None:
    with pytest.raises(TopologyError) as caught:
        Topology(sites=[SiteSpec("dc1"), SiteSpec("dc1")])
    assert caught.value.path == "sites[1].name"


@pytest.mark.parametrize(
    ("document", "path", "fragment"),
    [
        ("proxy_ns: 600\nlinkz: {}\n", "linkz", "unknown key 'linkz'"),
        ("links: {rack_ns: 1, hop_ns: 2}\n", "links.hop_ns", "expected one of"),
        ("proxy_ns: -1\n", "proxy_ns", "must not be negative"),
        ("links: {pod_ns: 2.5}\n", "links.pod_ns", "whole number of nanoseconds"),
        ("links: {site_ns: '1us'}\n", "links.site_ns", "whole number of nanoseconds"),
        ("links: {rack_ns: true}\n", "links.rack_ns", "whole number of nanoseconds"),
        (
            "sites:\n- name: a\n  pods:\n  - name: p\n  - name: q\n    rack_ns: -5\n",
            "sites[0].pods[1].rack_ns",
            "got -5",
        ),
        (
            "sites:\n- name: a\n  pods:\n  - name: p\n    racks: [{name: r, rack_ns: -1}]\n",
            "sites[0].pods[0].racks[0].rack_ns",
            "must not be negative",
        ),
        ("sites:\n- name: a\n- name: b\n- name: a\n", "sites[2].name", "duplicate site name 'a'"),
        (
            "sites:\n- name: a\n  pods: [{name: p}, {name: p}]\n",
            "sites[0].pods[1].name",
            "duplicate pod name 'p'",
        ),
        (
            "sites:\n- name: a\n  pods: [{name: p, racks: [{name: r}, {name: r}]}]\n",
            "sites[0].pods[0].racks[1].name",
            "duplicate rack name 'r'",
        ),
        ("sites:\n- site_ns: 5\n", "sites[0].name", "needs a name"),
        ("sites:\n- name: 7\n", "sites[0].name", "quote it"),
        ("sites:\n- name: a/b\n", "sites[0].name", "must not contain '/'"),
        ("sites:\n- name: a\n  podz: []\n", "sites[0].podz", "unknown key 'podz'"),
        ("sites: {name: a}\n", "sites", "expected a list"),
        ("sites:\n- dc1\n", "sites[0]", "expected a mapping"),
        (
            "sites: [{name: a}]\nplaces: {hosts: {h1: {site: b, pod: p, rack: r}}}\n",
            "places.hosts.h1.site",
            "site 'b' is not listed",
        ),
        (
            "sites: [{name: a, pods: [{name: p}]}]\n"
            "places: {boxes: {b1: {site: a, pod: q, rack: r}}}\n",
            "places.boxes.b1.pod",
            "pod 'q' is not listed in site 'a'",
        ),
        (
            "sites: [{name: a, pods: [{name: p, racks: [{name: r}]}]}]\n"
            "places: {boxes: {b1: {site: a, pod: p, rack: s}}}\n",
            "places.boxes.b1.rack",
            "rack 's' is not listed in pod a/p",
        ),
        ("places: {hosts: {h1: {site: a, pod: p}}}\n", "places.hosts.h1.rack", "missing"),
        ("places: {hosts: {h1: {site: a, pod: p, rack: r, row: 1}}}\n", "places.hosts.h1.row", ""),
        ("places: {hosts: {H_1: {site: a, pod: p, rack: r}}}\n", "places.hosts.H_1", "host id"),
        ("places: {nodes: {}}\n", "places.nodes", "expected one of: hosts, boxes"),
        ("- a\n- b\n", "", "expected a mapping"),
    ],
)
def test_errors_name_the_yaml_path(document: str, path: str, fragment: str) -> None:
    with pytest.raises(TopologyError) as caught:
        Topology.from_yaml(document)
    assert caught.value.path == path
    assert str(caught.value).startswith(f"{path or 'topology'}: ")
    assert fragment in str(caught.value)


def test_errors_are_value_errors_and_invalid_arguments() -> None:
    with pytest.raises(TopologyError) as caught:
        Topology.from_dict({"proxy_ns": -1})
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, InvalidArgument)
    assert caught.value.reason == "INVALID_TOPOLOGY"


def test_file_errors_name_the_file_and_path(tmp_path: Path) -> None:
    path = tmp_path / "topo.yaml"
    path.write_text("sites:\n- name: a\n  pods:\n  - name: p\n    pod_ns: -3\n")
    with pytest.raises(TopologyError) as caught:
        Topology.load(path)
    assert (
        str(caught.value)
        == f"{path}: sites[0].pods[0].pod_ns: latency must not be negative, got -3"
    )
    assert caught.value.source == str(path)


def test_yaml_syntax_errors_give_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("links:\n  rack_ns: 1\n  pod_ns: [\n")
    with pytest.raises(TopologyError, match=r"broken.yaml: .*invalid YAML at line \d+"):
        Topology.load(path)


def test_missing_file_and_empty_document_are_topology_errors(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read topology file"):
        Topology.load(tmp_path / "absent.yaml")
    with pytest.raises(TopologyError, match="document is empty"):
        Topology.from_yaml("# nothing here\n")
