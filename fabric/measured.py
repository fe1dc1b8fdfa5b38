"""The measured latency model: round trips host agents probed, smoothed, with a staleness
bound beyond which the topology model answers again.

How measurements flow:

1. A host agent probes the round trip to the boxes it uses (a timed non-posted PCIe read
   through the proxies) and smooths each box's probes with an exponentially weighted
   moving average (:class:`RoundTripSmoother`), so one slow probe moves the figure by
   ``alpha`` of the difference, not all of it.
2. It reports the smoothed round trip and the time of its last probe per box in its
   status record (``HostStatus.round_trips``), which only it writes.
3. Each broker keeps every host's latest report (:class:`MeasuredLatency`, fed from the
   cache) and hands placement an immutable :class:`MeasuredLatencyModel` made from the
   reports younger than the staleness bound. Pairs without a fresh report fall back to
   the topology model, so a host whose agent stopped probing (or died) drifts back to the
   tree's estimate instead of keeping a figure nobody vouches for.

**Classes stay racks.** Placement at 100,000 GPUs is fast because it ranks boxes once
per *class* of host, and the tree model's classes are racks. If every host and box with
a measurement were its own class, rankings would be per host and placement would go back
to O(hosts x boxes). So measurements are aggregated per (host rack, box rack): the model
answers every pair of those racks with the mean of the smoothed round trips measured
between them. The cost is that two hosts of one rack with different cabling look alike;
the rack-level mean is what a placement decision across thousands of hosts can use, and
a per-host outlier is an operations problem (a bad cable) more than a placement input.

Defaults, both assumptions to tune per deployment: ``alpha`` 0.2 (a new probe weighs a
fifth, so after a step change the figure is within 10% of the step after 11 probes), and a staleness
bound of 300 s (five minutes: several missed probe rounds at the agent's default period
of 30 s before the topology model takes over).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from dxpool.errors import InvalidArgument
from dxpool.fabric.latency import (
    DEFAULT_CACHE_SIZE,
    Place,
    ResolvedPlace,
    TopologyLatencyModel,
)
from dxpool.fabric.topology import Location, Topology
from dxpool.limits import MAX_LATENCY_NS

DEFAULT_EWMA_ALPHA = 0.2
DEFAULT_STALENESS_S = 300.0
DEFAULT_PROBE_INTERVAL_S = 30.0


def check_alpha(alpha: float) -> float:
    """Return ``alpha`` if it is a smoothing factor in (0, 1]."""
    if not (math.isfinite(alpha) and 0 < alpha <= 1):
        raise InvalidArgument(
            f"EWMA alpha {alpha!r} is out of range: use a number above 0 and at most 1 "
            "(1 keeps only the latest probe)",
            reason="INVALID_ALPHA",
        )
    return alpha


@dataclass(frozen=True, slots=True)
class Measurement:
    """A smoothed round trip to ``box`` (id) and when its last probe ran (Unix seconds)."""

    box: str
    round_trip_ns: int
    measured_at_s: float


class RoundTripSmoother:
    """Per-box EWMA of probed round trips, kept by a host agent: ``s = s + alpha(x - s)``,
    the first probe taken as is. Probes that are not a round trip (<= 0 or beyond 10 s) are
    ignored. Safe to share between threads."""

    def __init__(self, alpha: float = DEFAULT_EWMA_ALPHA) -> None:
        self._alpha = check_alpha(alpha)
        self._lock = threading.Lock()
        self._smoothed: dict[str, tuple[float, float]] = {}  # box -> (ns, measured_at_s)

    def observe(self, box: str, round_trip_ns: int, measured_at_s: float) -> int | None:
        """Fold one probe in; returns the box's smoothed round trip (None if ignored)."""
        if not 0 < round_trip_ns <= MAX_LATENCY_NS:
            return None
        with self._lock:
            previous = self._smoothed.get(box)
            if previous is None:
                value = float(round_trip_ns)
            else:
                value = previous[0] + self._alpha * (round_trip_ns - previous[0])
            self._smoothed[box] = (value, measured_at_s)
            return round(value)

    def forget(self, box: str) -> None:
        """Drop a box (no longer attached, or gone)."""
        with self._lock:
            self._smoothed.pop(box, None)

    def measurements(self) -> list[Measurement]:
        """Every box's smoothed round trip, by box id."""
        with self._lock:
            return [
                Measurement(box, round(ns), at) for box, (ns, at) in sorted(self._smoothed.items())
            ]


