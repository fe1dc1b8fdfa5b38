"""The placement data model: what placement reads, what it is asked, what it answers.

Every type here is an immutable value. A :class:`Snapshot` is a consistent view of the
inventory taken by the broker from its cache; placement never mutates it and never reads
anything else, so a placement is a pure function of (request, snapshot, latency model).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar, cast

from dxpool.errors import InvalidArgument
from dxpool.fabric.latency import LatencyEstimate, LatencyModel, Place
from dxpool.fabric.overhead import check_slowdown
from dxpool.names import check_id, parse_gpu
from dxpool.request import (
    check_box_spread,
    check_host_resources,
    model_set,
    normalize_model_set,
    validate_gpu_request,
)
from dxpool.text import check_labels

T = TypeVar("T")

MAX_DERIVED = 64
"""How many derived values one :class:`Snapshot` keeps (see :meth:`Snapshot.derived`)."""

__all__ = [
    "Binding",
    "BoxInfo",
    "CandidateReport",
    "ChangeJournal",
    "GpuInfo",
    "HostInfo",
    "LatencyEstimate",
    "LatencyModel",
    "Place",
    "Placement",
    "PlacementRequest",
    "PlacementResult",
    "ResourceScale",
    "Snapshot",
    "box_key",
    "check_excluded_hosts",
    "count_free_by_model",
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
    """A host: its proxy slots ``0..slot_capacity-1``, those in use, its liveness, its
    labels as (key, value) pairs, and the CPU cores and memory it offers (0: not
    declared) with how much of them its nodes hold."""

    host: str  # host id
    place: Place
    slot_capacity: int
    used_slots: frozenset[int]
    alive: bool
    labels: frozenset[tuple[str, str]] = frozenset()
    cpu_cores: int = 0
    memory_mib: int = 0
    used_cpu_cores: int = 0
    used_memory_mib: int = 0

    _free_count: int = field(init=False, repr=False, compare=False)  # read on every placement

    def __post_init__(self) -> None:
        in_range = sum(1 for slot in self.used_slots if 0 <= slot < self.slot_capacity)
        object.__setattr__(self, "_free_count", max(self.slot_capacity, 0) - in_range)

    def free_slots(self) -> list[int]:
        """The slots in ``range(slot_capacity)`` not in use, lowest first."""
        used = self.used_slots
        return [slot for slot in range(self.slot_capacity) if slot not in used]

    def free_slot_count(self) -> int:
        """How many slots in ``range(slot_capacity)`` are not in use."""
        return self._free_count


@dataclass(frozen=True, slots=True)
class ResourceScale:
    """The most CPU cores and memory any host declares: the scale that makes a host's
    free CPU and memory comparable with another's (0: no host declares it)."""

    cpu_cores: int
    memory_mib: int

    def room(self, host: HostInfo) -> int:
        """How much CPU and memory ``host`` has free, each as a share of the largest
        host's, summed (in integers: ``cpu x M + memory x C`` for the largest host's
        ``C`` cores and ``M`` MiB). Placement breaks ties between hosts by it, least
        room first: a node goes where its CPU and memory fit most tightly, so the
        roomiest hosts stay roomy for the nodes that need them. 0 for a host that
        declares neither."""
        cpu = max(host.cpu_cores - host.used_cpu_cores, 0)
        memory = max(host.memory_mib - host.used_memory_mib, 0)
        return cpu * max(self.memory_mib, 1) + memory * max(self.cpu_cores, 1)


def count_free_by_model(snapshot: Snapshot) -> dict[str, int]:
    """Free, healthy GPUs in the schedulable boxes of ``snapshot``, by model."""
    counts: dict[str, int] = {}
    boxes = snapshot.boxes
    for box_id, gpus in snapshot.gpus_by_box.items():
        box = boxes.get(box_id)
        if box is None or not box.schedulable:
            continue
        for gpu in gpus:
            if gpu.free and gpu.healthy:
                counts[gpu.model] = counts.get(gpu.model, 0) + 1
    return counts


def _scale_of(snapshot: Snapshot) -> ResourceScale:
    if snapshot.largest_host is not None:
        return ResourceScale(*snapshot.largest_host)
    hosts = snapshot.hosts.values()
    return ResourceScale(
        max((host.cpu_cores for host in hosts), default=0),
        max((host.memory_mib for host in hosts), default=0),
    )


