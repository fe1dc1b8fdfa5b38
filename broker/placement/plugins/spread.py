"""Where a node's GPUs come from together: all from one box, or spread over boxes.

Both are GPU filters that judge a box's GPUs as a group: a GPU is kept or dropped for
how many usable GPUs its box has, so they run last among the GPU filters (the usable
GPUs are what the others left). They look only at the GPUs of one box at a time, and
``filter_gpus`` groups whatever list it is given by box, so the supply is the same
whether the pipeline judges box by box or all GPUs at once. A single GPU cannot be
judged alone: ``filter_gpu`` keeps every GPU, and the pipeline always calls
``filter_gpus`` (they define it). The greedy rules then see only boxes that hold the
whole node (``SameBox``: every proposal is one box) or boxes cut to the per-box limit
(``SpreadBoxes``: no proposal takes more from one box), so neither needs a phase of its
own, and placement stays on its fast path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from dxpool.broker.placement.model import GpuInfo, PlacementRequest
from dxpool.broker.placement.status import SUCCESS, Status


class SameBox:
    """With ``same_box``, keeps the GPUs of boxes that hold the whole node: every GPU of
    the node then comes from one box and talks peer-to-peer behind its PCIe switch."""

    name = "same_box"
    reads = frozenset({"same_box", "count"})

    def applies(self, request: PlacementRequest) -> bool:
        return request.same_box

    def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status:
        return SUCCESS  # judged per box by filter_gpus

    def filter_gpus(self, request: PlacementRequest, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        if not request.same_box:
            return list(gpus)
        count = request.count
        per_box = Counter(gpu.box for gpu in gpus)
        return [gpu for gpu in gpus if per_box[gpu.box] >= count]

    def label(self, request: PlacementRequest) -> str:
        return f"in a box holding {request.count} of them (affinity box)"

    def closest(self, request: PlacementRequest, dropped: Sequence[GpuInfo]) -> str | None:
        return None  # filter_gpu drops nothing; the funnel's count says it


class SpreadBoxes:
    """With ``max_gpus_per_box`` M, keeps the M lowest slots of each box's usable GPUs:
    no box gives the node more than M GPUs, so losing a box costs it at most M."""

    name = "spread_boxes"
    reads = frozenset({"max_gpus_per_box"})

    def applies(self, request: PlacementRequest) -> bool:
        return request.max_gpus_per_box > 0

    def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status:
        return SUCCESS  # judged per box by filter_gpus

    def filter_gpus(self, request: PlacementRequest, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        limit = request.max_gpus_per_box
        if limit <= 0:
            return list(gpus)
        by_box: dict[str, list[GpuInfo]] = {}
        for gpu in gpus:
            by_box.setdefault(gpu.box, []).append(gpu)
        kept: set[int] = set()
        for group in by_box.values():
            lowest = sorted(group, key=_slot)[:limit] if len(group) > limit else group
            kept.update(id(gpu) for gpu in lowest)
        return [gpu for gpu in gpus if id(gpu) in kept]

    def label(self, request: PlacementRequest) -> str:
        limit = request.max_gpus_per_box
        return f"usable at {limit} per box (spread boxes:{limit})"

    def closest(self, request: PlacementRequest, dropped: Sequence[GpuInfo]) -> str | None:
        return None  # filter_gpu drops nothing; the funnel's count says it


def _slot(gpu: GpuInfo) -> int:
    return gpu.slot
