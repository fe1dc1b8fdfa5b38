"""SysfsPciBus against a fake sysfs tree that acts like the kernel, good and bad."""

from __future__ import annotations

import errno
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dxpool.hostagent.driver import ExpectedDevice
from dxpool.hostagent.drivers.linux_pci import SysfsPciBus
from dxpool.hostagent.errors import DeviceTimeoutError, DriverError, IdentityMismatchError
from tests.hostagent.fake_sysfs import FakeCard, FakeKernel

BRIDGE = "0000:40:01.0"
GPU_BDF = "0000:41:00.0"
BRIDGE2 = "0000:40:02.0"
GPU2_BDF = "0000:42:00.0"
DSN = "01-23-45-67-89-ab-cd-ef"


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[FakeKernel]:
    kernel = FakeKernel(tmp_path / "sys")
    kernel.add_port(BRIDGE, "0000:41", iommu_group=11)
    kernel.add_port(BRIDGE2, "0000:42", slot="7", iommu_group=12, surprise=True)
    yield kernel
    kernel.close()


def make_bus(kernel: FakeKernel, **options: object) -> SysfsPciBus:
    settings: dict[str, object] = {"poll_s": 0.01, "remove_timeout_s": 0.3, **options}
    return SysfsPciBus({0: BRIDGE, 1: BRIDGE2}, sysfs=kernel, **settings)  # type: ignore[arg-type]


def test_device_addresses_come_from_the_bridges_secondary_bus(kernel: FakeKernel) -> None:
    bus = make_bus(kernel)

    assert bus.device_address(0) == GPU_BDF
    assert bus.device_address(1) == GPU2_BDF


def test_rescan_below_the_bridge_brings_up_the_mapped_card_bound_to_nvidia(
    kernel: FakeKernel,
) -> None:
    kernel.insert(BRIDGE, FakeCard())
    bus = make_bus(kernel)
    assert bus.devices() == []

    bus.rescan()
    device = bus.wait_for_device(0, 1.0, ExpectedDevice(pci_id="10de:2330", dsn=DSN))

    assert (device.bdf, device.host_slot, device.driver) == (GPU_BDF, 0, "nvidia")
    assert (device.pci_id, device.dsn) == ("10de:2330", DSN)
    assert (f"bus/pci/devices/{BRIDGE}/rescan", "1") in kernel.writes
    assert [d.bdf for d in bus.devices()] == [GPU_BDF]


def test_a_managed_slot_comes_up_by_its_hotplug_driver_and_is_powered_off(
    kernel: FakeKernel,
) -> None:
    kernel.insert(BRIDGE2, FakeCard())  # the presence event: pciehp powers on, enumerates
    bus = make_bus(kernel)

    bus.rescan()
    bus.wait_for_device(1, 1.0)
    assert kernel.read_text("bus/pci/slots/7/power") == "1"
    bus.bind(GPU2_BDF, None)
    bus.remove(GPU2_BDF)

    assert kernel.read_text("bus/pci/slots/7/power") == "0"
    assert not kernel.present(GPU2_BDF)
    assert (f"bus/pci/devices/{BRIDGE2}/rescan", "1") not in kernel.writes
    assert (f"bus/pci/devices/{GPU2_BDF}/remove", "1") not in kernel.writes


def test_a_powered_slot_is_left_to_the_hotplug_driver_before_its_port_is_rescanned(
    kernel: FakeKernel,
) -> None:
    """pciehp powers the slot on by itself on the presence event; a rescan written while it
    enumerates races it. The driver writes nothing while the hot-plug driver has time."""
    kernel.insert(BRIDGE2, FakeCard(delay_s=0.3))  # powered at once, enumerated later
    bus = make_bus(kernel, hotplug_settle_s=5.0)
    assert kernel.read_text("bus/pci/slots/7/power") == "1"

    bus.rescan()
    assert bus.wait_for_device(1, 3.0).bdf == GPU2_BDF

    assert [w for w in kernel.writes if BRIDGE2 in w[0] or "slots/7" in w[0]] == []


def test_a_removed_device_of_a_powered_slot_is_brought_back_after_the_settle_time(
    kernel: FakeKernel,
) -> None:
    kernel.insert(BRIDGE2, FakeCard())
    kernel.write(f"bus/pci/devices/{GPU2_BDF}/remove", "1")  # slot powered, card present
    assert (kernel.read_text("bus/pci/slots/7/power"), kernel.present(GPU2_BDF)) == ("1", False)
    bus = make_bus(kernel, hotplug_settle_s=0.1)

    bus.rescan()
    assert (f"bus/pci/devices/{BRIDGE2}/rescan", "1") not in kernel.writes
    assert bus.wait_for_device(1, 3.0).bdf == GPU2_BDF

    assert (f"bus/pci/devices/{BRIDGE2}/rescan", "1") in kernel.writes


