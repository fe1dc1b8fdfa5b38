"""``NvmlInspector`` and the sysfs reader against a real NVIDIA GPU and driver.

Skipped where NVML does not initialize (no driver, no GPU), so they pass anywhere and
prove something only on a GPU host: run them there with ``pytest -m gpu``. They only
read, except two that start CUDA processes: one holds a context, and one, opted in with
``DXPOOL_TEST_GPU_FAULT=1``, makes a kernel fault on purpose (the driver logs an MMU-fault
XID; the GPU keeps working, no reset is needed).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dxpool.hostagent.drivers.linux_pci import PciSysfsReader
from dxpool.hostagent.errors import DriverError
from dxpool.hostagent.nvml import (
    DEGRADED,
    HEALTHY,
    MIB,
    NvmlInspector,
    assess,
    sysfs_bus_id,
)
from dxpool.hostagent.xid import APPLICATION_XIDS, XidWatcher

pynvml = pytest.importorskip("pynvml")

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
ABSENT_ADDRESS = "0000:ff:1f.7"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@pytest.fixture(scope="module")
def gpu_addresses() -> Iterator[list[str]]:
    """The sysfs address of every GPU NVML enumerates; NVML stays initialized meanwhile
    (initializations are counted, so inspectors may init and shut down on their own)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        pytest.skip(f"NVML does not initialize on this machine ({error})")
    try:
        addresses = [
            sysfs_bus_id(
                _text(pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).busId)
            )
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
        if not addresses:
            pytest.skip("NVML initializes but enumerates no GPU")
        yield addresses
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def inspector() -> Iterator[NvmlInspector]:
    inspector = NvmlInspector(watch_xids=False)
    yield inspector
    inspector.close()


def _cuda_child(action: str, bdf: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.hostagent.cuda_driver", action, bdf],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_identify_names_the_gpu_at_the_address_asked(
    gpu_addresses: list[str], inspector: NvmlInspector
) -> None:
    uuids = set()
    for bdf in gpu_addresses:
        identity = inspector.identify(bdf)
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bdf)

        assert identity.pci_bus_id == bdf
        assert identity.uuid == _text(pynvml.nvmlDeviceGetUUID(handle))
        assert identity.uuid.startswith("GPU-")
        assert identity.model == _text(pynvml.nvmlDeviceGetName(handle))
        assert identity.memory_mib == pynvml.nvmlDeviceGetMemoryInfo(handle).total // MIB > 0
        uuids.add(identity.uuid)
    assert len(uuids) == len(gpu_addresses)


def test_an_address_without_a_gpu_is_a_driver_error_and_the_inspector_still_works(
    gpu_addresses: list[str], inspector: NvmlInspector
) -> None:
    assert ABSENT_ADDRESS not in gpu_addresses
    first = inspector.identify(gpu_addresses[0])

    # NVML answers NotFound; the inspector initializes NVML anew and asks once more.
    with pytest.raises(DriverError, match=ABSENT_ADDRESS):
        inspector.identify(ABSENT_ADDRESS)

    assert inspector.identify(gpu_addresses[0]) == first


def test_an_idle_gpu_reads_healthy_or_says_why_not(gpu_addresses: list[str]) -> None:
    inspector = NvmlInspector(xid_wait_ms=100)
    try:
        for bdf in gpu_addresses:
            readout = inspector.readout(bdf)
            verdict = assess(readout)

            assert not readout.lost
            assert readout.ecc_volatile_uncorrected in (0, None)
            assert readout.remapped_rows_failed in (False, None)
            assert readout.temperature_c is None or 0 < readout.temperature_c < 120
            assert readout.xid is None
            assert isinstance(readout.xid_supported, bool)
            assert verdict.state in (HEALTHY, DEGRADED), verdict
            assert (verdict.state == HEALTHY) == (verdict.reason == ""), verdict
        assert inspector.xids.running
    finally:
        inspector.close()
    assert not inspector.xids.running


def test_compute_processes_lists_a_process_that_holds_a_context(
    gpu_addresses: list[str], inspector: NvmlInspector
) -> None:
    bdf = gpu_addresses[0]
    child = _cuda_child("hold", bdf)
    try:
        assert child.stdout is not None
        ready = child.stdout.readline().strip()
        assert ready == "ready", child.stderr.read() if child.stderr else ready

        assert child.pid in inspector.compute_processes(bdf)
    finally:
        child.communicate(timeout=30)
    assert child.returncode == 0

    deadline = time.monotonic() + 10
    while child.pid in inspector.compute_processes(bdf):
        assert time.monotonic() < deadline, "the driver still lists a process that exited"
        time.sleep(0.1)


def test_the_sysfs_reader_sees_the_device_nvml_names(gpu_addresses: list[str]) -> None:
    reader = PciSysfsReader()
    for bdf in gpu_addresses:
        pci = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByPciBusId(bdf))
        device_id, vendor_id = pci.pciDeviceId >> 16, pci.pciDeviceId & 0xFFFF

        assert reader.present(bdf)
        assert reader.pci_id(bdf) == f"{vendor_id:04x}:{device_id:04x}"
        assert vendor_id == 0x10DE
        assert reader.driver_of(bdf) == "nvidia"
        pci_class = reader.pci_class(bdf)
        assert pci_class is not None and pci_class >> 16 == 0x03  # a display controller


def test_the_xid_watcher_registers_every_gpu_and_a_quiet_wait_returns_nothing(
    gpu_addresses: list[str],
) -> None:
    watcher = XidWatcher(pynvml, wait_ms=50)
    try:
        for bdf in gpu_addresses:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bdf)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            supported = watcher.watch(uuid, handle)
            assert isinstance(supported, bool)
            assert watcher.watch(uuid, handle) is supported  # registered once

        assert watcher.wait_once(50) is None
    finally:
        watcher.stop()


@pytest.mark.skipif(
    os.environ.get("DXPOOL_TEST_GPU_FAULT") != "1",
    reason="makes a GPU kernel fault on purpose; opt in with DXPOOL_TEST_GPU_FAULT=1",
)
def test_an_application_fault_raises_an_xid_that_is_logged_and_does_not_fail_the_gpu(
    gpu_addresses: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    bdf = gpu_addresses[0]
    inspector = NvmlInspector(xid_wait_ms=100)
    try:
        before = inspector.health(bdf)  # registers the GPU and starts the watcher
        uuid = inspector.identify(bdf).uuid
        if not inspector.xids.watch(uuid, pynvml.nvmlDeviceGetHandleByPciBusId(bdf)):
            pytest.skip("NVML does not report XID events for this GPU")

        with caplog.at_level(logging.INFO, logger="dxpool.hostagent.xid"):
            child = _cuda_child("fault", bdf)
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0, (out, err)
            assert out.strip() == "CUDA_ERROR_ILLEGAL_ADDRESS"

            deadline = time.monotonic() + 10
            seen: list[logging.LogRecord] = []
            while not seen and time.monotonic() < deadline:
                time.sleep(0.1)
                seen = [r for r in caplog.records if getattr(r, "uuid", None) == uuid]

        assert seen, "no XID event arrived within 10 s of the fault"
        assert all(getattr(r, "xid", None) in APPLICATION_XIDS for r in seen), [
            (r.getMessage(), getattr(r, "xid", None)) for r in seen
        ]
        assert inspector.xids.latest(uuid) is None
        assert inspector.health(bdf) == before
    finally:
        inspector.close()
