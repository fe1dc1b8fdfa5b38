"""The Linux driver's PCIe bus (``SysfsPciBus``) inside a QEMU guest, on the real kernel:
every write path it has, with the test as the box-side proxy over QMP."""

from __future__ import annotations

import re

import pytest

from dxpool.hostagent.errors import DeviceTimeoutError, IdentityMismatchError
from tests.kernel import box
from tests.kernel.box import E1000E_PCI_ID, Card
from tests.kernel.conftest import PORTS
from tests.kernel.qemu_fabric import QemuFabric
from tests.kernel.qemu_guest import Guest
from tests.kernel.rig import (
    bus_ports,
    call_bus,
    device_of,
    driver_of,
    kernel_log,
    presented,
    wait_bound,
)

WAIT_S = 180.0  # a generous deadline: TCG on a loaded machine
SETTLE_S = 5.0


@pytest.fixture(params=["pciehp", "acpi"])
def guest(request: pytest.FixtureRequest) -> Guest:
    name = "pciehp_guest" if request.param == "pciehp" else "acpi_guest"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def make_bus(guest: Guest, name: str, *ports: int) -> None:
    guest.call(
        "make_bus",
        name=name,
        ports=bus_ports(*(PORTS[i] for i in ports)),
        vendors=["8086", "1b36"],
        hotplug_settle_s=SETTLE_S,
        remove_timeout_s=120.0,
    )


def expected(card: Card) -> dict[str, str]:
    return {"pci_id": card.pci_id, "dsn": card.dsn}


def test_hot_add_is_waited_for_identified_and_powered_off(guest: Guest) -> None:
    make_bus(guest, "hotadd", 0)
    card = QemuFabric.card("drv", 1)
    bdf = device_of(guest, PORTS[0])
    with presented(guest, card, PORTS[0]):
        call_bus(guest, "hotadd", "rescan")  # right after the presence event
        device = call_bus(guest, "hotadd", "wait_for_device", 0, WAIT_S, expected=expected(card))
        assert (device.bdf, device.host_slot, device.pci_id, device.dsn) == (
            bdf,
            0,
            E1000E_PCI_ID,
            card.dsn,
        )
        wait_bound(guest, bdf)  # udev loads e1000e, which takes the card
        assert driver_of(guest, bdf) == "e1000e"
        call_bus(guest, "hotadd", "bind", bdf, None)
        call_bus(guest, "hotadd", "remove", bdf)  # powers the slot off
        assert not guest.call("exists", path=f"bus/pci/devices/{bdf}")
        box.wait_deleted(guest, card.qemu_id, timeout_s=60)  # QEMU drops a powered-off card
    # no rescan raced the hot-plug driver
    assert kernel_log(guest, "already exists|cannot hot-add") == ""


@pytest.mark.parametrize(
    ("card", "message"),
    [
        (Card("other-id", 0x301, model="nvme"), "is PCI 1b36:0010, expected 8086:10d3"),
        (Card("other-dsn", 0x302), "has device serial number 52-54-00-ff-ff-00-03-02"),
    ],
)
def test_a_card_that_is_not_the_one_asked_for_is_refused(
    pciehp_guest: Guest, card: Card, message: str
) -> None:
    guest = pciehp_guest
    make_bus(guest, "mismatch", 0)
    wanted = QemuFabric.card("drv", 2)
    with presented(guest, card, PORTS[0]):
        call_bus(guest, "mismatch", "rescan")
        with pytest.raises(IdentityMismatchError, match=re.escape(message)):
            call_bus(guest, "mismatch", "wait_for_device", 0, WAIT_S, expected=expected(wanted))


def test_a_card_that_never_appears_times_out_naming_the_empty_slot(guest: Guest) -> None:
    make_bus(guest, "empty", 1)
    call_bus(guest, "empty", "rescan")
    with pytest.raises(DeviceTimeoutError) as caught:
        call_bus(guest, "empty", "wait_for_device", 0, 2.0)
    assert "no card present (adapter 0)" in str(caught.value)