def test_a_slot_left_powered_off_with_its_card_present_is_powered_on(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE2, FakeCard())
    kernel.write("bus/pci/slots/7/power", "0")  # an earlier detach; the proxy kept the map
    bus = make_bus(kernel)

    bus.rescan()

    assert bus.wait_for_device(1, 1.0).bdf == GPU2_BDF
    assert kernel.writes[-1] == ("bus/pci/slots/7/power", "1")


def test_a_port_without_a_power_controller_is_removed_not_powered_off(tmp_path: Path) -> None:
    """Its ``power`` reads 1 even when empty, and writing 0 would only unconfigure the
    device: the driver neither claims slot power nor uses it."""
    kernel = FakeKernel(tmp_path / "sys")
    kernel.add_port(BRIDGE, "0000:41", slot="3", power_controller=False)
    assert kernel.read_text("bus/pci/slots/3/power") == "1"
    bus = SysfsPciBus({0: BRIDGE}, sysfs=kernel, poll_s=0.01)
    assert bus.capabilities().slot_power is False
    kernel.insert(BRIDGE, FakeCard())
    bus.wait_for_device(0, 1.0)
    bus.bind(GPU_BDF, None)

    bus.remove(GPU_BDF)

    assert kernel.writes[-1] == (f"bus/pci/devices/{GPU_BDF}/remove", "1")
    assert not kernel.present(GPU_BDF)
    kernel.write("bus/pci/slots/3/power", "0")  # what the driver no longer relies on:
    kernel.write(f"bus/pci/devices/{BRIDGE}/rescan", "1")
    assert kernel.present(GPU_BDF)  # the slot stayed powered, the card came back


def test_without_a_bridge_rescan_attribute_the_whole_bus_is_not_rescanned(
    tmp_path: Path,
) -> None:
    """A whole-bus rescan would bring back every removed device whose card is still
    present, on any slot; the driver fails this slot instead, naming why."""
    kernel = FakeKernel(tmp_path / "sys")
    kernel.add_port(BRIDGE, "0000:41", rescan_file=False)
    kernel.insert(BRIDGE, FakeCard())
    bus = SysfsPciBus({0: BRIDGE}, sysfs=kernel, poll_s=0.01)

    bus.rescan()

    assert ("bus/pci/rescan", "1") not in kernel.writes
    with pytest.raises(DeviceTimeoutError, match=r"rescanning below bridge .* failed"):
        bus.wait_for_device(0, 0.1)


def test_a_card_that_appears_late_is_waited_for(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard(delay_s=0.2))
    bus = make_bus(kernel)

    bus.rescan()
    started = time.monotonic()
    device = bus.wait_for_device(0, 2.0)

    assert device.bdf == GPU_BDF
    assert time.monotonic() - started >= 0.15


def test_a_card_that_never_appears_times_out_naming_address_and_what_to_check(
    kernel: FakeKernel,
) -> None:
    kernel.insert(BRIDGE, FakeCard(appears=False))
    bus = make_bus(kernel)

    bus.rescan()
    with pytest.raises(DeviceTimeoutError) as caught:
        bus.wait_for_device(0, 0.2)

    message = str(caught.value)
    assert GPU_BDF in message and BRIDGE in message and "host slot 0" in message
    assert "rescanning below bridge" in message and "proxy mapped the GPU" in message


def test_an_empty_slot_times_out_saying_no_card_is_present(kernel: FakeKernel) -> None:
    bus = make_bus(kernel)

    bus.rescan()
    with pytest.raises(DeviceTimeoutError) as caught:
        bus.wait_for_device(1, 0.1)

    assert "hotplug slot 7 shows power 0, no card present (adapter 0)" in str(caught.value)
    assert ("bus/pci/slots/7/power", "1") not in kernel.writes


def test_a_failed_slot_power_on_is_named_in_the_timeout(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE2, FakeCard())
    kernel.write("bus/pci/slots/7/power", "0")  # an earlier detach; the card stays
    kernel.failing_writes["bus/pci/slots/7/power"] = errno.EIO
    bus = make_bus(kernel)

    bus.rescan()
    with pytest.raises(DeviceTimeoutError) as caught:
        bus.wait_for_device(1, 0.1)

    message = str(caught.value)
    assert "powering on hotplug slot 7 failed: Input/output error" in message
    assert "hotplug slot 7 shows power 0, a card present (adapter 1)" in message


