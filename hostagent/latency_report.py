"""Probing round trips to the host's boxes and reporting them for the measured model.

The agent probes each box it has GPUs from (per its status record) every
``probe_interval_s``, smooths each box's probes with an EWMA
(:class:`~dxpool.fabric.measured.RoundTripSmoother`) and writes the smoothed round trips
into its status record (:meth:`~dxpool.hostagent.status.StatusStore.set_round_trips`).

The status record is also what the broker compares before it frees a detached GPU, so
every write may cost a concurrent release one retry. The report is therefore written
only when it says something new: a box appeared or went, a smoothed round trip moved by
``min_change`` (2%) or more, or the last write is ``refresh_s`` (60 s) old, which keeps a
healthy report well inside the broker's staleness bound (300 s by default).

How to take one probe is the hardware's business (:class:`RoundTripProber`): a timed
non-posted read (a configuration or BAR read) through the host and box proxies. No
prober ships for the simulated fabric, which has no latency to measure; an agent
without a prober reports nothing and the broker's measured model answers with the
topology model for its racks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import resources_pb2
from dxpool.fabric.measured import Measurement, RoundTripSmoother
from dxpool.hostagent.status import StatusStore
from dxpool.names import box_name

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 60.0
DEFAULT_MIN_CHANGE = 0.02


class RoundTripProber(Protocol):
    """Measures one PCIe round trip from this host to a box."""

    def probe(self, box: str) -> int | None:
        """One round trip to box ``box`` (id) in ns; None when it cannot be measured
        now (no GPU of the box mapped, the proxy busy). May raise; the reporter logs and
        skips the box for this round."""
        ...


class LatencyReporter:
    """Probes, smooths and reports. :meth:`probe_once` is one round; the agent calls it
    every probe interval from one thread."""

    def __init__(
        self,
        prober: RoundTripProber,
        status: StatusStore,
        boxes: Callable[[], Iterable[str]],
        *,
        smoother: RoundTripSmoother | None = None,
        clock: Callable[[], float] = time.time,
        refresh_s: float = DEFAULT_REFRESH_S,
        min_change: float = DEFAULT_MIN_CHANGE,
    ) -> None:
        self._prober = prober
        self._status = status
        self._boxes = boxes
        self._smoother = smoother or RoundTripSmoother()
        self._clock = clock
        self._refresh_s = refresh_s
        self._min_change = min_change
        self._written: dict[str, int] = {}
        self._written_at = -float("inf")

    def probe_once(self) -> bool:
        """Probe every box in use, fold the probes in, and write the report if it says
        something new. Returns whether it wrote. Raises what the status write raises
        (:class:`~dxpool.hostagent.status.NotRegisteredError`, etcd errors)."""
        now = self._clock()
        wanted = sorted(set(self._boxes()))
        known = {m.box for m in self._smoother.measurements()}
        for gone in known - set(wanted):
            self._smoother.forget(gone)
        for box in wanted:
            try:
                round_trip = self._prober.probe(box)
            except Exception as error:  # a prober is hardware: keep the other boxes going
                log.warning("round-trip probe failed", extra={"box": box, "error": repr(error)})
                continue
            if round_trip is not None:
                self._smoother.observe(box, round_trip, now)
        report = self._smoother.measurements()
        if not self._news(report, now):
            return False
        self._status.set_round_trips([_sample(m) for m in report])
        self._written = {m.box: m.round_trip_ns for m in report}
        self._written_at = now
        return True

    def _news(self, report: list[Measurement], now: float) -> bool:
        if {m.box for m in report} != set(self._written):
            return True
        if now - self._written_at >= self._refresh_s:
            return bool(report)
        for measurement in report:
            before = self._written[measurement.box]
            if abs(measurement.round_trip_ns - before) >= self._min_change * before:
                return True
        return False


def _sample(measurement: Measurement) -> resources_pb2.RoundTripSample:
    stamp = Timestamp()
    stamp.FromNanoseconds(round(measurement.measured_at_s * 1e9))
    return resources_pb2.RoundTripSample(
        box=box_name(measurement.box),
        round_trip_ns=measurement.round_trip_ns,
        measure_time=stamp,
    )


__all__ = ["DEFAULT_MIN_CHANGE", "DEFAULT_REFRESH_S", "LatencyReporter", "RoundTripProber"]
