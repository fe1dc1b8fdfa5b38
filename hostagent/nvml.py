"""GPU identity and health as NVML reports them.

:class:`GpuInspector` is the seam the attach path uses to learn which GPU a PCI device is
and whether it is healthy. :class:`NvmlInspector` is the real implementation over the
``pynvml`` module (NVIDIA's ``nvidia-ml-py``). NVML sees only devices bound to the native
``nvidia`` driver: identify a device before binding it to ``vfio-pci`` (after that, the
PCI bus reads its vendor/device id and serial number from configuration space).

Health is read in two steps: :meth:`NvmlInspector.readout` gathers NVML's raw answers
(:class:`HealthReadout`), :func:`assess` maps them to HEALTHY, DEGRADED or UNHEALTHY with
a reason (:class:`HealthReport`):

=====================================================  ==========
signal                                                 verdict
=====================================================  ==========
volatile uncorrected ECC errors > 0                    UNHEALTHY
row remapping failed                                   UNHEALTHY
a critical XID other than the application ones         UNHEALTHY
the GPU is lost (NVML: GPU is lost)                    UNHEALTHY
row remap or page retirement pending (a reset applies  DEGRADED
it), XID 63 or 92
temperature at or above the slowdown threshold         DEGRADED
power draw above the enforced limit                    DEGRADED
PCIe link narrower than its maximum width              DEGRADED
=====================================================  ==========

The PCIe link *generation* is read but not judged: GPUs lower it when idle to save power.
A query NVML answers with ``NVMLError_NotSupported`` gives no signal.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dxpool.api.v1 import resources_pb2
from dxpool.hostagent.errors import DriverError
from dxpool.hostagent.xid import DEFAULT_WAIT_MS, XidEvent, XidWatcher

MIB = 1024 * 1024

HEALTHY = resources_pb2.GPU_HEALTH_HEALTHY
DEGRADED = resources_pb2.GPU_HEALTH_DEGRADED
UNHEALTHY = resources_pb2.GPU_HEALTH_UNHEALTHY
NO_HEALTH_SIGNAL = resources_pb2.GPU_HEALTH_UNSPECIFIED
_SEVERITY = {NO_HEALTH_SIGNAL: 0, HEALTHY: 1, DEGRADED: 2, UNHEALTHY: 3}


@dataclass(frozen=True)
class GpuIdentity:
    """What NVML reports about one GPU. ``uuid`` never changes for a physical GPU.
    ``pci_bus_id`` is NVML's address of it, in sysfs form (``"0000:41:00.0"``)."""

    uuid: str
    serial: str
    model: str
    memory_mib: int
    pci_bus_id: str = ""


@dataclass(frozen=True)
class HealthReport:
    """A health verdict and why: ``reason`` is empty for HEALTHY and no signal."""

    state: resources_pb2.GpuHealth.ValueType
    reason: str = ""


NO_HEALTH_REPORT = HealthReport(NO_HEALTH_SIGNAL)


@dataclass(frozen=True)
class HealthReadout:
    """NVML's raw health answers for one GPU; None where NVML does not support a query."""

    ecc_volatile_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    temperature_c: int | None = None
    slowdown_temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    link_width: int | None = None
    max_link_width: int | None = None
    link_generation: int | None = None
    max_link_generation: int | None = None
    lost: bool = False
    xid: XidEvent | None = None
    xid_supported: bool | None = None


