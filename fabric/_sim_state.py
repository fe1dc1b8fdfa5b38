"""The state of a simulated fabric and its JSON form.

One document holds the whole fabric: installed boxes and hosts, the proxy mapping table
(one entry per mapped GPU: the box-side and host-side tables always agree here), the PCI
devices present on each host, GPU health and pending injected faults. Invariant kept by
:class:`~dxpool.fabric.sim.SimFabric`: a device exists only where its GPU is mapped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dxpool.fabric._sim_types import SimGpuSpec

FORMAT = "dxpool-sim-fabric"
VERSION = 1

GpuKey = tuple[str, int]  # (box, slot)
HostSlot = tuple[str, int]  # (host, host_slot)


@dataclass
class DeviceRecord:
    """A device on a host's bus: which GPU, and the driver bound to it."""

    box: str
    slot: int
    driver: str | None


@dataclass
class FaultRecord:
    """A pending injected fault; ``None`` fields match anything."""

    op: str
    box: str | None
    slot: int | None
    host: str | None
    remaining: int
    message: str

    def matches(self, op: str, box: str | None, slot: int | None, host: str | None) -> bool:
        return (
            self.op == op
            and (self.box is None or self.box == box)
            and (self.slot is None or self.slot == slot)
            and (self.host is None or self.host == host)
        )


@dataclass
class FabricState:
    """The whole fabric, decoded. Mutated only inside a locked transaction."""

    boxes: dict[str, list[SimGpuSpec]] = field(default_factory=dict)
    hosts: dict[str, int] = field(default_factory=dict)
    mappings: dict[GpuKey, HostSlot] = field(default_factory=dict)
    devices: dict[str, dict[int, DeviceRecord]] = field(default_factory=dict)
    unhealthy: set[GpuKey] = field(default_factory=set)
    faults: list[FaultRecord] = field(default_factory=list)
    # Fencing tokens: the generation each mapping was made for, and per GPU the highest
    # generation fenced (maps for it or an older one are refused).
    mapped_generation: dict[GpuKey, int] = field(default_factory=dict)
    fenced: dict[GpuKey, int] = field(default_factory=dict)
    # Scrubs done, per GPU: the generation of the last one (for tests and audits).
    scrubbed: dict[GpuKey, int] = field(default_factory=dict)

    def gpu_in(self, host: str, host_slot: int) -> GpuKey | None:
        """The GPU mapped to ``host_slot`` of ``host``, if any."""
        for gpu, target in self.mappings.items():
            if target == (host, host_slot):
                return gpu
        return None

    def drop_mapping(self, gpu: GpuKey) -> None:
        """Remove the GPU's mapping and, if present, its device on the host."""
        target = self.mappings.pop(gpu, None)
        self.mapped_generation.pop(gpu, None)
        if target is not None:
            host, host_slot = target
            self.devices.get(host, {}).pop(host_slot, None)

    def take_fault(
        self, op: str, *, box: str | None = None, slot: int | None = None, host: str | None = None
    ) -> str | None:
        """Consume one matching fault (oldest first) and return its message."""
        for fault in self.faults:
            if fault.matches(op, box, slot, host):
                fault.remaining -= 1
                if fault.remaining <= 0:
                    self.faults.remove(fault)
                return fault.message
        return None

    # JSON -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "boxes": {
                box: [
                    {"model": gpu.model, "memory_mib": gpu.memory_mib, "pci_id": gpu.pci_id}
                    for gpu in gpus
                ]
                for box, gpus in self.boxes.items()
            },
            "hosts": dict(self.hosts),
            "mappings": [
                {
                    "box": box,
                    "slot": slot,
                    "host": host,
                    "host_slot": host_slot,
                    "generation": self.mapped_generation.get((box, slot), 0),
                }
                for (box, slot), (host, host_slot) in sorted(self.mappings.items())
            ],
            "fenced": [
                {"box": box, "slot": slot, "generation": generation}
                for (box, slot), generation in sorted(self.fenced.items())
            ],
            "scrubbed": [
                {"box": box, "slot": slot, "generation": generation}
                for (box, slot), generation in sorted(self.scrubbed.items())
            ],
            "devices": [
                {
                    "host": host,
                    "host_slot": host_slot,
                    "box": device.box,
                    "slot": device.slot,
                    "driver": device.driver,
                }
                for host, devices in sorted(self.devices.items())
                for host_slot, device in sorted(devices.items())
            ],
            "unhealthy": [{"box": box, "slot": slot} for box, slot in sorted(self.unhealthy)],
            "faults": [
                {
                    "op": fault.op,
                    "box": fault.box,
                    "slot": fault.slot,
                    "host": fault.host,
                    "remaining": fault.remaining,
                    "message": fault.message,
                }
                for fault in self.faults
            ],
        }

    @classmethod
    def from_json(cls, document: Any) -> FabricState:
        """Decode a document; raises ValueError naming what is wrong with it."""
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} document")
        if document.get("version") != VERSION:
            raise ValueError(f"unsupported version {document.get('version')!r}, want {VERSION}")
        try:
            return cls._decode(document)
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"malformed document: {error!r}") from None

    @classmethod
    def _decode(cls, doc: dict[str, Any]) -> FabricState:
        state = cls(
            boxes={
                str(box): [
                    SimGpuSpec(str(g["model"]), int(g["memory_mib"]), str(g["pci_id"]))
                    for g in gpus
                ]
                for box, gpus in doc["boxes"].items()
            },
            hosts={str(host): int(slots) for host, slots in doc["hosts"].items()},
            mappings={
                (str(m["box"]), int(m["slot"])): (str(m["host"]), int(m["host_slot"]))
                for m in doc["mappings"]
            },
            unhealthy={(str(u["box"]), int(u["slot"])) for u in doc["unhealthy"]},
            faults=[
                FaultRecord(
                    op=str(f["op"]),
                    box=_optional_str(f["box"]),
                    slot=None if f["slot"] is None else int(f["slot"]),
                    host=_optional_str(f["host"]),
                    remaining=int(f["remaining"]),
                    message=str(f["message"]),
                )
                for f in doc["faults"]
            ],
        )
        for m in doc["mappings"]:
            state.mapped_generation[(str(m["box"]), int(m["slot"]))] = int(m.get("generation", 0))
        for f in doc.get("fenced", []):
            state.fenced[(str(f["box"]), int(f["slot"]))] = int(f["generation"])
        for f in doc.get("scrubbed", []):
            state.scrubbed[(str(f["box"]), int(f["slot"]))] = int(f["generation"])
        for d in doc["devices"]:
            record = DeviceRecord(str(d["box"]), int(d["slot"]), _optional_str(d["driver"]))
            state.devices.setdefault(str(d["host"]), {})[int(d["host_slot"])] = record
        return state


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)
