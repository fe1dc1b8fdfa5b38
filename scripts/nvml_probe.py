#!/usr/bin/env python3
"""Print what the Linux host agent would read about every GPU on this machine. Read-only.

For each GPU NVML sees: the identity and the health readout and verdict that
``NvmlInspector`` produces, and the sysfs facts ``SysfsPciBus`` reads at the GPU's PCI
address (vendor/device id, Device Serial Number when readable, bound driver, IOMMU group,
link width and speed). Then it waits ``--xid-seconds`` for XID events on all of them.

It never writes to sysfs and never removes, rebinds or resets a device: it only calls
NVML queries, registers an event set for XID events, and reads sysfs files. The Device
Serial Number lies in extended configuration space, which only root can read.

Usage::

    python scripts/nvml_probe.py [--sysfs-root /sys] [--xid-seconds 5] [--json]

Exit status 0 when NVML answered, 1 when NVML is not available.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from dxpool.hostagent.drivers.linux_pci import PciSysfsReader
from dxpool.hostagent.drivers.sysfs import Sysfs
from dxpool.hostagent.errors import DriverError
from dxpool.hostagent.nvml import NvmlInspector, assess, sysfs_bus_id
from dxpool.hostagent.xid import XidWatcher


def gpu_addresses(nvml: Any) -> list[str]:
    """The PCI address of every GPU NVML enumerates, in sysfs form."""
    addresses = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        bus_id = nvml.nvmlDeviceGetPciInfo(handle).busId
        addresses.append(sysfs_bus_id(bus_id.decode() if isinstance(bus_id, bytes) else bus_id))
    return addresses


def probe_gpu(inspector: NvmlInspector, reader: PciSysfsReader, bdf: str) -> dict[str, Any]:
    """Identity, health and sysfs facts of the GPU at ``bdf``; errors are reported in place."""
    report: dict[str, Any] = {"bdf": bdf}
    try:
        report["identity"] = dataclasses.asdict(inspector.identify(bdf))
    except DriverError as error:
        report["identity_error"] = error.message
    try:
        readout = inspector.readout(bdf)
        verdict = assess(readout)
        report["health"] = {
            "state": verdict.state,
            "state_name": _health_name(verdict.state),
            "reason": verdict.reason,
            "readout": {k: v for k, v in dataclasses.asdict(readout).items() if k != "xid"},
        }
    except DriverError as error:
        report["health_error"] = error.message
    link = reader.link(bdf)
    report["sysfs"] = {
        "present": reader.present(bdf),
        "pci_id": reader.pci_id(bdf),
        "dsn": reader.dsn(bdf),
        "driver": reader.driver_of(bdf),
        "iommu_group": reader.iommu_group(bdf),
        "link": dataclasses.asdict(link),
    }
    return report


def _health_name(state: int) -> str:
    from dxpool.api.v1 import resources_pb2

    return resources_pb2.GpuHealth.Name(state)  # type: ignore[arg-type]


def wait_for_xids(nvml: Any, addresses: list[str], seconds: float) -> list[dict[str, Any]]:
    """Register every GPU for XID events and collect what arrives within ``seconds``."""
    watcher = XidWatcher(nvml, wait_ms=200)
    supported = {}
    for bdf in addresses:
        handle = nvml.nvmlDeviceGetHandleByPciBusId(bdf)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        supported[bdf] = watcher.watch(uuid, handle)
    events: list[dict[str, Any]] = [
        {"bdf": bdf, "xid_events_supported": ok} for bdf, ok in supported.items()
    ]
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
            event = watcher.wait_once(min(200, remaining_ms))
            if event is not None:
                events.append({"uuid": event.uuid, "xid": event.xid, "what": event.describe()})
    finally:
        watcher.reset()
    return events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sysfs-root", type=Path, default=Path("/sys"))
    parser.add_argument("--xid-seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    if args.xid_seconds < 0:
        parser.error("--xid-seconds must be >= 0")

    import pynvml

    inspector = NvmlInspector(pynvml, watch_xids=False)
    reader = PciSysfsReader(Sysfs(args.sysfs_root))
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        print(f"error: NVML is not available: {error}", file=sys.stderr)
        return 1
    try:
        addresses = gpu_addresses(pynvml)
        result = {
            "driver_version": _text(pynvml.nvmlSystemGetDriverVersion()),
            "gpus": [probe_gpu(inspector, reader, bdf) for bdf in addresses],
            "xid": wait_for_xids(pynvml, addresses, args.xid_seconds),
        }
    finally:
        inspector.close()
        pynvml.nvmlShutdown()
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=str)
        print()
    else:
        print_text(result)
    return 0


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def print_text(result: dict[str, Any]) -> None:
    print(f"NVIDIA driver {result['driver_version']}, {len(result['gpus'])} GPU(s)")
    for gpu in result["gpus"]:
        print(f"\n{gpu['bdf']}")
        for key in ("identity", "health", "sysfs"):
            if key in gpu:
                print(f"  {key}: {json.dumps(gpu[key], default=str)}")
        for key in ("identity_error", "health_error"):
            if key in gpu:
                print(f"  {key}: {gpu[key]}")
    print("\nXID events:")
    for entry in result["xid"]:
        print(f"  {json.dumps(entry, default=str)}")


if __name__ == "__main__":
    sys.exit(main())
