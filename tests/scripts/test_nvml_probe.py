"""scripts/nvml_probe.py on a fake pynvml and a fake sysfs tree: what it prints, and that
it writes nothing."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.hostagent.fake_nvml import FakeGpu, FakeNvml
from tests.hostagent.fake_sysfs import FakeCard, FakeKernel

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "nvml_probe.py"
BRIDGE = "0000:40:01.0"
BDF = "0000:41:00.0"


@pytest.fixture
def probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nvml_probe", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[FakeKernel, FakeNvml]]:
    kernel = FakeKernel(tmp_path / "sys")
    kernel.add_port(BRIDGE, "0000:41", iommu_group=7)
    kernel.insert(BRIDGE, FakeCard(dsn=0x0102030405060708, link_width=8))
    kernel.write(f"bus/pci/devices/{BRIDGE}/rescan", "1")
    kernel.writes.clear()
    nvml = FakeNvml.with_gpus(FakeGpu(bdf=BDF, uuid="GPU-aa", link_width=8))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    yield kernel, nvml
    kernel.close()


def test_the_probe_reports_identity_health_and_sysfs_and_writes_nothing(
    probe: ModuleType, machine: tuple[FakeKernel, FakeNvml], capsys: pytest.CaptureFixture[str]
) -> None:
    kernel, nvml = machine
    gpu = nvml.devices[BDF]
    gpu.events = 0

    status = probe.main(["--sysfs-root", str(kernel.root), "--xid-seconds", "0.3", "--json"])
    output = json.loads(capsys.readouterr().out)

    assert status == 0
    [report] = output["gpus"]
    assert report["identity"]["uuid"] == "GPU-aa"
    assert report["identity"]["pci_bus_id"] == BDF
    assert report["health"]["state_name"] == "GPU_HEALTH_DEGRADED"
    assert report["health"]["reason"] == "PCIe link x8, narrower than its x16"
    assert report["sysfs"] == {
        "present": True,
        "pci_id": "10de:2330",
        "dsn": "01-02-03-04-05-06-07-08",
        "driver": "nvidia",
        "iommu_group": "7",
        "link": {
            "width": 8,
            "max_width": 16,
            "speed": "32.0 GT/s PCIe",
            "max_speed": "32.0 GT/s PCIe",
        },
    }
    assert output["xid"] == [{"bdf": BDF, "xid_events_supported": True}]
    assert kernel.writes == []  # read-only
    assert nvml.init_calls == nvml.shutdown_calls


def test_the_probe_prints_xid_events_that_arrive_while_it_waits(
    probe: ModuleType, machine: tuple[FakeKernel, FakeNvml], capsys: pytest.CaptureFixture[str]
) -> None:
    kernel, nvml = machine
    gpu = nvml.devices[BDF]
    original = nvml.nvmlEventSetCreate

    def create_and_fire() -> object:
        event_set = original()
        event_set.gpus.add(str(gpu.uuid))
        nvml.raise_xid(gpu, 79)
        return event_set

    nvml.nvmlEventSetCreate = create_and_fire  # type: ignore[method-assign]

    assert probe.main(["--sysfs-root", str(kernel.root), "--xid-seconds", "0.5"]) == 0
    text = capsys.readouterr().out

    assert "1 GPU(s)" in text and BDF in text
    assert '"xid": 79' in text and "fallen off the bus" in text


def test_the_probe_exits_1_without_nvml(
    probe: ModuleType, machine: tuple[FakeKernel, FakeNvml], capsys: pytest.CaptureFixture[str]
) -> None:
    kernel, nvml = machine
    nvml.init_error = nvml.NVMLError(9)

    assert probe.main(["--sysfs-root", str(kernel.root)]) == 1
    assert "error: NVML is not available" in capsys.readouterr().err
