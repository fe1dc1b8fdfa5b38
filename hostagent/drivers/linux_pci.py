"""The host's real PCIe bus through Linux sysfs: :class:`SysfsPciBus`.

Each host-side proxy slot sits behind one PCIe downstream port (a bridge) of the host;
the operator names it in the configuration (host slot -> bridge address). The GPU mapped
to that slot appears as device 0, function 0 on the bridge's secondary bus, read from
``devices/<bridge>/pci_bus/``.

Attach side: :meth:`~SysfsPciBus.rescan` brings up each configured slot whose device is
absent, leaving to the kernel what the kernel does by itself. A port the kernel's hot-plug
driver (pciehp, acpiphp) manages has a hotplug slot in ``bus/pci/slots``: the proxy
presenting a card there raises a presence event, and the hot-plug driver powers the
slot on and enumerates the card on its own. So a managed slot whose ``power`` reads 0
with a card present (``adapter``) is powered on; one that reads 1 is left to the
hot-plug driver, and only if no device has appeared after ``hotplug_settle_s`` is the
port rescanned (a device that was removed through its ``remove`` attribute stays away
until then). A port without a hotplug slot is rescanned below its bridge
(``devices/<bridge>/rescan``) at once. The whole bus is never rescanned: that would
bring back every removed device of every slot whose card is still present, mapped or
not. :meth:`~SysfsPciBus.wait_for_device` waits, until a deadline, for the device at
the slot's address and checks its vendor/device id and Device Serial Number; its
timeout names what was done and what the slot shows (power, card present).
:meth:`~SysfsPciBus.bind` binds the native driver, or ``vfio-pci`` through
``driver_override`` + ``drivers_probe`` after checking that the device's IOMMU group is
viable for passthrough. Detach side: unbind, :meth:`~SysfsPciBus.remove` (slot power off
where the port has a power controller, else the device's ``remove``), then wait until
the device is gone.

All sysfs access goes through :class:`~dxpool.hostagent.drivers.sysfs.Sysfs`, so the
same code runs on ``/sys`` and on a fake tree in tests. Every failure is a
:class:`~dxpool.hostagent.errors.DriverError` whose message says what happened and what
to check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from dxpool.hostagent.driver import BDF_PATTERN, VFIO_DRIVER, ExpectedDevice, PciDevice
from dxpool.hostagent.drivers import pci_config
from dxpool.hostagent.drivers.sysfs import Sysfs
from dxpool.hostagent.errors import DeviceTimeoutError, DriverError, IdentityMismatchError

log = logging.getLogger(__name__)

NVIDIA_VENDOR = "10de"
PCI_CLASS_BRIDGE = 0x06
PASSTHROUGH_SAFE_DRIVERS = frozenset({VFIO_DRIVER, "pci-stub"})
DEFAULT_POLL_S = 0.05
DEFAULT_REMOVE_TIMEOUT_S = 10.0
# How long a slot the kernel's hot-plug driver manages is left to it before the driver
# rescans the port itself: pciehp powers a slot on and enumerates its card within about
# a second of the presence event (link training plus 100 ms); a rescan racing it makes
# it skip (or, on some kernels, fail) its own hot-add.
DEFAULT_HOTPLUG_SETTLE_S = 5.0
# How long a bind waits for its driver to be loaded: udev loads a hot-added device's
# module on the kernel's add event, possibly after the device is already visible.
DEFAULT_DRIVER_LOAD_S = 10.0
NO_OVERRIDE = ("", "(null)")


def check_bdf(bdf: str, what: str) -> str:
    """``bdf`` in sysfs's form (``0000:41:00.0``, lower case); DriverError otherwise."""
    normalized = bdf.strip().lower()
    if not BDF_PATTERN.match(normalized):
        raise DriverError(
            f"{what} {bdf!r} is not a PCI address; write it as domain:bus:device.function, "
            "e.g. 0000:40:01.0",
            retryable=False,
        )
    return normalized


