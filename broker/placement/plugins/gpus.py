"""GPU filters: which GPUs a request may take, whatever the host.

Each keeps or drops one GPU. The pipeline runs them in registry order and counts the
GPUs that pass each one, so a failed placement can say where the supply ran out
("512 in the pool, 12 H100, 3 free; 4 H100 requested"). Each also filters a whole list
at once (``filter_gpus``), keeping exactly the GPUs ``filter_gpu`` keeps: the pipeline
runs them on every GPU of the pool, so this is the hot loop of placement.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence

from dxpool.broker.placement.model import GpuInfo, PlacementRequest
from dxpool.broker.placement.status import SUCCESS, Status
from dxpool.broker.placement.text import format_memory
from dxpool.request import model_set


@functools.lru_cache(maxsize=256)
def _folded_models(model: str) -> frozenset[str]:
    return frozenset(part.casefold() for part in model_set(model))


class GpuModel:
    """Keeps GPUs of the requested model, or of any model of a set (``H100|A100``),
    compared case-insensitively; any model when it is ""."""

    name = "gpu_model"
    reads = frozenset({"model"})

    def applies(self, request: PlacementRequest) -> bool:
        return bool(request.model)

    def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status:
        if gpu.model.casefold() in _folded_models(request.model):
            return SUCCESS
        wanted = request.model
        what = f"not {wanted}" if "|" not in wanted else f"not one of {wanted}"
        return Status.unschedulable(f"model {gpu.model}, {what}", plugin=self.name)

    def filter_gpus(self, request: PlacementRequest, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        wanted = request.model
        if "|" in wanted:
            folded_set = _folded_models(wanted)
            return [gpu for gpu in gpus if gpu.model.casefold() in folded_set]
        folded = wanted.casefold()
        return [gpu for gpu in gpus if gpu.model == wanted or gpu.model.casefold() == folded]

    def label(self, request: PlacementRequest) -> str:
        return request.model

    def closest(self, request: PlacementRequest, dropped: Sequence[GpuInfo]) -> str | None:
        """The other models that have free healthy GPUs, most first."""
        free = Counter(gpu.model for gpu in dropped if gpu.free and gpu.healthy)
        if not free:
            return None
        ranked = sorted(free.items(), key=lambda item: (-item[1], item[0]))
        return "free GPUs of other models: " + ", ".join(f"{m} {n}" for m, n in ranked)


class GpuMemory:
    """Keeps GPUs with at least ``min_memory_mib``."""

    name = "gpu_memory"
    reads = frozenset({"min_memory_mib"})

    def applies(self, request: PlacementRequest) -> bool:
        return request.min_memory_mib > 0

    def filter_gpus(self, request: PlacementRequest, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        least = request.min_memory_mib
        return [gpu for gpu in gpus if gpu.memory_mib >= least]

    def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status:
        if gpu.memory_mib >= request.min_memory_mib:
            return SUCCESS
        return Status.unschedulable(
            f"{format_memory(gpu.memory_mib)} of memory, "
            f"{format_memory(request.min_memory_mib)} needed",
            plugin=self.name,
        )

    def label(self, request: PlacementRequest) -> str:
        return f"with >= {format_memory(request.min_memory_mib)}"

    def closest(self, request: PlacementRequest, dropped: Sequence[GpuInfo]) -> str | None:
        """The most memory a free healthy GPU that this filter dropped has."""
        free = [gpu for gpu in dropped if gpu.free and gpu.healthy]
        if not free:
            return None
        largest = min(free, key=lambda gpu: (-gpu.memory_mib, gpu.name))
        return (
            f"the largest free GPU below {format_memory(request.min_memory_mib)} has "
            f"{format_memory(largest.memory_mib)} ({largest.name})"
        )


class GpuFree:
    """Keeps GPUs that are FREE and have no owner."""

    name = "gpu_free"
    reads: frozenset[str] = frozenset()
    _NOT_FREE = Status.unschedulable("in use", plugin=name)

    def applies(self, request: PlacementRequest) -> bool:
        return True

    def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status:
        return SUCCESS if gpu.free else self._NOT_FREE

    def filter_gpus(self, request: PlacementRequest, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        return [gpu for gpu in gpus if gpu.free]

    def label(self, request: PlacementRequest) -> str:
        return "free"

    def closest(self, request: PlacementRequest, dropped: Sequence[GpuInfo]) -> str | None:
        return None


class GpuHealthy:
    """Keeps GPUs not reported unhealthy."""

    name = "gpu_healthy"
    reads: frozenset[str] = frozenset()
    _UNHEALTHY = Status.unschedulable("unhealthy", plugin=name)

    def applies(self, request: PlacementRequest) -> bool:
        return True

    def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status:
        return SUCCESS if gpu.healthy else self._UNHEALTHY

    def filter_gpus(self, request: PlacementRequest, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        return [gpu for gpu in gpus if gpu.healthy]

    def label(self, request: PlacementRequest) -> str:
        return "healthy"

    def closest(self, request: PlacementRequest, dropped: Sequence[GpuInfo]) -> str | None:
        return None


class GpuNotExcluded:
    """Drops the GPUs the request names in ``exclude_gpus``."""

    name = "gpu_not_excluded"
    reads = frozenset({"exclude_gpus"})
    _EXCLUDED = Status.unschedulable("excluded by the request", plugin=name)

    def applies(self, request: PlacementRequest) -> bool:
        return bool(request.exclude_gpus)

    def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status:
        return self._EXCLUDED if gpu.name in request.exclude_gpus else SUCCESS

    def filter_gpus(self, request: PlacementRequest, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        excluded = request.exclude_gpus
        return [gpu for gpu in gpus if gpu.name not in excluded]

    def label(self, request: PlacementRequest) -> str:
        return "not excluded"

    def closest(self, request: PlacementRequest, dropped: Sequence[GpuInfo]) -> str | None:
        return None
