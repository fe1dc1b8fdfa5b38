"""An operator-supplied latency matrix: measured or contracted round trips per location pair.

Where the tree model's per-switch figures are too coarse (an old pod behind a slow
aggregation layer, a metro link whose real round trip is known), operators write down
the round trips themselves, per pair of racks, pods or sites. YAML::

    fallback: topology        # pairs not listed: the topology model (default), or a
                              # duration such as 100us for every pair not listed
    symmetric: true           # default: an entry also covers hosts of `boxes` to boxes
                              # of `hosts` (unless that direction is listed too)
    round_trips:
      - {hosts: dc1/p1/r1, boxes: dc1/p1/r2, round_trip: 3.1us}   # rack pair
      - {hosts: dc1/p1, boxes: dc1/p2, round_trip: 6us}           # pod pair
      - {hosts: dc1, boxes: dc2, round_trip: 85us}                # site pair

or CSV, one entry a line, with a header (fallback and symmetry then come from the
caller, by default the topology model and symmetric)::

    hosts,boxes,round_trip
    dc1/p1/r1,dc1/p1/r2,3.1us

A round trip is the whole host-to-box PCIe round trip, proxies included (what a probe
from the host measures), as whole nanoseconds or a duration (``ns``, ``us``, ``ms``).
The most specific entry wins: a rack pair over a rack-pod pair over a pod pair, and so
on down to a site pair. Endpoints resolve to racks through the topology exactly as in
the tree model (explicit ``places`` first, then the record's Location); an unplaced
endpoint matches no entry and gets the fallback.

Every problem is a :class:`MatrixError` naming the file, the entry (``round_trips[2].hosts``
or ``line 4``) and what to write instead.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dxpool.errors import InvalidArgument
from dxpool.fabric.latency import DEFAULT_CACHE_SIZE, ResolvedPlace, TopologyLatencyModel
from dxpool.fabric.topology import Location, Topology
from dxpool.limits import MAX_LATENCY_NS
from dxpool.request import parse_duration_ns

Prefix = tuple[str, ...]  # ("dc1",), ("dc1", "p1") or ("dc1", "p1", "r1")

FALLBACK_TOPOLOGY = "topology"
CSV_HEADER = ("hosts", "boxes", "round_trip")
# Most specific first: (host depth, box depth).
_DEPTHS = ((3, 3), (3, 2), (2, 3), (2, 2), (3, 1), (1, 3), (2, 1), (1, 2), (1, 1))


class MatrixError(InvalidArgument, ValueError):
    """A latency matrix that cannot be used; the message names the file and entry."""

    def __init__(self, where: str, problem: str, *, source: str = "") -> None:
        prefix = f"{source}: " if source else ""
        super().__init__(f"{prefix}{where or 'latency matrix'}: {problem}", reason="INVALID_MATRIX")
        self.where = where
        self.problem = problem


class LatencyMatrix:
    """Validated round trips per (host location prefix, box location prefix), in ns.

    ``fallback_ns`` None means "ask the topology model" for pairs not listed.
    """

    def __init__(
        self,
        entries: Mapping[tuple[Prefix, Prefix], int],
        *,
        fallback_ns: int | None = None,
    ) -> None:
        self.entries = dict(entries)
        self.fallback_ns = fallback_ns

    def lookup(self, host: Location, box: Location) -> tuple[int, str] | None:
        """The most specific entry for two complete locations: (round trip, hop name)."""
        entries = self.entries
        hp = (host.site, host.pod, host.rack)
        bp = (box.site, box.pod, box.rack)
        for host_depth, box_depth in _DEPTHS:
            key = (hp[:host_depth], bp[:box_depth])
            found = entries.get(key)
            if found is not None:
                return found, f"matrix:{'/'.join(key[0])}->{'/'.join(key[1])}"
        return None

    # -- reading --------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, *, symmetric: bool = True) -> LatencyMatrix:
        """Read a ``.yaml``/``.yml`` or ``.csv`` file (by its suffix)."""
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise MatrixError("", f"cannot read: {error.strerror}", source=source) from None
        if Path(path).suffix.lower() == ".csv":
            return cls.from_csv(text, source=source, symmetric=symmetric)
        if Path(path).suffix.lower() in (".yaml", ".yml"):
            return cls.from_yaml(text, source=source)
        raise MatrixError("", "unknown file type: name it .yaml, .yml or .csv", source=source)

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "") -> LatencyMatrix:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise MatrixError("", f"invalid YAML{at}", source=source) from None
        if not isinstance(data, Mapping):
            raise MatrixError(
                "", "expected a mapping with round_trips (and fallback, symmetric)", source=source
            )
        unknown = sorted(
            str(key) for key in data if key not in ("round_trips", "fallback", "symmetric")
        )
        if unknown:
            raise MatrixError(
                unknown[0], "unknown key; expected round_trips, fallback, symmetric", source=source
            )
        symmetric = data.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise MatrixError(
                "symmetric", f"expected true or false, got {symmetric!r}", source=source
            )
        fallback = _fallback(data.get("fallback", FALLBACK_TOPOLOGY), source)
        rows = data.get("round_trips")
        if not isinstance(rows, list) or not rows:
            raise MatrixError(
                "round_trips",
                "expected a non-empty list of {hosts: LOCATION, boxes: LOCATION, round_trip: "
                "DURATION}",
                source=source,
            )
        builder = _Builder(symmetric, source)
        for i, row in enumerate(rows):
            at = f"round_trips[{i}]"
            if not isinstance(row, Mapping):
                raise MatrixError(at, f"expected a mapping, got {row!r}", source=source)
            extra = sorted(str(key) for key in row if key not in CSV_HEADER)
            missing = [key for key in CSV_HEADER if key not in row]
            if extra or missing:
                raise MatrixError(
                    at,
                    "expected exactly the keys hosts, boxes, round_trip "
                    f"(missing {missing or 'none'}, unknown {extra or 'none'})",
                    source=source,
                )
            builder.add(at, row["hosts"], row["boxes"], row["round_trip"])
        return cls(builder.entries, fallback_ns=fallback)

    @classmethod
    def from_csv(
        cls,
        text: str,
        *,
        source: str = "",
        symmetric: bool = True,
        fallback_ns: int | None = None,
    ) -> LatencyMatrix:
        reader = csv.reader(io.StringIO(text))
        rows: list[tuple[int, list[str]]] = []
        for row in reader:
            if row and not row[0].lstrip().startswith("#") and any(cell.strip() for cell in row):
                rows.append((reader.line_num, row))
        if not rows or tuple(cell.strip() for cell in rows[0][1]) != CSV_HEADER:
            raise MatrixError(
                "line 1", f"expected the header {','.join(CSV_HEADER)}", source=source
            )
        if len(rows) == 1:
            raise MatrixError("", "no entries after the header", source=source)
        builder = _Builder(symmetric, source)
        for number, row in rows[1:]:
            at = f"line {number}"
            if len(row) != 3:
                raise MatrixError(
                    at, f"expected 3 cells (hosts,boxes,round_trip), got {len(row)}", source=source
                )
            builder.add(at, row[0].strip(), row[1].strip(), row[2].strip())
        return cls(builder.entries, fallback_ns=fallback_ns)

    def check_against(self, topology: Topology, *, source: str = "") -> None:
        """Raise :class:`MatrixError` for a rack pair naming a rack an explicit topology
        does not contain (it could never match)."""
        if not topology.explicit:
            return
        for hosts, boxes in self.entries:
            for prefix in (hosts, boxes):
                if len(prefix) == 3 and not topology.contains(Location(*prefix)):
                    raise MatrixError(
                        "/".join(prefix),
                        "the topology does not contain this rack; fix the name or add the "
                        "rack to the topology",
                        source=source,
                    )


class _Builder:
    def __init__(self, symmetric: bool, source: str) -> None:
        self.entries: dict[tuple[Prefix, Prefix], int] = {}
        self._listed: set[tuple[Prefix, Prefix]] = set()
        self._mirrored: dict[tuple[Prefix, Prefix], str] = {}
        self._symmetric = symmetric
        self._source = source

    def add(self, at: str, hosts: object, boxes: object, round_trip: object) -> None:
        key = (self._prefix(f"{at}.hosts", hosts), self._prefix(f"{at}.boxes", boxes))
        ns = self._round_trip(f"{at}.round_trip", round_trip)
        if key in self._listed:
            raise MatrixError(
                at, f"duplicate entry for {_pair(key)}; list each pair once", source=self._source
            )
        self._listed.add(key)
        self._mirrored.pop(key, None)
        self.entries[key] = ns  # a listed direction beats a mirrored one
        mirror = (key[1], key[0])
        if self._symmetric and mirror not in self._listed:
            self.entries[mirror] = ns
            self._mirrored[mirror] = at

    def _prefix(self, at: str, value: object) -> Prefix:
        if not isinstance(value, str) or not value.strip():
            raise MatrixError(
                at, f"expected SITE, SITE/POD or SITE/POD/RACK, got {value!r}", source=self._source
            )
        parts = tuple(value.strip().split("/"))
        if len(parts) > 3 or any(not part or part != part.strip() for part in parts):
            raise MatrixError(
                at,
                f"expected SITE, SITE/POD or SITE/POD/RACK (names without spaces), got {value!r}",
                source=self._source,
            )
        return parts

    def _round_trip(self, at: str, value: object) -> int:
        ns: object = value
        if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 12:
            ns = int(value)  # whole nanoseconds, as a CSV cell gives them
        elif isinstance(value, str):
            try:
                ns = parse_duration_ns(value)
            except InvalidArgument as error:
                raise MatrixError(at, error.message, source=self._source) from None
        if isinstance(ns, bool) or not isinstance(ns, int) or not 0 < ns <= MAX_LATENCY_NS:
            raise MatrixError(
                at,
                "expected a round trip above 0 and at most 10s (e.g. 3.1us or 3100), "
                f"got {value!r}",
                source=self._source,
            )
        return ns


def _fallback(value: Any, source: str) -> int | None:
    if value == FALLBACK_TOPOLOGY:
        return None
    if isinstance(value, str):
        try:
            ns = parse_duration_ns(value)
        except InvalidArgument as error:
            raise MatrixError(
                "fallback", f"{error.message}; or write 'topology'", source=source
            ) from None
    elif isinstance(value, int) and not isinstance(value, bool):
        ns = value
    else:
        raise MatrixError(
            "fallback",
            f"expected 'topology' or a duration such as 100us, got {value!r}",
            source=source,
        )
    if not 0 < ns <= MAX_LATENCY_NS:
        raise MatrixError(
            "fallback", f"must be above 0 and at most 10s, got {value!r}", source=source
        )
    return ns


def _pair(key: tuple[Prefix, Prefix]) -> str:
    return f"hosts {'/'.join(key[0])}, boxes {'/'.join(key[1])}"


class MatrixLatencyModel(TopologyLatencyModel):
    """The operator's matrix over the tree model of ``topology``.

    Endpoints resolve to racks through the topology, as in the tree model, so classes are
    still racks and rankings stay per rack (see :class:`TopologyLatencyModel`); a pair the
    matrix lists gets its round trip (the path names the entry, ``matrix:dc1/p1->dc1/p2``),
    any other pair the matrix's fixed fallback (``matrix:fallback``) or, by default, the
    tree's estimate. Immutable and safe to share between threads.
    """

    def __init__(
        self, topology: Topology, matrix: LatencyMatrix, *, cache_size: int = DEFAULT_CACHE_SIZE
    ) -> None:
        super().__init__(topology, cache_size=cache_size)
        self._matrix = matrix

    @property
    def matrix(self) -> LatencyMatrix:
        return self._matrix

    def _override(
        self, host_side: ResolvedPlace, box_side: ResolvedPlace
    ) -> tuple[int, str] | None:
        if host_side.switches is not None and box_side.switches is not None:
            found = self._matrix.lookup(host_side.location, box_side.location)
            if found is not None:
                return found
        fallback = self._matrix.fallback_ns
        return None if fallback is None else (fallback, "matrix:fallback")


__all__ = ["LatencyMatrix", "MatrixError", "MatrixLatencyModel"]