@dataclass(frozen=True)
class PciLink:
    """A device's PCIe link as sysfs shows it (speed strings like ``"16.0 GT/s PCIe"``)."""

    width: int | None
    max_width: int | None
    speed: str | None
    max_speed: str | None


@dataclass(frozen=True)
class BusCapabilities:
    """What the host's ports and kernel support, read from sysfs.

    ``slot_power``: every configured port has a hotplug slot with a ``power`` attribute
    and a power controller (Slot Capabilities). Without the controller the kernel still
    shows ``power``, reading 1 even on an empty slot, and writing 0 to it only
    unconfigures the device: the slot stays powered and the card present.
    ``surprise_removal``: every port's Slot Capabilities declare hot-plug surprise.
    ``vfio``: the ``vfio-pci`` driver is loaded and the IOMMU is on (IOMMU groups exist).
    """

    slot_power: bool
    surprise_removal: bool
    vfio: bool


class PciSysfsReader:
    """Read-only facts about PCI devices from sysfs: ids, serial number, driver, IOMMU
    group, link. Never writes."""

    def __init__(self, sysfs: Sysfs | None = None) -> None:
        self._sysfs = sysfs or Sysfs()

    @property
    def sysfs(self) -> Sysfs:
        return self._sysfs

    def _device_dir(self, bdf: str) -> str:
        return f"bus/pci/devices/{bdf}"

    def present(self, bdf: str) -> bool:
        return self._sysfs.exists(self._device_dir(bdf))

    def driver_of(self, bdf: str) -> str | None:
        return self._sysfs.link_name(f"{self._device_dir(bdf)}/driver")

    def pci_id(self, bdf: str) -> str | None:
        """``vendor:device`` in lower-case hex without ``0x`` (``"10de:2330"``)."""
        vendor = self._sysfs.read_text(f"{self._device_dir(bdf)}/vendor")
        device = self._sysfs.read_text(f"{self._device_dir(bdf)}/device")
        if vendor is None or device is None:
            return None
        return f"{vendor.lower().removeprefix('0x')}:{device.lower().removeprefix('0x')}"

    def dsn(self, bdf: str) -> str | None:
        """The Device Serial Number from config space, or None (none, or not readable:
        only root reads beyond the first 64 bytes)."""
        config = self._sysfs.read_bytes(f"{self._device_dir(bdf)}/config")
        return pci_config.device_serial_number(config) if config is not None else None

    def pci_class(self, bdf: str) -> int | None:
        text = self._sysfs.read_text(f"{self._device_dir(bdf)}/class")
        try:
            return int(text, 16) if text is not None else None
        except ValueError:
            return None

    def iommu_group(self, bdf: str) -> str | None:
        return self._sysfs.link_name(f"{self._device_dir(bdf)}/iommu_group")

    def link(self, bdf: str) -> PciLink:
        base = self._device_dir(bdf)
        return PciLink(
            width=_int_or_none(self._sysfs.read_text(f"{base}/current_link_width")),
            max_width=_int_or_none(self._sysfs.read_text(f"{base}/max_link_width")),
            speed=self._sysfs.read_text(f"{base}/current_link_speed"),
            max_speed=self._sysfs.read_text(f"{base}/max_link_speed"),
        )


