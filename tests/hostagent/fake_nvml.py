"""A stand-in for the ``pynvml`` module: the functions, constants and error classes the
agent calls, answering from :class:`FakeGpu` records.

Devices are found by PCI address through ``lookup`` (by default the ``devices`` dict),
so a test can tie NVML's view to a fake sysfs tree (NVML sees only GPUs bound to
``nvidia``). XID events are queued with :meth:`FakeNvml.raise_xid` and delivered by
``nvmlEventSetWait`` to the event sets the GPU was registered in.
"""

# The stand-in mirrors pynvml's camelCase names.

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

MIB = 1024 * 1024
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"NVML error {self.value}"


class NVMLError_NotSupported(NVMLError):  # noqa: N801, N818 - pynvml's name
    def __init__(self, value: int = NVML_ERROR_NOT_SUPPORTED) -> None:
        super().__init__(value)


class NVMLError_NotFound(NVMLError):  # noqa: N801, N818
    def __init__(self, value: int = NVML_ERROR_NOT_FOUND) -> None:
        super().__init__(value)


class NVMLError_Timeout(NVMLError):  # noqa: N801, N818
    def __init__(self, value: int = NVML_ERROR_TIMEOUT) -> None:
        super().__init__(value)


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801, N818
    def __init__(self, value: int = NVML_ERROR_GPU_IS_LOST) -> None:
        super().__init__(value)


Answer = int | tuple[int, int, int, int] | Exception


@dataclass
class FakeGpu:
    """One GPU as NVML would describe it; an Exception value is raised by its query."""

    bdf: str = "0000:41:00.0"
    uuid: str | bytes = "GPU-1234"
    serial: str | bytes = "1650123456789"
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    memory_bytes: int = 81559 * MIB
    retired_pages_pending: Answer = 0
    volatile_uncorrected_ecc: Answer = 0
    remapped_rows: Answer = (0, 0, 0, 0)  # corrected, uncorrected, pending, failure
    temperature_c: Answer = 40
    slowdown_c: Answer = 90
    power_mw: Answer = 70_000
    power_limit_mw: Answer = 700_000
    link_width: Answer = 16
    max_link_width: Answer = 16
    link_generation: Answer = 5
    max_link_generation: Answer = 5
    events: Answer = 0  # an Exception makes nvmlDeviceRegisterEvents raise it
    processes: list[SimpleNamespace] = field(default_factory=list)


@dataclass
class _EventSet:
    events: queue.Queue[SimpleNamespace] = field(default_factory=queue.Queue)
    gpus: set[str] = field(default_factory=set)  # uuids registered
    freed: bool = False


def _answer(value: Answer) -> int | tuple[int, int, int, int]:
    if isinstance(value, Exception):
        raise value
    return value


@dataclass
class FakeNvml:
    """The subset of ``pynvml`` the agent uses."""

    devices: dict[str, FakeGpu] = field(default_factory=dict)
    lookup: Callable[[str], FakeGpu | None] | None = None
    init_error: Exception | None = None
    init_calls: int = 0
    shutdown_calls: int = 0
    event_sets: list[_EventSet] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    enumerate_at_init: bool = False  # True: GPUs added after nvmlInit are not found
    visible: set[str] | None = None

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVML_FEATURE_ENABLED = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    nvmlEventTypeXidCriticalError = 0x8  # noqa: N815

    @classmethod
    def with_gpus(cls, *gpus: FakeGpu) -> FakeNvml:
        return cls(devices={gpu.bdf: gpu for gpu in gpus})

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error
        if self.enumerate_at_init:
            self.visible = set(self.devices)

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return sorted(self.devices.values(), key=lambda gpu: gpu.bdf)[index]

    def nvmlDeviceGetHandleByPciBusId(self, bdf: str) -> FakeGpu:
        gpu = self.lookup(bdf) if self.lookup is not None else self.devices.get(bdf)
        if gpu is None or (self.visible is not None and bdf not in self.visible):
            raise NVMLError_NotFound()
        return gpu

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str | bytes:
        return handle.uuid

    def nvmlDeviceGetSerial(self, handle: FakeGpu) -> str | bytes:
        return handle.serial

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str | bytes:
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> SimpleNamespace:
        return SimpleNamespace(total=handle.memory_bytes, free=handle.memory_bytes, used=0)

    def nvmlDeviceGetPciInfo(self, handle: FakeGpu) -> SimpleNamespace:
        domain, rest = handle.bdf.split(":", 1)
        return SimpleNamespace(busId=f"0000{domain}:{rest}".upper().encode())

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeGpu) -> int:
        return int(_answer(handle.retired_pages_pending))  # type: ignore[arg-type]

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeGpu, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (1, 0), "asked for uncorrected volatile ECC errors"
        return int(_answer(handle.volatile_uncorrected_ecc))  # type: ignore[arg-type]

    def nvmlDeviceGetRemappedRows(self, handle: FakeGpu) -> tuple[int, int, int, int]:
        answer = _answer(handle.remapped_rows)
        assert isinstance(answer, tuple)
        return answer

    def nvmlDeviceGetTemperature(self, handle: FakeGpu, sensor: int) -> int:
        assert sensor == 0, "asked for the GPU core temperature"
        return int(_answer(handle.temperature_c))  # type: ignore[arg-type]

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeGpu, threshold: int) -> int:
        assert threshold == 1, "asked for the slowdown threshold"
        return int(_answer(handle.slowdown_c))  # type: ignore[arg-type]

    def nvmlDeviceGetPowerUsage(self, handle: FakeGpu) -> int:
        return int(_answer(handle.power_mw))  # type: ignore[arg-type]

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeGpu) -> int:
        return int(_answer(handle.power_limit_mw))  # type: ignore[arg-type]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeGpu) -> int:
        return int(_answer(handle.link_width))  # type: ignore[arg-type]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeGpu) -> int:
        return int(_answer(handle.max_link_width))  # type: ignore[arg-type]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeGpu) -> int:
        return int(_answer(handle.link_generation))  # type: ignore[arg-type]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeGpu) -> int:
        return int(_answer(handle.max_link_generation))  # type: ignore[arg-type]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[SimpleNamespace]:
        return list(handle.processes)

    # -- events ---------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> _EventSet:
        event_set = _EventSet()
        with self.lock:
            self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: FakeGpu, types: int, event_set: _EventSet) -> None:
        assert types & self.nvmlEventTypeXidCriticalError
        _answer(handle.events)
        with self.lock:
            event_set.gpus.add(str(handle.uuid))

    def nvmlEventSetWait(self, event_set: _EventSet, timeout_ms: int) -> SimpleNamespace:
        try:
            return event_set.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError_Timeout() from None

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        event_set.freed = True

    def raise_xid(self, gpu: FakeGpu, xid: int) -> None:
        """Deliver XID ``xid`` of ``gpu`` to every live event set it is registered in."""
        with self.lock:
            sets = [s for s in self.event_sets if str(gpu.uuid) in s.gpus and not s.freed]
        for event_set in sets:
            event_set.events.put(
                SimpleNamespace(
                    device=gpu, eventType=self.nvmlEventTypeXidCriticalError, eventData=xid
                )
            )


__all__ = ["FakeGpu", "FakeNvml", "NVMLError", "NVMLError_NotSupported"]