def test_vfio_binding_through_driver_override_a_reset_and_back(pciehp_guest: Guest) -> None:
    guest = pciehp_guest
    make_bus(guest, "vfio", 1)
    card = QemuFabric.card("drv", 3)
    bdf = device_of(guest, PORTS[1])
    with presented(guest, card, PORTS[1]):
        call_bus(guest, "vfio", "rescan")
        call_bus(guest, "vfio", "wait_for_device", 0, WAIT_S, expected=expected(card))
        wait_bound(guest, bdf)

        call_bus(guest, "vfio", "bind", bdf, "vfio-pci")
        assert driver_of(guest, bdf) == "vfio-pci"
        assert guest.call("read", path=f"bus/pci/devices/{bdf}/driver_override") == "vfio-pci"
        assert call_bus(guest, "vfio", "dsn", bdf) == card.dsn  # readable while vfio-bound
        call_bus(guest, "vfio", "bind", bdf, None)
        assert driver_of(guest, bdf) == ""
        assert guest.call("read", path=f"bus/pci/devices/{bdf}/driver_override") == "(null)"
        call_bus(guest, "vfio", "reset", bdf)
        call_bus(guest, "vfio", "bind", bdf, "e1000e")
        assert driver_of(guest, bdf) == "e1000e"
        call_bus(guest, "vfio", "bind", bdf, None)
        call_bus(guest, "vfio", "remove", bdf)


def test_capabilities_and_a_port_without_a_power_controller(pciehp_guest: Guest) -> None:
    """The port's ``power`` reads 1 though it cannot switch power: the driver claims no
    slot power and removes the device instead. (QEMU cannot withdraw a card from such a
    port under pciehp, so the card stays presented for the rest of the session.)"""
    guest = pciehp_guest
    make_bus(guest, "nopower", 3)
    make_bus(guest, "power", 0, 1, 2)
    assert call_bus(guest, "power", "capabilities").slot_power is True
    nopower = call_bus(guest, "nopower", "capabilities")
    assert (nopower.slot_power, nopower.vfio) == (False, True)
    card = QemuFabric.card("drv", 4)
    bdf = device_of(guest, PORTS[3])
    box.present(guest, card, PORTS[3].qemu_id)
    call_bus(guest, "nopower", "rescan")
    call_bus(guest, "nopower", "wait_for_device", 0, WAIT_S, expected=expected(card))
    wait_bound(guest, bdf)
    call_bus(guest, "nopower", "bind", bdf, None)

    call_bus(guest, "nopower", "remove", bdf)

    assert guest.call("exists", path=f"bus/pci/devices/{bdf}") is False
    call_bus(guest, "nopower", "rescan")  # left to pciehp first, then rescanned
    device = call_bus(guest, "nopower", "wait_for_device", 0, WAIT_S, expected=expected(card))
    assert device.bdf == bdf


def test_a_bound_device_withdrawn_at_the_box_side_is_survived(guest: Guest) -> None:
    make_bus(guest, "fence", 2)
    card = QemuFabric.card("drv", 5)
    bdf = device_of(guest, PORTS[2])
    with presented(guest, card, PORTS[2]):
        call_bus(guest, "fence", "rescan")
        call_bus(guest, "fence", "wait_for_device", 0, WAIT_S, expected=expected(card))
        call_bus(guest, "fence", "bind", bdf, "vfio-pci")

        took = box.withdraw(guest, card.qemu_id)

        assert call_bus(guest, "fence", "devices") == []
        call_bus(guest, "fence", "remove", bdf)  # a no-op now
    assert kernel_log(guest, "BUG|Oops|Call Trace") == ""
    print(f"box-side withdrawal of a vfio-bound device ({guest.spec.hotplug}): {took:.2f} s")