class SysfsPciBus(PciSysfsReader):
    """:class:`~dxpool.hostagent.driver.PciBus` over Linux sysfs.

    ``ports`` maps each host slot to the address of the downstream port (bridge) the proxy
    slot sits behind. ``vendors`` are the PCI vendor ids (hex, no ``0x``) accepted when an
    attach gives no expected id. ``poll_s`` is the interval of every wait;
    ``remove_timeout_s`` bounds the wait for a removed device to vanish;
    ``hotplug_settle_s`` is how long a powered hotplug slot without its device is left to
    the kernel's hot-plug driver before the port is rescanned; ``driver_load_s`` how long
    a bind waits for its driver's module to be loaded.
    Safe to call from several threads for different host slots.
    """

    def __init__(
        self,
        ports: Mapping[int, str],
        *,
        sysfs: Sysfs | None = None,
        vendors: frozenset[str] = frozenset({NVIDIA_VENDOR}),
        poll_s: float = DEFAULT_POLL_S,
        remove_timeout_s: float = DEFAULT_REMOVE_TIMEOUT_S,
        hotplug_settle_s: float = DEFAULT_HOTPLUG_SETTLE_S,
        driver_load_s: float = DEFAULT_DRIVER_LOAD_S,
    ) -> None:
        if not ports:
            raise ValueError("ports must name at least one host slot's bridge")
        if poll_s <= 0 or remove_timeout_s <= 0:
            raise ValueError("poll_s and remove_timeout_s must be > 0")
        if hotplug_settle_s < 0 or driver_load_s < 0:
            raise ValueError("hotplug_settle_s and driver_load_s must be >= 0")
        self._ports = {
            slot: check_bdf(bridge, f"the bridge of host slot {slot}")
            for slot, bridge in sorted(ports.items())
        }
        super().__init__(sysfs)
        self._vendors = frozenset(v.lower().removeprefix("0x") for v in vendors)
        self._poll_s = poll_s
        self._remove_timeout_s = remove_timeout_s
        self._hotplug_settle_s = hotplug_settle_s
        self._driver_load_s = driver_load_s
        self._rescan_notes: dict[int, str] = {}
        # host slot -> when its port is rescanned unless the hot-plug driver brought the
        # device up first (monotonic time)
        self._deferred_rescans: dict[int, float] = {}
        self._lock = threading.Lock()

    # -- addresses ------------------------------------------------------------------------

    def device_address(self, host_slot: int) -> str:
        """The address the GPU at ``host_slot`` gets: device 0, function 0 on the
        secondary bus of the slot's bridge."""
        bridge = self._bridge(host_slot)
        buses = self._sysfs.listdir(f"{self._device_dir(bridge)}/pci_bus")
        if not self._sysfs.exists(self._device_dir(bridge)):
            raise DriverError(
                f"the bridge {bridge} of host slot {host_slot} is not on this host's PCI bus; "
                "check the slot's bridge address in the agent's configuration (lspci -t)",
                retryable=False,
            )
        if len(buses) != 1:
            raise DriverError(
                f"the bridge {bridge} of host slot {host_slot} has {len(buses)} secondary buses "
                f"in sysfs ({', '.join(buses) or 'none'}); name the downstream port the proxy "
                "slot sits behind, not a device or a root complex",
                retryable=False,
            )
        return f"{buses[0]}:00.0"

    def _bridge(self, host_slot: int) -> str:
        bridge = self._ports.get(host_slot)
        if bridge is None:
            raise DriverError(
                f"host slot {host_slot} has no bridge in the agent's configuration (configured: "
                f"{', '.join(str(s) for s in self._ports)}); add it to the linux ports",
                retryable=False,
            )
        return bridge

    def _hotplug_slot(self, bdf: str) -> str | None:
        """The name of the hotplug slot holding ``bdf`` (its ``address`` is ``dom:bus:dev``)."""
        wanted = bdf.rsplit(".", 1)[0]
        for name in self._sysfs.listdir("bus/pci/slots"):
            if self._sysfs.read_text(f"bus/pci/slots/{name}/address") == wanted:
                return name
        return None

    def _power_file(self, bdf: str) -> str | None:
        """The ``power`` attribute of the hotplug slot holding ``bdf``, present when the
        kernel's hot-plug driver manages the slot."""
        slot = self._hotplug_slot(bdf)
        if slot is None or not self._sysfs.exists(f"bus/pci/slots/{slot}/power"):
            return None
        return f"bus/pci/slots/{slot}/power"

    def _power_control(self, host_slot: int, bdf: str) -> str | None:
        """The slot's ``power`` attribute when writing 0 to it really powers the slot off:
        the hot-plug driver manages the slot and the port's Slot Capabilities declare a
        power controller. None otherwise, also when the capabilities are not readable."""
        power = self._power_file(bdf)
        if power is None:
            return None
        config = self._sysfs.read_bytes(f"{self._device_dir(self._bridge(host_slot))}/config")
        caps = pci_config.slot_capabilities(config) if config is not None else None
        return power if caps is not None and caps.power_controller else None

    def _slot_state(self, bdf: str) -> str:
        """What the hotplug slot holding ``bdf`` shows, for messages."""
        power = self._power_file(bdf)
        if power is None:
            return "its port has no hotplug slot"
        slot = power.split("/")[-2]
        shown = [f"power {self._sysfs.read_text(power)}"]
        adapter = self._sysfs.read_text(f"bus/pci/slots/{slot}/adapter")
        if adapter is not None:
            shown.append(
                "a card present (adapter 1)" if adapter == "1" else "no card present (adapter 0)"
            )
        return f"hotplug slot {slot} shows {', '.join(shown)}"

    @staticmethod
    def _slot_name(power_file: str) -> str:
        return power_file.split("/")[-2]

    # -- reading --------------------------------------------------------------------------

    def capabilities(self) -> BusCapabilities:
        """What the configured ports and the kernel support now."""
        slot_power = True
        surprise = True
        for host_slot, bridge in self._ports.items():
            try:
                address = self.device_address(host_slot)
            except DriverError:
                slot_power = surprise = False
                continue
            slot_power = slot_power and self._power_control(host_slot, address) is not None
            config = self._sysfs.read_bytes(f"{self._device_dir(bridge)}/config")
            caps = pci_config.slot_capabilities(config) if config is not None else None
            surprise = surprise and caps is not None and caps.hotplug_surprise
        vfio = self._sysfs.exists(f"bus/pci/drivers/{VFIO_DRIVER}") and bool(
            self._sysfs.listdir("kernel/iommu_groups")
        )
        return BusCapabilities(slot_power=slot_power, surprise_removal=surprise, vfio=vfio)

    def devices(self) -> list[PciDevice]:
        found = []
        for host_slot in self._ports:
            try:
                bdf = self.device_address(host_slot)
            except DriverError as error:
                log.warning(
                    "host slot not readable", extra={"host_slot": host_slot, "error": str(error)}
                )
                continue
            if self._sysfs.exists(self._device_dir(bdf)):
                found.append(self._device(host_slot, bdf))
        return found

    def _device(self, host_slot: int, bdf: str) -> PciDevice:
        return PciDevice(
            bdf=bdf,
            host_slot=host_slot,
            driver=self.driver_of(bdf),
            pci_id=self.pci_id(bdf) or "",
            dsn=self.dsn(bdf) or "",
        )

    # -- attach ---------------------------------------------------------------------------

    def rescan(self) -> None:
        """Bring up every configured slot whose device is absent. Idempotent.

        A slot the kernel's hot-plug driver manages is powered on when it reads 0 with a
        card present, and otherwise left to that driver for ``hotplug_settle_s``
        (:meth:`wait_for_device` rescans its port after that); any other port is
        rescanned below its bridge. A failed write is logged and remembered: the device
        then does not appear, and :meth:`wait_for_device`'s timeout names the failure.
        """
        for host_slot, bridge in self._ports.items():
            bdf = self.device_address(host_slot)
            if self._sysfs.exists(self._device_dir(bdf)):
                continue
            power = self._power_file(bdf)
            if power is None:
                self._rescan_port(host_slot, bridge)
                continue
            slot = self._slot_name(power)
            adapter = self._sysfs.read_text(f"bus/pci/slots/{slot}/adapter")
            if self._sysfs.read_text(power) == "1" or adapter == "0":
                # Powered (by the hot-plug driver itself, on the card's presence event), or
                # empty so far: the hot-plug driver enumerates the card when it comes.
                # Its port is rescanned only if nothing has appeared after the settle
                # time, e.g. a device removed through its remove attribute.
                with self._lock:  # from this rescan on, not an earlier one's
                    self._deferred_rescans[host_slot] = time.monotonic() + self._hotplug_settle_s
                self._note(host_slot, f"left hotplug slot {slot} to the kernel's hot-plug driver")
                continue
            how = f"powering on hotplug slot {slot}"
            try:
                self._sysfs.write(power, "1")
            except OSError as error:
                # ENODEV: pciehp found no card in the slot. Expected for slots nothing is
                # mapped to; the wait for a slot that should have come up names it.
                self._note(host_slot, f"{how} failed: {error.strerror or error}")
            else:
                self._note(host_slot, how)

    def _rescan_port(self, host_slot: int, bridge: str, after: str = "") -> None:
        target = f"{self._device_dir(bridge)}/rescan"
        how = f"{after}rescanning below bridge {bridge}"
        try:
            self._sysfs.write(target, "1")
        except OSError as error:
            self._note(host_slot, f"{how} failed: {error.strerror or error}")
        else:
            self._note(host_slot, how)

    def _note(self, host_slot: int, note: str) -> None:
        log.debug("rescan", extra={"host_slot": host_slot, "note": note})
        with self._lock:
            self._rescan_notes[host_slot] = note

    def wait_for_device(
        self, host_slot: int, timeout_s: float, expected: ExpectedDevice | None = None
    ) -> PciDevice:
        """The device at ``host_slot`` once present and readable.

        Raises :class:`DeviceTimeoutError` after ``timeout_s`` and
        :class:`IdentityMismatchError` when the device that appeared has another
        vendor/device id or serial number than expected (or, with no expected id, a
        vendor outside ``vendors``).
        """
        bdf = self.device_address(host_slot)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._sysfs.exists(self._device_dir(bdf)) and self.pci_id(bdf) is not None:
                with self._lock:
                    self._deferred_rescans.pop(host_slot, None)
                device = self._device(host_slot, bdf)
                self._check_identity(device, expected)
                return device
            now = time.monotonic()
            with self._lock:
                due = self._deferred_rescans.get(host_slot)
                if due is not None and now >= due:
                    del self._deferred_rescans[host_slot]
            if due is not None and now >= due:
                self._rescan_port(
                    host_slot,
                    self._ports[host_slot],
                    after=f"nothing appeared {self._hotplug_settle_s:g}s after leaving its "
                    "hotplug slot to the kernel's hot-plug driver, so ",
                )
            if now >= deadline:
                with self._lock:
                    note = self._rescan_notes.get(host_slot, "no rescan was made")
                raise DeviceTimeoutError(
                    f"no PCI device appeared at {bdf} (host slot {host_slot}, behind bridge "
                    f"{self._ports[host_slot]}) within {timeout_s:g}s ({note}; "
                    f"{self._slot_state(bdf)}); check that the proxy mapped the GPU and that "
                    "the link came up (dmesg: pciehp, AER)"
                )
            time.sleep(self._poll_s)

    def _check_identity(self, device: PciDevice, expected: ExpectedDevice | None) -> None:
        where = f"the device at {device.bdf} (host slot {device.host_slot})"
        if expected is not None and expected.pci_id:
            if device.pci_id != expected.pci_id.lower():
                raise IdentityMismatchError(
                    f"{where} is PCI {device.pci_id}, expected {expected.pci_id}; the proxy "
                    "mapped another device than the inventory says, check the box slot"
                )
        elif device.pci_id.split(":")[0] not in self._vendors:
            raise IdentityMismatchError(
                f"{where} is PCI {device.pci_id}, not a GPU of vendor "
                f"{', '.join(sorted(self._vendors))}; check the host slot's bridge in the "
                "agent's configuration and what the proxy mapped"
            )
        if expected is not None and expected.dsn and device.dsn != expected.dsn.lower():
            found = device.dsn or "no readable serial number"
            raise IdentityMismatchError(
                f"{where} has device serial number {found}, expected {expected.dsn}; the proxy "
                "mapped another GPU than the one asked for"
            )

    def bind(self, bdf: str, driver: str | None) -> None:
        bdf = check_bdf(bdf, "device")
        base = self._device_dir(bdf)
        if not self._sysfs.exists(base):
            raise DriverError(f"no PCI device at {bdf} to bind; it was removed or never appeared")
        current = self.driver_of(bdf)
        if driver is None:
            if current is not None:
                self._unbind(bdf, current)
            self._clear_override(bdf)
            return
        if driver == VFIO_DRIVER:
            self._check_iommu_group(bdf)
        if current == driver:
            return
        if not self._driver_loaded(driver):
            hint = "modprobe vfio-pci" if driver == VFIO_DRIVER else f"load the {driver} module"
            raise DriverError(
                f"the {driver} driver is not loaded on this host {self._driver_load_s:g}s after "
                f"{bdf} appeared ({hint}); cannot bind {bdf}"
            )
        current = self.driver_of(bdf)  # the kernel's own probe may have bound it meanwhile
        if current == driver:
            return
        if driver == VFIO_DRIVER:
            self._write(f"{base}/driver_override", driver, f"setting driver_override of {bdf}")
        else:
            self._clear_override(bdf)
        if current is not None:
            self._unbind(bdf, current)
        if driver == VFIO_DRIVER:
            self._write_settling(
                "bus/pci/drivers_probe", bdf, f"probing {bdf} for {driver}", driver
            )
        else:
            self._write_settling(
                f"bus/pci/drivers/{driver}/bind", bdf, f"binding {bdf} to {driver}", driver
            )
        bound = self.driver_of(bdf)
        if bound != driver:
            raise DriverError(
                f"{bdf} is bound to {bound or 'no driver'} after binding it to {driver}; check "
                f"dmesg for the {driver} probe error"
            )

    def _driver_loaded(self, driver: str) -> bool:
        """Whether ``driver`` is loaded, waiting ``driver_load_s`` for it: after a hot-add
        udev loads the module the device's id asks for, which may come after the device."""
        deadline = time.monotonic() + self._driver_load_s
        while not self._sysfs.exists(f"bus/pci/drivers/{driver}"):
            if time.monotonic() >= deadline:
                return False
            time.sleep(self._poll_s)
        return True

    def _unbind(self, bdf: str, current: str) -> None:
        self._write_settling(
            f"bus/pci/drivers/{current}/unbind", bdf, f"unbinding {bdf} from {current}", None
        )

    def _write_settling(self, relative: str, bdf: str, what: str, wanted: str | None) -> None:
        """Write ``bdf`` to a bind/unbind/probe attribute. A write the kernel refuses
        because the device already is where it was to go (the kernel's own probe of a new
        device won the race, or another unbind came first) is success."""
        try:
            self._write(relative, bdf, what)
        except DriverError:
            if self.driver_of(bdf) != wanted:
                raise
            log.info("driver already settled", extra={"bdf": bdf, "driver": wanted})

    def _clear_override(self, bdf: str) -> None:
        override = self._sysfs.read_text(f"{self._device_dir(bdf)}/driver_override")
        if override is not None and override not in NO_OVERRIDE:
            self._write(
                f"{self._device_dir(bdf)}/driver_override",
                "\n",
                f"clearing driver_override of {bdf}",
            )

    def _check_iommu_group(self, bdf: str) -> None:
        """Refuse ``vfio-pci`` unless every other device of ``bdf``'s IOMMU group is bound
        to vfio-pci (or pci-stub), unbound, or a bridge: vfio hands a VM whole groups."""
        group = self.iommu_group(bdf)
        if group is None:
            raise DriverError(
                f"{bdf} has no IOMMU group, so it cannot be passed to a VM; enable the IOMMU "
                "(intel_iommu=on or amd_iommu=on on the kernel command line)",
                retryable=False,
            )
        for other in self._sysfs.listdir(f"kernel/iommu_groups/{group}/devices"):
            if other == bdf:
                continue
            other_class = self.pci_class(other)
            if other_class is not None and other_class >> 16 == PCI_CLASS_BRIDGE:
                continue
            other_driver = self.driver_of(other)
            if other_driver is None or other_driver in PASSTHROUGH_SAFE_DRIVERS:
                continue
            raise DriverError(
                f"IOMMU group {group} of {bdf} also holds {other} (class "
                f"{other_class if other_class is None else f'0x{other_class:06x}'}, bound to "
                f"{other_driver}), so the group is not viable for vfio-pci; give the GPU a "
                "group of its own (ACS on the PCIe switch) or unbind that device",
                retryable=False,
            )

    def _write(self, relative: str, value: str, what: str) -> None:
        try:
            self._sysfs.write(relative, value)
        except OSError as error:
            raise DriverError(
                f"{what} failed: {error.strerror or error} (writing {self._sysfs.path(relative)}); "
                "check dmesg"
            ) from error

    # -- scrub ----------------------------------------------------------------------------

    def reset(self, bdf: str) -> None:
        """Reset the device at ``bdf`` through its ``reset`` attribute (the kernel picks
        function-level, power-management or bus reset). The device must be unbound, so
        no driver holds state across the reset."""
        bdf = check_bdf(bdf, "device")
        base = self._device_dir(bdf)
        if not self._sysfs.exists(base):
            raise DriverError(f"no PCI device at {bdf} to reset; it was removed or never appeared")
        current = self.driver_of(bdf)
        if current is not None:
            raise DriverError(f"{bdf} is bound to {current}; unbind it before a reset")
        if not self._sysfs.exists(f"{base}/reset"):
            raise DriverError(
                f"{bdf} has no reset attribute: the kernel knows no reset method for it",
                retryable=False,
            )
        self._write(f"{base}/reset", "1", f"resetting {bdf}")

    # -- detach ---------------------------------------------------------------------------

    def remove(self, bdf: str) -> None:
        """Hot-remove the device at ``bdf`` and wait until it is gone: slot power off
        where the port has a power controller, else the device's ``remove`` (which leaves
        the card present and its link up: a rescan of the port brings it back, so the
        proxy must unmap it next). A no-op if it is absent."""
        bdf = check_bdf(bdf, "device")
        base = self._device_dir(bdf)
        if not self._sysfs.exists(base):
            return
        host_slot = next((s for s in self._ports if self.device_address(s) == bdf), None)
        power = self._power_control(host_slot, bdf) if host_slot is not None else None
        if power is not None:
            self._write(power, "0", f"powering off the slot of {bdf}")
            how = f"powering off hotplug slot {self._slot_name(power)}"
        else:
            self._write(f"{base}/remove", "1", f"removing {bdf}")
            how = "writing its remove attribute"
        deadline = time.monotonic() + self._remove_timeout_s
        while self._sysfs.exists(base):
            if time.monotonic() >= deadline:
                raise DriverError(
                    f"{bdf} is still on the PCI bus {self._remove_timeout_s:g}s after {how}; "
                    "a process or driver may still hold it (check nvidia-smi, lsof /dev/nvidia*, "
                    "dmesg)"
                )
            time.sleep(self._poll_s)


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


__all__ = [
    "NVIDIA_VENDOR",
    "BusCapabilities",
    "PciLink",
    "PciSysfsReader",
    "SysfsPciBus",
    "check_bdf",
]