class MeasuredLatencyModel(TopologyLatencyModel):
    """The topology model with measured rack pairs: a (host rack, box rack) pair with
    measurements answers their mean (path ``measured:{host rack}->{box rack}``); every
    other pair, and every unplaced endpoint, gets the tree's estimate. Immutable: a new
    model is made when measurements change (see :class:`MeasuredLatency`).

    ``samples`` are (host place, box place, round trip ns).
    """

    def __init__(
        self,
        topology: Topology,
        samples: Iterable[tuple[Place, Place, int]],
        *,
        expires_at_s: float = math.inf,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        super().__init__(topology, cache_size=cache_size)
        sums: dict[tuple[Location, Location], list[int]] = {}
        for host, box, round_trip in samples:
            host_side = self._resolve(host, "hosts/", topology.host_place)
            box_side = self._resolve(box, "boxes/", topology.box_place)
            if host_side.switches is None or box_side.switches is None:
                continue  # an unplaced endpoint has no rack to speak for
            totals = sums.setdefault((host_side.location, box_side.location), [0, 0])
            totals[0] += round_trip
            totals[1] += 1
        self._measured: Mapping[tuple[Location, Location], int] = {
            pair: round(total / count) for pair, (total, count) in sums.items()
        }
        self.expires_at_s = expires_at_s

    @property
    def measured_pairs(self) -> Mapping[tuple[Location, Location], int]:
        """Round trip per (host rack, box rack) with fresh measurements."""
        return self._measured

    def _override(
        self, host_side: ResolvedPlace, box_side: ResolvedPlace
    ) -> tuple[int, str] | None:
        if host_side.switches is None or box_side.switches is None:
            return None
        found = self._measured.get((host_side.location, box_side.location))
        if found is None:
            return None
        return found, f"measured:{host_side.location}->{box_side.location}"


PlaceLookup = Callable[[str], Place | None]
"""Resolves an id (``h1`` / ``b1``) to the endpoint's current place, None if unknown."""


class MeasuredLatency:
    """A :class:`~dxpool.fabric.latency.LatencySource` of measured models.

    Holds each host's latest report (:meth:`report`, :meth:`forget`); :meth:`current`
    makes a model from the reports measured within ``staleness_s`` of ``clock()`` and
    hands out the same model until a report changes or one of its measurements goes
    stale. A measurement time in the future (a host clock ahead of the broker's) counts
    as the time the report arrived. Safe to share between threads.
    """

    name = "measured"

    def __init__(
        self,
        topology: Topology,
        *,
        host_place: PlaceLookup,
        box_place: PlaceLookup,
        staleness_s: float = DEFAULT_STALENESS_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (math.isfinite(staleness_s) and staleness_s > 0):
            raise InvalidArgument(
                f"staleness bound {staleness_s!r}s must be a positive number of seconds",
                reason="INVALID_STALENESS",
            )
        self._topology = topology
        self._host_place = host_place
        self._box_place = box_place
        self._staleness_s = staleness_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reports: dict[str, tuple[Measurement, ...]] = {}
        self._version = 0
        self._model: MeasuredLatencyModel | None = None
        self._model_version = -1

    @property
    def staleness_s(self) -> float:
        return self._staleness_s

    def report(self, host: str, measurements: Sequence[Measurement]) -> None:
        """Replace ``host``'s report (its agent reports every box it measures at once).
        A measurement time later than now (the host's clock is ahead) is taken as now."""
        now = self._clock()
        report = tuple(
            m if m.measured_at_s <= now else Measurement(m.box, m.round_trip_ns, now)
            for m in measurements
        )
        with self._lock:
            if self._reports.get(host) == report:
                return
            if report:
                self._reports[host] = report
            else:
                self._reports.pop(host, None)
            self._version += 1

    def forget(self, host: str) -> None:
        """Drop ``host``'s report (its status record is gone)."""
        self.report(host, ())

    def invalidate(self) -> None:
        """Make the next :meth:`current` rebuild (e.g. a host or box moved rack)."""
        with self._lock:
            self._version += 1

    def current(self) -> MeasuredLatencyModel:
        now = self._clock()
        with self._lock:
            model = self._model
            if (
                model is not None
                and self._model_version == self._version
                and now < model.expires_at_s
            ):
                return model
            version = self._version
            reports = list(self._reports.items())
        model = self._build(reports, now)
        with self._lock:
            if version >= self._model_version:
                self._model, self._model_version = model, version
        return model

    def _build(
        self, reports: list[tuple[str, tuple[Measurement, ...]]], now: float
    ) -> MeasuredLatencyModel:
        oldest_fresh = now - self._staleness_s
        expires = math.inf
        samples: list[tuple[Place, Place, int]] = []
        for host_id, measurements in reports:
            host = self._host_place(host_id)
            if host is None:
                continue
            for measurement in measurements:
                measured_at = measurement.measured_at_s
                if measured_at <= oldest_fresh:
                    continue
                box = self._box_place(measurement.box)
                if box is None:
                    continue
                samples.append((host, box, measurement.round_trip_ns))
                expires = min(expires, measured_at + self._staleness_s)
        return MeasuredLatencyModel(self._topology, samples, expires_at_s=expires)


__all__ = [
    "DEFAULT_EWMA_ALPHA",
    "DEFAULT_PROBE_INTERVAL_S",
    "DEFAULT_STALENESS_S",
    "MeasuredLatency",
    "MeasuredLatencyModel",
    "Measurement",
    "RoundTripSmoother",
    "check_alpha",
]
