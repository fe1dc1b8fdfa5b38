"""Feeds the measured latency model from the cache: host agents' round-trip reports.

Each host agent reports its smoothed round trips to boxes in its status record
(``HostStatus.round_trips``). This listener hands every new report to a
:class:`~dxpool.fabric.measured.MeasuredLatency`, forgets a host whose status record is
deleted, and makes the model rebuild when a host or box record changes (it may have moved
rack). The model resolves ids to places through the cache when it rebuilds.
"""

from __future__ import annotations

from collections.abc import Callable

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.state.cache import Cache, Routes
from dxpool.fabric.latency import Place
from dxpool.fabric.measured import MeasuredLatency, Measurement
from dxpool.limits import MAX_LATENCY_NS
from dxpool.store.typed import Versioned


def measurements(status: pb.HostStatus) -> list[Measurement]:
    """The usable entries of a status record's report: one per box (the last one listed
    wins), with a box name and a round trip in (0, 10 s]; others are skipped."""
    by_box: dict[str, Measurement] = {}
    for sample in status.round_trips:
        box = sample.box.removeprefix("boxes/")
        if not box or "/" in box or not 0 < sample.round_trip_ns <= MAX_LATENCY_NS:
            continue
        at = sample.measure_time.seconds + sample.measure_time.nanos / 1e9
        by_box[box] = Measurement(box, sample.round_trip_ns, at)
    return [by_box[box] for box in sorted(by_box)]


def place_lookup(cache: Cache, collection: str) -> Callable[[str], Place | None]:
    """id -> the place of the cached host or box record of that id (None if unknown)."""

    def lookup(resource_id: str) -> Place | None:
        found = cache.get(collection, resource_id)
        return Place.of(found.value) if found is not None else None

    return lookup


class MeasuredFeed:
    """Subscribes ``model`` to ``cache``; :meth:`close` unsubscribes."""

    def __init__(self, cache: Cache, model: MeasuredLatency) -> None:
        self._model = model
        self._unsubscribe = cache.subscribe(
            Routes()
            .on(cache.host_statuses, self._on_status)
            .on(cache.hosts, self._on_place)
            .on(cache.boxes, self._on_place)
        )
        for name, record in cache.host_statuses.items():
            self._on_status(name, record)

    def close(self) -> None:
        self._unsubscribe()

    def _on_status(self, name: str, record: Versioned[pb.HostStatus] | None) -> None:
        if record is None:
            self._model.forget(name)
        else:
            self._model.report(name, measurements(record.value))

    def _on_place(self, name: str, record: object) -> None:
        """A host or a box changed: where things are may have changed."""
        self._model.invalidate()