def assess(readout: HealthReadout) -> HealthReport:
    """The verdict on ``readout``: the worst finding wins; reasons of equal weight are
    joined with "; ". HEALTHY when nothing is wrong."""
    findings: list[tuple[resources_pb2.GpuHealth.ValueType, str]] = []
    if readout.lost:
        findings.append((UNHEALTHY, "NVML reports the GPU lost (fallen off the bus)"))
    if readout.ecc_volatile_uncorrected:
        findings.append(
            (UNHEALTHY, f"{readout.ecc_volatile_uncorrected} volatile uncorrected ECC errors")
        )
    if readout.remapped_rows_failed:
        findings.append((UNHEALTHY, "row remapping failed"))
    if readout.xid is not None:
        findings.append(
            (DEGRADED if readout.xid.degrades_only else UNHEALTHY, readout.xid.describe())
        )
    if readout.remapped_rows_pending:
        findings.append((DEGRADED, "row remapping pending (a GPU reset applies it)"))
    if readout.retired_pages_pending:
        findings.append((DEGRADED, "page retirement pending (a GPU reset applies it)"))
    if (
        readout.temperature_c is not None
        and readout.slowdown_temperature_c is not None
        and readout.temperature_c >= readout.slowdown_temperature_c
    ):
        findings.append(
            (
                DEGRADED,
                f"temperature {readout.temperature_c} C at or above the slowdown threshold "
                f"{readout.slowdown_temperature_c} C",
            )
        )
    if (
        readout.power_w is not None
        and readout.power_limit_w is not None
        and readout.power_w > readout.power_limit_w
    ):
        findings.append(
            (
                DEGRADED,
                f"drawing {readout.power_w:.0f} W, above its {readout.power_limit_w:.0f} W limit",
            )
        )
    if (
        readout.link_width is not None
        and readout.max_link_width is not None
        and readout.link_width < readout.max_link_width
    ):
        findings.append(
            (
                DEGRADED,
                f"PCIe link x{readout.link_width}, narrower than its x{readout.max_link_width}",
            )
        )
    if not findings:
        return HealthReport(HEALTHY)
    worst = max(_SEVERITY[state] for state, _ in findings)
    state = next(state for state, _ in findings if _SEVERITY[state] == worst)
    return HealthReport(state, "; ".join(text for s, text in findings if _SEVERITY[s] == worst))


class GpuInspector(Protocol):
    """Reads identity and health of a GPU at a PCI address on this host.

    Both calls raise :class:`DriverError` when the device cannot be read (absent, bound to
    ``vfio-pci``, or NVML unavailable).
    """

    def identify(self, bdf: str) -> GpuIdentity:
        """Identity of the GPU at ``bdf`` (``"0000:41:00.0"``)."""
        ...

    def health(self, bdf: str) -> HealthReport:
        """HEALTHY, DEGRADED or UNHEALTHY with a reason, or no signal (UNSPECIFIED)."""
        ...

    def compute_processes(self, bdf: str) -> list[int]:
        """Process ids of the compute processes running on the GPU (empty when none, or
        when the device cannot tell)."""
        ...


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's ``"00000000:41:00.0"`` as sysfs writes it: ``"0000:41:00.0"``."""
    domain, _, rest = nvml_bus_id.strip().lower().partition(":")
    return f"{domain[-4:].rjust(4, '0')}:{rest}" if rest else nvml_bus_id.strip().lower()


