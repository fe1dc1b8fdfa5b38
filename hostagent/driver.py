"""The fabric driver interface and the step-by-step driver built from three seams.

A :class:`FabricDriver` makes one host's hardware hold the GPUs asked of it. The
:class:`StepDriver` implements it the way every real fabric does, from three seams:

* :class:`ProxyMapper` - the host-side proxy's mapping table (host slot -> box GPU);
* :class:`PciBus` - the host's PCIe bus (rescan, wait for a device, remove, bind a driver);
* :class:`~dxpool.hostagent.nvml.GpuInspector` - identity and health from NVML.

Attach is map -> rescan -> wait for the device -> identify -> verify -> bind ``vfio-pci`` if
asked. Identification comes before the ``vfio-pci`` bind because NVML cannot see a device
bound to ``vfio-pci``. Detach is unbind -> remove the device -> unmap.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Protocol

from dxpool.api.v1 import resources_pb2
from dxpool.hostagent.errors import (
    AttachConflictError,
    DriverError,
    GpuBusyError,
    IdentityMismatchError,
    ScrubError,
)
from dxpool.hostagent.nvml import NO_HEALTH_REPORT, NO_HEALTH_SIGNAL, GpuIdentity, GpuInspector
from dxpool.names import GpuRef

log = logging.getLogger(__name__)

NATIVE_DRIVER = "nvidia"
VFIO_DRIVER = "vfio-pci"
DEFAULT_DEVICE_TIMEOUT_S = 30.0
BDF_PATTERN = re.compile(r"\A[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\Z")  # as sysfs writes it
# A PCIe Device Serial Number as the bus shows it: eight bytes, "01-23-45-67-89-ab-cd-ef".
DSN_PATTERN = re.compile(r"\A[0-9a-fA-F]{2}(?:-[0-9a-fA-F]{2}){7}\Z")


@dataclass(frozen=True)
class DriverCapabilities:
    """What a fabric driver supports, so callers never test its type.

    ``hotplug``: GPUs can be added and removed while the host runs.
    ``surprise_removal``: the host survives a GPU vanishing without a prior remove.
    ``vfio``: devices can be bound to ``vfio-pci`` for a VM.
    ``p2p``: peer-to-peer transfers between GPUs of one host work across the fabric.
    ``identity``: the driver verifies GPU identity (UUID, model) on attach.
    ``slot_power``: slots have power control, so a removed GPU's slot is powered off.
    """

    hotplug: bool
    surprise_removal: bool
    vfio: bool
    p2p: bool
    identity: bool
    slot_power: bool = False


@dataclass(frozen=True)
class AttachRequest:
    """One GPU wanted at one host slot.

    ``expected_uuid``, ``expected_serial`` and ``model`` are verified against NVML when
    not empty; ``pci_id`` (``"10de:2330"``) against the device's configuration space when
    not empty, and so is ``expected_serial`` when it has the form of a PCIe Device Serial
    Number (``"01-23-45-67-89-ab-cd-ef"``); ``vfio`` asks for the device bound to
    ``vfio-pci`` instead of the native driver.
    """

    gpu: GpuRef
    host_slot: int
    vfio: bool = False
    expected_uuid: str = ""
    model: str = ""
    generation: int = 0  # the assignment's fencing token, carried by the mapping
    pci_id: str = ""
    expected_serial: str = ""

    def __post_init__(self) -> None:
        if self.host_slot < 0:
            raise ValueError(f"host_slot must be >= 0, got {self.host_slot}")

    @property
    def expected_device(self) -> ExpectedDevice:
        """What the bus checks in the device's configuration space."""
        dsn = self.expected_serial if DSN_PATTERN.fullmatch(self.expected_serial) else ""
        return ExpectedDevice(pci_id=self.pci_id, dsn=dsn)

    @property
    def kernel_driver(self) -> str:
        """The kernel driver the device must end up bound to, with NVIDIA's driver as the
        native one (a driver with another native driver asks :meth:`AttachedGpu.wanted_driver`)."""
        return VFIO_DRIVER if self.vfio else NATIVE_DRIVER


