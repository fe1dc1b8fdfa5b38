"""The driver seams over the simulated fabric (:mod:`dxpool.fabric.sim`).

Each seam acts for one host on a shared :class:`~dxpool.fabric.sim.SimFabric`, exactly
where the Linux driver would touch the proxy card, sysfs and NVML. Fabric errors become
:class:`~dxpool.hostagent.errors.DriverError`: mapping conflicts and injected faults are
retryable, unknown targets are not.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from dxpool.fabric.sim import Fenced, MappingConflict, SimFabric, SimFabricError, UnknownTarget
from dxpool.hostagent.driver import (
    DEFAULT_DEVICE_TIMEOUT_S,
    DriverCapabilities,
    ExpectedDevice,
    PciDevice,
    StepDriver,
)
from dxpool.hostagent.errors import AttachConflictError, DeviceTimeoutError, DriverError
from dxpool.hostagent.nvml import HEALTHY, UNHEALTHY, GpuIdentity, HealthReport
from dxpool.names import GpuRef

SIM_CAPABILITIES = DriverCapabilities(
    hotplug=True, surprise_removal=True, vfio=True, p2p=False, identity=True
)
DEVICE_POLL_S = 0.02


@contextmanager
def fabric_errors() -> Iterator[None]:
    """Translate simulated fabric errors into driver errors."""
    try:
        yield
    except MappingConflict as error:
        raise AttachConflictError(str(error)) from error
    except Fenced as error:
        raise DriverError(str(error), retryable=False) from error
    except UnknownTarget as error:
        raise DriverError(str(error), retryable=False) from error
    except SimFabricError as error:
        raise DriverError(str(error)) from error


class SimProxyMapper:
    """:class:`~dxpool.hostagent.driver.ProxyMapper` for ``host`` on a simulated fabric."""

    def __init__(self, fabric: SimFabric, host: str) -> None:
        self._fabric = fabric
        self._host = host

    def map(self, gpu: GpuRef, host_slot: int, generation: int) -> None:
        with fabric_errors():
            self._fabric.map(gpu.box, gpu.slot, self._host, host_slot, generation=generation)

    def unmap(self, gpu: GpuRef) -> None:
        with fabric_errors():
            self._fabric.unmap(gpu.box, gpu.slot, self._host)

    def mappings(self) -> dict[int, GpuRef]:
        with fabric_errors():
            table = self._fabric.mappings(self._host)
        return {host_slot: GpuRef(box, slot) for host_slot, (box, slot) in table.items()}

    def fence(self, host: str) -> list[GpuRef]:
        with fabric_errors():
            dropped = self._fabric.fence_host(host)
        return [GpuRef(box, slot) for box, slot in dropped]


class SimPciBus:
    """:class:`~dxpool.hostagent.driver.PciBus` of ``host`` on a simulated fabric."""

    def __init__(self, fabric: SimFabric, host: str, *, poll_s: float = DEVICE_POLL_S) -> None:
        self._fabric = fabric
        self._host = host
        self._poll_s = poll_s

    def rescan(self) -> None:
        with fabric_errors():
            self._fabric.rescan(self._host)

    def devices(self) -> list[PciDevice]:
        with fabric_errors():
            found = self._fabric.devices(self._host)
        return [PciDevice(bdf=d.bdf, host_slot=d.host_slot, driver=d.driver) for d in found]

    def wait_for_device(
        self, host_slot: int, timeout_s: float, expected: ExpectedDevice | None = None
    ) -> PciDevice:
        """The device at ``host_slot`` once present. ``expected`` is not checked: the
        simulated bus has no configuration space (the simulated NVML checks identity)."""
        deadline = time.monotonic() + timeout_s
        while True:
            device = next((d for d in self.devices() if d.host_slot == host_slot), None)
            if device is not None:
                return device
            if time.monotonic() >= deadline:
                raise DeviceTimeoutError(
                    f"no PCI device appeared at host slot {host_slot} of {self._host} within "
                    f"{timeout_s:g}s after a rescan"
                )
            time.sleep(self._poll_s)

    def remove(self, bdf: str) -> None:
        with fabric_errors():
            self._fabric.remove_device(self._host, bdf)

    def bind(self, bdf: str, driver: str | None) -> None:
        with fabric_errors():
            self._fabric.bind(self._host, bdf, driver)

    def reset(self, bdf: str) -> None:
        with fabric_errors():
            self._fabric.reset(self._host, bdf)


class SimNvml:
    """:class:`~dxpool.hostagent.nvml.GpuInspector` of ``host`` on a simulated fabric.

    Like NVML it cannot read a device bound to ``vfio-pci``.
    """

    def __init__(self, fabric: SimFabric, host: str) -> None:
        self._fabric = fabric
        self._host = host

    def identify(self, bdf: str) -> GpuIdentity:
        with fabric_errors():
            found = self._fabric.identity(self._host, bdf)
        return GpuIdentity(
            uuid=found.uuid, serial=found.serial, model=found.model, memory_mib=found.memory_mib
        )

    def compute_processes(self, bdf: str) -> list[int]:
        """Simulated GPUs run no processes; the device must exist, as for NVML."""
        with fabric_errors():
            self._fabric.identity(self._host, bdf)
        return []

    def health(self, bdf: str) -> HealthReport:
        with fabric_errors():
            found = self._fabric.identity(self._host, bdf)
        if found.healthy:
            return HealthReport(HEALTHY)
        return HealthReport(UNHEALTHY, "marked unhealthy in the simulated fabric")


def make_sim_driver(
    fabric: SimFabric, host_id: str, *, device_timeout_s: float = DEFAULT_DEVICE_TIMEOUT_S
) -> StepDriver:
    """A :class:`StepDriver` for ``host_id`` on ``fabric``."""
    return StepDriver(
        proxy=SimProxyMapper(fabric, host_id),
        bus=SimPciBus(fabric, host_id),
        inspector=SimNvml(fabric, host_id),
        capabilities=SIM_CAPABILITIES,
        device_timeout_s=device_timeout_s,
    )


__all__ = ["SIM_CAPABILITIES", "SimNvml", "SimPciBus", "SimProxyMapper", "make_sim_driver"]