class NvmlInspector:
    """:class:`GpuInspector` over ``pynvml``.

    ``nvml`` is the module to call; None (the default) imports the real ``pynvml``. Tests
    pass a stand-in object with the same functions, constants and error classes.
    ``nvmlInit`` runs once, on first use, and starts the XID watcher thread (unless
    ``watch_xids`` is False); :meth:`close` stops it and shuts NVML down again.

    A device NVML does not find is looked up once more after initializing NVML anew, since
    NVML may enumerate GPUs only at initialization and ours are hot-added.
    """

    def __init__(
        self,
        nvml: Any | None = None,
        *,
        watch_xids: bool = True,
        xid_wait_ms: int = DEFAULT_WAIT_MS,
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml
        self._lock = threading.Lock()
        self._initialized = False
        self._epoch = 0  # counts initializations, so concurrent callers re-init once
        self._watch_xids = watch_xids
        self._xids = XidWatcher(nvml, wait_ms=xid_wait_ms)

    @property
    def xids(self) -> XidWatcher:
        return self._xids

    def _ensure_initialized(self) -> int:
        with self._lock:
            if not self._initialized:
                try:
                    self._nvml.nvmlInit()
                except self._nvml.NVMLError as error:
                    raise DriverError(
                        f"NVML is not available ({error}); install the NVIDIA driver on this "
                        "host or run the agent with the simulated fabric (--driver sim)"
                    ) from error
                self._initialized = True
                self._epoch += 1
                if self._watch_xids:
                    self._xids.start()
            return self._epoch

    def _reinitialize(self, epoch: int) -> None:
        with self._lock:
            if not self._initialized or self._epoch != epoch:
                return  # someone else did it since this caller looked
            self._initialized = False
        self._xids.stop()
        with contextlib.suppress(self._nvml.NVMLError):  # initializing again is what matters
            self._nvml.nvmlShutdown()
        self._ensure_initialized()

    def close(self) -> None:
        """Stop the XID watcher and shut NVML down if this inspector initialized it.
        Idempotent."""
        self._xids.stop()
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
        epoch = self._ensure_initialized()
        # The Python binding calls the C function nvmlDeviceGetHandleByPciBusId_v2.
        try:
            return self._nvml.nvmlDeviceGetHandleByPciBusId(bdf)
        except self._nvml.NVMLError_NotFound:
            self._reinitialize(epoch)
        except self._nvml.NVMLError:
            pass  # reported by the second attempt below
        return self._call("the handle", bdf, lambda: self._nvml.nvmlDeviceGetHandleByPciBusId(bdf))

    def identify(self, bdf: str) -> GpuIdentity:
        handle = self._handle(bdf)
        nvml = self._nvml
        uuid = _text(self._call("the UUID", bdf, lambda: nvml.nvmlDeviceGetUUID(handle)))
        serial = _text(self._call("the serial", bdf, lambda: nvml.nvmlDeviceGetSerial(handle)))
        name = _text(self._call("the name", bdf, lambda: nvml.nvmlDeviceGetName(handle)))
        memory = self._call("the memory size", bdf, lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        pci = self._call("the PCI info", bdf, lambda: nvml.nvmlDeviceGetPciInfo(handle))
        return GpuIdentity(
            uuid=uuid,
            serial=serial,
            model=name,
            memory_mib=int(memory.total) // MIB,
            pci_bus_id=sysfs_bus_id(_text(pci.busId)),
        )

    def health(self, bdf: str) -> HealthReport:
        return assess(self.readout(bdf))

    def compute_processes(self, bdf: str) -> list[int]:
        handle = self._handle(bdf)
        try:
            running = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except self._nvml.NVMLError_NotSupported:
            return []
        except self._nvml.NVMLError as error:
            raise DriverError(
                f"NVML could not list the compute processes of the device at {bdf}: {error}"
            ) from error
        return sorted({int(process.pid) for process in running})

    def readout(self, bdf: str) -> HealthReadout:
        """NVML's raw health answers for the GPU at ``bdf``."""
        handle = self._handle(bdf)
        nvml = self._nvml
        lost = False

        def query(what: str, fn: Callable[[], Any]) -> Any:
            nonlocal lost
            try:
                return fn()
            except nvml.NVMLError_NotSupported:
                return None
            except nvml.NVMLError_GpuIsLost:
                lost = True
                return None
            except nvml.NVMLError as error:
                raise DriverError(
                    f"NVML could not read {what} of the device at {bdf}: {error}"
                ) from error

        ecc = query(
            "volatile uncorrected ECC errors",
            lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            ),
        )
        retired = query(
            "retired pages pending",
            lambda: (
                nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == nvml.NVML_FEATURE_ENABLED
            ),
        )
        remapped = query("remapped rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        temperature = query(
            "the temperature",
            lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        )
        slowdown = query(
            "the slowdown temperature",
            lambda: nvml.nvmlDeviceGetTemperatureThreshold(
                handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            ),
        )
        power_mw = query("the power draw", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        limit_mw = query("the power limit", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
        width = query("the PCIe link width", lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
        max_width = query(
            "the maximum PCIe link width", lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
        )
        generation = query(
            "the PCIe link generation", lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        )
        max_generation = query(
            "the maximum PCIe link generation",
            lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle),
        )
        xid: XidEvent | None = None
        xid_supported: bool | None = None
        if self._watch_xids and not lost:
            uuid = _text(self._call("the UUID", bdf, lambda: nvml.nvmlDeviceGetUUID(handle)))
            xid_supported = query("XID events", lambda: self._xids.watch(uuid, handle))
            xid = self._xids.latest(uuid)
        return HealthReadout(
            ecc_volatile_uncorrected=None if ecc is None else int(ecc),
            retired_pages_pending=retired,
            remapped_rows_pending=None if remapped is None else bool(remapped[2]),
            remapped_rows_failed=None if remapped is None else bool(remapped[3]),
            temperature_c=temperature,
            slowdown_temperature_c=slowdown,
            power_w=None if power_mw is None else power_mw / 1000,
            power_limit_w=None if limit_mw is None else limit_mw / 1000,
            link_width=width,
            max_link_width=max_width,
            link_generation=generation,
            max_link_generation=max_generation,
            lost=lost,
            xid=xid,
            xid_supported=xid_supported,
        )


def _text(value: str | bytes) -> str:
    """pynvml returns ``str`` in current releases and ``bytes`` in old ones."""
    return value.decode() if isinstance(value, bytes) else value


__all__ = [
    "DEGRADED",
    "HEALTHY",
    "NO_HEALTH_REPORT",
    "NO_HEALTH_SIGNAL",
    "UNHEALTHY",
    "GpuIdentity",
    "GpuInspector",
    "HealthReadout",
    "HealthReport",
    "NvmlInspector",
    "assess",
    "sysfs_bus_id",
]