@dataclass(frozen=True)
class ExpectedDevice:
    """What the device at a host slot must be, each part checked when not empty: the PCI
    ``vendor:device`` id (``"10de:2330"``) and the Device Serial Number (``"01-23-..-ef"``)."""

    pci_id: str = ""
    dsn: str = ""


@dataclass(frozen=True)
class PciDevice:
    """A PCI device on the host bus, at the address its host slot gives it.

    ``pci_id`` and ``dsn`` come from its configuration space, empty where the bus cannot
    read them. They stay readable while the device is bound to ``vfio-pci``, when NVML
    cannot see it.
    """

    bdf: str
    host_slot: int
    driver: str | None  # "nvidia", "vfio-pci", or None when unbound
    pci_id: str = ""
    dsn: str = ""


@dataclass(frozen=True)
class AttachedGpu:
    """A GPU mapped to this host, as the hardware shows it.

    ``bdf`` is empty while the mapping exists but the device has not appeared on the bus
    (a partial attach). ``identity`` is None when NVML cannot read the device and no
    earlier reading of it is known (bound to ``vfio-pci`` or unbound). ``native_driver``
    is the kernel driver the host runs its GPUs on when they are not passed to a VM.
    """

    gpu: GpuRef
    host_slot: int
    bdf: str = ""
    driver: str | None = None
    identity: GpuIdentity | None = None
    health: resources_pb2.GpuHealth.ValueType = NO_HEALTH_SIGNAL
    health_reason: str = ""
    native_driver: str = NATIVE_DRIVER

    @property
    def present(self) -> bool:
        """True once the device is on the host's PCI bus."""
        return bool(self.bdf)

    def satisfies(self, request: AttachRequest) -> bool:
        """True when this is the attachment ``request`` asks for: the same host slot, the
        device present and bound to the asked driver, and no known identity contradicting
        the request."""
        return (
            request.gpu == self.gpu
            and request.host_slot == self.host_slot
            and self.present
            and self.driver == self.wanted_driver(request)
            and (self.identity is None or identity_problem(request, self.identity) is None)
        )

    def wanted_driver(self, request: AttachRequest) -> str:
        """The kernel driver ``request`` wants the device bound to on this host."""
        return VFIO_DRIVER if request.vfio else self.native_driver


def model_matches(wanted: str, reported: str) -> bool:
    """True when NVML's device name ``reported`` is the model ``wanted``.

    NVML names read like ``"NVIDIA H100 80GB HBM3"`` where requests say ``"H100"``: the
    model matches when equal to the name or to one of its words, ignoring case.
    """
    wanted_folded = wanted.strip().casefold()
    reported_folded = reported.strip().casefold()
    return wanted_folded == reported_folded or wanted_folded in reported_folded.split()


def identity_problem(request: AttachRequest, identity: GpuIdentity) -> str | None:
    """Why ``identity`` is not the GPU ``request`` asks for, or None when it is."""
    if request.expected_uuid and identity.uuid != request.expected_uuid:
        return (
            f"{request.gpu.name} reports UUID {identity.uuid}, expected {request.expected_uuid}; "
            "the box slot holds a different GPU than the inventory says"
        )
    if (
        request.expected_serial
        and identity.serial
        and not DSN_PATTERN.fullmatch(request.expected_serial)
        and identity.serial != request.expected_serial
    ):
        return (
            f"{request.gpu.name} reports serial {identity.serial}, expected "
            f"{request.expected_serial}; the box slot holds a different GPU than the one "
            "first attached there"
        )
    if request.model and not model_matches(request.model, identity.model):
        return (
            f"{request.gpu.name} reports model {identity.model!r}, expected {request.model!r}; "
            "correct the box's GPU model in the inventory"
        )
    return None


