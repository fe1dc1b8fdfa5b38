"""Small pools for placement tests: a snapshot builder and a table-driven latency model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dxpool.broker.placement.model import (
    BoxInfo,
    GpuInfo,
    HostInfo,
    LatencyEstimate,
    Place,
    Snapshot,
)

DEFAULT_LATENCY_NS = 2_000


@dataclass
class TableLatency:
    """A LatencyModel from a table of (host id, box id) -> round trip in ns.

    Pairs not in the table are ``default_ns`` away; pairs in ``broken`` raise, as a model
    that cannot place an endpoint would.
    """

    table: Mapping[tuple[str, str], int] = field(default_factory=dict)
    default_ns: int = DEFAULT_LATENCY_NS
    broken: frozenset[tuple[str, str]] = frozenset()
    calls: int = 0

    def round_trip(self, host: Place, box: Place) -> LatencyEstimate:
        self.calls += 1
        key = (host.name.removeprefix("hosts/"), box.name.removeprefix("boxes/"))
        if key in self.broken:
            raise LookupError(f"no route from {host.name} to {box.name}")
        ns = self.table.get(key, self.default_ns)
        return LatencyEstimate(ns, (f"proxy:{host.name}", f"proxy:{box.name}"))


@dataclass
class Pool:
    """Builds a :class:`Snapshot` one box and host at a time."""

    boxes: dict[str, BoxInfo] = field(default_factory=dict)
    gpus: dict[str, list[GpuInfo]] = field(default_factory=dict)
    hosts: dict[str, HostInfo] = field(default_factory=dict)

    def box(
        self,
        box: str,
        free: int = 8,
        *,
        busy: int = 0,
        model: str = "H100",
        memory_mib: int = 81920,
        schedulable: bool = True,
        unhealthy: Iterable[int] = (),
        rack: str = "r1",
    ) -> Pool:
        """A box whose first ``busy`` slots are in use and the next ``free`` are free."""
        sick = set(unhealthy)
        self.boxes[box] = BoxInfo(box, Place(f"boxes/{box}", "dc1", "p1", rack), schedulable)
        self.gpus[box] = [
            GpuInfo(
                name=f"boxes/{box}/gpus/{slot}",
                box=box,
                slot=slot,
                model=model,
                memory_mib=memory_mib,
                free=slot >= busy,
                healthy=slot not in sick,
            )
            for slot in range(busy + free)
        ]
        return self

    def gpu(self, box: str, gpu: GpuInfo) -> Pool:
        """Adds one GPU to an existing box."""
        self.gpus[box].append(gpu)
        return self

    def host(
        self,
        host: str,
        slots: int = 8,
        *,
        used: Iterable[int] = (),
        alive: bool = True,
        rack: str = "r1",
    ) -> Pool:
        self.hosts[host] = HostInfo(
            host, Place(f"hosts/{host}", "dc1", "p1", rack), slots, frozenset(used), alive
        )
        return self

    def snapshot(self) -> Snapshot:
        return Snapshot(
            boxes=dict(self.boxes),
            hosts=dict(self.hosts),
            gpus_by_box={box: tuple(gpus) for box, gpus in self.gpus.items()},
        )
