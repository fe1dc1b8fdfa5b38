"""Fabric latency models: how long a PCIe transaction takes between a host and a box.

A transaction leaves the host through its host-side proxy card, crosses the switches on
the tree path between the host's rack and the box's rack, and enters the box through its
box-side proxy card; the answer comes back the same way. So::

    round trip = 2 x (host proxy + box proxy + every switch crossed)

and the switches crossed are, by how far apart the two racks are:

=================  =======================================================
same rack          rack
same pod           rack(host), pod, rack(box)
same site          rack(host), pod(host), site, pod(box), rack(box)
other site         rack, pod, site (host side), inter-site, site, pod, rack (box side)
=================  =======================================================

An endpoint whose place is unknown (an empty or incomplete location, or one an explicit
topology does not contain) is assumed to be in another site behind the slowest switches of
the topology: the estimate is an upper bound, and its path says ``unplaced:{name}``.

The round trip depends only on the racks the two endpoints resolve to, so the model is
also a :class:`TieredLatencyModel`: placement asks it once per rack of hosts for every
rack of boxes, ranked nearest first, instead of once per (host, box) pair.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dxpool.fabric.topology import Location, SwitchLatencies, Topology

if TYPE_CHECKING:
    from dxpool.api.v1 import resources_pb2

DEFAULT_CACHE_SIZE = 1 << 16
INTER_SITE_HOP = "inter-site"


@dataclass(frozen=True)
class Place:
    """Where an endpoint sits. ``name`` is its resource name (``hosts/h1``, ``boxes/b1``);
    empty site, pod or rack mean "unknown".

    Places key the latency caches on every placement, so the hash is computed once, at
    construction.
    """

    name: str
    site: str = ""
    pod: str = ""
    rack: str = ""
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.name, self.site, self.pod, self.rack)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Place], tuple[str, str, str, str]]:
        # string hashes differ between processes: a copy hashes its fields anew
        return Place, (self.name, self.site, self.pod, self.rack)

    @classmethod
    def of(cls, record: resources_pb2.Host | resources_pb2.Box) -> Place:
        """The place of a stored Host or Box record, from its name and Location."""
        location = record.location
        return cls(record.name, location.site, location.pod, location.rack)


@dataclass(frozen=True)
class LatencyEstimate:
    """A host-to-box round trip and the hops it crosses, nearest the host first, e.g.
    ``("proxy:hosts/h1", "rack:dc1/p1/r1", "proxy:boxes/b1")``."""

    round_trip_ns: int
    path: tuple[str, ...]

    @property
    def one_way_ns(self) -> int:
        return self.round_trip_ns // 2


@runtime_checkable
class LatencyModel(Protocol):
    """Estimates host-to-box latency. Implementations must be pure (the same places give
    the same estimate) and cheap: placement calls them for every (host, box) pair."""

    def round_trip(self, host: Place, box: Place) -> LatencyEstimate: ...


Tiers = tuple[tuple[int, tuple[int, ...]], ...]
"""Box classes grouped by their round trip from one host class, nearest tier first:
``((round_trip_ns, (box class, ...)), ...)``, classes ascending inside a tier."""


@runtime_checkable
class TieredLatencyModel(LatencyModel, Protocol):
    """A latency model that can rank every box for a host at once (optional capability).

    Its round trips depend only on a coarse *class* of each endpoint (for the tree model,
    the rack the endpoint resolves to), so placement ranks the boxes once per class of
    host instead of asking for every (host, box) pair. The contract, for any two places:
    ``box_class(box)`` is in exactly one tier of ``ranking(host_class(host))``, and that
    tier's round trip equals ``round_trip(host, box).round_trip_ns``. Class numbers are
    the model's own and mean nothing to another model. None of the three methods raises.
    """

    def host_class(self, host: Place) -> int:
        """The class of a host's place."""
        ...

    def box_class(self, box: Place) -> int:
        """The class of a box's place."""
        ...

    def ranking(self, host_class: int) -> Tiers:
        """Every class numbered so far, grouped by round trip from ``host_class``.

        A class returned by :meth:`host_class` or :meth:`box_class` before this call is
        in the answer; classes of places the model has not seen yet may be missing.
        """
        ...

    def class_round_trip_ns(self, host_class: int, box_class: int) -> int:
        """The round trip between any host of ``host_class`` and any box of
        ``box_class`` (both numbered by this model already): the round trip of the
        tier of ``ranking(host_class)`` that holds ``box_class``, without ranking."""
        ...


@runtime_checkable
class LatencySource(Protocol):
    """Where placement gets the latency model to use now.

    A model must be pure, but measurements change: a source hands out immutable models,
    a new one whenever what it knows changes, and the same object while nothing did (so
    what placement derived from a model stays valid exactly as long as the model).
    ``name`` says which kind of model it is (``topology``, ``matrix``, ``measured``).
    """

    name: str

    def current(self) -> LatencyModel:
        """The model to use for the next placement. Never raises."""
        ...