@pytest.mark.parametrize(
    ("card", "expected", "message"),
    [
        (
            FakeCard(device=0x20B0),
            ExpectedDevice(pci_id="10de:2330"),
            "is PCI 10de:20b0, expected 10de:2330",
        ),
        (
            FakeCard(vendor=0x15B3, device=0x1021),
            None,
            "is PCI 15b3:1021, not a GPU of vendor 10de",
        ),
        (
            FakeCard(dsn=0x1111),
            ExpectedDevice(dsn=DSN),
            "serial number 00-00-00-00-00-00-11-11, expected",
        ),
        (FakeCard(dsn=None), ExpectedDevice(dsn=DSN), "no readable serial number"),
    ],
)
def test_a_card_that_is_not_the_expected_device_is_refused(
    kernel: FakeKernel, card: FakeCard, expected: ExpectedDevice | None, message: str
) -> None:
    kernel.insert(BRIDGE, card)
    bus = make_bus(kernel)

    bus.rescan()
    with pytest.raises(IdentityMismatchError, match=re.escape(message)) as caught:
        bus.wait_for_device(0, 1.0, expected)

    assert caught.value.retryable is False
    assert GPU_BDF in str(caught.value)


def test_remove_that_leaves_the_device_on_the_bus_fails_with_what_to_check(
    kernel: FakeKernel,
) -> None:
    kernel.insert(BRIDGE, FakeCard(sticky=True))
    bus = make_bus(kernel)
    bus.rescan()
    bus.wait_for_device(0, 1.0)
    bus.bind(GPU_BDF, None)

    with pytest.raises(
        DriverError, match=r"still on the PCI bus 0\.3s after writing its remove"
    ) as caught:
        bus.remove(GPU_BDF)

    assert "nvidia-smi" in str(caught.value)
    assert caught.value.retryable


def test_remove_of_an_absent_device_is_a_no_op(kernel: FakeKernel) -> None:
    make_bus(kernel).remove(GPU_BDF)

    assert kernel.writes == []


def test_detach_steps_unbind_then_remove(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard())
    bus = make_bus(kernel)
    bus.rescan()
    bus.wait_for_device(0, 1.0)

    bus.bind(GPU_BDF, None)
    assert bus.driver_of(GPU_BDF) is None
    bus.remove(GPU_BDF)

    assert not kernel.present(GPU_BDF)
    assert kernel.writes[-2:] == [
        ("bus/pci/drivers/nvidia/unbind", GPU_BDF),
        (f"bus/pci/devices/{GPU_BDF}/remove", "1"),
    ]


def test_vfio_bind_goes_through_driver_override_and_back(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard())
    bus = make_bus(kernel)
    bus.rescan()
    bus.wait_for_device(0, 1.0)

    bus.bind(GPU_BDF, "vfio-pci")
    assert bus.driver_of(GPU_BDF) == "vfio-pci"
    assert kernel.read_text(f"bus/pci/devices/{GPU_BDF}/driver_override") == "vfio-pci"
    assert ("bus/pci/drivers_probe", GPU_BDF) in kernel.writes
    bus.bind(GPU_BDF, "vfio-pci")  # already bound: nothing to do
    bus.bind(GPU_BDF, "nvidia")

    assert bus.driver_of(GPU_BDF) == "nvidia"
    assert kernel.read_text(f"bus/pci/devices/{GPU_BDF}/driver_override") == "(null)"


def test_vfio_bind_accepts_a_group_with_a_bridge_and_an_unbound_function(
    kernel: FakeKernel,
) -> None:
    kernel.insert(BRIDGE, FakeCard())
    kernel.add_device(
        "0000:41:00.1",
        vendor=0x10DE,
        device=0x22A3,
        class_code=0x040300,
        iommu_group=11,
        driver=None,
    )
    kernel.add_device(
        "0000:3f:00.0",
        vendor=0x1000,
        device=0xC010,
        class_code=0x060400,
        iommu_group=11,
        driver="pcieport",
    )
    bus = make_bus(kernel)
    bus.rescan()
    bus.wait_for_device(0, 1.0)

    bus.bind(GPU_BDF, "vfio-pci")

    assert bus.driver_of(GPU_BDF) == "vfio-pci"


