"""GPU identity and health as NVML reports them.

:class:`GpuInspector` is the seam the attach path uses to learn which GPU a PCI device is
and whether it is healthy. :class:`NvmlInspector` is the real implementation over the
``pynvml`` module (NVIDIA's ``nvidia-ml-py``). NVML sees only devices bound to the native
``nvidia`` driver: identify a device before binding it to ``vfio-pci``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dxpool.api.v1 import resources_pb2
from dxpool.hostagent.errors import DriverError

MIB = 1024 * 1024

HEALTHY = resources_pb2.GPU_HEALTH_HEALTHY
UNHEALTHY = resources_pb2.GPU_HEALTH_UNHEALTHY
NO_HEALTH_SIGNAL = resources_pb2.GPU_HEALTH_UNSPECIFIED


@dataclass(frozen=True)
class GpuIdentity:
    """What NVML reports about one GPU. ``uuid`` never changes for a physical GPU."""

    uuid: str
    serial: str
    model: str
    memory_mib: int


class GpuInspector(Protocol):
    """Reads identity and health of a GPU at a PCI address on this host.

    Both calls raise :class:`DriverError` when the device cannot be read (absent, bound to
    ``vfio-pci``, or NVML unavailable).
    """

    def identify(self, bdf: str) -> GpuIdentity:
        """Identity of the GPU at ``bdf`` (``"0000:41:00.0"``)."""
        ...

    def health(self, bdf: str) -> resources_pb2.GpuHealth.ValueType:
        """HEALTHY, UNHEALTHY, or UNSPECIFIED when the device gives no health signal."""
        ...


class NvmlInspector:
    """:class:`GpuInspector` over ``pynvml``.

    ``nvml`` is the module to call; None (the default) imports the real ``pynvml``. Tests
    pass a stand-in object with the same functions, constants and error classes.
    ``nvmlInit`` runs once, on first use; :meth:`close` shuts NVML down again.

    Health is UNHEALTHY when retired pages are pending or the volatile uncorrected ECC
    count is above zero. A query NVML answers with ``NVMLError_NotSupported`` gives no
    signal; a device with no bad signal is HEALTHY.
    """

    def __init__(self, nvml: Any | None = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml
        self._lock = threading.Lock()
        self._initialized = False

    def _ensure_initialized(self) -> None:
        with self._lock:
            if self._initialized:
                return
            try:
                self._nvml.nvmlInit()
            except self._nvml.NVMLError as error:
                raise DriverError(
                    f"NVML is not available ({error}); install the NVIDIA driver on this host "
                    "or run the agent with the simulated fabric (--driver sim)"
                ) from error
            self._initialized = True

    def close(self) -> None:
        """Shut NVML down if this inspector initialized it. Idempotent."""
        with self._lock:
            if self._initialized:
                self._initialized = False
                self._nvml.nvmlShutdown()

    def _call(self, what: str, bdf: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self._nvml.NVMLError as error:
            raise DriverError(
                f"NVML could not read {what} of the device at {bdf}: {error}"
            ) from error

    def _handle(self, bdf: str) -> Any:
        self._ensure_initialized()
        # The Python binding calls the C function nvmlDeviceGetHandleByPciBusId_v2.
        return self._call("the handle", bdf, lambda: self._nvml.nvmlDeviceGetHandleByPciBusId(bdf))

    def identify(self, bdf: str) -> GpuIdentity:
        handle = self._handle(bdf)
        nvml = self._nvml
        uuid = _text(self._call("the UUID", bdf, lambda: nvml.nvmlDeviceGetUUID(handle)))
        serial = _text(self._call("the serial", bdf, lambda: nvml.nvmlDeviceGetSerial(handle)))
        name = _text(self._call("the name", bdf, lambda: nvml.nvmlDeviceGetName(handle)))
        memory = self._call("the memory size", bdf, lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        return GpuIdentity(
            uuid=uuid, serial=serial, model=name, memory_mib=int(memory.total) // MIB
        )

    def health(self, bdf: str) -> resources_pb2.GpuHealth.ValueType:
        handle = self._handle(bdf)
        nvml = self._nvml
        pending = self._signal(
            "retired pages pending",
            bdf,
            lambda: (
                nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == nvml.NVML_FEATURE_ENABLED
            ),
        )
        ecc = self._signal(
            "volatile uncorrected ECC errors",
            bdf,
            lambda: (
                nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
                > 0
            ),
        )
        return UNHEALTHY if pending or ecc else HEALTHY

    def _signal(self, what: str, bdf: str, query: Callable[[], bool]) -> bool | None:
        """True for a bad signal, False for a good one, None when NVML does not support it."""
        try:
            return query()
        except self._nvml.NVMLError_NotSupported:
            return None
        except self._nvml.NVMLError as error:
            raise DriverError(
                f"NVML could not read {what} of the device at {bdf}: {error}"
            ) from error


def _text(value: str | bytes) -> str:
    """pynvml returns ``str`` in current releases and ``bytes`` in old ones."""
    return value.decode() if isinstance(value, bytes) else value


__all__ = ["GpuIdentity", "GpuInspector", "NvmlInspector"]
