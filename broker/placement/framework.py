"""The plugin phases of the placement pipeline, one small Protocol per phase.

Phases, in the order the pipeline runs them:

1. **PreFilter** (:class:`PreFilterPlugin`) looks at the request and the whole snapshot
   once and rejects a request that cannot fit whatever the inventory's state
   (``UNRESOLVABLE``).
2. **Filter**, at four granularities. :class:`BoxFilterPlugin` and
   :class:`GpuFilterPlugin` do not depend on the host, so they run once per box, then
   once per GPU of the boxes kept, and leave the *supply*: per usable box, the GPUs the
   request may take. :class:`HostFilterPlugin` runs once per host, and
   :class:`LinkFilterPlugin` once per (host, box) pair with the fabric's latency estimate
   for that pair. Work is at box granularity: the cost is O(hosts x boxes), not
   O(hosts x GPUs); with a latency model that ranks boxes per class of host and no link
   filter, it is O(host classes x tiers walked), and no pair is asked for.
3. **Select** (not a plugin): per host, a few greedy rules propose which boxes to take
   GPUs from (:mod:`dxpool.broker.placement.selection`).
4. **Score** (:class:`ScorePlugin`) rates every proposal, then normalizes its raw scores
   across all proposals to 0-100; the pipeline sums the normalized scores with the
   registry's weights and takes the best proposal, ties broken by host id.

Placement carries its work over from one snapshot to the next and from one request to
the next (:mod:`~dxpool.broker.placement.carry`), by the request's :class:`Signature`:
what each carried part may depend on, as the Kubernetes scheduler framework signs pods
("two pods with the same signature should get the same feasibility and scores"). A
plugin that says which request fields it reads (``reads``) lets requests that differ
only elsewhere share that work.

A plugin implements only the phases it needs. ``applies(request)`` lets a filter step
aside for requests it has nothing to say about (a latency bound of 0, no memory
minimum), so it costs nothing then. Filters return a :class:`Status`, never raise; every
filter can also explain, after the fact, what it dropped and what was closest. Every
phase is a pure function of its arguments: the pipeline remembers verdicts and reuses
them (see :mod:`~dxpool.broker.placement.pipeline`).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from dxpool.broker.placement.model import (
    BoxInfo,
    GpuInfo,
    HostInfo,
    LatencyEstimate,
    PlacementRequest,
    Snapshot,
    box_key,
)
from dxpool.broker.placement.status import Status
from dxpool.request import format_duration_ns

MAX_SCORE = 100.0


@functools.cache
def defined_with(plugin_type: type, method: str, reference: str) -> bool:
    """Whether ``plugin_type`` defines ``method`` no higher in its class tree than
    ``reference``: a faster form of ``reference`` is trusted only then, so a subclass that
    changes ``reference`` alone is still obeyed."""

    def depth(name: str) -> int | None:
        return next((i for i, cls in enumerate(plugin_type.__mro__) if name in vars(cls)), None)

    fast, slow = depth(method), depth(reference)
    return fast is not None and (slow is None or fast <= slow)


@dataclass(frozen=True, slots=True)
class BoxSupply:
    """A schedulable box and the GPUs of it that passed every GPU filter, lowest slot first."""

    box: BoxInfo
    gpus: tuple[GpuInfo, ...]
    available: int = field(init=False)  # len(gpus), kept as a field: read in hot loops

    def __post_init__(self) -> None:
        object.__setattr__(self, "available", len(self.gpus))


@dataclass(frozen=True, slots=True)
class Take:
    """Take the first ``count`` GPUs of ``supply``, ``latency_ns`` away from the host."""

    supply: BoxSupply
    count: int
    latency_ns: int


@dataclass(frozen=True, slots=True)
class Proposal:
    """One way to serve the request from one host: which boxes, how many GPUs from each.

    ``rule`` names the greedy rule that proposed it; ``free_slots`` is the host's free
    proxy slot count before the placement.
    """

    host: HostInfo
    free_slots: int
    takes: tuple[Take, ...]
    rule: str
    # Derived from ``takes`` once, since every score plugin reads them:
    gpu_count: int = field(init=False)
    box_count: int = field(init=False)
    mean_latency_ns: float = field(init=False)
    available_in_boxes: int = field(init=False)  # usable GPUs in the boxes it touches

    def __post_init__(self) -> None:
        gpus = latency = available = 0
        for take in self.takes:
            count = take.count
            gpus += count
            latency += count * take.latency_ns
            available += take.supply.available
        init = object.__setattr__
        init(self, "gpu_count", gpus)
        init(self, "box_count", len(self.takes))
        init(self, "mean_latency_ns", latency / max(gpus, 1))
        init(self, "available_in_boxes", available)

    def describe(self) -> str:
        """``"boxes/b1 x4 @1.2us, boxes/b2 x2 @2us"``."""
        return ", ".join(
            f"boxes/{take.supply.box.box} x{take.count} @{format_duration_ns(take.latency_ns)}"
            for take in self.takes
        )


@dataclass(frozen=True, slots=True)
class DroppedLink:
    """A (host, box) pair a link filter rejected, with the estimate it judged."""

    host: HostInfo
    box: BoxInfo
    estimate: LatencyEstimate
    gpus: int  # GPUs of the box's supply the host lost


class Plugin(Protocol):
    """What every plugin has: a unique name, used in reasons and in the registry."""

    name: str


class FilterPlugin(Protocol):
    """What every filter has besides its phase method."""

    name: str

    def applies(self, request: PlacementRequest) -> bool:
        """False when the filter would keep everything for this request."""
        ...


class PreFilterPlugin(Protocol):
    """Rejects a request that cannot fit whatever the inventory's state."""

    name: str

    def pre_filter(self, request: PlacementRequest, snapshot: Snapshot) -> Status:
        """SUCCESS, or UNRESOLVABLE with a reason naming the constraint and what exists."""
        ...


