"""GPU filters: each keeps exactly the GPUs it is about, and explains what it dropped."""

from __future__ import annotations

from dxpool.broker.placement.model import GpuInfo, PlacementRequest
from dxpool.broker.placement.plugins.gpus import (
    GpuFree,
    GpuHealthy,
    GpuMemory,
    GpuModel,
    GpuNotExcluded,
)
from dxpool.broker.placement.status import Code


def gpu(
    slot: int = 0,
    model: str = "H100",
    *,
    memory_mib: int = 81920,
    free: bool = True,
    healthy: bool = True,
    box: str = "b1",
) -> GpuInfo:
    return GpuInfo(f"boxes/{box}/gpus/{slot}", box, slot, model, memory_mib, free, healthy)


def test_model_matches_case_insensitively_and_steps_aside_for_any_model() -> None:
    plugin = GpuModel()
    request = PlacementRequest("h100", 1)
    assert plugin.applies(request)
    assert plugin.filter_gpu(request, gpu(model="H100")).ok
    dropped = plugin.filter_gpu(request, gpu(model="A100"))
    assert dropped.code is Code.UNSCHEDULABLE
    assert dropped.reasons == ("model A100, not h100",)
    assert dropped.plugin == "gpu_model"
    assert not plugin.applies(PlacementRequest("", 1))
    assert plugin.label(request) == "h100"


def test_model_names_the_free_gpus_of_other_models() -> None:
    plugin = GpuModel()
    request = PlacementRequest("H100", 1)
    dropped = [
        gpu(0, "A100"),
        gpu(1, "L40S"),
        gpu(2, "L40S"),
        gpu(3, "A100", free=False),
        gpu(4, "B200", healthy=False),
    ]
    assert plugin.closest(request, dropped) == "free GPUs of other models: L40S 2, A100 1"
    assert plugin.closest(request, [gpu(0, "A100", free=False)]) is None


def test_memory_keeps_gpus_with_enough_and_names_the_largest_below() -> None:
    plugin = GpuMemory()
    request = PlacementRequest("H100", 1, min_memory_mib=81920)
    assert plugin.filter_gpu(request, gpu(memory_mib=81920)).ok
    assert plugin.filter_gpu(request, gpu(memory_mib=40960)).reasons == (
        "40GiB of memory, 80GiB needed",
    )
    assert not plugin.applies(PlacementRequest("H100", 1))
    assert plugin.label(request) == "with >= 80GiB"
    dropped = [gpu(0, memory_mib=24576), gpu(1, memory_mib=40960), gpu(2, memory_mib=40960)]
    assert plugin.closest(request, dropped) == (
        "the largest free GPU below 80GiB has 40GiB (boxes/b1/gpus/1)"
    )


def test_free_and_healthy() -> None:
    request = PlacementRequest("", 1)
    assert GpuFree().filter_gpu(request, gpu()).ok
    assert GpuFree().filter_gpu(request, gpu(free=False)).reasons == ("in use",)
    assert GpuHealthy().filter_gpu(request, gpu()).ok
    assert GpuHealthy().filter_gpu(request, gpu(healthy=False)).reasons == ("unhealthy",)
    assert GpuFree().applies(request) and GpuHealthy().applies(request)


def test_not_excluded_drops_the_named_gpus_only() -> None:
    plugin = GpuNotExcluded()
    request = PlacementRequest("", 1, exclude_gpus=frozenset({"boxes/b1/gpus/1"}))
    assert plugin.applies(request)
    assert plugin.filter_gpu(request, gpu(0)).ok
    assert plugin.filter_gpu(request, gpu(1)).code is Code.UNSCHEDULABLE
    assert plugin.filter_gpu(request, gpu(1, box="b2")).ok
    assert not plugin.applies(PlacementRequest("", 1))


def test_model_set_keeps_any_model_of_the_set() -> None:
    plugin = GpuModel()
    request = PlacementRequest("H100|a100", 2, mixed_models=True)
    gpus = [gpu(0, "H100"), gpu(1, "A100"), gpu(2, "L40S"), gpu(3, "h100")]
    assert [g.slot for g in plugin.filter_gpus(request, gpus)] == [0, 1, 3]
    assert [g.slot for g in gpus if plugin.filter_gpu(request, g).ok] == [0, 1, 3]
    assert plugin.filter_gpu(request, gpu(2, "L40S")).reasons == (
        "model L40S, not one of H100|a100",
    )
    assert plugin.label(request) == "H100|a100"