class ChangeJournal(Protocol):
    """Which records changed between two versions of one inventory view."""

    def changed_since(
        self, version: int, until: int
    ) -> tuple[frozenset[str], frozenset[str]] | None:
        """The box ids and host ids whose placement view changed after ``version`` up to
        and including ``until``; None when that stretch is no longer remembered (the
        caller then starts from the snapshot alone). A box counts as changed when its
        record or any of its GPUs changed."""
        ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A consistent view of the inventory.

    ``gpus_by_box`` holds every GPU of every box, free or not, keyed by box id. A snapshot
    is never changed once made (its mappings must not be mutated), so what placement
    derives from it alone, such as the host ids in order, is computed once per snapshot.

    ``version`` and ``journal`` are set by a source that hands out successive snapshots of
    one inventory (the broker's placement index): ``journal`` says which boxes and hosts
    differ between two of its versions, so placement can bring what it derived from an
    earlier snapshot up to this one instead of starting again. Without a journal every
    snapshot stands alone.
    """

    boxes: Mapping[str, BoxInfo]
    hosts: Mapping[str, HostInfo]
    gpus_by_box: Mapping[str, Sequence[GpuInfo]]
    version: int = field(default=0, compare=False)
    journal: ChangeJournal | None = field(default=None, repr=False, compare=False)
    # What a source keeps counted as records change, so that placement need not count
    # them per snapshot (None: counted from the records when first asked):
    free_models: Mapping[str, int] | None = field(default=None, repr=False, compare=False)
    largest_host: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    _derived: dict[Hashable, object] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __reduce__(self) -> tuple[type[Snapshot], tuple[object, ...]]:
        # what was derived stays behind: it may hold plugins and latency models
        return Snapshot, (self.boxes, self.hosts, self.gpus_by_box)

    def free_by_model(self) -> Mapping[str, int]:
        """Free, healthy GPUs in schedulable boxes, by model as the GPUs name it (models
        with none free are left out): ``free_models`` when the source keeps the count,
        else counted once per snapshot."""
        if self.free_models is not None:
            return self.free_models
        return self.derived("free by model", lambda: count_free_by_model(self))

    def resource_scale(self) -> ResourceScale:
        """The CPU cores and memory of the largest hosts: ``largest_host`` when the
        source keeps it, else found once per snapshot."""
        return self.derived("resource scale", lambda: _scale_of(self))

    def host_ids(self) -> tuple[str, ...]:
        """Every host id, sorted; computed once per snapshot."""
        return self.derived("host ids", lambda: tuple(sorted(self.hosts)))

    def box_ids(self) -> tuple[str, ...]:
        """Every box id of ``gpus_by_box``, sorted; computed once per snapshot."""
        return self.derived("box ids", lambda: tuple(sorted(self.gpus_by_box)))

    def derived(self, key: Hashable, make: Callable[[], T]) -> T:
        """What ``make()`` returns, made once per snapshot and ``key``.

        For values derived from this snapshot alone (and from immutable things named in
        ``key``): the snapshot never changes, so neither do they. Keeps at most
        ``MAX_DERIVED`` keys; beyond that it forgets the others and starts again. Safe
        from several threads (a value may then be made twice).
        """
        derived = self._derived
        try:
            return cast(T, derived[key])
        except KeyError:
            pass
        value = make()
        if len(derived) >= MAX_DERIVED:
            derived.clear()
        derived[key] = value
        return value


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What a node asks of placement.

    ``model`` "" matches any model and compares case-insensitively; a set ``"H100|A100"``
    matches any of its models (a model named twice counts once: ``model`` holds the set
    with each named once), and :func:`~dxpool.broker.placement.placer.place` then gives
    the node GPUs of one model (see there which) unless ``mixed_models``, when the
    pipeline takes any mix of them; ``host`` pins the node
    to that host id; ``max_latency_ns`` 0 means no latency bound; ``max_slowdown`` 0 means
    no slowdown bound, else the predicted slowdown of ``workload`` (a profile name or
    ``ROUND_TRIPS@STEP_TIME``, see :mod:`dxpool.fabric.overhead`) on every GPU must be at
    most that; ``exclude_gpus`` holds
    GPU names (``boxes/{box}/gpus/{slot}``) that must not be chosen; ``same_box`` requires
    every GPU from one box; ``same_switch`` every GPU from boxes under one top-of-rack
    switch (the boxes' site/pod/rack; see
    :func:`~dxpool.broker.placement.selection.switch_of`), the host anywhere;
    ``max_gpus_per_box`` (0: no limit) spreads the node so that no
    box gives it more than that many GPUs; ``host_selector`` holds (key, value) pairs
    every chosen host's labels must include; ``cpu_cores`` and ``host_memory_mib`` (0:
    none) must be free on the host; ``exclude_hosts`` holds host ids the node must not
    go to (anti-affinity: the caller names the hosts running what the node must avoid).
    Construction raises :class:`~dxpool.errors.InvalidArgument` naming the field to
    fix.

    Placement keeps what it works out for a request keyed by the fields each part reads:
    box and GPU filters (and the score plugins that work by host class) must not read
    the host-side fields (``host``, ``host_selector``, ``cpu_cores``,
    ``host_memory_mib``, ``exclude_hosts``); see :func:`box_key`.
    """

    model: str
    count: int
    min_memory_mib: int = 0
    host: str | None = None
    max_latency_ns: int = 0
    exclude_gpus: frozenset[str] = field(default_factory=frozenset)
    max_slowdown: float = 0.0
    workload: str = ""
    mixed_models: bool = False
    same_box: bool = False
    max_gpus_per_box: int = 0
    host_selector: frozenset[tuple[str, str]] = field(default_factory=frozenset)
    cpu_cores: int = 0
    host_memory_mib: int = 0
    same_switch: bool = False
    exclude_hosts: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        validate_gpu_request(self.model, self.count, self.min_memory_mib, self.mixed_models)
        normalized = normalize_model_set(self.model)
        if normalized != self.model:  # one spelling per set: what placement keys on
            object.__setattr__(self, "model", normalized)
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
        check_slowdown(self.max_slowdown, self.workload)
        check_box_spread(self.max_gpus_per_box, same_box=self.same_box)
        if self.same_box and self.same_switch:
            raise InvalidArgument(
                "same_box and same_switch are both set: one box is already under one "
                "switch; ask for one or the other",
                reason="INVALID_AFFINITY",
            )
        if not isinstance(self.host_selector, frozenset):
            raise InvalidArgument(
                "host_selector must be a frozenset of (key, value) pairs, got "
                f"{type(self.host_selector).__name__}"
            )
        check_labels(dict(self.host_selector), "host_selector")
        check_host_resources(self.cpu_cores, self.host_memory_mib, memory_field="host_memory_mib")
        check_excluded_hosts(self.exclude_hosts)

    @property
    def models(self) -> tuple[str, ...]:
        """The models of ``model`` in the order written; () for any model."""
        return model_set(self.model)


def check_excluded_hosts(hosts: object, field_name: str = "exclude_hosts") -> None:
    """``hosts`` must be a frozenset of host ids. Any number: the bound on what a request
    over the wire names is the API's (``NodeSpec.exclude_hosts``, checked by the
    broker's validation); in process, the embedding API's anti-affinity may exclude as
    many hosts as run what a node must avoid."""
    if not isinstance(hosts, frozenset):
        raise InvalidArgument(
            f"{field_name} must be a frozenset of host ids, got {type(hosts).__name__}"
        )
    for host in sorted(hosts):
        check_id(host, "host")


def box_key(request: PlacementRequest) -> PlacementRequest:
    """``request`` with its host-side fields cleared: what box and GPU filters, the
    supply and the chooser depend on (they judge whatever the host)."""
    if not (
        request.host is not None
        or request.host_selector
        or request.cpu_cores
        or request.host_memory_mib
        or request.exclude_hosts
    ):
        return request
    return replace(
        request,
        host=None,
        host_selector=frozenset(),
        cpu_cores=0,
        host_memory_mib=0,
        exclude_hosts=frozenset(),
    )


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


Candidates = tuple[CandidateReport, ...]


class PlacementResult:
    """The answer: a placement, or None and a per-constraint account in ``unsatisfied``.

    ``candidates`` explains every host in the snapshot: feasible hosts first (best score
    first, then as ties go: least room, then host id), then dropped hosts by host id. It
    may be given as a function that makes it: it is then made on first read (a compose
    never reads it; a plan does), and the result reads and compares the same either
    way. Immutable.
    """

    __slots__ = ("_candidates", "_explain", "placement", "unsatisfied")

    placement: Placement | None
    unsatisfied: tuple[str, ...]
    _candidates: Candidates | None
    _explain: Callable[[], Candidates]

    def __init__(
        self,
        placement: Placement | None,
        candidates: Candidates | Callable[[], Candidates],
        unsatisfied: tuple[str, ...],
    ) -> None:
        init = object.__setattr__
        init(self, "placement", placement)
        init(self, "unsatisfied", unsatisfied)
        if isinstance(candidates, tuple):
            init(self, "_candidates", candidates)
            init(self, "_explain", _no_explanation)
        else:
            init(self, "_candidates", None)
            init(self, "_explain", candidates)

    @property
    def candidates(self) -> Candidates:
        """Why each host was kept or dropped (made on first read when given lazily)."""
        made = self._candidates
        if made is None:
            made = self._explain()
            object.__setattr__(self, "_candidates", made)
        return made

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"PlacementResult is immutable: cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"PlacementResult is immutable: cannot delete {name}")

    def __reduce__(self) -> tuple[type[PlacementResult], tuple[object, ...]]:
        return PlacementResult, (self.placement, self.candidates, self.unsatisfied)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlacementResult):
            return NotImplemented
        return (self.placement, self.candidates, self.unsatisfied) == (
            other.placement,
            other.candidates,
            other.unsatisfied,
        )

    def __hash__(self) -> int:
        return hash((self.placement, self.candidates, self.unsatisfied))

    def __repr__(self) -> str:
        return (
            f"PlacementResult(placement={self.placement!r}, candidates={self.candidates!r}, "
            f"unsatisfied={self.unsatisfied!r})"
        )


def _no_explanation() -> Candidates:
    return ()