class GpuFilterPlugin(Protocol):
    """Keeps or drops one GPU, whatever the host.

    A GPU filter may also be a :class:`GpuListFilterPlugin`, judging a whole list at once
    without a :class:`Status` per GPU. The pipeline uses ``filter_gpus`` when the class
    defines it no higher in the class tree than ``filter_gpu`` (so a subclass that only
    changes ``filter_gpu`` is still obeyed).
    """

    name: str

    def applies(self, request: PlacementRequest) -> bool:
        """False when the filter would keep every GPU for this request."""
        ...

    def filter_gpu(self, request: PlacementRequest, gpu: GpuInfo) -> Status: ...

    def label(self, request: PlacementRequest) -> str:
        """What the GPUs that pass are, for counts: ``"free"``, ``"with >= 80GiB"``."""
        ...

    def closest(self, request: PlacementRequest, dropped: Sequence[GpuInfo]) -> str | None:
        """The nearest thing to what was asked among ``dropped`` (None if nothing useful)."""
        ...


class GpuListFilterPlugin(GpuFilterPlugin, Protocol):
    """A GPU filter that can also judge a whole list of GPUs at once."""

    def filter_gpus(self, request: PlacementRequest, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        """The GPUs of ``gpus`` that :meth:`filter_gpu` keeps, in order."""
        ...


class BoxFilterPlugin(Protocol):
    """Keeps or drops a whole box, whatever the host."""

    name: str

    def applies(self, request: PlacementRequest) -> bool: ...

    def filter_box(self, request: PlacementRequest, box: BoxInfo) -> Status: ...

    def label(self, request: PlacementRequest) -> str:
        """What the GPUs of the boxes that pass are: ``"in schedulable boxes"``."""
        ...


class HostFilterPlugin(Protocol):
    """Keeps or drops one host."""

    name: str

    def applies(self, request: PlacementRequest) -> bool: ...

    def filter_host(self, request: PlacementRequest, host: HostInfo) -> Status: ...

    def explain(
        self, request: PlacementRequest, failed: Sequence[HostInfo], reached: int
    ) -> str | None:
        """One line on the constraint, given the ``failed`` hosts among ``reached`` checked.

        Returns None when there is nothing to add (the failures are explained elsewhere).
        """
        ...


class HostCheckPlugin(HostFilterPlugin, Protocol):
    """A host filter that can also say yes or no without a :class:`Status`.

    Placement carries over its work between requests by what they read (see
    :func:`~dxpool.broker.placement.model.box_key`): the hosts other filters keep are
    grouped once per distinct value of the fields those filters read, and a check like
    this, whose fields (CPU and memory asked for, hosts excluded) take many values, is
    applied at decision time to the few hosts a decision looks at. ``keeps`` must
    agree with ``filter_host`` (SUCCESS exactly when it returns True, never raising
    where ``filter_host`` does not). ``reads`` names the request fields it depends on,
    as every host filter may (a filter without it is taken to read every field).
    """

    reads: frozenset[str]

    def keeps(self, request: PlacementRequest, host: HostInfo) -> bool: ...


class LinkFilterPlugin(Protocol):
    """Keeps or drops one box for one host, given the fabric's latency estimate."""

    name: str

    def applies(self, request: PlacementRequest) -> bool: ...

    def filter_link(
        self,
        request: PlacementRequest,
        host: HostInfo,
        box: BoxInfo,
        estimate: LatencyEstimate,
    ) -> Status: ...

    def explain(self, request: PlacementRequest, nearest: Sequence[DroppedLink]) -> str | None:
        """One line on the constraint, given the nearest dropped link of each host."""
        ...


class BoundLinkFilterPlugin(LinkFilterPlugin, Protocol):
    """A link filter that keeps exactly the links within a round-trip bound.

    The pipeline then judges whole tiers of boxes at once instead of calling
    :meth:`filter_link` for each pair (when the class defines ``round_trip_bound`` no
    higher in its class tree than ``filter_link``). The results must be the same.
    """

    def round_trip_bound(self, request: PlacementRequest) -> int:
        """:meth:`filter_link` keeps a link exactly when its round trip is at most this,
        and drops the others as UNSCHEDULABLE (never ERROR)."""
        ...


class ScorePlugin(Protocol):
    """Rates proposals. Higher normalized scores are better.

    A plugin may set ``by_host_class = True`` when its raw score depends only on the
    proposal's takes and free slot count (and on the request's box key, never on its
    host-side fields), never on which host of a latency class it is, and its
    ``normalize`` only on the best raw score (max or min), not on how many proposals
    there are. Placement then scores each group of hosts alike (latency class, free
    slots) once (see :mod:`~dxpool.broker.placement.carry`); a plugin without it makes
    every host be scored.

    A ``by_host_class`` plugin may also set ``by_take_shape = True`` when its raw score
    reads of each take only its GPU count, its round trip and its box's usable GPUs
    (``supply.available``), never which box it is (its id, place, model or GPUs), and
    of the proposal nothing else but the free slot count and the rule. Proposals of one
    shape then score alike whichever boxes they take: placement scores a shape once and
    files hosts whose tightest boxes differ but have that shape together.
    """

    name: str

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        """A raw score; its meaning (and direction) is the plugin's own."""
        ...

    def normalize(self, scores: Sequence[float]) -> list[float]:
        """Map the raw scores of all proposals to 0-100, higher better, same order."""
        ...


def scale_to_best(scores: Sequence[float]) -> list[float]:
    """Higher-is-better raw scores (>= 0): the best becomes 100, the rest in proportion."""
    best = max(scores, default=0.0)
    if best <= 0:
        return [0.0 for _ in scores]
    return [MAX_SCORE * max(score, 0.0) / best for score in scores]


def invert_to_best(costs: Sequence[float]) -> list[float]:
    """Lower-is-better raw costs (>= 0): the lowest becomes 100, others ``100 * best/cost``."""
    best = min(costs, default=0.0)
    return [MAX_SCORE if cost <= best else MAX_SCORE * best / cost for cost in costs]


# -- the signature of carried work ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Signature:
    """What work carried over for one request may depend on; two requests with equal
    parts of a signature share that part of the work, and get from it exactly what a
    run that carries nothing gives them (the tests compare them after random commits
    and releases).

    * ``supply``: the request as the box and GPU filters read it, for the supply (each
      usable box's GPUs): the :func:`~dxpool.broker.placement.model.box_key`, of size 1
      when no box or GPU filter that applies reads ``count`` (sizes then share it);
    * ``boxes``: the box key, for the chooser (the greedy rules per host class) and the
      raw scores of proposals by their takes (score plugins that declare
      ``by_host_class`` read nothing else of the request);
    * ``hosts``: the names of the host filters grouped ahead of a decision (those that
      are not :class:`HostCheckPlugin`), with the values of the request fields they read
      (``reads``; a filter that does not say is taken to read every field, and the whole
      request is then the key), for the hosts those filters keep.

    What a request asks beyond these (CPU and memory, hosts excluded, any
    :class:`HostCheckPlugin`'s fields) is never carried: it is checked at decision time
    on the few hosts a decision looks at. Each part is also kept per latency model and
    brought forward only along one journal of snapshots (see
    :class:`~dxpool.broker.placement.model.Snapshot`)."""

    supply: PlacementRequest
    boxes: PlacementRequest
    hosts: Hashable


def sign(
    request: PlacementRequest,
    supply_filters: Iterable[object],
    host_filters: Sequence[HostFilterPlugin],
) -> Signature:
    """The :class:`Signature` of ``request`` for a pipeline whose box and GPU filters
    that apply are ``supply_filters`` and whose host filters grouped ahead of a decision
    are ``host_filters``."""
    boxes = box_key(request)
    return Signature(supply_key(boxes, supply_filters), boxes, hosts_key(request, host_filters))


def supply_key(boxes: PlacementRequest, filters: Iterable[object]) -> PlacementRequest:
    """The box key ``boxes`` of size 1 when no filter of ``filters`` reads the size
    (every filter that does not say is taken to)."""
    for plugin in filters:
        reads = getattr(plugin, "reads", None)
        if reads is None or "count" in reads:
            return boxes
    return replace(boxes, count=1) if boxes.count != 1 else boxes


def hosts_key(request: PlacementRequest, filters: Sequence[HostFilterPlugin]) -> Hashable:
    """The names of ``filters`` and the values of the request fields they read (the
    whole request when one does not say)."""
    fields: set[str] = set()
    for plugin in filters:
        reads = getattr(plugin, "reads", None)
        if reads is None:
            return (tuple(p.name for p in filters), request)
        fields.update(reads)
    return (
        tuple(plugin.name for plugin in filters),
        tuple((name, getattr(request, name)) for name in sorted(fields)),
    )
