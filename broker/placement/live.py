"""The supply of one request brought up to date change by change.

The broker's placement index hands out snapshots with a version and a journal of which
boxes and hosts each version changed (:class:`~dxpool.broker.placement.model.Snapshot`).
For the snapshot after a compose only a box or two differ from the one before, so
instead of judging every box again, :class:`LiveSupply` (the usable boxes by (usable
GPUs, box id), with each box's share, its counts after each filter, in a persistent
map, so the funnel's totals move by the changed boxes' shares) judges only those.

It is immutable: :meth:`LiveSupply.advance` makes the next one and leaves this one as it
was. Each step costs O(changed boxes x log n); the usable boxes are sorted only when
something reads them (:class:`SortedSupplies`). :mod:`~dxpool.broker.placement.carry`
keeps one per box key.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import immutables

from dxpool.broker.placement.explain import FunnelStage
from dxpool.broker.placement.framework import BoxFilterPlugin, BoxSupply, GpuFilterPlugin
from dxpool.broker.placement.guard import PluginError
from dxpool.broker.placement.model import PlacementRequest, Snapshot
from dxpool.broker.placement.supply import BoxPart, Supply, judge_box, label
from dxpool.broker.placement.tiered import supply_order

HostKey = tuple[int, int] | None
"""(latency class of the host, free slot count); None for a host whose class the model
could not tell (each such host is looked at on its own)."""


@dataclass(frozen=True, slots=True)
class LiveSupply:
    """The supply of one request on one snapshot, and each box's share of it."""

    supply: Supply
    parts: immutables.Map[str, BoxPart]
    totals: tuple[int, ...]  # GPUs left after the box filters, then after each GPU filter
    pool: int  # every GPU of every box

    @staticmethod
    def build(
        request: PlacementRequest,
        snapshot: Snapshot,
        box_filters: Sequence[BoxFilterPlugin],
        gpu_filters: Sequence[GpuFilterPlugin],
    ) -> LiveSupply | None:
        """Judges every box of ``snapshot``; None when the supply holds fewer GPUs than
        requested, a plugin fails, or a record names another box (the reference path
        in :mod:`.supply` then answers, with its hints)."""
        counts: list[tuple[int, ...]] = []
        parts: dict[str, BoxPart] = {}
        boxes: list[BoxSupply] = []
        pool = 0
        known = snapshot.boxes
        try:
            for box_id, gpus in snapshot.gpus_by_box.items():
                part = judge_box(request, box_id, known.get(box_id), gpus, box_filters, gpu_filters)
                if not part.own:
                    return None
                parts[box_id] = part
                pool += len(gpus)
                counts.append(part.counts)
                if part.supply is not None:
                    boxes.append(part.supply)
            totals = tuple(sum(column) for column in zip(*counts, strict=True))
            totals = totals or (0,) * (len(gpu_filters) + 1)
            if totals[-1] < request.count:
                return None
            funnel = _funnel(request, pool, totals, box_filters, gpu_filters)
        except PluginError:
            return None
        boxes.sort(key=supply_order)
        supply = Supply(tuple(boxes), totals[-1], funnel)
        return LiveSupply(supply, immutables.Map(parts), totals, pool)

    def advance(
        self,
        request: PlacementRequest,
        snapshot: Snapshot,
        changed: Iterable[str],
        box_filters: Sequence[BoxFilterPlugin],
        gpu_filters: Sequence[GpuFilterPlugin],
        removed: list[BoxSupply] | None = None,
        added: list[BoxSupply] | None = None,
    ) -> LiveSupply | None:
        """This supply with the boxes ``changed`` judged again on ``snapshot`` (None as
        for :meth:`build`). Appends the box supplies that left to ``removed`` and those
        that came to ``added``."""
        totals = list(self.totals)
        pool = self.pool
        gpus_by_box = snapshot.gpus_by_box
        known = snapshot.boxes
        try:
            with self.parts.mutate() as parts:
                for box_id in changed:
                    old = parts.get(box_id)
                    if old is not None:
                        pool -= len(old.gpus)
                        totals = [t - c for t, c in zip(totals, old.counts, strict=True)]
                        if old.supply is not None and removed is not None:
                            removed.append(old.supply)
                        del parts[box_id]
                    gpus = gpus_by_box.get(box_id)
                    if gpus is None:
                        continue
                    part = judge_box(
                        request, box_id, known.get(box_id), gpus, box_filters, gpu_filters
                    )
                    if not part.own:
                        return None
                    parts[box_id] = part
                    pool += len(gpus)
                    totals = [t + c for t, c in zip(totals, part.counts, strict=True)]
                    if part.supply is not None and added is not None:
                        added.append(part.supply)
                finished = parts.finish()
            if totals[-1] < request.count:
                return None
            funnel = _funnel(request, pool, tuple(totals), box_filters, gpu_filters)
        except PluginError:
            return None
        supply = Supply(SortedSupplies(finished), totals[-1], funnel)
        return LiveSupply(supply, finished, tuple(totals), pool)


def _funnel(
    request: PlacementRequest,
    pool: int,
    totals: tuple[int, ...],
    box_filters: Sequence[BoxFilterPlugin],
    gpu_filters: Sequence[GpuFilterPlugin],
) -> tuple[FunnelStage, ...]:
    """The funnel of a supply that holds enough GPUs (no hints), as :mod:`.supply`
    counts it."""
    labels = [label(plugin, request) for plugin in box_filters]
    return (
        FunnelStage("in the pool", pool, None),
        FunnelStage(" and ".join(labels) or "in registered boxes", totals[0], None),
        *(
            FunnelStage(label(plugin, request), count, None)
            for plugin, count in zip(gpu_filters, totals[1:], strict=True)
        ),
    )


class SortedSupplies(Sequence[BoxSupply]):
    """The usable boxes of a live supply by (usable GPUs, box id), sorted when first
    read. A decision carried over reads the chooser and the class table, not this
    list (only a run host by host, an explanation or a chooser made from scratch does),
    so the next version no longer copies one pointer per usable box for each change.
    Safe to share between threads: two first reads sort the same boxes the same way."""

    __slots__ = ("_parts", "_sorted")

    def __init__(self, parts: immutables.Map[str, BoxPart]) -> None:
        self._parts = parts
        self._sorted: tuple[BoxSupply, ...] | None = None

    def _boxes(self) -> tuple[BoxSupply, ...]:
        found = self._sorted
        if found is None:
            usable = [part.supply for part in self._parts.values() if part.supply is not None]
            found = self._sorted = tuple(sorted(usable, key=supply_order))
        return found

    def __len__(self) -> int:
        return len(self._boxes())

    @overload
    def __getitem__(self, index: int) -> BoxSupply: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[BoxSupply, ...]: ...

    def __getitem__(self, index: int | slice) -> BoxSupply | tuple[BoxSupply, ...]:
        return self._boxes()[index]

    def __iter__(self) -> Iterator[BoxSupply]:
        return iter(self._boxes())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self._boxes() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._boxes())

    def __repr__(self) -> str:
        return f"SortedSupplies({self._boxes()!r})"