class FabricDriver(Protocol):
    """Makes this host's hardware hold GPUs. Implementations are safe to call from several
    threads for different GPUs; callers never act on one GPU from two threads at once."""

    @property
    def capabilities(self) -> DriverCapabilities:
        """What this driver supports."""
        ...

    def attach(self, request: AttachRequest) -> AttachedGpu:
        """Attach ``request.gpu`` at ``request.host_slot`` and return it as attached.

        Idempotent: a GPU already attached as asked is returned without touching hardware,
        and a partial attach left by a crash is completed. Raises :class:`AttachConflictError`
        when the GPU is mapped at another host slot (detach it first) and
        :class:`IdentityMismatchError` when the device is not the GPU asked for; in that case
        the GPU is detached again before the error is raised.
        """
        ...

    def detach(self, gpu: GpuRef, *, force: bool = False) -> None:
        """Remove ``gpu`` from this host: unbind, hot-remove the device, unmap.

        Idempotent: detaching a GPU that is not attached is a no-op, and a partial detach
        left by a crash is completed. Raises :class:`GpuBusyError`, touching nothing,
        while compute processes run on the GPU, unless ``force``; a GPU whose processes
        cannot be read (NVML cannot see it) is detached.
        """
        ...

    def scrub(self, gpu: GpuRef, *, force: bool = False) -> None:
        """Reset ``gpu`` on this host and check that it is healthy, so nothing of its last
        tenant reaches the next one; the GPU stays attached (bound to the native driver).

        Raises :class:`GpuBusyError`, touching nothing, while compute processes run on
        it, unless ``force``; :class:`ScrubError` when it is not healthy after the reset;
        :class:`DriverError` when it is not mapped here, its device is not on the bus, or
        the reset failed. Safe to call again after any failure.
        """
        ...

    def observe(self) -> dict[GpuRef, AttachedGpu]:
        """Every GPU mapped to this host, read from the hardware (not from memory of past
        calls), including partial attachments whose device is not present."""
        ...


class ProxyMapper(Protocol):
    """The host-side proxy's mapping table for one host. Raises :class:`DriverError`."""

    def map(self, gpu: GpuRef, host_slot: int, generation: int) -> None:
        """Map ``gpu`` to ``host_slot`` for the assignment of ``generation``. Idempotent
        for the identical mapping; :class:`AttachConflictError` when the GPU is mapped
        elsewhere or the slot is taken. ``generation`` is a fencing token: the box side
        refuses (a non-retryable :class:`DriverError`) a mapping for a generation the
        broker has fenced, so a stale agent can never map a GPU that was reclaimed."""
        ...

    def unmap(self, gpu: GpuRef) -> None:
        """Drop ``gpu``'s mapping on this host; a no-op if it is not mapped here."""
        ...

    def mappings(self) -> dict[int, GpuRef]:
        """Host slot -> GPU, for every mapping on this host."""
        ...

    def fence(self, host: str) -> list[GpuRef]:
        """Revoke, at the box side, every mapping ``host`` holds, and return the GPUs whose
        mappings were dropped.

        ``host`` may be any host of the fabric, not only the one this mapper serves: the
        caller is whoever must cut a host off (the broker, for a lost host), never that
        host's own agent. Only ``host``'s mappings are touched; a mapping another host
        holds, or takes while the fence runs, is left alone. The revocation holds no
        matter what the fenced host does: its proxy cannot reach a GPU whose box-side
        mapping is gone. Idempotent: fencing a host with nothing mapped is a no-op and
        returns an empty list. Raises :class:`DriverError` when the box side could not
        be reached or refused; some mappings may then be revoked already, and calling
        it again finishes the job."""
        ...


class PciBus(Protocol):
    """The host's PCIe bus. Raises :class:`DriverError`."""

    def rescan(self) -> None:
        """Rescan the bus so mapped GPUs appear as devices. Idempotent."""
        ...

    def devices(self) -> list[PciDevice]:
        """Every fabric-attached device now on the bus."""
        ...

    def wait_for_device(
        self, host_slot: int, timeout_s: float, expected: ExpectedDevice | None = None
    ) -> PciDevice:
        """The device at ``host_slot`` once present; :class:`DeviceTimeoutError` after
        ``timeout_s``. A bus that reads configuration space checks ``expected`` and raises
        :class:`IdentityMismatchError` for another device."""
        ...

    def remove(self, bdf: str) -> None:
        """Hot-remove the device at ``bdf``; a no-op if it is absent."""
        ...

    def bind(self, bdf: str, driver: str | None) -> None:
        """Bind the device at ``bdf`` to ``driver`` ("nvidia", "vfio-pci"), or unbind it
        with None. Binding the driver it already has is a no-op."""
        ...

    def reset(self, bdf: str) -> None:
        """Reset the device at ``bdf`` (function-level or bus reset, as the kernel
        chooses); it must be unbound. :class:`DriverError` when it is absent or the reset
        failed."""
        ...


