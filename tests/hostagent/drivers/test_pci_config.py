"""Configuration space parsing: capabilities found by walking the lists as PCIe lays them out."""

from __future__ import annotations

from dxpool.hostagent.drivers.pci_config import (
    CAP_ID_PCI_EXPRESS,
    SLOT_CAP_HOTPLUG_CAPABLE,
    SLOT_CAP_HOTPLUG_SURPRISE,
    SLOT_CAP_POWER_CONTROLLER,
    build_config,
    device_serial_number,
    find_capability,
    slot_capabilities,
)


def test_dsn_is_printed_most_significant_byte_first_like_lspci() -> None:
    config = build_config(vendor=0x10DE, device=0x2330, dsn=0x48B02D0300A1B2C3)

    assert device_serial_number(config) == "48-b0-2d-03-00-a1-b2-c3"


def test_dsn_found_after_other_extended_capabilities() -> None:
    config = bytearray(build_config(vendor=0x10DE, device=0x2330))
    # AER (id 1) at 0x100 pointing to DSN at 0x140.
    config[0x100:0x104] = (0x0001 | (1 << 16) | (0x140 << 20)).to_bytes(4, "little")
    config[0x140:0x144] = (0x0003 | (1 << 16)).to_bytes(4, "little")
    config[0x144:0x14C] = (0x1122334455667788).to_bytes(8, "little")

    assert device_serial_number(bytes(config)) == "11-22-33-44-55-66-77-88"


def test_no_dsn_when_absent_or_when_only_64_bytes_are_readable() -> None:
    with_dsn = build_config(vendor=0x10DE, device=0x2330, dsn=1)

    assert device_serial_number(build_config(vendor=0x10DE, device=0x2330)) is None
    assert device_serial_number(with_dsn[:64]) is None  # what a non-root reader gets
    assert device_serial_number(b"") is None


def test_a_looping_capability_list_ends() -> None:
    config = bytearray(build_config(vendor=1, device=2))
    config[0x100:0x104] = (0x0001 | (0x100 << 20)).to_bytes(4, "little")  # points to itself

    assert device_serial_number(bytes(config)) is None


def test_slot_capabilities_of_a_port() -> None:
    caps = SLOT_CAP_POWER_CONTROLLER | SLOT_CAP_HOTPLUG_SURPRISE | SLOT_CAP_HOTPLUG_CAPABLE
    config = build_config(vendor=0x1000, device=0xC010, class_code=0x060400, slot_caps=caps)

    found = slot_capabilities(config)

    assert find_capability(config, CAP_ID_PCI_EXPRESS) == 0x40
    assert found is not None
    assert (found.power_controller, found.hotplug_surprise, found.hotplug_capable) == (
        True,
        True,
        True,
    )
    assert slot_capabilities(build_config(vendor=1, device=2)) is None
