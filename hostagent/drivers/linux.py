"""The Linux fabric driver: sysfs PCIe bus + command-hook proxy mapper + NVML.

:func:`make_linux_driver` builds a :class:`~dxpool.hostagent.driver.StepDriver` from
:class:`~dxpool.hostagent.drivers.linux_pci.SysfsPciBus`,
:class:`~dxpool.hostagent.drivers.command_hook.CommandHookMapper` (or a box-side mapper
such as Redfish's) and
:class:`~dxpool.hostagent.nvml.NvmlInspector`, and declares its capabilities from what
sysfs shows (slot power, hot-plug surprise, vfio with an IOMMU) plus what the operator
says of the fabric (peer-to-peer). It checks the configuration against the host first,
so a wrong hook path or bridge address stops the agent at start with a message that says
what to fix, instead of failing every attach.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dxpool.errors import FailedPrecondition, InvalidArgument
from dxpool.hostagent.driver import (
    DEFAULT_DEVICE_TIMEOUT_S,
    NATIVE_DRIVER,
    DriverCapabilities,
    ProxyMapper,
    StepDriver,
)
from dxpool.hostagent.drivers.command_hook import DEFAULT_HOOK_TIMEOUT_S, CommandHookMapper
from dxpool.hostagent.drivers.linux_pci import NVIDIA_VENDOR, SysfsPciBus
from dxpool.hostagent.drivers.sysfs import DEFAULT_SYSFS_ROOT, Sysfs
from dxpool.hostagent.errors import DriverError
from dxpool.hostagent.nvml import GpuInspector, NvmlInspector


def make_linux_driver(
    *,
    host_id: str,
    ports: Mapping[int, str],
    proxy_hook: Path | None = None,
    mapper: ProxyMapper | None = None,
    sysfs: Sysfs | None = None,
    inspector: GpuInspector | None = None,
    nvml: Any | None = None,
    hook_timeout_s: float = DEFAULT_HOOK_TIMEOUT_S,
    device_timeout_s: float = DEFAULT_DEVICE_TIMEOUT_S,
    p2p: bool = False,
    native_driver: str = NATIVE_DRIVER,
    vendors: frozenset[str] | None = None,
) -> StepDriver:
    """The Linux driver for ``host_id``.

    ``ports``: host slot -> address of the PCIe downstream port behind which the proxy
    presents that slot's GPU. ``proxy_hook``: the executable that programs the host's
    proxy (see :mod:`~dxpool.hostagent.drivers.command_hook`); ``mapper``: a box-side
    mapper to use instead (e.g. Redfish); exactly one of the two is given. ``sysfs``
    defaults to ``/sys``; ``inspector`` to an :class:`NvmlInspector` over ``nvml`` (the
    real ``pynvml`` when None). ``p2p``: the fabric carries peer-to-peer traffic between GPUs.
    ``native_driver`` and ``vendors`` (PCI vendor ids accepted when an attach names no PCI
    id) default to NVIDIA's; the real-kernel tests run the driver on stand-in devices.

    Raises FailedPrecondition when the hook is not an executable file, the sysfs root
    has no PCI bus, or a port's bridge is not on it.
    """
    if (proxy_hook is None) == (mapper is None):
        raise InvalidArgument("the linux driver needs exactly one of proxy_hook and mapper")
    sysfs = sysfs or Sysfs(DEFAULT_SYSFS_ROOT)
    proxy: ProxyMapper
    if mapper is not None:
        proxy = mapper
    elif proxy_hook is not None and proxy_hook.is_file() and os.access(proxy_hook, os.X_OK):
        proxy = CommandHookMapper(proxy_hook, host_id, timeout_s=hook_timeout_s)
    else:
        raise FailedPrecondition(
            f"the proxy hook {proxy_hook} is not an executable file; install it or correct "
            "--proxy-hook"
        )
    if not sysfs.exists("bus/pci/devices"):
        raise FailedPrecondition(
            f"no PCI bus under {sysfs.root} (bus/pci/devices is missing); run the agent on "
            "the host itself, with sysfs mounted, or correct --sysfs-root"
        )
    bus = SysfsPciBus(ports, sysfs=sysfs, vendors=vendors or frozenset({NVIDIA_VENDOR}))
    for host_slot in sorted(ports):
        try:
            bus.device_address(host_slot)
        except DriverError as error:
            raise FailedPrecondition(error.message) from error
    found = bus.capabilities()
    capabilities = DriverCapabilities(
        hotplug=True,
        surprise_removal=found.surprise_removal,
        vfio=found.vfio,
        p2p=p2p,
        identity=True,
        slot_power=found.slot_power,
    )
    return StepDriver(
        proxy=proxy,
        bus=bus,
        inspector=inspector if inspector is not None else NvmlInspector(nvml),
        capabilities=capabilities,
        device_timeout_s=device_timeout_s,
        native_driver=native_driver,
    )


__all__ = ["make_linux_driver"]
