"""Reading PCI configuration space: the capabilities the Linux driver needs.

Pure functions over the bytes of a device's sysfs ``config`` file. Linux gives the full
4 KiB of PCIe extended configuration space to root and only the first 64 bytes to other
users; every function here answers None when the bytes it needs are not there, so a
short read means "not readable", never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass

CAPABILITIES_POINTER = 0x34
STATUS_REGISTER = 0x06
STATUS_CAPABILITIES_LIST = 0x10
EXTENDED_CAPABILITIES_START = 0x100
CAP_ID_PCI_EXPRESS = 0x10
EXT_CAP_ID_DEVICE_SERIAL_NUMBER = 0x0003
SLOT_CAPABILITIES_OFFSET = 0x14  # within the PCI Express capability
SLOT_CAP_POWER_CONTROLLER = 1 << 1
SLOT_CAP_HOTPLUG_SURPRISE = 1 << 5
SLOT_CAP_HOTPLUG_CAPABLE = 1 << 6
_MAX_CAPABILITIES = 48  # a loop guard: more than the standard space can hold


def _u16(config: bytes, offset: int) -> int | None:
    if offset + 2 > len(config):
        return None
    return int.from_bytes(config[offset : offset + 2], "little")


def _u32(config: bytes, offset: int) -> int | None:
    if offset + 4 > len(config):
        return None
    return int.from_bytes(config[offset : offset + 4], "little")


def find_capability(config: bytes, cap_id: int) -> int | None:
    """Offset of the standard capability ``cap_id``, or None (absent or not readable)."""
    status = _u16(config, STATUS_REGISTER)
    if status is None or not status & STATUS_CAPABILITIES_LIST:
        return None
    if len(config) <= CAPABILITIES_POINTER:
        return None
    offset = config[CAPABILITIES_POINTER] & 0xFC
    for _ in range(_MAX_CAPABILITIES):
        if offset < 0x40 or offset + 2 > len(config):
            return None
        if config[offset] == cap_id:
            return offset
        offset = config[offset + 1] & 0xFC
    return None


def find_extended_capability(config: bytes, cap_id: int) -> int | None:
    """Offset of the PCIe extended capability ``cap_id``, or None."""
    offset = EXTENDED_CAPABILITIES_START
    for _ in range(_MAX_CAPABILITIES * 8):
        header = _u32(config, offset)
        if header is None or header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == cap_id:
            return offset
        offset = (header >> 20) & 0xFFC
        if offset < EXTENDED_CAPABILITIES_START:
            return None
    return None


def device_serial_number(config: bytes) -> str | None:
    """The Device Serial Number capability as ``lspci`` prints it (``"01-23-..-ef"``, most
    significant byte first), or None when the device has none or it is not readable."""
    offset = find_extended_capability(config, EXT_CAP_ID_DEVICE_SERIAL_NUMBER)
    if offset is None:
        return None
    low = _u32(config, offset + 4)
    high = _u32(config, offset + 8)
    if low is None or high is None:
        return None
    value = (high << 32) | low
    return "-".join(f"{byte:02x}" for byte in value.to_bytes(8, "big"))


@dataclass(frozen=True)
class SlotCapabilities:
    """What a downstream port's PCIe Slot Capabilities register says about its slot."""

    power_controller: bool
    hotplug_surprise: bool
    hotplug_capable: bool


def slot_capabilities(config: bytes) -> SlotCapabilities | None:
    """The Slot Capabilities of a PCIe port, or None when not readable or not a port."""
    express = find_capability(config, CAP_ID_PCI_EXPRESS)
    if express is None:
        return None
    register = _u32(config, express + SLOT_CAPABILITIES_OFFSET)
    if register is None:
        return None
    return SlotCapabilities(
        power_controller=bool(register & SLOT_CAP_POWER_CONTROLLER),
        hotplug_surprise=bool(register & SLOT_CAP_HOTPLUG_SURPRISE),
        hotplug_capable=bool(register & SLOT_CAP_HOTPLUG_CAPABLE),
    )


def build_config(
    *,
    vendor: int,
    device: int,
    class_code: int = 0x030200,
    dsn: int | None = None,
    slot_caps: int | None = None,
) -> bytes:
    """4 KiB of configuration space with the given ids, an optional PCI Express
    capability holding ``slot_caps`` and an optional Device Serial Number capability.

    For fake device trees in tests and for checking the parsers against the layout the
    PCIe specification defines.
    """
    config = bytearray(4096)
    config[0:2] = vendor.to_bytes(2, "little")
    config[2:4] = device.to_bytes(2, "little")
    config[0x09:0x0C] = class_code.to_bytes(3, "little")
    if slot_caps is not None:
        config[STATUS_REGISTER] = STATUS_CAPABILITIES_LIST
        config[CAPABILITIES_POINTER] = 0x40
        config[0x40] = CAP_ID_PCI_EXPRESS
        config[0x41] = 0  # end of list
        start = 0x40 + SLOT_CAPABILITIES_OFFSET
        config[start : start + 4] = slot_caps.to_bytes(4, "little")
    if dsn is not None:
        header = EXT_CAP_ID_DEVICE_SERIAL_NUMBER | (1 << 16)  # version 1, no next
        config[0x100:0x104] = header.to_bytes(4, "little")
        config[0x104:0x10C] = dsn.to_bytes(8, "little")
    return bytes(config)


__all__ = [
    "SlotCapabilities",
    "build_config",
    "device_serial_number",
    "find_capability",
    "find_extended_capability",
    "slot_capabilities",
]
