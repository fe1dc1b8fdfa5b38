"""Which borrowed nodes to take GPUs from so that a waiting request fits, at least cost.

A request that does not fit may take GPUs from **borrowed** nodes (``preemptible``: on
lent capacity, see :mod:`dxpool.broker.nodes.loaning`), never from a node within its tenant's
guarantee, nor from nodes that take no part in loaning. Which borrowed nodes it may take
(:func:`eligibility`):

* any borrowed node of another tenant, when the request fits in what is left of its own
  tenant's guarantee: the owner takes its lent capacity back ("lent capacity");
* otherwise, a borrowed node of another tenant with a lower ``priority`` than the
  request's ("lower priority").

A node already under a notice is not taken again (its GPUs are on their way). A gang's
members are one holder: taking one member's GPUs costs the gang, so the whole gang goes.

**Order (Aryl's least preemption cost, EDL's shrink first).** The planner tries, each
time asking placement whether the request would then fit on the pool as it would be
(the public ``place()`` on the snapshot with the candidate GPUs and host slots freed):

1. shrinking elastic borrowed nodes (``spec.min_gpus``) toward their minimum, lowest
   priority and least GPU-hours first, their most recently added GPUs first: the job
   keeps running, smaller;
2. else preempting one whole holder that covers what is missing, the cheapest by
   (priority, nodes it has, GPU-hours it has run, name): one preemption;
3. else whole holders in that order, as many as it takes.

The plan keeps only what the placement it found uses (GPUs, or host slots on the
request's host): a victim whose GPUs the request would not get is spared. A plan is a
proposal on one snapshot: notices are written with compare-and-swap on every victim and
the request (:mod:`dxpool.broker.control.notices`), and the request is admitted, like any other,
once placement finds room.

Pure: the broker's dispatcher and ``node plan`` and the replay benchmark call the same
function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from dxpool.broker.nodes.gang import without_placement
from dxpool.broker.placement import (
    HostInfo,
    Placement,
    PlacementRequest,
    PlacementResult,
    Snapshot,
    place,
)
from dxpool.fabric.latency import LatencyModel
from dxpool.request import model_set

LENT_CAPACITY = "lent capacity"
LOWER_PRIORITY = "lower priority"
MAX_SIMULATIONS = 24
"""How many placements one plan may try (each one runs placement from scratch)."""


@dataclass(frozen=True, slots=True)
class HeldGpu:
    """One GPU a node holds: its name, box, slot, model and host slot."""

    name: str
    box: str
    slot: int
    model: str
    host_slot: int


@dataclass(frozen=True, slots=True)
class HeldNode:
    """One node of a holder: its host id, its GPUs in binding order (the last added
    last), its elastic minimum (0: not elastic) and the GPU-hours it has run."""

    name: str
    host: str
    gpus: tuple[HeldGpu, ...]
    min_gpus: int = 0
    gpu_hours: float = 0.0


@dataclass(frozen=True, slots=True)
class Holder:
    """What one preemption takes: a node alone, or a gang (its live members)."""

    name: str  # "nodes/{node}" or "gangs/{gang}"
    tenant: str
    priority: int
    nodes: tuple[HeldNode, ...]

    @property
    def gpu_count(self) -> int:
        return sum(len(node.gpus) for node in self.nodes)

    @property
    def gpu_hours(self) -> float:
        return sum(node.gpu_hours for node in self.nodes)

    @property
    def elastic(self) -> bool:
        """A node alone that may shrink (a gang member never does: it would change the
        gang's shape under the job)."""
        return (
            len(self.nodes) == 1
            and self.name.startswith("nodes/")
            and 0 < self.nodes[0].min_gpus < len(self.nodes[0].gpus)
        )


@dataclass(frozen=True, slots=True)
class Ask:
    """A waiting request: one placement request per node (a gang: per member, in
    order), its tenant, priority, and whether it fits in its tenant's guarantee."""

    requests: tuple[PlacementRequest, ...]
    tenant: str
    priority: int
    within_guarantee: bool

    @property
    def gpus(self) -> int:
        return sum(r.count for r in self.requests)


@dataclass(frozen=True, slots=True)
class Cut:
    """One thing a plan does: shrink ``node`` by ``gpus`` (names), or, with ``gpus``
    empty, preempt it whole. ``holder`` is what the cut belongs to (a gang's members
    are all cut whole together)."""

    node: str
    gpus: tuple[str, ...]
    holder: Holder
    reason: str

    @property
    def whole(self) -> bool:
        return not self.gpus


@dataclass(frozen=True, slots=True)
class Plan:
    """Cuts that make the request fit, and where it would then go (one placement per
    request of the ask)."""

    cuts: tuple[Cut, ...]
    placements: tuple[Placement, ...]

    @property
    def freed(self) -> int:
        total = 0
        for cut in self.cuts:
            node = next(n for n in cut.holder.nodes if n.name == cut.node)
            total += len(cut.gpus) if cut.gpus else len(node.gpus)
        return total


Placer = Callable[[PlacementRequest, Snapshot, LatencyModel], PlacementResult]


def eligibility(ask: Ask, holder: Holder) -> str | None:
    """Why ``holder`` (a borrowed node or gang) may be preempted for ``ask``, or None."""
    if holder.tenant == ask.tenant:
        return None
    if ask.within_guarantee:
        return LENT_CAPACITY
    if holder.priority < ask.priority:
        return LOWER_PRIORITY
    return None


def _matches(model: str, wanted: Sequence[PlacementRequest]) -> bool:
    for request in wanted:
        models = {m.lower() for m in model_set(request.model)}
        if not models or model.lower() in models:
            return True
    return False


def usable_free(snapshot: Snapshot, ask: Ask) -> int:
    """GPUs free now that the request could use (its models, healthy, in an ACTIVE box)."""
    free = 0
    for box_id, gpus in snapshot.gpus_by_box.items():
        box = snapshot.boxes.get(box_id)
        if box is None or not box.schedulable:
            continue
        free += sum(1 for g in gpus if g.free and g.healthy and _matches(g.model, ask.requests))
    return free


def with_freed(snapshot: Snapshot, cuts: Iterable[tuple[HeldNode, Sequence[HeldGpu]]]) -> Snapshot:
    """``snapshot`` as it would be once each node gave up the GPUs named with it: those
    GPUs free and their host slots unused. Stands alone (no journal)."""
    freed: dict[str, set[int]] = {}
    slots: dict[str, set[int]] = {}
    for node, gpus in cuts:
        for gpu in gpus:
            freed.setdefault(gpu.box, set()).add(gpu.slot)
            slots.setdefault(node.host, set()).add(gpu.host_slot)
    gpus_by_box = dict(snapshot.gpus_by_box)
    for box, box_slots in freed.items():
        if box in gpus_by_box:
            gpus_by_box[box] = tuple(
                replace(g, free=True) if g.slot in box_slots else g for g in gpus_by_box[box]
            )
    hosts: dict[str, HostInfo] = dict(snapshot.hosts)
    for host, host_slots in slots.items():
        info = hosts.get(host)
        if info is not None:
            hosts[host] = replace(info, used_slots=info.used_slots - frozenset(host_slots))
    return Snapshot(boxes=snapshot.boxes, hosts=hosts, gpus_by_box=gpus_by_box)


def place_all(
    ask: Ask, snapshot: Snapshot, latency: LatencyModel, placer: Placer = place
) -> tuple[Placement, ...] | None:
    """Every request of ``ask`` placed in order, each taken out of the snapshot before
    the next (as a gang is placed); None when one does not fit."""
    placements: list[Placement] = []
    for request in ask.requests:
        result = placer(request, snapshot, latency)
        if result.placement is None:
            return None
        placements.append(result.placement)
        snapshot = without_placement(
            snapshot, result.placement, request.cpu_cores, request.host_memory_mib
        )
    return tuple(placements)


@dataclass
class _Trial:
    """Cuts tried so far: (node, GPUs it gives up, the cut)."""

    parts: list[tuple[HeldNode, tuple[HeldGpu, ...], Cut]]

    def freed(self) -> list[tuple[HeldNode, Sequence[HeldGpu]]]:
        return [(node, gpus) for node, gpus, _ in self.parts]


class _Simulator:
    def __init__(self, ask: Ask, snapshot: Snapshot, latency: LatencyModel, placer: Placer):
        self.ask = ask
        self.snapshot = snapshot
        self.latency = latency
        self.placer = placer
        self.runs = 0
        self.free = usable_free(snapshot, ask)

    def enough(self, parts: list[tuple[HeldNode, tuple[HeldGpu, ...], Cut]]) -> bool:
        matching = sum(
            1 for _, gpus, _ in parts for g in gpus if _matches(g.model, self.ask.requests)
        )
        return self.free + matching >= self.ask.gpus

    def run(
        self, parts: list[tuple[HeldNode, tuple[HeldGpu, ...], Cut]]
    ) -> tuple[Placement, ...] | None:
        if self.runs >= MAX_SIMULATIONS or not self.enough(parts):
            return None
        self.runs += 1
        snapshot = with_freed(self.snapshot, _Trial(parts).freed())
        return place_all(self.ask, snapshot, self.latency, self.placer)


def _cost(holder: Holder) -> tuple[int, int, float, str]:
    return (holder.priority, len(holder.nodes), holder.gpu_hours, holder.name)


def _whole(holder: Holder, reason: str) -> list[tuple[HeldNode, tuple[HeldGpu, ...], Cut]]:
    return [(node, node.gpus, Cut(node.name, (), holder, reason)) for node in holder.nodes]


def _trimmed(
    parts: list[tuple[HeldNode, tuple[HeldGpu, ...], Cut]], placements: tuple[Placement, ...]
) -> tuple[Cut, ...]:
    """The cuts a placement found on the freed pool needs: GPUs it takes, or host slots
    it takes on a victim's host. A whole holder is kept or spared as a whole."""
    used_gpus = {(b.box, b.slot) for p in placements for b in p.bindings}
    used_slots = {(p.host, b.host_slot) for p in placements for b in p.bindings}

    def needed(node: HeldNode, gpu: HeldGpu) -> bool:
        return (gpu.box, gpu.slot) in used_gpus or (node.host, gpu.host_slot) in used_slots

    holders_needed = {
        cut.holder.name for node, gpus, cut in parts if any(needed(node, g) for g in gpus)
    }
    cuts: list[Cut] = []
    for node, gpus, cut in parts:
        if cut.holder.name not in holders_needed:
            continue
        if cut.whole:
            cuts.append(cut)
        else:
            kept = tuple(g.name for g in gpus if needed(node, g))
            if kept:
                cuts.append(replace(cut, gpus=kept))
    return tuple(cuts)


def plan(
    ask: Ask,
    holders: Iterable[Holder],
    snapshot: Snapshot,
    latency: LatencyModel,
    placer: Placer = place,
) -> Plan | None:
    """The cheapest cuts that let ``ask`` fit (see the module docstring); None when no
    eligible holders make it fit."""
    eligible = [(h, r) for h in holders if (r := eligibility(ask, h)) is not None]
    if not eligible:
        return None
    sim = _Simulator(ask, snapshot, latency, placer)
    # 1. shrink elastic borrowers toward their minimum
    elastic = sorted((pair for pair in eligible if pair[0].elastic), key=lambda p: _cost(p[0]))
    parts: list[tuple[HeldNode, tuple[HeldGpu, ...], Cut]] = []
    for holder, reason in elastic:
        node = holder.nodes[0]
        offer = node.gpus[node.min_gpus :]
        parts.append((node, offer, Cut(node.name, tuple(g.name for g in offer), holder, reason)))
        if sim.enough(parts):
            found = sim.run(parts)
            if found is not None:
                return Plan(_trimmed(parts, found), found)
    # 2. one whole holder that covers what is missing, cheapest first
    ordered = sorted(eligible, key=lambda pair: _cost(pair[0]))
    for holder, reason in ordered:
        single = _whole(holder, reason)
        if sim.enough(single):
            found = sim.run(single)
            if found is not None:
                return Plan(_trimmed(single, found), found)
    # 3. whole holders in cost order, as many as it takes
    parts = []
    for holder, reason in ordered:
        parts.extend(_whole(holder, reason))
        if sim.enough(parts):
            found = sim.run(parts)
            if found is not None:
                return Plan(_trimmed(parts, found), found)
    return None


__all__ = [
    "LENT_CAPACITY",
    "LOWER_PRIORITY",
    "Ask",
    "Cut",
    "HeldGpu",
    "HeldNode",
    "Holder",
    "Plan",
    "eligibility",
    "place_all",
    "plan",
    "usable_free",
    "with_freed",
]
