"""The placement data model: what placement reads, what it is asked, what it answers.

Every type here is an immutable value. A :class:`Snapshot` is a consistent view of the
inventory taken by the broker from its cache; placement never mutates it and never reads
anything else, so a placement is a pure function of (request, snapshot, latency model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dxpool.errors import InvalidArgument
from dxpool.fabric.latency import LatencyEstimate, LatencyModel, Place
from dxpool.names import check_id, parse_gpu
from dxpool.request import validate_gpu_request

__all__ = [
    "Binding",
    "BoxInfo",
    "CandidateReport",
    "GpuInfo",
    "HostInfo",
    "LatencyEstimate",
    "LatencyModel",
    "Place",
    "Placement",
    "PlacementRequest",
    "PlacementResult",
    "Snapshot",
]


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as placement sees it.

    ``free`` means state FREE and no owner; ``healthy`` means not reported unhealthy.
    """

    name: str  # "boxes/b1/gpus/3"
    box: str  # box id, "b1"
    slot: int
    model: str
    memory_mib: int
    free: bool
    healthy: bool


@dataclass(frozen=True, slots=True)
class BoxInfo:
    """A GPU box: ``schedulable`` is true while it is ACTIVE (not cordoned)."""

    box: str  # box id
    place: Place
    schedulable: bool


@dataclass(frozen=True, slots=True)
class HostInfo:
    """A host: its proxy slots ``0..slot_capacity-1``, those in use, and its liveness."""

    host: str  # host id
    place: Place
    slot_capacity: int
    used_slots: frozenset[int]
    alive: bool

    def free_slots(self) -> list[int]:
        """The slots in ``range(slot_capacity)`` not in use, lowest first."""
        used = self.used_slots
        return [slot for slot in range(self.slot_capacity) if slot not in used]

    def free_slot_count(self) -> int:
        """How many slots in ``range(slot_capacity)`` are not in use."""
        in_range = sum(1 for slot in self.used_slots if 0 <= slot < self.slot_capacity)
        return max(self.slot_capacity, 0) - in_range


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A consistent view of the inventory.

    ``gpus_by_box`` holds every GPU of every box, free or not, keyed by box id.
    """

    boxes: Mapping[str, BoxInfo]
    hosts: Mapping[str, HostInfo]
    gpus_by_box: Mapping[str, Sequence[GpuInfo]]


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What a node asks of placement.

    ``model`` "" matches any model and compares case-insensitively; ``host`` pins the node
    to that host id; ``max_latency_ns`` 0 means no latency bound; ``exclude_gpus`` holds
    GPU names (``boxes/{box}/gpus/{slot}``) that must not be chosen. Construction raises
    :class:`~dxpool.errors.InvalidArgument` naming the field to fix.
    """

    model: str
    count: int
    min_memory_mib: int = 0
    host: str | None = None
    max_latency_ns: int = 0
    exclude_gpus: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        validate_gpu_request(self.model, self.count, self.min_memory_mib)
        if self.host is not None:
            check_id(self.host, "host")
        if self.max_latency_ns < 0:
            raise InvalidArgument(
                f"invalid max_latency_ns {self.max_latency_ns}: must be 0 (no bound) or more",
                reason="INVALID_LATENCY",
            )
        if not isinstance(self.exclude_gpus, frozenset):
            raise InvalidArgument(
                "exclude_gpus must be a frozenset of GPU names ('boxes/{box}/gpus/{slot}'), "
                f"got {type(self.exclude_gpus).__name__}"
            )
        for name in sorted(self.exclude_gpus):
            parse_gpu(name)


@dataclass(frozen=True, slots=True)
class Binding:
    """One chosen GPU and the host proxy slot it goes to."""

    gpu: str
    box: str
    slot: int
    model: str
    host_slot: int
    latency_ns: int


@dataclass(frozen=True, slots=True)
class Placement:
    """The chosen host, its GPUs (nearest first) and the weighted score that won."""

    host: str
    bindings: tuple[Binding, ...]
    score: float


@dataclass(frozen=True, slots=True)
class CandidateReport:
    """Why one host was kept (score breakdown) or dropped (filter reasons)."""

    host: str
    feasible: bool
    reasons: tuple[str, ...]
    score: float


@dataclass(frozen=True, slots=True)
class PlacementResult:
    """The answer: a placement, or None and a per-constraint account in ``unsatisfied``.

    ``candidates`` explains every host in the snapshot: feasible hosts first (best score
    first), then dropped hosts, each group by host id.
    """

    placement: Placement | None
    candidates: tuple[CandidateReport, ...]
    unsatisfied: tuple[str, ...]
