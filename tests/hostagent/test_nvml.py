"""NvmlInspector's mapping of NVML answers, with a stand-in for the pynvml module.

The stand-in offers the same functions, constants and error classes the inspector calls
on the real module; there is no GPU here to exercise the real one beyond its absence.
"""

# The stand-in mirrors pynvml's camelCase function names.

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.hostagent.errors import DriverError
from dxpool.hostagent.nvml import GpuIdentity, NvmlInspector

BDF = "0000:41:00.0"
MIB = 1024 * 1024
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_UNKNOWN = 999


class StandInNvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"NVML error {self.value}"


class StandInNotSupportedError(StandInNvmlError):
    def __init__(self, value: int = NVML_ERROR_NOT_SUPPORTED) -> None:
        super().__init__(value)


@dataclass
class Device:
    uuid: str | bytes = "GPU-1234"
    serial: str | bytes = "1650123456789"
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    memory_bytes: int = 81559 * MIB
    retired_pages_pending: int | Exception = 0
    volatile_uncorrected_ecc: int | Exception = 0


@dataclass
class StandInNvml:
    """The subset of ``pynvml`` that NvmlInspector uses."""

    devices: dict[str, Device] = field(default_factory=dict)
    init_error: Exception | None = None
    init_calls: int = 0
    shutdown_calls: int = 0

    NVMLError = StandInNvmlError
    NVMLError_NotSupported = StandInNotSupportedError
    NVML_FEATURE_ENABLED = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetHandleByPciBusId(self, bdf: str) -> Device:
        if bdf not in self.devices:
            raise StandInNvmlError(NVML_ERROR_NOT_FOUND)
        return self.devices[bdf]

    def nvmlDeviceGetUUID(self, handle: Device) -> str | bytes:
        return handle.uuid

    def nvmlDeviceGetSerial(self, handle: Device) -> str | bytes:
        return handle.serial

    def nvmlDeviceGetName(self, handle: Device) -> str | bytes:
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: Device) -> SimpleNamespace:
        return SimpleNamespace(total=handle.memory_bytes, free=handle.memory_bytes, used=0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Device) -> int:
        if isinstance(handle.retired_pages_pending, Exception):
            raise handle.retired_pages_pending
        return handle.retired_pages_pending

    def nvmlDeviceGetTotalEccErrors(self, handle: Device, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (1, 0), "asked for uncorrected volatile ECC errors"
        if isinstance(handle.volatile_uncorrected_ecc, Exception):
            raise handle.volatile_uncorrected_ecc
        return handle.volatile_uncorrected_ecc


def inspector_for(**device: object) -> tuple[NvmlInspector, StandInNvml]:
    nvml = StandInNvml(devices={BDF: Device(**device)})  # type: ignore[arg-type]
    return NvmlInspector(nvml), nvml


def test_identify_maps_nvml_answers() -> None:
    inspector, _ = inspector_for()

    assert inspector.identify(BDF) == GpuIdentity(
        uuid="GPU-1234", serial="1650123456789", model="NVIDIA H100 80GB HBM3", memory_mib=81559
    )


def test_identify_decodes_bytes_from_old_pynvml_releases() -> None:
    inspector, _ = inspector_for(uuid=b"GPU-abcd", serial=b"42", name=b"NVIDIA A100-SXM4-40GB")

    identity = inspector.identify(BDF)

    assert (identity.uuid, identity.serial, identity.model) == (
        "GPU-abcd",
        "42",
        "NVIDIA A100-SXM4-40GB",
    )


def test_nvml_is_initialized_once_and_shut_down_once() -> None:
    inspector, nvml = inspector_for()

    inspector.identify(BDF)
    inspector.health(BDF)
    inspector.identify(BDF)
    inspector.close()
    inspector.close()

    assert nvml.init_calls == 1
    assert nvml.shutdown_calls == 1


def test_unknown_device_is_a_driver_error_naming_it() -> None:
    inspector, _ = inspector_for()

    with pytest.raises(DriverError, match=re.escape("0000:99:00.0")):
        inspector.identify("0000:99:00.0")


def test_nvml_init_failure_says_what_to_do() -> None:
    nvml = StandInNvml(init_error=StandInNvmlError(NVML_ERROR_UNKNOWN))

    with pytest.raises(DriverError, match=r"NVML is not available.*--driver sim"):
        NvmlInspector(nvml).identify(BDF)


def test_a_healthy_device() -> None:
    inspector, _ = inspector_for()

    assert inspector.health(BDF) == resources_pb2.GPU_HEALTH_HEALTHY


def test_pending_retired_pages_make_a_device_unhealthy() -> None:
    inspector, _ = inspector_for(retired_pages_pending=1)

    assert inspector.health(BDF) == resources_pb2.GPU_HEALTH_UNHEALTHY


def test_volatile_uncorrected_ecc_errors_make_a_device_unhealthy() -> None:
    inspector, _ = inspector_for(volatile_uncorrected_ecc=2)

    assert inspector.health(BDF) == resources_pb2.GPU_HEALTH_UNHEALTHY


def test_unsupported_queries_give_no_signal() -> None:
    inspector, _ = inspector_for(
        retired_pages_pending=StandInNotSupportedError(),
        volatile_uncorrected_ecc=StandInNotSupportedError(),
    )

    assert inspector.health(BDF) == resources_pb2.GPU_HEALTH_HEALTHY


def test_one_unsupported_query_does_not_hide_the_other() -> None:
    inspector, _ = inspector_for(
        retired_pages_pending=StandInNotSupportedError(), volatile_uncorrected_ecc=1
    )

    assert inspector.health(BDF) == resources_pb2.GPU_HEALTH_UNHEALTHY


def test_other_nvml_errors_in_health_queries_are_driver_errors() -> None:
    inspector, _ = inspector_for(volatile_uncorrected_ecc=StandInNvmlError(NVML_ERROR_UNKNOWN))

    with pytest.raises(DriverError, match="ECC"):
        inspector.health(BDF)


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