class StepDriver:
    """:class:`FabricDriver` from a proxy mapper, a PCI bus and a GPU inspector.

    Identities read before a ``vfio-pci`` bind are remembered per GPU and device (address,
    PCI id, serial number), so :meth:`observe` can still name a GPU that NVML can no longer
    see, as long as the device's configuration space says it is the same device; every
    other field of an observation is read from the hardware. ``native_driver`` is the
    kernel driver GPUs run on when not passed to a VM (``nvidia``; a stand-in device's own
    driver where the bus carries one, as in the real-kernel tests).
    """

    def __init__(
        self,
        *,
        proxy: ProxyMapper,
        bus: PciBus,
        inspector: GpuInspector,
        capabilities: DriverCapabilities,
        device_timeout_s: float = DEFAULT_DEVICE_TIMEOUT_S,
        native_driver: str = NATIVE_DRIVER,
    ) -> None:
        if device_timeout_s <= 0:
            raise ValueError(f"device_timeout_s must be > 0, got {device_timeout_s}")
        self._native = native_driver
        self._proxy = proxy
        self._bus = bus
        self._inspector = inspector
        self._capabilities = capabilities
        self._device_timeout_s = device_timeout_s
        self._identities: dict[GpuRef, tuple[PciDevice, GpuIdentity]] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> DriverCapabilities:
        return self._capabilities

    def attach(self, request: AttachRequest) -> AttachedGpu:
        if request.vfio and not self._capabilities.vfio:
            raise DriverError(
                f"{request.gpu.name} asks for vfio-pci, which this fabric driver does not support",
                retryable=False,
            )
        current = self.observe().get(request.gpu)
        if current is not None and current.satisfies(request):
            return current
        if current is not None and current.host_slot != request.host_slot:
            raise AttachConflictError(
                f"{request.gpu.name} is mapped at host slot {current.host_slot}, not "
                f"{request.host_slot}; detach it first"
            )
        self._proxy.map(request.gpu, request.host_slot, request.generation)
        self._bus.rescan()
        try:
            device = self._bus.wait_for_device(
                request.host_slot, self._device_timeout_s, request.expected_device
            )
        except IdentityMismatchError:
            self._roll_back(request.gpu)
            raise
        if device.driver != self._native:
            self._bus.bind(device.bdf, self._native)
        identity = self._inspector.identify(device.bdf)
        problem = identity_problem(request, identity)
        if problem is not None:
            self._roll_back(request.gpu)
            raise IdentityMismatchError(problem)
        self._remember(request.gpu, device, identity)
        health = self._inspector.health(device.bdf)
        if request.vfio:
            self._bus.bind(device.bdf, VFIO_DRIVER)
        return AttachedGpu(
            gpu=request.gpu,
            host_slot=request.host_slot,
            bdf=device.bdf,
            driver=VFIO_DRIVER if request.vfio else self._native,
            identity=identity,
            health=health.state,
            health_reason=health.reason,
            native_driver=self._native,
        )

    def _roll_back(self, gpu: GpuRef) -> None:
        try:
            self.detach(gpu, force=True)  # just attached and not the GPU asked for
        except DriverError:
            log.exception("rollback of a mismatched gpu failed", extra={"gpu": gpu.name})

    def detach(self, gpu: GpuRef, *, force: bool = False) -> None:
        host_slot = next((slot for slot, ref in self._proxy.mappings().items() if ref == gpu), None)
        if host_slot is not None:
            device = next((d for d in self._bus.devices() if d.host_slot == host_slot), None)
            if device is not None:
                if not force and device.driver == self._native:
                    self._refuse_if_busy(gpu, device.bdf)
                if device.driver is not None:
                    self._bus.bind(device.bdf, None)
                self._bus.remove(device.bdf)
            self._proxy.unmap(gpu)
        self._forget(gpu)

    def scrub(self, gpu: GpuRef, *, force: bool = False) -> None:
        host_slot = next((slot for slot, ref in self._proxy.mappings().items() if ref == gpu), None)
        if host_slot is None:
            raise DriverError(f"{gpu.name} is not mapped to this host; nothing to scrub")
        device = next((d for d in self._bus.devices() if d.host_slot == host_slot), None)
        if device is None:
            raise DriverError(
                f"{gpu.name} is mapped at host slot {host_slot} but its device is not on the "
                "bus; it cannot be reset from this host"
            )
        if not force and device.driver == self._native:
            self._refuse_if_busy(gpu, device.bdf)
        if device.driver is not None:
            self._bus.bind(device.bdf, None)
        self._bus.reset(device.bdf)
        self._bus.bind(device.bdf, self._native)
        health = self._inspector.health(device.bdf)
        if health.state == resources_pb2.GPU_HEALTH_UNHEALTHY:
            raise ScrubError(
                f"{gpu.name} at {device.bdf} is unhealthy after a reset: "
                f"{health.reason or 'no reason given'}"
            )

    def _refuse_if_busy(self, gpu: GpuRef, bdf: str) -> None:
        try:
            pids = self._inspector.compute_processes(bdf)
        except DriverError as error:
            log.warning(
                "compute processes not readable; detaching",
                extra={"gpu": gpu.name, "bdf": bdf, "error": str(error)},
            )
            return
        if pids:
            shown = ", ".join(str(pid) for pid in pids[:8]) + (", ..." if len(pids) > 8 else "")
            raise GpuBusyError(
                f"{gpu.name} at {bdf} still runs {len(pids)} compute process(es) (pids {shown}); "
                "stop them to release the GPU",
                tuple(pids),
            )

    def observe(self) -> dict[GpuRef, AttachedGpu]:
        mappings = self._proxy.mappings()
        devices = {device.host_slot: device for device in self._bus.devices()}
        return {
            gpu: self._describe(gpu, host_slot, devices.get(host_slot))
            for host_slot, gpu in mappings.items()
        }

    def _describe(self, gpu: GpuRef, host_slot: int, device: PciDevice | None) -> AttachedGpu:
        if device is None:
            return AttachedGpu(gpu=gpu, host_slot=host_slot, native_driver=self._native)
        identity = self._remembered(gpu, device)
        health = NO_HEALTH_REPORT
        if device.driver == self._native:
            try:
                identity = self._inspector.identify(device.bdf)
                health = self._inspector.health(device.bdf)
            except DriverError as error:
                log.warning(
                    "gpu not readable by nvml",
                    extra={"gpu": gpu.name, "bdf": device.bdf, "error": str(error)},
                )
            else:
                self._remember(gpu, device, identity)
        return AttachedGpu(
            gpu=gpu,
            host_slot=host_slot,
            bdf=device.bdf,
            driver=device.driver,
            identity=identity,
            health=health.state,
            health_reason=health.reason,
            native_driver=self._native,
        )

    def _remember(self, gpu: GpuRef, device: PciDevice, identity: GpuIdentity) -> None:
        with self._lock:
            self._identities[gpu] = (device, identity)

    def _remembered(self, gpu: GpuRef, device: PciDevice) -> GpuIdentity | None:
        """The identity NVML gave for ``gpu`` while it was ``device``, if the device now at
        that address is still the same one: same address and, where configuration space
        is readable, the same PCI id and serial number."""
        with self._lock:
            known = self._identities.get(gpu)
        if known is None:
            return None
        seen, identity = known
        if seen.bdf != device.bdf:
            return None
        if seen.pci_id and device.pci_id and seen.pci_id != device.pci_id:
            return None
        if seen.dsn and device.dsn and seen.dsn != device.dsn:
            return None
        return identity

    def _forget(self, gpu: GpuRef) -> None:
        with self._lock:
            self._identities.pop(gpu, None)


__all__ = [
    "BDF_PATTERN",
    "DSN_PATTERN",
    "NATIVE_DRIVER",
    "VFIO_DRIVER",
    "AttachRequest",
    "AttachedGpu",
    "DriverCapabilities",
    "ExpectedDevice",
    "FabricDriver",
    "PciBus",
    "PciDevice",
    "ProxyMapper",
    "StepDriver",
    "identity_problem",
    "model_matches",
]
