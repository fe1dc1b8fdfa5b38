"""``python -m tests.kernel.guest_agent AGENT-OPTIONS...``: the real host agent
(``dxpool agent``, the same click command and options) inside a QEMU guest, with two
things of the guest's hardware put in: NVML is the stand-in ``pynvml``
(:mod:`tests.hostagent.fake_nvml`) answering for the stand-in cards the kernel shows
bound to their own driver, and the Linux driver runs those cards on ``e1000e`` (their
native driver) and accepts their vendors. Everything else - sysfs, hot-plug, vfio, the
proxy hook, the broker it reaches - is real.
"""

from __future__ import annotations

from dxpool.cli.commands.agent import agent_command
from dxpool.hostagent import drivers
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.driver import FabricDriver
from dxpool.hostagent.drivers.linux import make_linux_driver
from dxpool.hostagent.drivers.linux_pci import PciSysfsReader
from dxpool.hostagent.drivers.sysfs import Sysfs
from dxpool.hostagent.nvml import NvmlInspector
from tests.hostagent.fake_nvml import FakeGpu, FakeNvml

NATIVE_DRIVER = "e1000e"
VENDORS = frozenset({"8086"})


def stand_in_nvml(sysfs: Sysfs) -> FakeNvml:
    """NVML as it would see our cards: a card bound to its native driver is a GPU whose
    UUID and serial come from its Device Serial Number."""
    reader = PciSysfsReader(sysfs)
    known: dict[str, FakeGpu] = {}

    def lookup(bdf: str) -> FakeGpu | None:
        if reader.driver_of(bdf) != NATIVE_DRIVER:
            return None
        dsn = reader.dsn(bdf)
        if dsn is None:
            return None
        if bdf not in known or known[bdf].serial != dsn:
            known[bdf] = FakeGpu(bdf=bdf, uuid=f"GPU-{dsn}", serial=dsn)
        return known[bdf]

    return FakeNvml(lookup=lookup)


def build_guest_linux_driver(config: AgentConfig) -> FabricDriver:
    sysfs = Sysfs(config.sysfs_root)
    return make_linux_driver(
        host_id=config.host_id,
        ports=config.linux_ports,
        proxy_hook=config.proxy_hook,
        sysfs=sysfs,
        inspector=NvmlInspector(stand_in_nvml(sysfs)),
        hook_timeout_s=config.proxy_hook_timeout_s,
        device_timeout_s=config.device_timeout_s,
        native_driver=NATIVE_DRIVER,
        vendors=VENDORS,
    )


def main() -> None:
    drivers.DRIVERS["linux"] = build_guest_linux_driver
    agent_command(prog_name="python -m tests.kernel.guest_agent")


if __name__ == "__main__":
    main()
