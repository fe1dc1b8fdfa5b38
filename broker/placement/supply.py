"""The supply: per usable box, the GPUs a request may take, and how the pool narrowed.

Box filters run once per box, then GPU filters once per GPU of the boxes kept, each on
what the previous one left, so the count after each filter is known (the *funnel*). This
is the only part of a placement that grows with the number of GPUs, so a GPU filter that
can judge a whole list at once (``filter_gpus``) is asked to.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter
from typing import cast

from dxpool.broker.placement.explain import FunnelStage
from dxpool.broker.placement.framework import (
    BoxFilterPlugin,
    BoxSupply,
    GpuFilterPlugin,
    GpuListFilterPlugin,
    defined_with,
)
from dxpool.broker.placement.guard import PluginError, failure
from dxpool.broker.placement.model import BoxInfo, GpuInfo, PlacementRequest, Snapshot, box_key
from dxpool.broker.placement.status import Code

_box_of = attrgetter("box")
_slot_of = attrgetter("slot")


@dataclass(frozen=True, slots=True)
class Supply:
    """What a request may draw from.

    ``boxes`` are the usable boxes ordered by (usable GPUs, box id), each with its usable
    GPUs lowest slot first; ``usable`` counts their GPUs; ``funnel[0]`` is the whole pool
    and each later stage what one filter left, in the order the filters ran.
    """

    boxes: Sequence[BoxSupply]
    usable: int
    funnel: tuple[FunnelStage, ...]


class BoxVerdicts:
    """Remembers, per request, what the filters made of each box while it is unchanged.

    A remembered verdict is used only for a snapshot that holds the very same
    :class:`BoxInfo` and the very same tuple of GPUs as when it was made (the broker's
    placement index hands out the same objects for boxes whose records did not change).
    Filters are pure functions of (request, box or GPU), so the verdict still holds and
    only the boxes that changed are judged again. Keeps the ``max_requests`` requests used
    last (by box key). Safe to share between threads.
    """

    def __init__(self, max_requests: int = 16) -> None:
        self._lock = threading.Lock()
        self._max_requests = max_requests
        self._by_request: OrderedDict[PlacementRequest, dict[str, BoxPart]] = OrderedDict()

    def parts(self, request: PlacementRequest) -> dict[str, BoxPart]:
        """The verdicts remembered for ``request``, by box id (the caller adds to them).

        They are kept by the request's box key: requests that differ only in what they
        ask of the host (a pin, a selector, CPU and memory, hosts excluded) share them,
        since box and GPU filters judge whatever the host.
        """
        request = box_key(request)
        with self._lock:
            parts = self._by_request.get(request)
            if parts is None:
                parts = self._by_request[request] = {}
                if len(self._by_request) > self._max_requests:
                    self._by_request.popitem(last=False)
            else:
                self._by_request.move_to_end(request)
            return parts


@dataclass(frozen=True, slots=True)
class BoxPart:
    """One box's share of the supply for one request, and the records it was judged on.

    ``counts``: its GPUs left after the box filters, then after each GPU filter. ``own``
    is false when a GPU kept names another box, or the box record another id: the
    box-by-box path then leaves the supply to the stage-by-stage one.
    """

    box: BoxInfo | None
    gpus: Sequence[GpuInfo]
    counts: tuple[int, ...]
    supply: BoxSupply | None
    own: bool


def build_supply(
    request: PlacementRequest,
    snapshot: Snapshot,
    box_filters: Sequence[BoxFilterPlugin],
    gpu_filters: Sequence[GpuFilterPlugin],
    verdicts: BoxVerdicts | None = None,
) -> Supply:
    """Runs the box filters, then the GPU filters on the GPUs of the boxes kept.

    When fewer than ``request.count`` GPUs are left, each GPU filter's stage carries its
    hint about the closest thing it dropped. Raises :class:`PluginError` when a filter
    raises or returns an ERROR status. With ``verdicts``, boxes judged before for this
    request and unchanged since are not judged again; the answer is the same.
    """
    if verdicts is not None:
        supply = _box_by_box(request, snapshot, box_filters, gpu_filters, verdicts)
        if supply is not None:
            return supply
    return _stage_by_stage(request, snapshot, box_filters, gpu_filters)


def _box_by_box(
    request: PlacementRequest,
    snapshot: Snapshot,
    box_filters: Sequence[BoxFilterPlugin],
    gpu_filters: Sequence[GpuFilterPlugin],
    verdicts: BoxVerdicts,
) -> Supply | None:
    """The supply from each box's verdict, judging only boxes not remembered; None when
    the stage-by-stage path must answer (a plugin failed, the supply is short and needs
    hints, or a record names another box)."""
    parts = verdicts.parts(request)
    gpus_by_box = snapshot.gpus_by_box
    known = snapshot.boxes
    pool = 0
    counts: list[tuple[int, ...]] = []
    supplies: list[BoxSupply] = []
    try:
        for box_id, gpus in gpus_by_box.items():  # any order: only sums and a sort follow
            box = known.get(box_id)
            part = parts.get(box_id)
            if part is None or part.box is not box or part.gpus is not gpus:
                part = judge_box(request, box_id, box, gpus, box_filters, gpu_filters)
                if type(gpus) is tuple:  # only an immutable sequence can be trusted later
                    parts[box_id] = part
            if not part.own:
                return None
            pool += len(gpus)
            counts.append(part.counts)
            if part.supply is not None:
                supplies.append(part.supply)
        totals = [sum(column) for column in zip(*counts, strict=True)]
        totals = totals or [0] * (len(gpu_filters) + 1)
        if totals[-1] < request.count:
            return None
        labels = [label(plugin, request) for plugin in box_filters]
        funnel = [
            FunnelStage("in the pool", pool, None),
            FunnelStage(" and ".join(labels) or "in registered boxes", totals[0], None),
            *(
                FunnelStage(label(plugin, request), count, None)
                for plugin, count in zip(gpu_filters, totals[1:], strict=True)
            ),
        ]
    except PluginError:
        return None
    usable = totals[-1]
    supplies.sort(key=_supply_order)
    return Supply(tuple(supplies), usable, tuple(funnel))


def judge_box(
    request: PlacementRequest,
    box_id: str,
    box: BoxInfo | None,
    gpus: Sequence[GpuInfo],
    box_filters: Sequence[BoxFilterPlugin],
    gpu_filters: Sequence[GpuFilterPlugin],
) -> BoxPart:
    """What the filters make of one box and its GPUs."""
    if box is None or not _box_kept(request, box, box_filters):
        return BoxPart(box, gpus, (0,) * (len(gpu_filters) + 1), None, True)
    kept = list(gpus)
    counts = [len(kept)]
    for plugin in gpu_filters:
        kept = _gpu_stage(plugin, request, kept)
        counts.append(len(kept))
    own = box.box == box_id and all(gpu.box == box_id for gpu in kept)
    supply = BoxSupply(box, tuple(sorted(kept, key=_slot_of))) if kept else None
    return BoxPart(box, gpus, tuple(counts), supply, own)


def _stage_by_stage(
    request: PlacementRequest,
    snapshot: Snapshot,
    box_filters: Sequence[BoxFilterPlugin],
    gpu_filters: Sequence[GpuFilterPlugin],
) -> Supply:
    """Each filter over everything the previous one left (the reference path)."""
    gpus_by_box = snapshot.gpus_by_box
    boxes = _kept_boxes(request, snapshot, box_filters)
    pool = sum(len(gpus) for gpus in gpus_by_box.values())
    gpus = [gpu for box in boxes for gpu in gpus_by_box[box.box]]
    labels = [label(plugin, request) for plugin in box_filters]
    funnel = [
        FunnelStage("in the pool", pool, None),
        FunnelStage(" and ".join(labels) or "in registered boxes", len(gpus), None),
    ]
    inputs: list[list[GpuInfo]] = []
    for plugin in gpu_filters:
        inputs.append(gpus)
        gpus = _gpu_stage(plugin, request, gpus)
        funnel.append(FunnelStage(label(plugin, request), len(gpus), None))
    if len(gpus) < request.count:
        _add_hints(request, gpu_filters, inputs, funnel)
    return Supply(_by_box(boxes, gpus), len(gpus), tuple(funnel))


def _kept_boxes(
    request: PlacementRequest, snapshot: Snapshot, box_filters: Sequence[BoxFilterPlugin]
) -> list[BoxInfo]:
    """The registered boxes that pass every box filter, by box id."""
    known = snapshot.boxes
    kept: list[BoxInfo] = []
    for box_id in snapshot.box_ids():
        box = known.get(box_id)
        if box is not None and _box_kept(request, box, box_filters):
            kept.append(box)
    return kept


def _box_kept(
    request: PlacementRequest, box: BoxInfo, box_filters: Sequence[BoxFilterPlugin]
) -> bool:
    """Whether ``box`` passes every box filter; an ERROR raises :class:`PluginError`."""
    for plugin in box_filters:
        try:
            status = plugin.filter_box(request, box)
        except Exception as error:
            status = failure(plugin.name, error)
        if status.code is Code.SUCCESS:
            continue
        if status.code is Code.ERROR:
            raise PluginError(plugin.name, RuntimeError(status.message()))
        return False
    return True


def _gpu_stage(
    plugin: GpuFilterPlugin, request: PlacementRequest, gpus: list[GpuInfo]
) -> list[GpuInfo]:
    """The GPUs ``plugin`` keeps of ``gpus``, in order."""
    try:
        if defined_with(type(plugin), "filter_gpus", "filter_gpu"):
            return cast(GpuListFilterPlugin, plugin).filter_gpus(request, gpus)
        keep = plugin.filter_gpu
        success = Code.SUCCESS
        return [gpu for gpu in gpus if keep(request, gpu).code is success]
    except Exception as error:
        raise PluginError(plugin.name, error) from error


def label(plugin: BoxFilterPlugin | GpuFilterPlugin, request: PlacementRequest) -> str:
    try:
        return plugin.label(request)
    except Exception as error:
        raise PluginError(plugin.name, error) from error


def _add_hints(
    request: PlacementRequest,
    gpu_filters: Sequence[GpuFilterPlugin],
    inputs: Sequence[list[GpuInfo]],
    funnel: list[FunnelStage],
) -> None:
    """When the supply is short, asks each GPU filter for the closest thing among the
    GPUs it dropped (``inputs[i]`` is what the i-th filter was given)."""
    offset = len(funnel) - len(inputs)
    for index, (plugin, gpus) in enumerate(zip(gpu_filters, inputs, strict=True)):
        try:
            dropped = [g for g in gpus if plugin.filter_gpu(request, g).code is not Code.SUCCESS]
            closest = plugin.closest(request, dropped) if dropped else None
        except Exception as error:
            raise PluginError(plugin.name, error) from error
        stage = funnel[offset + index]
        funnel[offset + index] = FunnelStage(stage.label, stage.count, closest)


def _by_box(boxes: Sequence[BoxInfo], gpus: Sequence[GpuInfo]) -> tuple[BoxSupply, ...]:
    """One supply per box of ``boxes`` with usable GPUs, ordered by (usable, box id)."""
    by_box: dict[str, list[GpuInfo]] = {}
    for box_id, group in groupby(gpus, _box_of):
        found = by_box.get(box_id)
        if found is None:
            by_box[box_id] = list(group)
        else:
            found.extend(group)
    supplies = [
        BoxSupply(box, tuple(sorted(by_box[box.box], key=_slot_of)))
        for box in boxes
        if box.box in by_box
    ]
    supplies.sort(key=_supply_order)
    return tuple(supplies)


def _supply_order(supply: BoxSupply) -> tuple[int, str]:
    return supply.available, supply.box.box
