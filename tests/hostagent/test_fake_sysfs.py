"""The fake kernel's rules, each as Linux 6.1 showed it in a QEMU guest
(``tests/kernel/test_kernel_rules.py`` checks the same facts on the real kernel)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hostagent.fake_sysfs import ACPIPHP, FakeCard, FakeKernel

BRIDGE = "0000:40:01.0"
DEVICE = "0000:41:00.0"


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[FakeKernel]:
    kernel = FakeKernel(tmp_path / "sys")
    kernel.add_port(BRIDGE, "0000:41", slot="1", iommu_group=4)
    yield kernel
    kernel.close()


def errno_of(kernel: FakeKernel, relative: str, value: str) -> int | None:
    try:
        kernel.write(relative, value)
    except OSError as error:
        return error.errno
    return None


def test_a_presented_card_is_powered_on_and_enumerated_by_the_hotplug_driver(
    kernel: FakeKernel,
) -> None:
    assert (
        kernel.read_text("bus/pci/slots/1/power"),
        kernel.read_text("bus/pci/slots/1/adapter"),
    ) == ("0", "0")
    kernel.insert(BRIDGE, FakeCard())

    assert kernel.present(DEVICE)
    assert (
        kernel.read_text("bus/pci/slots/1/power"),
        kernel.read_text("bus/pci/slots/1/adapter"),
    ) == ("1", "1")
    assert kernel.writes == []


def test_powering_an_empty_slot_is_enodev_under_pciehp_and_taken_under_acpiphp(
    kernel: FakeKernel,
) -> None:
    kernel.add_port("0000:40:02.0", "0000:42", slot="2", hotplug=ACPIPHP)

    assert errno_of(kernel, "bus/pci/slots/1/power", "1") == errno.ENODEV
    assert kernel.read_text("bus/pci/slots/1/power") == "0"
    assert errno_of(kernel, "bus/pci/slots/2/power", "1") is None
    assert kernel.read_text("bus/pci/slots/2/power") == "0"
    assert not kernel.present("0000:42:00.0")


def test_a_port_without_a_power_controller_reads_powered_and_power_off_only_unconfigures(
    tmp_path: Path,
) -> None:
    kernel = FakeKernel(tmp_path / "sys")
    kernel.add_port(BRIDGE, "0000:41", slot="3", power_controller=False)
    assert kernel.read_text("bus/pci/slots/3/power") == "1"  # empty, yet "powered"
    kernel.insert(BRIDGE, FakeCard())

    kernel.write("bus/pci/slots/3/power", "0")

    assert not kernel.present(DEVICE)
    assert (
        kernel.read_text("bus/pci/slots/3/power"),
        kernel.read_text("bus/pci/slots/3/adapter"),
    ) == ("1", "1")
    kernel.write(f"bus/pci/devices/{BRIDGE}/rescan", "1")
    assert kernel.present(DEVICE)


def test_after_remove_the_slot_stays_powered_and_any_rescan_brings_the_device_back(
    kernel: FakeKernel,
) -> None:
    kernel.insert(BRIDGE, FakeCard())
    kernel.write(f"bus/pci/devices/{DEVICE}/remove", "1")
    assert kernel.read_text("bus/pci/slots/1/power") == "1"

    kernel.write("bus/pci/rescan", "1")

    assert kernel.present(DEVICE)


def test_a_powered_off_slot_stays_down_on_a_rescan(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard())
    kernel.write("bus/pci/slots/1/power", "0")

    kernel.write(f"bus/pci/devices/{BRIDGE}/rescan", "1")
    kernel.write("bus/pci/rescan", "1")

    assert not kernel.present(DEVICE)


def test_bind_errnos_follow_driver_override_and_the_bound_driver(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard())  # comes up bound to nvidia
    override = f"bus/pci/devices/{DEVICE}/driver_override"

    assert errno_of(kernel, "bus/pci/drivers/nvidia/bind", DEVICE) == errno.EBUSY
    assert errno_of(kernel, "bus/pci/drivers/vfio-pci/unbind", DEVICE) == errno.ENODEV
    kernel.write("bus/pci/drivers/nvidia/unbind", DEVICE)
    assert errno_of(kernel, "bus/pci/drivers/vfio-pci/bind", DEVICE) == errno.ENODEV  # no ids
    kernel.write(override, "vfio-pci")
    assert errno_of(kernel, "bus/pci/drivers/nvidia/bind", DEVICE) == errno.ENODEV
    kernel.write("bus/pci/drivers_probe", DEVICE)
    assert kernel.link_name(f"bus/pci/devices/{DEVICE}/driver") == "vfio-pci"
    assert errno_of(kernel, "bus/pci/drivers_probe", DEVICE) is None  # bound: nothing to do
    kernel.write(override, "\n")
    assert kernel.read_text(override) == "(null)"


def test_reset_works_with_a_driver_bound(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard())

    kernel.write(f"bus/pci/devices/{DEVICE}/reset", "1")

    assert kernel.resets == [DEVICE]
    assert kernel.link_name(f"bus/pci/devices/{DEVICE}/driver") == "nvidia"
