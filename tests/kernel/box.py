"""The box side of the fabric, played over QMP: a proxy presenting a card behind a host's
port is a ``device_add`` into that port; withdrawing it is a ``device_del``.

The stand-in for a GPU is QEMU's ``e1000e``, a PCIe device with a Device Serial Number
capability that QEMU derives from its MAC address, so each stand-in card has an identity
the driver reads from configuration space. ``nvme`` stands in for a card of another
PCI id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tests.kernel.qemu_guest import Guest

E1000E_PCI_ID = "8086:10d3"
NVME_PCI_ID = "1b36:0010"
DELETE_TIMEOUT_S = 120.0  # pciehp waits 5 s on the attention button; TCG is slow
BUSY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Card:
    """A stand-in card: ``index`` picks its MAC, hence its serial number."""

    qemu_id: str
    index: int
    model: str = "e1000e"

    @property
    def mac(self) -> str:
        return f"52:54:00:00:{self.index >> 8 & 0xFF:02x}:{self.index & 0xFF:02x}"

    @property
    def dsn(self) -> str:
        """The Device Serial Number QEMU gives an e1000e: the MAC with ff-ff in the middle."""
        octets = self.mac.split(":")
        return "-".join([*octets[:3], "ff", "ff", *octets[3:]])

    @property
    def pci_id(self) -> str:
        return E1000E_PCI_ID if self.model == "e1000e" else NVME_PCI_ID

    def device_add_arguments(self, port: str) -> dict[str, Any]:
        if self.model == "e1000e":
            return {"driver": "e1000e", "id": self.qemu_id, "bus": port, "mac": self.mac}
        return {"driver": "nvme", "id": self.qemu_id, "bus": port, "serial": f"dx{self.index}"}


def present(guest: Guest, card: Card, port: str) -> None:
    """Present ``card`` behind the root port ``port`` (its QEMU id)."""
    with guest.qmp_lock:
        guest.qmp.cmd("device_add", **card.device_add_arguments(port))


def request_withdraw(guest: Guest, qemu_id: str, timeout_s: float = BUSY_TIMEOUT_S) -> None:
    """Ask QEMU to take the card away; the guest's hot-plug driver must let it go.

    Under pciehp QEMU refuses while the slot's power indicator blinks, which it does for
    the 5 s after a card was presented: the request is made again until ``timeout_s``.
    A request while an earlier one is under way is refused too (that error is raised).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with guest.qmp_lock:
                guest.qmp.cmd("device_del", id=qemu_id)
            return
        except Exception as error:
            if "guest is busy" not in str(error) or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def wait_deleted(guest: Guest, qemu_id: str, timeout_s: float = DELETE_TIMEOUT_S) -> float:
    """Seconds until QEMU reports the device deleted (``DEVICE_DELETED``, or no longer in
    the machine); TimeoutError after ``timeout_s``."""
    started = time.monotonic()
    while qemu_id in cards_in(guest):
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"QEMU still holds {qemu_id} {timeout_s:g}s after device_del")
        time.sleep(0.1)
    return time.monotonic() - started


def withdraw(guest: Guest, qemu_id: str, timeout_s: float = DELETE_TIMEOUT_S) -> float:
    """``device_del`` and wait until it is done; seconds it took."""
    started = time.monotonic()
    request_withdraw(guest, qemu_id)
    wait_deleted(guest, qemu_id, timeout_s)
    return time.monotonic() - started


def cards_in(guest: Guest) -> set[str]:
    """QEMU ids of the devices added with ``device_add`` or ``-device id=`` still there."""
    with guest.qmp_lock:
        listed = guest.qmp.cmd("qom-list", path="/machine/peripheral")
    return {entry["name"] for entry in listed if entry["type"].startswith("child<")}
