"""NvmlInspector's reading of NVML and its health verdicts, with a stand-in pynvml module.

The stand-in (:mod:`tests.hostagent.fake_nvml`) offers the functions, constants and error
classes the inspector calls on the real module; there is no GPU here to exercise the real
one beyond its absence.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.hostagent.errors import DriverError
from dxpool.hostagent.nvml import (
    GpuIdentity,
    HealthReadout,
    HealthReport,
    NvmlInspector,
    assess,
    sysfs_bus_id,
)
from tests.hostagent.fake_nvml import (
    NVML_ERROR_UNKNOWN,
    FakeGpu,
    FakeNvml,
    NVMLError,
    NVMLError_GpuIsLost,
    NVMLError_NotSupported,
)

BDF = "0000:41:00.0"
HEALTHY = resources_pb2.GPU_HEALTH_HEALTHY
DEGRADED = resources_pb2.GPU_HEALTH_DEGRADED
UNHEALTHY = resources_pb2.GPU_HEALTH_UNHEALTHY


@pytest.fixture
def inspectors() -> Iterator[list[NvmlInspector]]:
    made: list[NvmlInspector] = []
    yield made
    for inspector in made:
        inspector.close()


def inspector_for(
    inspectors: list[NvmlInspector], **gpu: object
) -> tuple[NvmlInspector, FakeNvml, FakeGpu]:
    device = FakeGpu(**gpu)  # type: ignore[arg-type]
    nvml = FakeNvml.with_gpus(device)
    inspector = NvmlInspector(nvml, xid_wait_ms=20)
    inspectors.append(inspector)
    return inspector, nvml, device


def test_identify_maps_nvml_answers(inspectors: list[NvmlInspector]) -> None:
    inspector, _, _ = inspector_for(inspectors)

    assert inspector.identify(BDF) == GpuIdentity(
        uuid="GPU-1234",
        serial="1650123456789",
        model="NVIDIA H100 80GB HBM3",
        memory_mib=81559,
        pci_bus_id=BDF,
    )


def test_nvml_bus_ids_are_written_as_sysfs_writes_them() -> None:
    assert sysfs_bus_id("00000000:41:00.0") == "0000:41:00.0"
    assert sysfs_bus_id("00000001:C1:00.0") == "0001:c1:00.0"


def test_identify_decodes_bytes_from_old_pynvml_releases(inspectors: list[NvmlInspector]) -> None:
    inspector, _, _ = inspector_for(
        inspectors, uuid=b"GPU-abcd", serial=b"42", name=b"NVIDIA A100-SXM4-40GB"
    )

    identity = inspector.identify(BDF)

    assert (identity.uuid, identity.serial, identity.model) == (
        "GPU-abcd",
        "42",
        "NVIDIA A100-SXM4-40GB",
    )


def test_nvml_is_initialized_once_and_shut_down_once(inspectors: list[NvmlInspector]) -> None:
    inspector, nvml, _ = inspector_for(inspectors)

    inspector.identify(BDF)
    inspector.health(BDF)
    inspector.identify(BDF)
    inspector.close()
    inspector.close()

    assert nvml.init_calls == 1
    assert nvml.shutdown_calls == 1


def test_a_device_not_found_is_looked_up_again_after_initializing_nvml_anew(
    inspectors: list[NvmlInspector],
) -> None:
    inspector, nvml, _ = inspector_for(inspectors)
    nvml.enumerate_at_init = True
    inspector.identify(BDF)
    late = FakeGpu(bdf="0000:42:00.0", uuid="GPU-late")
    nvml.devices[late.bdf] = late  # hot-added after NVML was initialized

    assert inspector.identify(late.bdf).uuid == "GPU-late"
    assert (nvml.init_calls, nvml.shutdown_calls) == (2, 1)


def test_unknown_device_is_a_driver_error_naming_it(inspectors: list[NvmlInspector]) -> None:
    inspector, _, _ = inspector_for(inspectors)

    with pytest.raises(DriverError, match=re.escape("0000:99:00.0")):
        inspector.identify("0000:99:00.0")


def test_nvml_init_failure_says_what_to_do() -> None:
    nvml = FakeNvml(init_error=NVMLError(NVML_ERROR_UNKNOWN))

    with pytest.raises(DriverError, match=r"NVML is not available.*--driver sim"):
        NvmlInspector(nvml).identify(BDF)


def test_a_healthy_device(inspectors: list[NvmlInspector]) -> None:
    inspector, _, _ = inspector_for(inspectors)

    assert inspector.health(BDF) == HealthReport(HEALTHY)


@pytest.mark.parametrize(
    ("gpu", "verdict"),
    [
        ({"volatile_uncorrected_ecc": 2}, (UNHEALTHY, "2 volatile uncorrected ECC errors")),
        ({"remapped_rows": (0, 1, 0, 1)}, (UNHEALTHY, "row remapping failed")),
        ({"remapped_rows": (0, 1, 1, 0)}, (DEGRADED, "row remapping pending")),
        ({"retired_pages_pending": 1}, (DEGRADED, "page retirement pending")),
        (
            {"temperature_c": 92, "slowdown_c": 90},
            (DEGRADED, "temperature 92 C at or above the slowdown threshold 90 C"),
        ),
        ({"power_mw": 720_000}, (DEGRADED, "drawing 720 W, above its 700 W limit")),
        ({"link_width": 8}, (DEGRADED, "PCIe link x8, narrower than its x16")),
        ({"link_generation": 1}, (HEALTHY, "")),  # idle GPUs lower their link speed
        ({"temperature_c": NVMLError_GpuIsLost()}, (UNHEALTHY, "GPU lost")),
    ],
)
def test_health_signals(
    inspectors: list[NvmlInspector], gpu: dict[str, object], verdict: tuple[int, str]
) -> None:
    inspector, _, _ = inspector_for(inspectors, **gpu)

    report = inspector.health(BDF)

    assert report.state == verdict[0]
    assert verdict[1] in report.reason


def test_the_worst_finding_wins_and_names_every_reason_of_its_weight() -> None:
    report = assess(
        HealthReadout(
            ecc_volatile_uncorrected=1,
            remapped_rows_failed=True,
            temperature_c=95,
            slowdown_temperature_c=90,
        )
    )

    assert report == HealthReport(
        UNHEALTHY, "1 volatile uncorrected ECC errors; row remapping failed"
    )


def test_unsupported_queries_give_no_signal(inspectors: list[NvmlInspector]) -> None:
    unsupported = NVMLError_NotSupported()
    inspector, _, _ = inspector_for(
        inspectors,
        retired_pages_pending=unsupported,
        volatile_uncorrected_ecc=unsupported,
        remapped_rows=unsupported,
        temperature_c=unsupported,
        power_mw=unsupported,
        link_width=unsupported,
        events=unsupported,
    )

    readout = inspector.readout(BDF)

    assert assess(readout) == HealthReport(HEALTHY)
    assert readout.ecc_volatile_uncorrected is None and readout.xid_supported is False


def test_one_unsupported_query_does_not_hide_the_other(inspectors: list[NvmlInspector]) -> None:
    inspector, _, _ = inspector_for(
        inspectors, retired_pages_pending=NVMLError_NotSupported(), volatile_uncorrected_ecc=1
    )

    assert inspector.health(BDF).state == UNHEALTHY


def test_other_nvml_errors_in_health_queries_are_driver_errors(
    inspectors: list[NvmlInspector],
) -> None:
    inspector, _, _ = inspector_for(
        inspectors, volatile_uncorrected_ecc=NVMLError(NVML_ERROR_UNKNOWN)
    )

    with pytest.raises(DriverError, match="ECC"):
        inspector.health(BDF)


def wait_for_report(inspector: NvmlInspector, state: int) -> HealthReport:
    deadline = time.monotonic() + 5
    while True:
        report = inspector.health(BDF)
        if report.state == state or time.monotonic() > deadline:
            return report
        time.sleep(0.02)


def test_a_critical_xid_fails_the_gpu(inspectors: list[NvmlInspector]) -> None:
    inspector, nvml, gpu = inspector_for(inspectors)
    assert inspector.health(BDF).state == HEALTHY  # registers the GPU for XID events

    nvml.raise_xid(gpu, 79)
    report = wait_for_report(inspector, UNHEALTHY)

    assert report.state == UNHEALTHY
    assert "XID 79 (GPU has fallen off the bus)" in report.reason


def test_xid_63_only_degrades_and_application_xids_are_ignored(
    inspectors: list[NvmlInspector],
) -> None:
    inspector, nvml, gpu = inspector_for(inspectors)
    inspector.health(BDF)

    nvml.raise_xid(gpu, 13)  # a graphics engine exception: the application's fault
    nvml.raise_xid(gpu, 63)
    report = wait_for_report(inspector, DEGRADED)

    assert report.state == DEGRADED
    assert "XID 63 (row remapping pending)" in report.reason
    latest = inspector.xids.latest("GPU-1234")
    assert latest is not None and (latest.uuid, latest.xid) == ("GPU-1234", 63)


def test_close_stops_the_xid_thread_and_frees_the_event_set(
    inspectors: list[NvmlInspector],
) -> None:
    inspector, nvml, _ = inspector_for(inspectors)
    inspector.health(BDF)
    assert inspector.xids.running

    started = time.monotonic()
    inspector.close()

    assert time.monotonic() - started < 15  # joined its thread; no wait for an event
    assert [s.freed for s in nvml.event_sets] == [True]
    assert not inspector.xids.running


def test_the_default_is_the_real_pynvml_module() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML; the absent-library path is not testable")

    with pytest.raises(DriverError, match="NVML is not available"):
        NvmlInspector().identify(BDF)


def test_compute_processes_are_listed_by_pid(inspectors: list[NvmlInspector]) -> None:
    inspector, _, gpu = inspector_for(inspectors)
    assert inspector.compute_processes(BDF) == []

    gpu.processes = [SimpleNamespace(pid=9, usedGpuMemory=1), SimpleNamespace(pid=3)]

    assert inspector.compute_processes(BDF) == [3, 9]