def test_vfio_bind_refuses_a_group_holding_a_foreign_bound_device(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard())
    kernel.load_driver("mlx5_core")
    kernel.add_device(
        "0000:43:00.0",
        vendor=0x15B3,
        device=0x1021,
        class_code=0x020000,
        iommu_group=11,
        driver="mlx5_core",
    )
    bus = make_bus(kernel)
    bus.rescan()
    bus.wait_for_device(0, 1.0)

    with pytest.raises(DriverError) as caught:
        bus.bind(GPU_BDF, "vfio-pci")

    message = str(caught.value)
    assert "IOMMU group 11" in message and "0000:43:00.0" in message and "mlx5_core" in message
    assert "not viable" in message and "ACS" in message
    assert caught.value.retryable is False
    assert bus.driver_of(GPU_BDF) == "nvidia"  # refused before touching it


def test_vfio_bind_without_an_iommu_group_says_to_enable_the_iommu(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path / "sys")
    kernel.add_port(BRIDGE, "0000:41")
    kernel.add_device(
        "0000:50:00.0",
        vendor=0x10DE,
        device=0x2330,
        class_code=0x030200,
        iommu_group=None,  # type: ignore[arg-type]
        driver="nvidia",
    )
    bus = SysfsPciBus({0: BRIDGE}, sysfs=kernel)

    with pytest.raises(DriverError, match=r"no IOMMU group.*intel_iommu=on"):
        bus.bind("0000:50:00.0", "vfio-pci")


def test_vfio_bind_without_the_vfio_module_says_to_load_it(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path / "sys", drivers=("nvidia",))
    kernel.add_port(BRIDGE, "0000:41", iommu_group=3)
    kernel.insert(BRIDGE, FakeCard())
    bus = SysfsPciBus({0: BRIDGE}, sysfs=kernel, poll_s=0.01, driver_load_s=0.1)
    bus.rescan()
    bus.wait_for_device(0, 1.0)

    with pytest.raises(DriverError, match="modprobe vfio-pci"):
        bus.bind(GPU_BDF, "vfio-pci")
    assert bus.capabilities().vfio is False


def test_a_native_driver_loaded_by_udev_after_the_hot_add_is_waited_for(tmp_path: Path) -> None:
    """The device shows up before udev has loaded its module; the bind waits for it."""
    kernel = FakeKernel(tmp_path / "sys", drivers=("vfio-pci",))
    kernel.add_port(BRIDGE, "0000:41", iommu_group=3)
    kernel.insert(BRIDGE, FakeCard())
    bus = SysfsPciBus({0: BRIDGE}, sysfs=kernel, poll_s=0.01, driver_load_s=5.0)
    bus.rescan()
    assert bus.wait_for_device(0, 1.0).driver is None
    udev = threading.Timer(0.2, kernel.load_driver, ("nvidia",))
    udev.start()

    bus.bind(GPU_BDF, "nvidia")

    udev.join()
    assert bus.driver_of(GPU_BDF) == "nvidia"


def test_bind_of_an_absent_device_is_a_driver_error(kernel: FakeKernel) -> None:
    with pytest.raises(DriverError, match=re.escape("no PCI device at 0000:41:00.0")):
        make_bus(kernel).bind(GPU_BDF, "nvidia")


def test_a_bridge_that_is_not_there_is_a_configuration_error(kernel: FakeKernel) -> None:
    bus = SysfsPciBus({0: "0000:7f:01.0"}, sysfs=kernel)

    with pytest.raises(DriverError, match=r"not on this host's PCI bus.*lspci") as caught:
        bus.device_address(0)
    assert caught.value.retryable is False


def test_a_bad_bridge_address_is_refused_at_construction(kernel: FakeKernel) -> None:
    with pytest.raises(DriverError, match="not a PCI address"):
        SysfsPciBus({0: "40:01.0"}, sysfs=kernel)


def test_capabilities_are_read_from_the_ports(kernel: FakeKernel) -> None:
    caps = make_bus(kernel).capabilities()
    only_power = SysfsPciBus({1: BRIDGE2}, sysfs=kernel).capabilities()

    assert (caps.slot_power, caps.surprise_removal, caps.vfio) == (False, False, True)
    assert (only_power.slot_power, only_power.surprise_removal) == (True, True)


