"""The real-kernel lane: Linux in QEMU guests, the test as the box-side proxy.

Two guests boot once per session, at the same time: ``pciehp_guest`` with QEMU's ACPI
hot-plug off (the kernel's PCIe native hot-plug driver owns the ports) and
``acpi_guest`` with QEMU's default ACPI hot-plug. Both reach the session's etcd and the
emulated fabric (``fabric``) on this machine's loopback through restricted user
networking. Every test here is marked ``kernel`` and ``slow``; all skip, saying what to
install, where QEMU, the kernel image, busybox, udev or virtme-ng are missing (they fail
instead with ``DXPOOL_REQUIRE_KERNEL=1``, as in CI).

The lane's timings (each boot, each test) are printed at the end of the run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dxpool.store.embedded import EmbeddedEtcd
from tests.kernel.qemu_fabric import QemuFabric
from tests.kernel.qemu_guest import Guest, GuestSpec, PortSpec, Timings, missing_tools

# Root ports of every guest: host slots 0-2 have power controllers, 3 has none.
PORTS = (
    PortSpec("rp0", 0x10, 1),
    PortSpec("rp1", 0x11, 2),
    PortSpec("rp2", 0x12, 3),
    PortSpec("rp3", 0x13, 4, power_controller=False),
)
TIMINGS = Timings()
_KERNEL_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The end-to-end test kills the pciehp guest (host loss): it runs after the others.
    items.sort(key=lambda item: item.fspath.basename == "test_agent_e2e.py")
    reason = missing_tools()
    for item in items:
        if _KERNEL_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.kernel)
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(1800))
            if reason is not None and os.environ.get("DXPOOL_REQUIRE_KERNEL") != "1":
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TIMINGS.phases:
        return
    terminalreporter.section("real-kernel lane timings")
    for name, seconds in TIMINGS.phases:
        terminalreporter.write_line(f"{seconds:8.1f} s  {name}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Time each test's own run, without its fixtures (a guest's boot is timed apart)."""
    if _KERNEL_DIR not in Path(str(item.fspath)).parents:
        return (yield)
    with TIMINGS.phase(item.nodeid.split("::", 1)[-1]):
        return (yield)


@pytest.fixture(scope="session")
def fabric(etcd_server: EmbeddedEtcd) -> Iterator[QemuFabric]:
    """The emulated box side, serving hooks on a free loopback port."""
    with QemuFabric() as fabric:
        yield fabric


def _etcd_port(etcd_server: EmbeddedEtcd) -> int:
    return int(etcd_server.endpoint.rsplit(":", 1)[1])


@pytest.fixture(scope="session")
def _guests(
    tmp_path_factory: pytest.TempPathFactory, etcd_server: EmbeddedEtcd, fabric: QemuFabric
) -> Iterator[dict[str, Guest]]:
    reason = missing_tools()
    if reason is not None:  # only where DXPOOL_REQUIRE_KERNEL=1 says the lane must run
        pytest.fail(reason)
    forwards = (_etcd_port(etcd_server), fabric.port)
    guests = {
        mode: Guest(
            GuestSpec(f"dx-{mode}", hotplug=mode, ports=PORTS, forwards=forwards),
            tmp_path_factory.mktemp(f"guest-{mode}"),
        )
        for mode in ("pciehp", "acpi")
    }
    started = time.monotonic()
    try:
        for guest in guests.values():
            guest.start()
        yield guests
    finally:
        for guest in guests.values():
            guest.close()
        TIMINGS.phases.append(("both guests, start to close", time.monotonic() - started))


def _ready(guest: Guest) -> Guest:
    if guest.boot_s is None:
        with TIMINGS.phase(f"boot of {guest.spec.name} ({guest.accelerator}), waited here"):
            guest.wait_ready()
        TIMINGS.phases.append((f"boot of {guest.spec.name} from QEMU start", guest.boot_s or 0))
    return guest


@pytest.fixture(scope="session")
def pciehp_guest(_guests: dict[str, Guest]) -> Guest:
    return _ready(_guests["pciehp"])


@pytest.fixture(scope="session")
def acpi_guest(_guests: dict[str, Guest]) -> Guest:
    return _ready(_guests["acpi"])
