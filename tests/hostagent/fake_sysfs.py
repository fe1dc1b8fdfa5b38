"""A fake sysfs tree that acts like the Linux kernel when the driver writes to it.

:class:`FakeKernel` is a :class:`~dxpool.hostagent.drivers.sysfs.Sysfs` over a real
directory laid out like ``/sys`` (``bus/pci/devices``, ``bus/pci/drivers``,
``bus/pci/slots``, ``kernel/iommu_groups``). Reads are the real ones; writes to the kernel's
control attributes are acted on as Linux 6.1 does (each rule below was checked against
that kernel in a QEMU guest, ``tests/kernel``):

* A port with a hotplug slot is managed by a hot-plug driver (pciehp by default, or
  acpiphp). A card presented there (:meth:`FakeKernel.insert`, or
  :meth:`FakeKernel.presence_changed`) is powered on and enumerated by that driver
  itself. The slot's ``power`` shows the hardware: under pciehp 0 on an empty slot with a
  power controller and 1 always on a port without one, under acpiphp 0 on any empty
  slot; ``adapter`` shows whether a card is there.
  Writing 1 to ``power`` of an empty slot fails with ENODEV under pciehp (acpiphp takes
  it and nothing appears); writing 0 powers the slot off and removes the device, except
  without a power controller, where it only removes the device (the card stays present,
  the slot powered).
* A rescan below a bridge, or of the whole bus, brings up the card of every powered slot
  whose device is absent - also one the driver removed through ``remove``, since the
  card is still there. A powered-off slot's card stays down.
* ``bind``: ENODEV when the driver does not match the device (its ``driver_override``
  names another driver; ``vfio-pci`` without one), EBUSY when the device has a driver.
  ``unbind`` of a device the driver does not hold: ENODEV. ``drivers_probe`` of a bound
  device does nothing. ``reset`` works with a driver bound.

Cards can misbehave: never appear, appear late, carry another vendor/device id or serial
number, or stay after ``remove`` (:class:`FakeCard`). Devices that share an IOMMU group
with a card are added with :meth:`FakeKernel.add_device`.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dxpool.hostagent.drivers.pci_config import (
    SLOT_CAP_HOTPLUG_CAPABLE,
    SLOT_CAP_HOTPLUG_SURPRISE,
    SLOT_CAP_POWER_CONTROLLER,
    build_config,
)
from dxpool.hostagent.drivers.sysfs import Sysfs

H100_DEVICE = 0x2330
NVIDIA = 0x10DE
BRIDGE_CLASS = 0x060400
PCIEHP = "pciehp"
ACPIPHP = "acpiphp"


@dataclass(frozen=True)
class FakeCard:
    """The device a proxy presents behind a bridge once its link comes up."""

    vendor: int = NVIDIA
    device: int = H100_DEVICE
    dsn: int | None = 0x0123456789ABCDEF
    class_code: int = 0x030200
    appears: bool = True  # False: a rescan never brings it up
    delay_s: float = 0.0  # it appears this long after the rescan
    sticky: bool = False  # True: remove/power-off leaves it on the bus
    link_width: int = 16
    max_link_width: int = 16


@dataclass
class _Port:
    bridge: str
    secondary: str  # "0000:41"
    slot: str | None  # hotplug slot name, when a hot-plug driver manages the port
    iommu_group: int
    power_controller: bool = True
    hotplug: str = PCIEHP
    powered: bool = False  # the slot's power (always True without a slot or controller)

    @property
    def device_bdf(self) -> str:
        return f"{self.secondary}:00.0"


class FakeKernel(Sysfs):
    """A sysfs tree under ``root`` with the kernel's reactions to writes.

    ``cards(bridge)`` says what is behind a bridge right now (None: nothing mapped); by
    default the cards given with :meth:`insert`. ``drivers`` are the loaded drivers.
    Every write is recorded in :attr:`writes` as ``(relative path, value)``; a path in
    :attr:`failing_writes` fails with its errno, as a kernel refusing it would.
    """

    def __init__(
        self,
        root: Path,
        *,
        drivers: tuple[str, ...] = ("nvidia", "vfio-pci", "pcieport"),
        cards: Callable[[str], FakeCard | None] | None = None,
    ) -> None:
        super().__init__(root)
        self._inserted: dict[str, FakeCard] = {}
        self._cards = cards or self._inserted.get
        self._ports: dict[str, _Port] = {}
        self._lock = threading.RLock()
        self._timers: list[threading.Timer] = []
        self.writes: list[tuple[str, str]] = []
        self.resets: list[str] = []  # devices reset through their reset attribute
        self.failing_writes: dict[str, int] = {}  # relative path -> errno the write fails with
        for relative in ("bus/pci/devices", "bus/pci/slots", "kernel/iommu_groups"):
            self.path(relative).mkdir(parents=True, exist_ok=True)
        for name in drivers:
            self.load_driver(name)
        self._plain("bus/pci/rescan", "")
        self._plain("bus/pci/drivers_probe", "")

    # -- building the tree ----------------------------------------------------------------

    def load_driver(self, name: str) -> None:
        """Load a driver: it takes every unbound device it matches, as a module does."""
        with self._lock:
            base = self.path(f"bus/pci/drivers/{name}")
            base.mkdir(parents=True, exist_ok=True)
            for attribute in ("bind", "unbind"):
                (base / attribute).touch()
            for bdf in self.listdir("bus/pci/devices"):
                unbound = self.link_name(f"bus/pci/devices/{bdf}/driver") is None
                if unbound and self._default_driver(bdf) == name:
                    self._set_driver(bdf, name)

    def unload_driver(self, name: str) -> None:
        base = self.path(f"bus/pci/drivers/{name}")
        for attribute in ("bind", "unbind"):
            (base / attribute).unlink()
        base.rmdir()

    def add_port(
        self,
        bridge: str,
        secondary: str,
        *,
        slot: str | None = None,
        iommu_group: int = 1,
        surprise: bool = False,
        rescan_file: bool = True,
        power_controller: bool = True,
        hotplug: str = PCIEHP,
    ) -> None:
        """A downstream port at ``bridge`` whose secondary bus is ``secondary``; ``slot``
        names its hotplug slot when a hot-plug driver (``hotplug``: pciehp or acpiphp)
        manages it, with a power controller unless ``power_controller`` is False."""
        with self._lock:
            has_controller = slot is not None and power_controller
            self._ports[bridge] = _Port(
                bridge,
                secondary,
                slot,
                iommu_group,
                power_controller=has_controller,
                hotplug=hotplug,
                powered=not has_controller,
            )
            caps = SLOT_CAP_HOTPLUG_SURPRISE if surprise else 0
            if slot is not None:
                caps |= SLOT_CAP_HOTPLUG_CAPABLE
            if has_controller:
                caps |= SLOT_CAP_POWER_CONTROLLER
            self._make_device(
                bridge,
                build_config(vendor=0x1000, device=0xC010, class_code=BRIDGE_CLASS, slot_caps=caps),
                vendor=0x1000,
                device=0xC010,
                class_code=BRIDGE_CLASS,
                iommu_group=iommu_group,  # a port without ACS shares its card's group
                driver="pcieport",
            )
            self.path(f"bus/pci/devices/{bridge}/pci_bus/{secondary}").mkdir(parents=True)
            if not rescan_file:
                self.path(f"bus/pci/devices/{bridge}/rescan").unlink()
            if slot is not None:
                self._plain(f"bus/pci/slots/{slot}/address", f"{secondary}:00\n")
                self._show_slot(self._ports[bridge])

    def presence_changed(self, bridge: str) -> None:
        """The card behind ``bridge`` came or went (the proxy mapped or unmapped): the
        hot-plug driver of a managed slot powers a new card on and enumerates it."""
        with self._lock:
            port = self._ports[bridge]
            if port.slot is None:
                return
            card = self._cards(bridge)
            if card is not None and port.power_controller:
                port.powered = True
            self._show_slot(port)
            if card is not None:
                self._bring_up(port)

    def insert(self, bridge: str, card: FakeCard | None) -> None:
        """Put ``card`` behind ``bridge`` (None: take it away). Behind a managed hotplug
        slot it comes up by itself; behind any other port on a rescan."""
        with self._lock:
            if card is None:
                self._inserted.pop(bridge, None)
            else:
                self._inserted[bridge] = card
            if bridge in self._ports:
                self.presence_changed(bridge)

    def add_device(
        self,
        bdf: str,
        *,
        vendor: int,
        device: int,
        class_code: int,
        iommu_group: int,
        driver: str | None,
    ) -> None:
        """A device that is simply there (e.g. another function in a card's IOMMU group)."""
        with self._lock:
            self._make_device(
                bdf,
                build_config(vendor=vendor, device=device, class_code=class_code),
                vendor=vendor,
                device=device,
                class_code=class_code,
                iommu_group=iommu_group,
                driver=driver,
            )

    def present(self, bdf: str) -> bool:
        return self.path(f"bus/pci/devices/{bdf}").is_dir()

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()

    # -- the kernel's reactions -----------------------------------------------------------

    def write(self, relative: str, value: str) -> None:
        with self._lock:
            self.writes.append((relative, value))
            parts = relative.split("/")
            if not self.path(relative).exists():
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), relative)
            if relative in self.failing_writes:
                code = self.failing_writes[relative]
                raise OSError(code, os.strerror(code), relative)
            if relative == "bus/pci/rescan":
                for port in self._ports.values():
                    if port.powered:
                        self._bring_up(port)
            elif relative == "bus/pci/drivers_probe":
                self._probe(value.strip())
            elif parts[:3] == ["bus", "pci", "devices"] and len(parts) == 5:
                self._device_write(parts[3], parts[4], value)
            elif parts[:3] == ["bus", "pci", "drivers"] and len(parts) == 5:
                self._driver_write(parts[3], parts[4], value.strip())
            elif parts[:3] == ["bus", "pci", "slots"] and parts[-1] == "power":
                self._power(parts[3], value.strip())
            else:
                super().write(relative, value)

    def _device_write(self, bdf: str, attribute: str, value: str) -> None:
        if attribute == "rescan" and bdf in self._ports:
            if self._ports[bdf].powered:
                self._bring_up(self._ports[bdf])
        elif attribute == "remove":
            self._take_down(bdf)
        elif attribute == "reset":
            self.resets.append(bdf)  # with or without a driver bound, as Linux does
        elif attribute == "driver_override":
            self._plain(
                f"bus/pci/devices/{bdf}/driver_override", (value.strip() or "(null)") + "\n"
            )
        else:
            super().write(f"bus/pci/devices/{bdf}/{attribute}", value)

    def _driver_write(self, driver: str, attribute: str, bdf: str) -> None:
        if not self.present(bdf):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), bdf)
        current = self.link_name(f"bus/pci/devices/{bdf}/driver")
        if attribute == "unbind":
            if current != driver:
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), bdf)
            self._set_driver(bdf, None)
        elif attribute == "bind":
            if not self._matches(driver, bdf):
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), bdf)
            if current is not None:
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), bdf)
            self._set_driver(bdf, driver)

    def _matches(self, driver: str, bdf: str) -> bool:
        """Whether ``driver`` takes the device: its ``driver_override`` alone decides when
        set; else the driver's id table (vfio-pci and pci-stub have none of their own)."""
        override = self.read_text(f"bus/pci/devices/{bdf}/driver_override")
        if override not in (None, "(null)"):
            return driver == override
        if driver in ("vfio-pci", "pci-stub"):
            return False
        if driver == "nvidia":
            return self.read_text(f"bus/pci/devices/{bdf}/vendor") == f"0x{NVIDIA:04x}"
        return True

    def _probe(self, bdf: str) -> None:
        if not self.present(bdf):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), bdf)
        if self.link_name(f"bus/pci/devices/{bdf}/driver") is not None:
            return
        override = self.read_text(f"bus/pci/devices/{bdf}/driver_override")
        if override not in (None, "(null)"):
            if self.exists(f"bus/pci/drivers/{override}"):
                self._set_driver(bdf, override)
            return
        self._set_driver(bdf, self._default_driver(bdf))

    def _default_driver(self, bdf: str) -> str | None:
        vendor = self.read_text(f"bus/pci/devices/{bdf}/vendor")
        if vendor == f"0x{NVIDIA:04x}" and self.exists("bus/pci/drivers/nvidia"):
            return "nvidia"
        return None

    def _power(self, slot: str, value: str) -> None:
        port = next((p for p in self._ports.values() if p.slot == slot), None)
        if port is None or value not in ("0", "1"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), slot)
        card = self._cards(port.bridge)
        if value == "1":
            if card is None and port.hotplug == PCIEHP:
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), slot)  # empty slot
            if port.power_controller:
                port.powered = True
            self._bring_up(port)
        else:
            if port.power_controller:
                port.powered = False
            self._take_down(port.device_bdf, forced=True)
        self._show_slot(port)

    def _show_slot(self, port: _Port) -> None:
        """``power`` and ``adapter`` as the slot's hardware shows them."""
        if port.slot is None:
            return
        present = self._cards(port.bridge) is not None
        # acpiphp reads the slot's state from ACPI (_STA), which is off while empty
        powered = port.powered and (present or port.hotplug == PCIEHP)
        self._plain(f"bus/pci/slots/{port.slot}/power", f"{int(powered)}\n")
        self._plain(f"bus/pci/slots/{port.slot}/adapter", f"{int(present)}\n")

    def _bring_up(self, port: _Port) -> None:
        card = self._cards(port.bridge)
        if card is None or not card.appears or self.present(port.device_bdf):
            return
        if card.delay_s > 0:
            timer = threading.Timer(card.delay_s, self._appear, (port, card))
            timer.daemon = True
            self._timers.append(timer)
            timer.start()
        else:
            self._appear(port, card)

    def _appear(self, port: _Port, card: FakeCard) -> None:
        with self._lock:
            if self.present(port.device_bdf):
                return
            self._make_device(
                port.device_bdf,
                build_config(
                    vendor=card.vendor, device=card.device, class_code=card.class_code, dsn=card.dsn
                ),
                vendor=card.vendor,
                device=card.device,
                class_code=card.class_code,
                iommu_group=port.iommu_group,
                driver=None,
                link=(card.link_width, card.max_link_width),
            )
            self._set_driver(port.device_bdf, self._default_driver(port.device_bdf))

    def _take_down(self, bdf: str, *, forced: bool = False) -> None:
        """Remove the device at ``bdf``; a sticky card stays unless its slot's power is
        cut (``forced``)."""
        bridge = next((p.bridge for p in self._ports.values() if p.device_bdf == bdf), None)
        card = self._cards(bridge) if bridge is not None else None
        if card is not None and card.sticky and not forced:
            return
        base = self.path(f"bus/pci/devices/{bdf}")
        if not base.is_dir():
            return
        group = self.link_name(f"bus/pci/devices/{bdf}/iommu_group")
        if group is not None:
            os.unlink(self.path(f"kernel/iommu_groups/{group}/devices/{bdf}"))
        for entry in base.iterdir():
            entry.unlink()
        base.rmdir()

    # -- helpers --------------------------------------------------------------------------

    def _plain(self, relative: str, text: str) -> None:
        path = self.path(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def _set_driver(self, bdf: str, driver: str | None) -> None:
        link = self.path(f"bus/pci/devices/{bdf}/driver")
        if link.is_symlink():
            link.unlink()
        if driver is not None:
            os.symlink(self.path(f"bus/pci/drivers/{driver}"), link)

    def _make_device(
        self,
        bdf: str,
        config: bytes,
        *,
        vendor: int,
        device: int,
        class_code: int,
        iommu_group: int | None,
        driver: str | None,
        link: tuple[int, int] = (16, 16),
    ) -> None:
        base = f"bus/pci/devices/{bdf}"
        self._plain(f"{base}/vendor", f"0x{vendor:04x}\n")
        self._plain(f"{base}/device", f"0x{device:04x}\n")
        self._plain(f"{base}/class", f"0x{class_code:06x}\n")
        self.path(f"{base}/config").write_bytes(config)
        self._plain(f"{base}/driver_override", "(null)\n")
        self._plain(f"{base}/current_link_width", f"{link[0]}\n")
        self._plain(f"{base}/max_link_width", f"{link[1]}\n")
        self._plain(f"{base}/current_link_speed", "32.0 GT/s PCIe\n")
        self._plain(f"{base}/max_link_speed", "32.0 GT/s PCIe\n")
        for attribute in ("remove", "rescan", "reset"):
            self._plain(f"{base}/{attribute}", "")
        if iommu_group is not None:
            group_dir = self.path(f"kernel/iommu_groups/{iommu_group}/devices")
            group_dir.mkdir(parents=True, exist_ok=True)
            os.symlink(self.path(base), group_dir / bdf)
            os.symlink(
                self.path(f"kernel/iommu_groups/{iommu_group}"), self.path(f"{base}/iommu_group")
            )
        self._set_driver(bdf, driver)


__all__ = ["BRIDGE_CLASS", "H100_DEVICE", "NVIDIA", "FakeCard", "FakeKernel"]