def test_link_width_and_speed_are_read(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard(link_width=8))
    bus = make_bus(kernel)
    bus.rescan()
    bus.wait_for_device(0, 1.0)

    link = bus.link(GPU_BDF)

    assert (link.width, link.max_width, link.speed) == (8, 16, "32.0 GT/s PCIe")


class RacingKernel(FakeKernel):
    """Before the agent's write to ``race_on`` lands, the device's driver changes as if the
    kernel's own probe (or another unbind) got there first."""

    race_on: str = ""
    race_to: str | None = None

    def write(self, relative: str, value: str) -> None:
        if relative == self.race_on:
            self.race_on = ""
            self._set_driver(value.strip(), self.race_to)
        super().write(relative, value)


@pytest.mark.parametrize(
    ("race_on", "race_to", "start", "wanted"),
    [
        ("bus/pci/drivers/nvidia/bind", "nvidia", None, "nvidia"),
        ("bus/pci/drivers/nvidia/unbind", None, "nvidia", None),
    ],
)
def test_a_bind_that_loses_the_race_to_the_kernels_own_probe_is_success(
    tmp_path: Path, race_on: str, race_to: str | None, start: str | None, wanted: str | None
) -> None:
    kernel = RacingKernel(tmp_path / "sys")
    kernel.add_port(BRIDGE, "0000:41", iommu_group=3)
    kernel.add_device(
        GPU_BDF, vendor=0x10DE, device=0x2330, class_code=0x030200, iommu_group=3, driver=start
    )
    bus = SysfsPciBus({0: BRIDGE}, sysfs=kernel)
    kernel.race_on, kernel.race_to = race_on, race_to

    bus.bind(GPU_BDF, wanted)  # the write itself fails (EBUSY / ENODEV)

    assert bus.driver_of(GPU_BDF) == wanted
    assert (race_on, GPU_BDF) in kernel.writes


def test_a_refused_bind_that_did_not_settle_is_still_an_error(tmp_path: Path) -> None:
    kernel = RacingKernel(tmp_path / "sys")
    kernel.add_port(BRIDGE, "0000:41", iommu_group=3)
    kernel.add_device(
        GPU_BDF, vendor=0x10DE, device=0x2330, class_code=0x030200, iommu_group=3, driver=None
    )
    kernel.failing_writes["bus/pci/drivers/nvidia/bind"] = errno.ENODEV
    bus = SysfsPciBus({0: BRIDGE}, sysfs=kernel)

    with pytest.raises(
        DriverError, match=re.escape("binding 0000:41:00.0 to nvidia failed: No such device")
    ):
        bus.bind(GPU_BDF, "nvidia")


def test_reset_writes_the_reset_attribute_of_an_unbound_device(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard())
    bus = make_bus(kernel)
    bus.rescan()
    bus.wait_for_device(0, 1.0)
    bus.bind(GPU_BDF, None)

    bus.reset(GPU_BDF)

    assert kernel.resets == [GPU_BDF]
    assert kernel.writes[-1] == (f"bus/pci/devices/{GPU_BDF}/reset", "1")


def test_reset_of_a_bound_device_is_refused_before_any_write(kernel: FakeKernel) -> None:
    kernel.insert(BRIDGE, FakeCard())
    bus = make_bus(kernel)
    bus.rescan()
    bus.wait_for_device(0, 1.0)
    writes = len(kernel.writes)

    with pytest.raises(DriverError, match="bound to nvidia; unbind it before a reset"):
        bus.reset(GPU_BDF)

    assert kernel.resets == []
    assert len(kernel.writes) == writes


def test_reset_of_an_absent_device_is_a_driver_error(kernel: FakeKernel) -> None:
    with pytest.raises(DriverError, match=r"no PCI device at .* to reset"):
        make_bus(kernel).reset(GPU_BDF)


def test_a_slot_mapped_long_after_an_earlier_rescan_is_still_left_to_its_hotplug_driver(
    kernel: FakeKernel,
) -> None:
    """An earlier attach's rescan of the then-empty slot must not make a later attach
    rescan the port at once, racing the hot-plug driver's enumeration."""
    bus = make_bus(kernel, hotplug_settle_s=0.3)
    bus.rescan()  # slot 7 empty: left to pciehp
    time.sleep(0.4)  # that settle time is long past
    kernel.insert(BRIDGE2, FakeCard(delay_s=0.2))  # now mapped; pciehp enumerates late

    bus.rescan()
    assert bus.wait_for_device(1, 3.0).bdf == GPU2_BDF

    assert (f"bus/pci/devices/{BRIDGE2}/rescan", "1") not in kernel.writes
