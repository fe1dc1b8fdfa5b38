"""Helpers the real-kernel tests share: a guest's slots, cards presented for one test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tests.kernel import box
from tests.kernel.box import Card
from tests.kernel.qemu_guest import Guest, PortSpec


def slot_of(guest: Guest, port: PortSpec) -> str:
    """The name of the hotplug slot of ``port`` in the guest (pciehp names them by
    chassis slot, acpiphp by its own numbering)."""
    bus = guest.call("read", path=f"bus/pci/devices/{port.bridge}/subordinate_bus_number")
    address = f"0000:{int(bus):02x}:00"
    for line in guest.sh("grep -H . /sys/bus/pci/slots/*/address").splitlines():
        path, _, value = line.partition(":")
        if value == address:
            return path.split("/")[-2]
    raise AssertionError(f"no hotplug slot at {address} in {guest.spec.name}")


def device_of(guest: Guest, port: PortSpec) -> str:
    bus = guest.call("read", path=f"bus/pci/devices/{port.bridge}/secondary_bus_number")
    return f"0000:{int(bus):02x}:00.0"


def slot_shows(guest: Guest, port: PortSpec) -> tuple[str | None, str | None]:
    """(power, adapter) of the port's hotplug slot."""
    slot = slot_of(guest, port)
    return (
        guest.call("read", path=f"bus/pci/slots/{slot}/power"),
        guest.call("read", path=f"bus/pci/slots/{slot}/adapter"),
    )


def driver_of(guest: Guest, bdf: str) -> str:
    return guest.sh(f'basename "$(readlink /sys/bus/pci/devices/{bdf}/driver)" || true').strip()


def wait_bound(guest: Guest, bdf: str, timeout_s: float = 120.0) -> None:
    """Wait until a driver took the device (udev loads it after the hot-add)."""
    guest.sh(
        f"for i in $(seq {int(timeout_s * 10)}); do "
        f"[ -e /sys/bus/pci/devices/{bdf}/driver ] && exit 0; sleep 0.1; done; exit 1",
        timeout_s=timeout_s + 30,
    )


def write_errno(guest: Guest, path: str, value: str) -> int | None:
    """The errno the kernel answers a write with, None when it takes it."""
    try:
        guest.call("write", path=path, value=value)
    except OSError as error:
        return error.errno
    return None


def kernel_log(guest: Guest, pattern: str) -> str:
    """The kernel log's lines matching the extended regular expression ``pattern``."""
    return guest.sh(f"dmesg | grep -E '{pattern}' || true")


@contextlib.contextmanager
def presented(guest: Guest, card: Card, port: PortSpec) -> Iterator[Card]:
    """``card`` presented behind ``port`` for the block; withdrawn after it if still
    there (the test may have withdrawn it, or powered the slot off, which drops it)."""
    box.present(guest, card, port.qemu_id)
    try:
        yield card
    finally:
        if guest.alive and card.qemu_id in box.cards_in(guest):
            with contextlib.suppress(Exception):
                box.request_withdraw(guest, card.qemu_id)
            box.wait_deleted(guest, card.qemu_id)


def bus_ports(*ports: PortSpec) -> dict[str, str]:
    """Host slot -> bridge, as the driver is configured, for the guest's bus."""
    return {str(i): port.bridge for i, port in enumerate(ports)}


def call_bus(guest: Guest, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
    return guest.call("bus_call", name=name, method=method, args=list(args), **kwargs)
