"""The fabric topology: where hosts and boxes sit, and what each switch costs.

A topology places hosts and boxes in a three-tier tree, site / pod / rack, and gives the
one-way latency of crossing each tier's switch plus the latency of one proxy card. It is
read from YAML::

    proxy_ns: 600            # one traversal of one proxy card (host side or box side)
    links:                   # defaults for every element, overridable below
      rack_ns: 250
      pod_ns: 500
      site_ns: 1000
      inter_site_ns: 40000
    sites:                   # optional; when listed, only these sites exist
      - name: dc1
        site_ns: 1200        # a site may override site_ns, pod_ns and rack_ns
        pods:                # optional; when listed, only these pods exist in dc1
          - name: p1
            pod_ns: 450      # a pod may override pod_ns and rack_ns
            racks:           # optional; when listed, only these racks exist in p1
              - name: r1
                rack_ns: 300
    places:                  # optional placement by resource id, overriding the Location
      hosts: {h1: {site: dc1, pod: p1, rack: r1}}
      boxes: {b1: {site: dc1, pod: p1, rack: r1}}

An override applies to the element it is written on and everything below it, so a site's
``rack_ns`` is the default for every rack in that site. A level that lists no children
accepts any child name with the inherited latencies, so :meth:`Topology.default` (no sites
at all) accepts every complete location. Every problem is reported as a
:class:`TopologyError` naming the YAML path at fault, e.g. ``sites[0].pods[1].rack_ns``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from dxpool.errors import InvalidArgument
from dxpool.names import check_id

# Default one-way latencies, in ns. They are assumptions of plausible magnitude, not
# measurements of a particular fabric: give a topology (or a matrix, or let agents
# measure, see dxpool.fabric.models) for real decisions.
#
# - proxy (600): one traversal of a proxy card, which turns PCIe transactions into network
#   packets and back. Not published for DxPU's proxies (He et al., ACM TACO 20(4), 2023,
#   report end-to-end overheads, not per-hop figures), so an assumption: a PCIe switch
#   hop (Broadcom quotes 105 ns cut-through between x16 ports for its PEX88000 Gen4
#   switches, per the Linley Group, 2019), encapsulation, and a network MAC/PHY. The box's
#   own PCIe switch is counted in the box-side proxy figure.
# - rack (250), pod (500), site (1000): crossing the top-of-rack, pod aggregation and
#   site core network switches, assumed at a few hundred ns for cut-through ToR switches
#   and more for the larger chassis above them.
# - inter-site (40,000): a metro link between sites, assumed as about 8 km of fibre at
#   about 5 us per km.
DEFAULT_PROXY_NS = 600
DEFAULT_RACK_NS = 250
DEFAULT_POD_NS = 500
DEFAULT_SITE_NS = 1000
DEFAULT_INTER_SITE_NS = 40_000


class TopologyError(InvalidArgument, ValueError):
    """A topology that cannot be used. ``path`` is the YAML path at fault ("" for the
    whole document) and ``source`` the file it came from, if any."""

    def __init__(self, path: str, problem: str, *, source: str = "") -> None:
        where = path or "topology"
        prefix = f"{source}: " if source else ""
        super().__init__(f"{prefix}{where}: {problem}", reason="INVALID_TOPOLOGY")
        self.path = path
        self.source = source
        self.problem = problem


@dataclass(frozen=True)
class Location:
    """A rack's address in the tree. Complete only when all three names are set."""

    site: str = ""
    pod: str = ""
    rack: str = ""

    @property
    def complete(self) -> bool:
        return bool(self.site and self.pod and self.rack)

    def __str__(self) -> str:
        return f"{self.site}/{self.pod}/{self.rack}"


@dataclass(frozen=True)
class LinkLatencies:
    """Default one-way latency, in nanoseconds, of crossing each tier's switch."""

    rack_ns: int = DEFAULT_RACK_NS
    pod_ns: int = DEFAULT_POD_NS
    site_ns: int = DEFAULT_SITE_NS
    inter_site_ns: int = DEFAULT_INTER_SITE_NS


@dataclass(frozen=True)
class RackSpec:
    """A rack listed in the topology; ``None`` latencies inherit from its pod."""

    name: str
    rack_ns: int | None = None


@dataclass(frozen=True)
class PodSpec:
    """A pod listed in the topology; ``racks`` empty accepts any rack name."""

    name: str
    pod_ns: int | None = None
    rack_ns: int | None = None
    racks: tuple[RackSpec, ...] = ()


@dataclass(frozen=True)
class SiteSpec:
    """A site listed in the topology; ``pods`` empty accepts any pod name."""

    name: str
    site_ns: int | None = None
    pod_ns: int | None = None
    rack_ns: int | None = None
    pods: tuple[PodSpec, ...] = ()


