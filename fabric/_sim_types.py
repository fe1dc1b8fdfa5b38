"""Values and errors of the simulated fabric (re-exported by :mod:`dxpool.fabric.sim`).

Exception hierarchy::

    SimFabricError          base; the message says what failed (also: bad configuration,
    │                       an operation the hardware cannot do, a corrupt state file)
    ├── MappingConflict     the GPU is mapped to another host or slot, or the host slot
    │                       holds another GPU
    ├── UnknownTarget       no such box, slot, host, host slot, device or fabric
    └── InjectedFault       a fault injected by a test or an operator
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

DRIVERS = ("nvidia", "vfio-pci")
FIRST_BUS = 0x41  # host slot 0 appears at bus 0x41, slot 1 at 0x42, ...
MAX_HOST_SLOTS = 0xFF - FIRST_BUS + 1
_PCI_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{4}$")
_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://dxpool.io/sim-fabric/gpu")


class SimFabricError(Exception):
    """Base of every error the simulated fabric raises; the message says what failed."""


class MappingConflict(SimFabricError):  # noqa: N818 (names fixed by the fabric contract)
    """The GPU is already mapped to another host or host slot, or the host slot already
    holds another GPU."""


class Fenced(SimFabricError):  # noqa: N818 (names fixed by the fabric contract)
    """The box side refuses a mapping for a generation that has been fenced."""


class UnknownTarget(SimFabricError):  # noqa: N818 (names fixed by the fabric contract)
    """An unknown box, slot, host, host slot, PCI device, or no fabric in the directory."""


class InjectedFault(SimFabricError):  # noqa: N818 (names fixed by the fabric contract)
    """A fault injected with :meth:`SimFabric.inject_fault`."""


@dataclass(frozen=True)
class SimGpuSpec:
    """One GPU installed in a box slot."""

    model: str
    memory_mib: int
    pci_id: str = "10de:2330"

    def __post_init__(self) -> None:
        if not self.model or not self.model.strip():
            raise SimFabricError("a simulated GPU needs a model name, e.g. 'H100'")
        if isinstance(self.memory_mib, bool) or not isinstance(self.memory_mib, int):
            raise SimFabricError(f"GPU memory_mib must be an integer, got {self.memory_mib!r}")
        if self.memory_mib <= 0:
            raise SimFabricError(f"GPU memory_mib must be positive, got {self.memory_mib}")
        if not _PCI_ID.match(self.pci_id):
            raise SimFabricError(
                f"GPU pci_id {self.pci_id!r} must be 'vendor:device' in lowercase hex, "
                "e.g. '10de:2330'"
            )


@dataclass(frozen=True)
class SimDelays:
    """How long operations take, in seconds. Per process: never stored in the state."""

    map_s: float = 0.0  # a proxy mapping table update (map, unmap, revoke)
    hotplug_s: float = 0.0  # from rescan until the device appears, or until it is removed
    bind_s: float = 0.0  # a driver bind or unbind

    def __post_init__(self) -> None:
        for field in ("map_s", "hotplug_s", "bind_s"):
            if getattr(self, field) < 0:
                raise SimFabricError(f"delay {field} must not be negative")


NO_DELAYS = SimDelays()


@dataclass(frozen=True)
class SimDevice:
    """A PCI device visible on a host's bus."""

    bdf: str  # "0000:{0x41+host_slot:02x}:00.0"
    box: str
    slot: int
    host_slot: int
    driver: str | None  # "nvidia", "vfio-pci" or None (unbound)


@dataclass(frozen=True)
class SimIdentity:
    """What NVML reports for a GPU."""

    uuid: str  # "GPU-" + uuid5 of (box, slot): stable forever
    serial: str
    model: str
    memory_mib: int
    pci_id: str
    healthy: bool


def bdf_for(host_slot: int) -> str:
    """The PCI address a GPU in ``host_slot`` gets on its host."""
    return f"0000:{FIRST_BUS + host_slot:02x}:00.0"


def gpu_uuid(box: str, slot: int) -> str:
    """The stable NVML UUID of the GPU in ``slot`` of ``box``."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{box}/{slot}')}"


def gpu_serial(box: str, slot: int) -> str:
    """The stable 13-digit board serial of the GPU in ``slot`` of ``box``."""
    number = uuid.uuid5(_UUID_NAMESPACE, f"serial:{box}/{slot}").int % 10**12
    return f"1{number:012d}"
