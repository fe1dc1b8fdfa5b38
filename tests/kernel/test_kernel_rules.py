"""What Linux 6.1 does on the writes the Linux driver makes, seen in a QEMU guest: the
facts the fake sysfs tree (``tests/hostagent/fake_sysfs.py``) was corrected to, checked
here against the real kernel (``tests/hostagent/test_fake_sysfs.py`` checks the fake)."""

from __future__ import annotations

import errno
import time

from tests.kernel import box
from tests.kernel.conftest import PORTS
from tests.kernel.qemu_fabric import QemuFabric
from tests.kernel.qemu_guest import Guest
from tests.kernel.rig import (
    device_of,
    driver_of,
    presented,
    slot_of,
    slot_shows,
    wait_bound,
    write_errno,
)

WITH_POWER, NO_POWER = PORTS[0], PORTS[3]


def wait_present(guest: Guest, bdf: str, present: bool = True, timeout_s: float = 120) -> float:
    return float(
        guest.call("wait_for", path=f"bus/pci/devices/{bdf}", present=present, timeout_s=timeout_s)
    )


def test_a_port_without_a_power_controller_reads_powered_when_empty(pciehp_guest: Guest) -> None:
    assert slot_shows(pciehp_guest, WITH_POWER) == ("0", "0")
    assert slot_shows(pciehp_guest, NO_POWER) == ("1", "0")


def test_pciehp_powers_the_slot_on_and_enumerates_the_card_by_itself(
    pciehp_guest: Guest,
) -> None:
    bdf = device_of(pciehp_guest, WITH_POWER)
    with presented(pciehp_guest, QemuFabric.card("rules", 1), WITH_POWER):
        waited = wait_present(pciehp_guest, bdf)  # nothing written to sysfs meanwhile
        assert slot_shows(pciehp_guest, WITH_POWER) == ("1", "1")
        assert driver_of(pciehp_guest, bdf) == "e1000e"  # udev loaded the driver
    print(f"device_add to device in the guest: {waited:.2f} s")


def test_powering_an_empty_slot_is_enodev_under_pciehp_and_taken_under_acpi(
    pciehp_guest: Guest, acpi_guest: Guest
) -> None:
    native = f"bus/pci/slots/{slot_of(pciehp_guest, WITH_POWER)}/power"
    acpi = f"bus/pci/slots/{slot_of(acpi_guest, WITH_POWER)}/power"

    assert write_errno(pciehp_guest, native, "1") == errno.ENODEV
    assert write_errno(acpi_guest, acpi, "1") is None
    assert pciehp_guest.call("read", path=native) == "0"  # the hardware's state, not
    assert acpi_guest.call("read", path=acpi) == "0"  # what was written
    assert not acpi_guest.call(
        "exists", path=f"bus/pci/devices/{device_of(acpi_guest, WITH_POWER)}"
    )


def test_bind_errnos_and_a_reset_with_a_driver_bound(pciehp_guest: Guest) -> None:
    guest = pciehp_guest
    bdf = device_of(guest, WITH_POWER)
    with presented(guest, QemuFabric.card("rules", 2), WITH_POWER):
        wait_present(guest, bdf)
        wait_bound(guest, bdf)
        override = f"bus/pci/devices/{bdf}/driver_override"

        assert write_errno(guest, "bus/pci/drivers/e1000e/bind", bdf) == errno.EBUSY
        assert write_errno(guest, "bus/pci/drivers/vfio-pci/unbind", bdf) == errno.ENODEV
        assert write_errno(guest, f"bus/pci/devices/{bdf}/reset", "1") is None  # bound
        assert driver_of(guest, bdf) == "e1000e"
        guest.call("write", path="bus/pci/drivers/e1000e/unbind", value=bdf)
        assert write_errno(guest, "bus/pci/drivers/vfio-pci/bind", bdf) == errno.ENODEV
        guest.call("write", path=override, value="vfio-pci")
        assert write_errno(guest, "bus/pci/drivers/e1000e/bind", bdf) == errno.ENODEV
        guest.call("write", path="bus/pci/drivers_probe", value=bdf)
        assert driver_of(guest, bdf) == "vfio-pci"
        assert write_errno(guest, "bus/pci/drivers_probe", bdf) is None
        assert write_errno(guest, f"bus/pci/devices/{bdf}/reset", "1") is None
        guest.call("write", path=override, value="\n")
        assert guest.call("read", path=override) == "(null)"


def test_after_remove_the_slot_stays_powered_and_a_rescan_brings_the_device_back(
    pciehp_guest: Guest,
) -> None:
    guest = pciehp_guest
    bdf = device_of(guest, WITH_POWER)
    with presented(guest, QemuFabric.card("rules", 3), WITH_POWER):
        wait_present(guest, bdf)
        guest.call("write", path=f"bus/pci/devices/{bdf}/remove", value="1")
        wait_present(guest, bdf, present=False)
        time.sleep(1)
        assert slot_shows(guest, WITH_POWER) == ("1", "1")
        assert not guest.call("exists", path=f"bus/pci/devices/{bdf}")

        guest.call("write", path=f"bus/pci/devices/{WITH_POWER.bridge}/rescan", value="1")

        wait_present(guest, bdf, timeout_s=30)


def test_powering_the_slot_off_in_the_guest_makes_qemu_drop_the_card(pciehp_guest: Guest) -> None:
    guest = pciehp_guest
    bdf = device_of(guest, WITH_POWER)
    card = QemuFabric.card("rules", 4)
    with presented(guest, card, WITH_POWER):
        wait_present(guest, bdf)
        guest.call("write", path=f"bus/pci/slots/{slot_of(guest, WITH_POWER)}/power", value="0")

        box.wait_deleted(guest, card.qemu_id, timeout_s=60)
        assert slot_shows(guest, WITH_POWER) == ("0", "0")


def test_a_second_device_del_during_the_attention_button_wait_is_refused(
    pciehp_guest: Guest,
) -> None:
    guest = pciehp_guest
    bdf = device_of(guest, WITH_POWER)
    card = QemuFabric.card("rules", 5)
    with presented(guest, card, WITH_POWER):
        wait_present(guest, bdf)
        started = time.monotonic()
        box.request_withdraw(guest, card.qemu_id)
        try:
            box.request_withdraw(guest, card.qemu_id)
        except Exception as error:
            refusal = str(error)
        else:
            refusal = ""
        box.wait_deleted(guest, card.qemu_id)
        took = time.monotonic() - started

    assert "already in the process of unplug" in refusal
    assert took >= 4.5  # pciehp's attention-button wait is 5 s
    print(f"device_del to DEVICE_DELETED under pciehp: {took:.2f} s")
