"""A whole fake Linux host for the Linux driver: sysfs, proxy hook and NVML, tied together.

The proxy hook (:mod:`tests.hostagent.proxy_hook`) is a real executable keeping a real
mapping table; the fake kernel (:mod:`tests.hostagent.fake_sysfs`) brings up, behind the
bridge of a host slot, the card the table maps there; the fake NVML
(:mod:`tests.hostagent.fake_nvml`) sees the GPUs present in that tree and bound to
``nvidia``. Each GPU has a UUID and a serial number derived from its name, so a test can
tell which one is where.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from dxpool.hostagent.driver import StepDriver
from dxpool.hostagent.drivers.linux import make_linux_driver
from dxpool.hostagent.nvml import NvmlInspector
from dxpool.names import GpuRef
from tests.hostagent.fake_nvml import FakeGpu, FakeNvml
from tests.hostagent.fake_sysfs import FakeCard, FakeKernel
from tests.hostagent.proxy_hook import read_table, write_proxy_hook


def uuid_for(gpu: GpuRef) -> str:
    return f"GPU-{gpu.box}-{gpu.slot}"


def dsn_for(gpu: GpuRef) -> int:
    return int.from_bytes(hashlib.sha256(gpu.name.encode()).digest()[:8], "big")


def bridge_for(host_slot: int) -> str:
    return f"0000:40:{host_slot + 1:02x}.0"


def device_for(host_slot: int) -> str:
    return f"0000:{0x41 + host_slot:02x}:00.0"


@dataclass
class LinuxHost:
    """Host ``host`` with ``slots`` proxy slots, one downstream port each."""

    root: Path
    host: str = "h1"
    slots: int = 4
    kernel: FakeKernel = field(init=False)
    hook: Path = field(init=False)
    nvml: FakeNvml = field(init=False)
    ports: dict[int, str] = field(init=False)
    card_overrides: dict[GpuRef, FakeCard] = field(default_factory=dict)
    _gpus: dict[str, FakeGpu] = field(default_factory=dict)
    _inspectors: list[NvmlInspector] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hook = write_proxy_hook(self.root / "proxy")
        self.kernel = FakeKernel(self.root / "sys", cards=self._card_behind)
        self.ports = {slot: bridge_for(slot) for slot in range(self.slots)}
        for slot, bridge in self.ports.items():
            self.kernel.add_port(bridge, device_for(slot).rsplit(":", 1)[0], iommu_group=20 + slot)
        self.nvml = FakeNvml(lookup=self._nvml_sees)

    def mapped(self) -> dict[int, GpuRef]:
        return read_table(self.hook).get(self.host, {})

    def _card_behind(self, bridge: str) -> FakeCard | None:
        slot = next(s for s, b in self.ports.items() if b == bridge)
        gpu = self.mapped().get(slot)
        if gpu is None:
            return None
        return self.card_overrides.get(gpu, FakeCard(dsn=dsn_for(gpu)))

    def _nvml_sees(self, bdf: str) -> FakeGpu | None:
        slot = next((s for s in self.ports if device_for(s) == bdf), None)
        if slot is None or not self.kernel.present(bdf):
            return None
        if self.kernel.link_name(f"bus/pci/devices/{bdf}/driver") != "nvidia":
            return None
        gpu = self.mapped().get(slot)
        if gpu is None:
            return None
        uuid = uuid_for(gpu)
        if uuid not in self._gpus or self._gpus[uuid].bdf != bdf:
            self._gpus[uuid] = FakeGpu(bdf=bdf, uuid=uuid, serial=str(dsn_for(gpu)))
        return self._gpus[uuid]

    def driver(self, *, device_timeout_s: float = 2.0) -> StepDriver:
        inspector = NvmlInspector(self.nvml, xid_wait_ms=50)
        self._inspectors.append(inspector)
        return make_linux_driver(
            host_id=self.host,
            ports=self.ports,
            proxy_hook=self.hook,
            sysfs=self.kernel,
            inspector=inspector,
            hook_timeout_s=10,
            device_timeout_s=device_timeout_s,
        )

    def close(self) -> None:
        for inspector in self._inspectors:
            inspector.close()
        self.kernel.close()


__all__ = ["LinuxHost", "bridge_for", "device_for", "dsn_for", "uuid_for"]