@dataclass(frozen=True)
class SwitchLatencies:
    """One-way latencies of the rack, pod and site switches above one rack."""

    rack_ns: int
    pod_ns: int
    site_ns: int


@dataclass(frozen=True)
class _PodIndex:
    pod_ns: int
    rack_ns: int
    racks: Mapping[str, int]  # empty: any rack, at rack_ns


@dataclass(frozen=True)
class _SiteIndex:
    site_ns: int
    pod_ns: int
    rack_ns: int
    pods: Mapping[str, _PodIndex]  # empty: any pod, at pod_ns / rack_ns


class Topology:
    """A validated topology. Immutable; safe to share between threads.

    Construct with :meth:`load`, :meth:`from_yaml`, :meth:`from_dict` or :meth:`default`;
    the constructor itself validates latencies, duplicate names and places and raises
    :class:`TopologyError` naming the offending path.
    """

    def __init__(
        self,
        *,
        proxy_ns: int = DEFAULT_PROXY_NS,
        links: LinkLatencies | None = None,
        sites: Sequence[SiteSpec] = (),
        host_places: Mapping[str, Location] | None = None,
        box_places: Mapping[str, Location] | None = None,
    ) -> None:
        self.proxy_ns = proxy_ns
        self.links = links or LinkLatencies()
        self.sites = tuple(sites)
        _check_ns(proxy_ns, "proxy_ns")
        for field in ("rack_ns", "pod_ns", "site_ns", "inter_site_ns"):
            _check_ns(getattr(self.links, field), f"links.{field}")
        self._sites = self._index_sites()
        self.host_places: Mapping[str, Location] = MappingProxyType(dict(host_places or {}))
        self.box_places: Mapping[str, Location] = MappingProxyType(dict(box_places or {}))
        self._check_places("hosts", self.host_places)
        self._check_places("boxes", self.box_places)
        self._worst = self._worst_case()

    # construction -------------------------------------------------------------------

    @classmethod
    def default(cls) -> Topology:
        """Default latencies, no listed sites: every complete location is accepted."""
        return cls()

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        """Read a YAML topology file; errors name the file and the YAML path."""
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise TopologyError(
                "", f"cannot read topology file: {error.strerror}", source=source
            ) from None
        return cls.from_yaml(text, source=source)

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "") -> Topology:
        """Parse a YAML document (``yaml.safe_load``); an empty document is an error."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(error, "problem", None) or str(error)
            raise TopologyError("", f"invalid YAML{at}: {problem}", source=source) from None
        if data is None:
            raise TopologyError("", "the document is empty; expected a mapping", source=source)
        try:
            return cls.from_dict(data)
        except TopologyError as error:
            if not source:
                raise
            raise TopologyError(error.path, error.problem, source=source) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """Build from the parsed YAML mapping (see the module docstring for the schema)."""
        root = _Node(data, "")
        # ``latency`` chooses the latency model (read by dxpool.fabric.models)
        root.only_keys("proxy_ns", "links", "sites", "places", "latency")
        links_node = root.child_mapping("links")
        links = LinkLatencies()
        if links_node is not None:
            links_node.only_keys("rack_ns", "pod_ns", "site_ns", "inter_site_ns")
            links = LinkLatencies(
                rack_ns=links_node.ns("rack_ns", DEFAULT_RACK_NS),
                pod_ns=links_node.ns("pod_ns", DEFAULT_POD_NS),
                site_ns=links_node.ns("site_ns", DEFAULT_SITE_NS),
                inter_site_ns=links_node.ns("inter_site_ns", DEFAULT_INTER_SITE_NS),
            )
        sites = tuple(_parse_site(node) for node in root.child_list("sites"))
        host_places: dict[str, Location] = {}
        box_places: dict[str, Location] = {}
        places = root.child_mapping("places")
        if places is not None:
            places.only_keys("hosts", "boxes")
            host_places = _parse_places(places.child_mapping("hosts"), "host")
            box_places = _parse_places(places.child_mapping("boxes"), "box")
        return cls(
            proxy_ns=root.ns("proxy_ns", DEFAULT_PROXY_NS),
            links=links,
            sites=sites,
            host_places=host_places,
            box_places=box_places,
        )

    # queries ------------------------------------------------------------------------

    @property
    def explicit(self) -> bool:
        """True when the topology lists its sites (and so rejects unlisted ones)."""
        return bool(self._sites)

    def contains(self, location: Location) -> bool:
        """True when ``location`` is complete and the topology accepts it."""
        return self.switches(location) is not None

    def switches(self, location: Location) -> SwitchLatencies | None:
        """The switch latencies above ``location``'s rack, or None when the location is
        incomplete or names a site, pod or rack that a listing level does not contain."""
        if not location.complete:
            return None
        links = self.links
        if not self._sites:
            return SwitchLatencies(links.rack_ns, links.pod_ns, links.site_ns)
        site = self._sites.get(location.site)
        if site is None:
            return None
        if not site.pods:
            return SwitchLatencies(site.rack_ns, site.pod_ns, site.site_ns)
        pod = site.pods.get(location.pod)
        if pod is None:
            return None
        if not pod.racks:
            return SwitchLatencies(pod.rack_ns, pod.pod_ns, site.site_ns)
        rack_ns = pod.racks.get(location.rack)
        if rack_ns is None:
            return None
        return SwitchLatencies(rack_ns, pod.pod_ns, site.site_ns)

    def host_place(self, host_id: str) -> Location | None:
        """The explicit place of a host (by id, e.g. ``h1``), if ``places`` names it."""
        return self.host_places.get(host_id)

    def box_place(self, box_id: str) -> Location | None:
        """The explicit place of a box (by id, e.g. ``b1``), if ``places`` names it."""
        return self.box_places.get(box_id)

    def worst_case(self) -> SwitchLatencies:
        """The slowest rack, pod and site switch anywhere in the topology (defaults
        included): what an endpoint of unknown place is assumed to sit behind."""
        return self._worst

    # validation and indexing ----------------------------------------------------------

    def _index_sites(self) -> dict[str, _SiteIndex]:
        links = self.links
        index: dict[str, _SiteIndex] = {}
        for i, site in enumerate(self.sites):
            at = f"sites[{i}]"
            _check_name(site.name, f"{at}.name")
            if site.name in index:
                raise TopologyError(f"{at}.name", f"duplicate site name {site.name!r}")
            site_ns = _inherit(site.site_ns, links.site_ns, f"{at}.site_ns")
            pod_ns = _inherit(site.pod_ns, links.pod_ns, f"{at}.pod_ns")
            rack_ns = _inherit(site.rack_ns, links.rack_ns, f"{at}.rack_ns")
            pods: dict[str, _PodIndex] = {}
            for j, pod in enumerate(site.pods):
                pod_at = f"{at}.pods[{j}]"
                _check_name(pod.name, f"{pod_at}.name")
                if pod.name in pods:
                    raise TopologyError(
                        f"{pod_at}.name", f"duplicate pod name {pod.name!r} in site {site.name!r}"
                    )
                pods[pod.name] = self._index_pod(pod, pod_at, pod_ns, rack_ns)
            index[site.name] = _SiteIndex(site_ns, pod_ns, rack_ns, MappingProxyType(pods))
        return index

    @staticmethod
    def _index_pod(pod: PodSpec, at: str, pod_ns: int, rack_ns: int) -> _PodIndex:
        own_pod_ns = _inherit(pod.pod_ns, pod_ns, f"{at}.pod_ns")
        own_rack_ns = _inherit(pod.rack_ns, rack_ns, f"{at}.rack_ns")
        racks: dict[str, int] = {}
        for k, rack in enumerate(pod.racks):
            rack_at = f"{at}.racks[{k}]"
            _check_name(rack.name, f"{rack_at}.name")
            if rack.name in racks:
                raise TopologyError(
                    f"{rack_at}.name", f"duplicate rack name {rack.name!r} in pod {pod.name!r}"
                )
            racks[rack.name] = _inherit(rack.rack_ns, own_rack_ns, f"{rack_at}.rack_ns")
        return _PodIndex(own_pod_ns, own_rack_ns, MappingProxyType(racks))

    def _check_places(self, kind: str, places: Mapping[str, Location]) -> None:
        singular = "host" if kind == "hosts" else "box"
        for resource_id, location in places.items():
            at = f"places.{kind}.{resource_id}"
            try:
                check_id(resource_id, singular)
            except InvalidArgument as error:
                raise TopologyError(at, error.message) from None
            for field in ("site", "pod", "rack"):
                if not getattr(location, field):
                    raise TopologyError(
                        f"{at}.{field}", "missing; a place needs site, pod and rack"
                    )
            self._check_listed(location, at)

    def _check_listed(self, location: Location, at: str) -> None:
        if not self._sites:
            return
        site = self._sites.get(location.site)
        if site is None:
            raise TopologyError(
                f"{at}.site", f"site {location.site!r} is not listed; {_listed(self._sites)}"
            )
        if not site.pods:
            return
        pod = site.pods.get(location.pod)
        if pod is None:
            raise TopologyError(
                f"{at}.pod",
                f"pod {location.pod!r} is not listed in site {location.site!r}; "
                f"{_listed(site.pods)}",
            )
        if pod.racks and location.rack not in pod.racks:
            raise TopologyError(
                f"{at}.rack",
                f"rack {location.rack!r} is not listed in pod {location.site}/{location.pod}; "
                f"{_listed(pod.racks)}",
            )

    def _worst_case(self) -> SwitchLatencies:
        racks = [self.links.rack_ns]
        pods = [self.links.pod_ns]
        sites = [self.links.site_ns]
        for site in self._sites.values():
            sites.append(site.site_ns)
            pods.append(site.pod_ns)
            racks.append(site.rack_ns)
            for pod in site.pods.values():
                pods.append(pod.pod_ns)
                racks.append(pod.rack_ns)
                racks.extend(pod.racks.values())
        return SwitchLatencies(max(racks), max(pods), max(sites))


def _listed(names: Iterable[str]) -> str:
    shown = sorted(names)
    return "listed: " + ", ".join(repr(name) for name in shown)


def _check_ns(value: int, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(path, f"expected a whole number of nanoseconds, got {value!r}")
    if value < 0:
        raise TopologyError(path, f"latency must not be negative, got {value}")
    return value


def _inherit(own: int | None, inherited: int, path: str) -> int:
    return inherited if own is None else _check_ns(own, path)


def _check_name(name: str, path: str) -> None:
    if not isinstance(name, str) or not name:
        raise TopologyError(path, f"expected a non-empty name, got {name!r}")
    if "/" in name or name != name.strip():
        raise TopologyError(path, f"name {name!r} must not contain '/' or surrounding spaces")


class _Node:
    """One mapping of the parsed YAML, with the path that leads to it."""

    def __init__(self, value: object, path: str) -> None:
        if not isinstance(value, Mapping):
            raise TopologyError(path, f"expected a mapping, got {_kind(value)}")
        self.value: Mapping[Any, Any] = value
        self.path = path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def only_keys(self, *allowed: str) -> None:
        for key in self.value:
            if key not in allowed:
                raise TopologyError(
                    self.at(str(key)), f"unknown key {key!r}; expected one of: {', '.join(allowed)}"
                )

    def ns(self, key: str, default: int) -> int:
        return _check_ns(self.value.get(key, default), self.at(key))

    def optional_ns(self, key: str) -> int | None:
        value = self.value.get(key)
        return None if value is None else _check_ns(value, self.at(key))

    def name(self) -> str:
        if "name" not in self.value:
            raise TopologyError(self.at("name"), "missing; every site, pod and rack needs a name")
        name = self.value["name"]
        if not isinstance(name, str):
            raise TopologyError(self.at("name"), f"expected a string (quote it), got {name!r}")
        _check_name(name, self.at("name"))
        return name

    def text(self, key: str) -> str:
        value = self.value.get(key, "")
        if not isinstance(value, str):
            raise TopologyError(self.at(key), f"expected a string (quote it), got {value!r}")
        return value

    def child_mapping(self, key: str) -> _Node | None:
        value = self.value.get(key)
        return None if value is None else _Node(value, self.at(key))

    def child_list(self, key: str) -> list[_Node]:
        value = self.value.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise TopologyError(self.at(key), f"expected a list, got {_kind(value)}")
        return [_Node(item, f"{self.at(key)}[{i}]") for i, item in enumerate(value)]


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"


def _parse_site(node: _Node) -> SiteSpec:
    node.only_keys("name", "site_ns", "pod_ns", "rack_ns", "pods")
    return SiteSpec(
        name=node.name(),
        site_ns=node.optional_ns("site_ns"),
        pod_ns=node.optional_ns("pod_ns"),
        rack_ns=node.optional_ns("rack_ns"),
        pods=tuple(_parse_pod(child) for child in node.child_list("pods")),
    )


def _parse_pod(node: _Node) -> PodSpec:
    node.only_keys("name", "pod_ns", "rack_ns", "racks")
    return PodSpec(
        name=node.name(),
        pod_ns=node.optional_ns("pod_ns"),
        rack_ns=node.optional_ns("rack_ns"),
        racks=tuple(_parse_rack(child) for child in node.child_list("racks")),
    )


def _parse_rack(node: _Node) -> RackSpec:
    node.only_keys("name", "rack_ns")
    return RackSpec(name=node.name(), rack_ns=node.optional_ns("rack_ns"))


def _parse_places(node: _Node | None, kind: str) -> dict[str, Location]:
    if node is None:
        return {}
    places: dict[str, Location] = {}
    for key in node.value:
        if not isinstance(key, str):
            raise TopologyError(node.at(str(key)), f"expected a {kind} id, got {key!r}")
        entry = _Node(node.value[key], node.at(key))
        entry.only_keys("site", "pod", "rack")
        places[key] = Location(entry.text("site"), entry.text("pod"), entry.text("rack"))
    return places