class StaticLatency:
    """A source whose model never changes (the topology and matrix models)."""

    def __init__(self, model: LatencyModel, name: str = "topology") -> None:
        self.model = model
        self.name = name

    def current(self) -> LatencyModel:
        return self.model


def as_source(latency: LatencyModel | LatencySource) -> LatencySource:
    """``latency`` itself when it is a source, else a static source of the model."""
    if isinstance(latency, LatencySource):
        return latency
    return StaticLatency(latency)


@dataclass(frozen=True)
class ResolvedPlace:
    """One endpoint resolved against the topology; ``switches`` None when unplaced."""

    location: Location
    switches: SwitchLatencies | None


_NOWHERE = Place("")  # stands in for an endpoint whose name does not matter
_UNPLACED = ResolvedPlace(Location(), None)


class _ClassGroups:
    """A set of classes (racks) grouped as :meth:`TopologyLatencyModel._grouped_ns` reads
    them: the placed ones by pod, and by what the way down from their site switch costs;
    every class by what the way up to its site switch costs (the worst case when
    unplaced)."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], list[tuple[int, str, int]]] = {}
        self.site_up: dict[int, list[int]] = {}  # every class by its way up to the site
        self.sites: dict[str, dict[int, list[int]]] = {}  # placed classes by site, way up
        self.downs: dict[str, dict[int, list[int]]] = {}  # by site, pod + rack way down
        self._away_site: dict[str, dict[int, list[int]]] = {}
        self._away_pod: dict[tuple[str, str], dict[int, list[int]]] = {}

    @staticmethod
    def of(sides: Sequence[ResolvedPlace], worst: SwitchLatencies) -> _ClassGroups:
        groups = _ClassGroups()
        for number, side in enumerate(sides):
            up = side.switches or worst
            total = up.rack_ns + up.pod_ns + up.site_ns
            groups.site_up.setdefault(total, []).append(number)
            switches = side.switches
            if switches is None:
                continue
            loc = side.location
            groups.sites.setdefault(loc.site, {}).setdefault(total, []).append(number)
            down = switches.pod_ns + switches.rack_ns
            groups.downs.setdefault(loc.site, {}).setdefault(down, []).append(number)
            groups.pods.setdefault((loc.site, loc.pod), []).append(
                (number, loc.rack, switches.rack_ns)
            )
        return groups

    def away_from_site(self, site: str) -> dict[int, list[int]]:
        """Classes not placed in ``site`` (unplaced ones included), by way up."""
        found = self._away_site.get(site)
        if found is None:
            inside = {n for numbers in self.sites.get(site, {}).values() for n in numbers}
            found = {}
            for up, numbers in self.site_up.items():
                rest = [n for n in numbers if n not in inside]
                if rest:
                    found[up] = rest
            self._away_site[site] = found
        return found

    def away_from_pod(self, site: str, pod: str) -> dict[int, list[int]]:
        """Classes placed in ``site`` but not in its ``pod``, by way down."""
        found = self._away_pod.get((site, pod))
        if found is None:
            inside = {n for n, _, _ in self.pods.get((site, pod), ())}
            found = {}
            for down, numbers in self.downs.get(site, {}).items():
                rest = [n for n in numbers if n not in inside]
                if rest:
                    found[down] = rest
            self._away_pod[(site, pod)] = found
        return found


class TopologyLatencyModel:
    """The tree model of the module docstring, driven by a :class:`Topology`.

    A host or box named in the topology's ``places`` sits there whatever its Place says.
    Estimates are cached per (host place, box place); the model is immutable, so the cache
    never goes stale. Build a new model when the topology changes.

    It is also a :class:`TieredLatencyModel`: an endpoint's class is the rack it resolves
    to (every unplaced endpoint shares one class), and rankings are cached per host class.
    Safe to share between threads.
    """

    def __init__(self, topology: Topology, *, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._topology = topology
        self._proxy_ns = topology.proxy_ns
        self._inter_site_ns = topology.links.inter_site_ns
        self._worst = topology.worst_case()
        self._cached = functools.lru_cache(maxsize=cache_size)(self._estimate)
        self._host_classes = functools.lru_cache(maxsize=cache_size)(self._classify_host)
        self._box_classes = functools.lru_cache(maxsize=cache_size)(self._classify_box)
        self._class_lock = threading.Lock()
        self._class_numbers: dict[Location | None, int] = {}
        self._class_sides: list[ResolvedPlace] = []
        # host class -> (how many classes there were, the ranking of all of them)
        self._rankings: dict[int, tuple[int, Tiers]] = {}
        # equal tiers of rankings made for the same classes, as one tuple: racks of one
        # pod see the rest of the site as one tier, and a caller may keep what it learned
        # of a tier by the tuple's identity (placement follows its least box once)
        self._interned: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._interned_at = 0
        # the classes grouped for rankings made without asking every pair (see _grouped)
        self._groups: tuple[int, _ClassGroups] | None = None

    @property
    def topology(self) -> Topology:
        return self._topology

    def round_trip(self, host: Place, box: Place) -> LatencyEstimate:
        """The round trip of one PCIe transaction between ``host`` and ``box``."""
        return self._cached(host, box)

    def host_class(self, host: Place) -> int:
        """The class of the rack ``host`` resolves to (one class for every unplaced one)."""
        return self._host_classes(host)

    def box_class(self, box: Place) -> int:
        """The class of the rack ``box`` resolves to (one class for every unplaced one)."""
        return self._box_classes(box)

    def ranking(self, host_class: int) -> Tiers:
        """Every class numbered so far, grouped by round trip from ``host_class``."""
        known = len(self._class_sides)
        cached = self._rankings.get(host_class)
        if cached is not None and cached[0] == known:
            return cached[1]
        host_side = self._class_sides[host_class]
        by_ns: dict[int, list[int]] = {}
        if type(self)._override is TopologyLatencyModel._override:
            self._grouped_ns(host_side, known, by_ns)
        else:  # an override may single out any pair of racks: ask each
            for box_class, box_side in enumerate(self._class_sides[:known]):
                by_ns.setdefault(self._sides_ns(host_side, box_side), []).append(box_class)
        if self._interned_at != known:
            self._interned, self._interned_at = {}, known
        interned = self._interned
        listed: list[tuple[int, tuple[int, ...]]] = []
        for ns in sorted(by_ns):
            numbers = tuple(sorted(by_ns[ns]))
            listed.append((ns, interned.setdefault(numbers, numbers)))
        tiers = tuple(listed)
        self._rankings[host_class] = (known, tiers)
        return tiers

    def class_round_trip_ns(self, host_class: int, box_class: int) -> int:
        """The round trip between any host of ``host_class`` and any box of ``box_class``
        (what :meth:`ranking` files ``box_class`` under), from the classes' racks alone."""
        sides = self._class_sides
        return self._sides_ns(sides[host_class], sides[box_class])

    def _grouped_ns(
        self, host_side: ResolvedPlace, known: int, by_ns: dict[int, list[int]]
    ) -> None:
        """Adds every class below ``known`` to ``by_ns`` under its round trip from
        ``host_side``, as :meth:`_sides_ns` gives it, without asking each pair: with no
        override the tree's round trip from a rack depends on a class only through its
        site and pod (and, in the host's pod, its rack), and the classes are grouped
        by those once per set of classes."""
        groups = self._groups
        if groups is None or groups[0] != known:
            groups = (known, _ClassGroups.of(self._class_sides[:known], self._worst))
            self._groups = groups
        grouped = groups[1]
        proxies = 2 * self._proxy_ns
        h, hs = host_side.location, host_side.switches
        if hs is None:
            site_up = self._site_ns(None) + self._inter_site_ns
            for up, classes in grouped.site_up.items():
                by_ns.setdefault(2 * (proxies + site_up + up), []).extend(classes)
            return
        site_up = self._site_ns(hs) + self._inter_site_ns
        for up, classes in grouped.away_from_site(h.site).items():
            by_ns.setdefault(2 * (proxies + site_up + up), []).extend(classes)
        pod_up = hs.rack_ns + hs.pod_ns + hs.site_ns
        for down, classes in grouped.away_from_pod(h.site, h.pod).items():
            by_ns.setdefault(2 * (proxies + pod_up + down), []).extend(classes)
        for number, rack, rack_ns in grouped.pods.get((h.site, h.pod), ()):
            if rack == h.rack:
                ns = 2 * (proxies + hs.rack_ns)
            else:
                ns = 2 * (proxies + hs.rack_ns + hs.pod_ns + rack_ns)
            by_ns.setdefault(ns, []).append(number)

    def _estimate(self, host: Place, box: Place) -> LatencyEstimate:
        host_side = self._resolve(host, "hosts/", self._topology.host_place)
        box_side = self._resolve(box, "boxes/", self._topology.box_place)
        override = self._override(host_side, box_side)
        if override is not None:
            round_trip, hop = override
            return LatencyEstimate(round_trip, (f"proxy:{host.name}", hop, f"proxy:{box.name}"))
        hops, switch_ns = self._switch_path(host, host_side, box, box_side)
        one_way = 2 * self._proxy_ns + switch_ns
        path = (f"proxy:{host.name}", *hops, f"proxy:{box.name}")
        return LatencyEstimate(round_trip_ns=2 * one_way, path=path)

    def _sides_ns(self, host_side: ResolvedPlace, box_side: ResolvedPlace) -> int:
        """The round trip between two resolved endpoints (what :meth:`_estimate` gives),
        without naming the hops: rankings ask this for every pair of classes."""
        override = self._override(host_side, box_side)
        if override is not None:
            return override[0]
        return 2 * (2 * self._proxy_ns + self._switch_ns(host_side, box_side))

    def _switch_ns(self, host_side: ResolvedPlace, box_side: ResolvedPlace) -> int:
        """The switch latency of :meth:`_switch_path`, computed the same way."""
        h, b = host_side.location, box_side.location
        hs, bs = host_side.switches, box_side.switches
        if hs is not None and bs is not None and h.site == b.site:
            if h.pod == b.pod:
                if h.rack == b.rack:
                    return hs.rack_ns
                return hs.rack_ns + hs.pod_ns + bs.rack_ns
            return hs.rack_ns + hs.pod_ns + hs.site_ns + bs.pod_ns + bs.rack_ns
        return self._site_ns(hs) + self._inter_site_ns + self._site_ns(bs)

    def _site_ns(self, switches: SwitchLatencies | None) -> int:
        """One way from a rack up to its site switch (the worst case when unplaced)."""
        up = switches if switches is not None else self._worst
        return up.rack_ns + up.pod_ns + up.site_ns

    def _override(
        self, host_side: ResolvedPlace, box_side: ResolvedPlace
    ) -> tuple[int, str] | None:
        """A whole round trip (proxies included) that replaces the tree's for a pair of
        resolved endpoints, and the hop that names where it came from; None keeps the
        tree's. The tree model has none; models built on it (an operator's matrix,
        measurements) override pairs of racks. It must depend only on the two sides'
        locations (and whether they are placed), so classes stay racks."""
        return None

    def _classify_host(self, host: Place) -> int:
        return self._number(self._resolve(host, "hosts/", self._topology.host_place))

    def _classify_box(self, box: Place) -> int:
        return self._number(self._resolve(box, "boxes/", self._topology.box_place))

    def _number(self, side: ResolvedPlace) -> int:
        """The class of a resolved endpoint, numbered on first sight."""
        key = side.location if side.switches is not None else None
        number = self._class_numbers.get(key)
        if number is not None:
            return number
        with self._class_lock:
            number = self._class_numbers.get(key)
            if number is None:
                number = len(self._class_sides)
                self._class_sides.append(side if key is not None else _UNPLACED)
                self._class_numbers[key] = number
            return number

    def _resolve(self, place: Place, prefix: str, explicit: _PlaceLookup) -> ResolvedPlace:
        resource_id = place.name.removeprefix(prefix)
        location = explicit(resource_id) or Location(place.site, place.pod, place.rack)
        return ResolvedPlace(location, self._topology.switches(location))

    def _switch_path(
        self, host: Place, host_side: ResolvedPlace, box: Place, box_side: ResolvedPlace
    ) -> tuple[list[str], int]:
        h, b = host_side.location, box_side.location
        hs, bs = host_side.switches, box_side.switches
        if hs is not None and bs is not None and h.site == b.site:
            if h.pod == b.pod:
                if h.rack == b.rack:
                    return [_rack_hop(h)], hs.rack_ns
                hops = [_rack_hop(h), _pod_hop(h), _rack_hop(b)]
                return hops, hs.rack_ns + hs.pod_ns + bs.rack_ns
            hops = [_rack_hop(h), _pod_hop(h), f"site:{h.site}", _pod_hop(b), _rack_hop(b)]
            return hops, hs.rack_ns + hs.pod_ns + hs.site_ns + bs.pod_ns + bs.rack_ns
        host_hops, host_ns = self._up_to_site(host, host_side)
        box_hops, box_ns = self._up_to_site(box, box_side)
        hops = [*host_hops, INTER_SITE_HOP, *reversed(box_hops)]
        return hops, host_ns + self._inter_site_ns + box_ns

    def _up_to_site(self, place: Place, side: ResolvedPlace) -> tuple[list[str], int]:
        """Hops from a rack up to its site switch, nearest the rack first."""
        switches = side.switches
        if switches is None:
            worst = self._worst
            return [f"unplaced:{place.name}"], worst.rack_ns + worst.pod_ns + worst.site_ns
        loc = side.location
        hops = [_rack_hop(loc), _pod_hop(loc), f"site:{loc.site}"]
        return hops, switches.rack_ns + switches.pod_ns + switches.site_ns


class _PlaceLookup(Protocol):
    def __call__(self, resource_id: str, /) -> Location | None: ...


def _rack_hop(location: Location) -> str:
    return f"rack:{location.site}/{location.pod}/{location.rack}"


def _pod_hop(location: Location) -> str:
    return f"pod:{location.site}/{location.pod}"
