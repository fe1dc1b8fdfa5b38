"""The placement pipeline: runs the phases of :mod:`~dxpool.broker.placement.framework`
over one snapshot and explains the outcome.

A run is a pure function of (request, snapshot, latency model, plugins): it reads the
snapshot, never mutates it, and breaks every tie the same way (among equally good
proposals, the host with the least room, see
:meth:`~dxpool.broker.placement.model.ResourceScale.room`, then the lowest id), so the
same inputs always give the same placement and the same explanation.

Placement sits on the compose path, so a run does no work it can avoid, none of which
changes what it answers:

- for a snapshot with a journal (the broker's placement index) and score plugins that
  work by host class, the decision is read off what the pipeline carries over from
  earlier snapshots, kept by the request fields each part depends on and brought up to
  date by the records changed since (:mod:`~dxpool.broker.placement.carry`);
- otherwise what a run works out before looking at hosts (the filters that apply, the
  pre-filters' verdict, the supply) is remembered by the snapshot, for the next run on
  it, and box and GPU filter verdicts are remembered by the pipeline per box key and
  box, and reused for a new snapshot that holds the same box objects (see
  :class:`~dxpool.broker.placement.supply.BoxVerdicts`);
- with a :class:`~dxpool.fabric.latency.TieredLatencyModel` and no link filter that must
  see each pair, boxes are chosen once per class of host by walking the model's ranking
  nearest tier first (:mod:`~dxpool.broker.placement.tiered`), instead of asking for
  every (host, box) pair, and hosts alike (latency class, free slots) are proposed for
  once;
- a result explains each candidate only when its ``candidates`` are read (a plan reads
  them, a compose does not); what a failed placement answers in ``unsatisfied`` is made
  at once, by a run over every host.

Plugins must therefore be pure: the same request and candidate give the same verdict.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from dxpool.broker.placement import selection
from dxpool.broker.placement.carry import Carried, Parts, decide
from dxpool.broker.placement.explain import (
    link_error_line,
    reach_line,
    supply_line,
    switch_line,
    switch_reason,
    unreached_host_reason,
)
from dxpool.broker.placement.framework import (
    MAX_SCORE,
    BoundLinkFilterPlugin,
    BoxFilterPlugin,
    BoxSupply,
    DroppedLink,
    GpuFilterPlugin,
    HostCheckPlugin,
    HostFilterPlugin,
    LinkFilterPlugin,
    Plugin,
    PreFilterPlugin,
    Proposal,
    ScorePlugin,
    defined_with,
    sign,
)
from dxpool.broker.placement.guard import PluginError, applying, failure, guarded, guarded_text
from dxpool.broker.placement.model import (
    Binding,
    CandidateReport,
    Candidates,
    HostInfo,
    LatencyEstimate,
    LatencyModel,
    Placement,
    PlacementRequest,
    PlacementResult,
    Snapshot,
)
from dxpool.broker.placement.plugins.hosts import HostSlots, PinnedHost
from dxpool.broker.placement.status import SUCCESS, Code, Status
from dxpool.broker.placement.supply import BoxVerdicts, Supply, build_supply
from dxpool.broker.placement.tiered import TieredChooser
from dxpool.fabric.latency import TieredLatencyModel

_SCORE_DIGITS = 6  # totals are compared rounded, so float noise never beats a name


@dataclass(frozen=True, slots=True)
class WeightedScore:
    """A score plugin and the weight of its normalized score in the total."""

    plugin: ScorePlugin
    weight: float


@dataclass(frozen=True)
class Pipeline:
    """The plugins of each phase, in the order they run, and the score weights.

    Construction raises ``ValueError`` for two plugins of one name or a weight that is
    not a positive finite number. A pipeline carries its work over from one snapshot to
    the next and remembers its filters' verdicts (see the module docstring); it is safe
    to share between threads.
    """

    pre_filters: tuple[PreFilterPlugin, ...] = ()
    gpu_filters: tuple[GpuFilterPlugin, ...] = ()
    box_filters: tuple[BoxFilterPlugin, ...] = ()
    host_filters: tuple[HostFilterPlugin, ...] = ()
    link_filters: tuple[LinkFilterPlugin, ...] = ()
    scores: tuple[WeightedScore, ...] = ()
    _verdicts: BoxVerdicts = field(
        default_factory=BoxVerdicts, init=False, repr=False, compare=False
    )
    _carried: Carried = field(default_factory=Carried, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        plugins: tuple[Plugin, ...] = (
            *self.pre_filters,
            *self.gpu_filters,
            *self.box_filters,
            *self.host_filters,
            *self.link_filters,
        )
        names = [plugin.name for plugin in plugins]
        scores = [score.plugin.name for score in self.scores]
        for group in (names, scores):
            duplicates = sorted({name for name in group if group.count(name) > 1})
            if duplicates:
                raise ValueError(f"placement plugins listed twice: {', '.join(duplicates)}")
        for score in self.scores:
            if not (math.isfinite(score.weight) and score.weight > 0):
                raise ValueError(
                    f"score plugin {score.plugin.name}: weight must be a positive number, "
                    f"got {score.weight!r}"
                )

    def run(
        self, request: PlacementRequest, snapshot: Snapshot, latency: LatencyModel
    ) -> PlacementResult:
        """Place ``request`` on ``snapshot``. Never raises for a plugin's failure: the
        failure becomes an ERROR status and is reported in the result."""
        try:
            return _Run(self, request, snapshot, latency).result()
        except PluginError as failed:
            reason = f"internal: placement plugin {failed.plugin} failed: {failed.error}"
            return _rejected(snapshot, (reason,))


@dataclass(slots=True)
class _HostOutcome:
    """What happened to one host in this run."""

    host: HostInfo
    status: Status
    proposals: list[Proposal]


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What a run works out before it looks at any host. It depends only on (pipeline,
    request, snapshot, latency model), so the snapshot remembers it for later runs."""

    owners: tuple[Pipeline, LatencyModel]  # held, so the ids in the memo key stay theirs
    gpu_filters: tuple[GpuFilterPlugin, ...]
    box_filters: tuple[BoxFilterPlugin, ...]
    host_filters: tuple[HostFilterPlugin, ...]
    link_filters: tuple[LinkFilterPlugin, ...]
    rejected: tuple[str, ...]  # the pre-filters' reasons; the rest is empty when set
    supply: Supply
    chooser: TieredChooser | None


def _prepare(
    pipeline: Pipeline, request: PlacementRequest, snapshot: Snapshot, latency: LatencyModel
) -> _Prepared:
    """Runs the pre-filters, picks the filters that apply and builds the supply (and a
    chooser per host class when the model ranks boxes in bulk and no link filter must
    see each pair). Raises :class:`PluginError` when a plugin fails for every host."""
    gpu_filters = applying(pipeline.gpu_filters, request)
    box_filters = applying(pipeline.box_filters, request)
    host_filters = applying(pipeline.host_filters, request)
    link_filters = applying(pipeline.link_filters, request)
    reasons: list[str] = []
    for plugin in pipeline.pre_filters:
        status = guarded(plugin.name, plugin.pre_filter, request, snapshot)
        if status.code is not Code.SUCCESS:
            reasons.extend(status.reasons or (f"rejected by {plugin.name}",))
    owners = (pipeline, latency)
    filters = (gpu_filters, box_filters, host_filters, link_filters)
    if reasons:
        return _Prepared(owners, *filters, tuple(reasons), Supply((), 0, ()), None)
    supply = build_supply(request, snapshot, box_filters, gpu_filters, pipeline._verdicts)
    chooser = None
    if supply.usable >= request.count and _is_tiered(type(latency)):
        try:
            tiered, bound = _tiers_suffice(link_filters, request)
            if tiered:
                model = cast(TieredLatencyModel, latency)
                chooser = TieredChooser(
                    model, supply.boxes, request.count, bound, same_switch=request.same_switch
                )
        except Exception:
            chooser = None  # the pair-by-pair path finds and reports what failed
    return _Prepared(owners, *filters, (), supply, chooser)


def _carried_parts(pipeline: Pipeline, request: PlacementRequest) -> Parts | None:
    """What :func:`~dxpool.broker.placement.carry.decide` needs of ``pipeline`` for
    ``request``; None when the link filters must see each pair. Raises
    :class:`PluginError` when a filter's ``applies`` fails."""
    link_filters = applying(pipeline.link_filters, request)
    tiered, bound = _tiers_suffice(link_filters, request)
    if not tiered:
        return None
    base: list[HostFilterPlugin] = []
    checks: list[HostCheckPlugin] = []
    pinned = False
    min_free = 0
    for plugin in pipeline.host_filters:
        if isinstance(plugin, PinnedHost):
            pinned = plugin.applies(request)
        elif isinstance(plugin, HostSlots):
            min_free = request.count
        elif callable(getattr(plugin, "keeps", None)) and hasattr(plugin, "reads"):
            checks.append(cast(HostCheckPlugin, plugin))
        elif plugin.applies(request):
            base.append(plugin)
    if request.host is not None and not pinned:
        return None  # a pin no filter enforces: the run host by host says what it does
    scores = pipeline.scores
    box_filters = applying(pipeline.box_filters, request)
    gpu_filters = applying(pipeline.gpu_filters, request)
    base_filters = tuple(base)
    return Parts(
        pipeline.pre_filters,
        box_filters,
        gpu_filters,
        base_filters,
        tuple(checks),
        pinned,
        min_free,
        bound,
        tuple(weighted.plugin for weighted in scores),
        tuple(weighted.weight for weighted in scores),
        _scores_declare(pipeline, "by_take_shape"),
        sign(request, (*box_filters, *gpu_filters), base_filters),
    )


def _scores_declare(pipeline: Pipeline, flag: str) -> bool:
    """Whether every score plugin sets ``flag`` (``by_host_class``: hosts of one class
    are scored once; ``by_take_shape``: proposals of one shape score alike)."""
    return all(getattr(w.plugin, flag, False) for w in pipeline.scores)


def _tiers_suffice(
    link_filters: tuple[LinkFilterPlugin, ...], request: PlacementRequest
) -> tuple[bool, int | None]:
    """Whether the link filters can be applied tier by tier, and the round-trip bound
    they apply (None: no bound). They cannot when there are several, or one cannot say
    which bound it applies: each pair must then be shown to them."""
    if not link_filters:
        return True, None
    (only, *others) = link_filters
    if others or not defined_with(type(only), "round_trip_bound", "filter_link"):
        return False, None
    return True, cast(BoundLinkFilterPlugin, only).round_trip_bound(request)


class _Run:
    """The state of one placement (like a scheduling cycle's state)."""

    def __init__(
        self,
        pipeline: Pipeline,
        request: PlacementRequest,
        snapshot: Snapshot,
        latency: LatencyModel,
        *,
        share_classes: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.request = request
        self.snapshot = snapshot
        self.latency = latency
        self.share_classes = share_classes
        self.room = snapshot.resource_scale().room

    def _setup(self) -> None:
        """What a run that looks at hosts needs: the preparation and its counters."""
        pipeline, request, snapshot, latency = (
            self.pipeline,
            self.request,
            self.snapshot,
            self.latency,
        )
        key = ("placement", id(pipeline), id(latency), request)
        prepared = snapshot.derived(key, lambda: _prepare(pipeline, request, snapshot, latency))
        self.prepared = prepared
        self.host_filters = prepared.host_filters
        self.link_filters = prepared.link_filters
        self.supply = prepared.supply
        self.chooser = prepared.chooser
        self.host_failures: dict[str, list[HostInfo]] = {f.name: [] for f in self.host_filters}
        self.host_stops = [0] * len(self.host_filters)  # hosts each host filter dropped
        self.nearest_dropped: dict[str, list[DroppedLink]] = {f.name: [] for f in self.link_filters}
        self.link_errors: list[str] = []
        self.best_reach: tuple[int, str] | None = None  # (GPUs within reach, host id)
        # with switch affinity: (GPUs under one switch, switch name, host id), the most
        self.best_switch: tuple[int, str, str] | None = None

    # -- phases ------------------------------------------------------------------------

    def result(self) -> PlacementResult:
        by_class = _scores_declare(self.pipeline, "by_host_class")
        if (
            self.share_classes
            and by_class
            and self.snapshot.journal is not None
            and _is_tiered(type(self.latency))
        ):
            parts = self.pipeline._carried.parts_of(
                self.request, functools.partial(_carried_parts, self.pipeline, self.request)
            )
            if parts is not None:
                model = cast(TieredLatencyModel, self.latency)
                chosen = decide(self.pipeline._carried, parts, self.request, self.snapshot, model)
                if chosen is not None:
                    free = chosen.host.free_slot_count()
                    proposal = Proposal(chosen.host, free, chosen.takes, chosen.rule)
                    decided = self.bind(proposal, chosen.total)
                    return PlacementResult(decided, self._explain_every_host, ())
        self._setup()
        if self.prepared.rejected:
            return _rejected(self.snapshot, self.prepared.rejected)
        hosts = self.snapshot.hosts
        pinned = self._pinned_only()
        if pinned is not None:
            visited, shared = pinned
            self.host_stops[0] += shared
            outcomes = [self.filter_and_select(hosts[host]) for host in visited]
        elif self.share_classes and by_class and self.chooser is not None:
            outcomes, shared = self._filter_and_select_by_class()
            if shared and not any(outcome.proposals for outcome in outcomes):
                # Nothing fits: the account of why covers every host, host by host.
                return _Run(
                    self.pipeline, self.request, self.snapshot, self.latency, share_classes=False
                ).result()
        else:
            outcomes = [self.filter_and_select(hosts[host]) for host in self.snapshot.host_ids()]
            shared = 0
        proposals = [p for outcome in outcomes for p in outcome.proposals]
        totals, by_plugin = self.score(proposals)
        best: dict[str, tuple[float, int]] = {}
        for index, proposal in enumerate(proposals):
            host = proposal.host.host
            if host not in best or totals[index] > best[host][0]:
                best[host] = (totals[index], index)
        room = self.room
        winner = min(
            best.items(),
            key=lambda item: (-item[1][0], room(proposals[item[1][1]].host), item[0]),
            default=None,
        )
        placement = None
        if winner is not None:
            total, index = winner[1]
            placement = self.bind(proposals[index], total)
        unsatisfied = () if placement is not None else tuple(self.unsatisfied(outcomes))
        if shared:
            # Hosts were skipped as alike; an explanation covers every host, so it is
            # made by a run that looks at each (only when read: a compose never reads it).
            return PlacementResult(placement, self._explain_every_host, unsatisfied)
        return PlacementResult(
            placement, lambda: self.report(outcomes, best, proposals, by_plugin), unsatisfied
        )

    def _pinned_only(self) -> tuple[list[str], int] | None:
        """For a request pinned to a host whose first host filter is the pin: the hosts
        worth looking at (the pinned one, if the snapshot has it) and how many others the
        pin drops unseen. The pin explains nothing of those (see
        :class:`~dxpool.broker.placement.plugins.hosts.PinnedHost`), so the decision and
        its unsatisfied lines are those of a run over every host; the per-host account
        is made by such a run when read. None when the run must look at every host."""
        host = self.request.host
        if (
            host is None
            or not self.share_classes
            or not self.host_filters
            or not isinstance(self.host_filters[0], PinnedHost)
        ):
            return None
        visited = [host] if host in self.snapshot.hosts else []
        return visited, len(self.snapshot.hosts) - len(visited)

    def _explain_every_host(self) -> Candidates:
        full = _Run(self.pipeline, self.request, self.snapshot, self.latency, share_classes=False)
        return full.result().candidates

    def _filter_and_select_by_class(self) -> tuple[list[_HostOutcome], int]:
        """The chooser's proposals made once per host class: hosts with the same latency
        class and the same free slot count get the same proposals and scores, and only
        the first of them by id can win (ties go to the lower id). Hosts the host filters
        drop are skipped without a record. Hosts are looked at by (room, id), so the first
        of a group is the one a tie goes to. Returns the outcomes of the hosts looked at
        and how many were skipped; when none got a proposal the caller asks a full run
        for the account of why."""
        chooser = self.chooser
        assert chooser is not None
        hosts = self.snapshot.hosts
        served: set[tuple[int, int]] = set()
        outcomes: list[_HostOutcome] = []
        shared = 0
        for host_id in _by_room(self.snapshot):
            host = hosts[host_id]
            if self.host_filter_failure(host) is not None:
                shared += 1  # dropped: only an explanation (a full run) says why
                continue
            try:
                key: tuple[int, int] | None = (
                    chooser.host_class(host.place),
                    host.free_slot_count(),
                )
            except Exception:
                key = None  # filter_and_select goes pair by pair and reports it
            if key in served:
                shared += 1
                continue
            outcome = self.filter_and_select(host)
            outcomes.append(outcome)
            if outcome.proposals and key is not None:
                served.add(key)
        return outcomes, shared

    def host_filter_failure(self, host: HostInfo) -> tuple[int, Status] | None:
        """The first host filter that drops ``host`` (its index and status), or None."""
        request = self.request
        for index, plugin in enumerate(self.host_filters):
            try:
                status = plugin.filter_host(request, host)
            except Exception as error:
                status = failure(plugin.name, error)
            if status.code is not Code.SUCCESS:
                return index, status
        return None

    def filter_and_select(self, host: HostInfo) -> _HostOutcome:
        request = self.request
        dropped = self.host_filter_failure(host)
        if dropped is not None:
            index, status = dropped
            self.host_stops[index] += 1
            if status.code is not Code.ERROR:  # errors are reported per host
                self.host_failures[self.host_filters[index].name].append(host)
            return _HostOutcome(host, status, [])
        if self.chooser is not None:
            tiered = self.choose_tiered(host, self.chooser)
            if tiered is not None:
                return tiered
        links, nearest, errors = self.links(host)
        if len(links) == len(self.supply.boxes):
            reach = self.supply.usable
        else:
            reach = sum(supply.available for _, supply in links)
        self.note_reach(reach, host.host)
        proposals = []
        if reach >= request.count:
            proposals = selection.propose(
                host,
                host.free_slot_count(),
                request.count,
                links,
                same_switch=request.same_switch,
            )
        if proposals:
            return _HostOutcome(host, SUCCESS, proposals)
        if reach >= request.count and request.same_switch:
            most = selection.most_in_one_switch(links)
            return self.no_switch_holds(host, most)
        status = Status.unschedulable(
            unreached_host_reason(request, reach, nearest, errors), plugin="selection"
        )
        return _HostOutcome(host, status, proposals)

    def note_reach(self, reach: int, host_id: str) -> None:
        """Keep the host reaching the most GPUs for the account, the lowest id among
        equals: the line then names the same host whatever order hosts were looked at in
        (by id, or by room when hosts alike are served once)."""
        best = self.best_reach
        if best is None or (-reach, host_id) < (-best[0], best[1]):
            self.best_reach = (reach, host_id)

    def no_switch_holds(self, host: HostInfo, most: tuple[int, str] | None) -> _HostOutcome:
        """The outcome of a host that reaches enough GPUs, but no switch's boxes among
        them hold the node (switch affinity); ``most`` is the switch holding the most."""
        held, name = most if most is not None else (0, "none")
        best = self.best_switch
        if best is None or (-held, host.host) < (-best[0], best[2]):
            self.best_switch = (held, name, host.host)  # the most held, then the lowest id
        reason = switch_reason(self.request, held, name)
        return _HostOutcome(host, Status.unschedulable(reason, plugin="selection"), [])

    def choose_tiered(self, host: HostInfo, chooser: TieredChooser) -> _HostOutcome | None:
        """What the chooser gives ``host``, as the pair-by-pair path would record and
        explain it; None when the model failed for the host (the caller then goes pair by
        pair, which reports the failure)."""
        try:
            choice = chooser.choose(host.place)
            dropped = None
            if choice.dropped is not None:
                supply = choice.dropped[1]
                estimate = self.latency.round_trip(host.place, supply.box.place)
                dropped = DroppedLink(host, supply.box, estimate, supply.available)
        except Exception:
            return None
        reach = choice.reach
        no_switch = not choice.options and reach >= self.request.count
        if no_switch and not self.request.same_switch:
            return None  # cannot happen with a model that keeps its contract
        if dropped is not None:
            self.nearest_dropped[self.link_filters[0].name].append(dropped)
        self.note_reach(reach, host.host)
        if choice.options:
            free = host.free_slot_count()
            proposals = [Proposal(host, free, takes, rule) for rule, takes in choice.options]
            return _HostOutcome(host, SUCCESS, proposals)
        if no_switch:
            return self.no_switch_holds(host, choice.switch)
        reason = unreached_host_reason(self.request, reach, dropped, [])
        return _HostOutcome(host, Status.unschedulable(reason, plugin="selection"), [])

    def host_reached(self, index: int) -> int:
        """How many hosts the ``index``-th host filter was asked about."""
        return len(self.snapshot.hosts) - sum(self.host_stops[:index])

    def links(self, host: HostInfo) -> tuple[list[selection.Link], DroppedLink | None, list[str]]:
        """The host's view of the supply: (latency, supply) for every box it may use."""
        round_trip = self.latency.round_trip
        place = host.place
        link_filters = self.link_filters
        if not link_filters:  # no pair is filtered
            fast: list[selection.Link] | None
            try:
                boxes = self.supply.boxes
                fast = [(round_trip(place, s.box.place).round_trip_ns, s) for s in boxes]
            except Exception:
                fast = None  # the loop below finds and records the pair that failed
            if fast is not None:
                return fast, None, []
        links: list[selection.Link] = []
        nearest: dict[str, DroppedLink] = {}
        errors: list[str] = []
        for supply in self.supply.boxes:
            box = supply.box
            try:
                estimate = round_trip(place, box.place)
            except Exception as error:
                errors.append(
                    f"latency hosts/{host.host} to boxes/{box.box}: {type(error).__name__}: {error}"
                )
                continue
            if link_filters and not self.link_passes(host, supply, estimate, nearest, errors):
                continue
            links.append((estimate.round_trip_ns, supply))
        for name, link in nearest.items():
            self.nearest_dropped[name].append(link)
        self.link_errors.extend(errors)
        first = min(nearest.values(), key=lambda link: link.estimate.round_trip_ns, default=None)
        return links, first, errors

    def link_passes(
        self,
        host: HostInfo,
        supply: BoxSupply,
        estimate: LatencyEstimate,
        nearest: dict[str, DroppedLink],
        errors: list[str],
    ) -> bool:
        """Runs the link filters on one (host, box) pair; records the nearest drop per
        filter in ``nearest`` and plugin failures in ``errors``."""
        for plugin in self.link_filters:
            try:
                status = plugin.filter_link(self.request, host, supply.box, estimate)
            except Exception as error:
                status = failure(plugin.name, error)
            if status.code is Code.SUCCESS:
                continue
            if status.code is Code.ERROR:
                errors.append(status.message())
                return False
            seen = nearest.get(plugin.name)
            if seen is None or estimate.round_trip_ns < seen.estimate.round_trip_ns:
                nearest[plugin.name] = DroppedLink(host, supply.box, estimate, supply.available)
            return False
        return True

    def score(self, proposals: Sequence[Proposal]) -> tuple[list[float], list[list[float]]]:
        """Weighted totals (0-100) per proposal, and per score plugin the normalized
        scores of every proposal (bounded to 0-100)."""
        scores = self.pipeline.scores
        weight_sum = sum(score.weight for score in scores) or 1.0
        totals = [0.0] * len(proposals)
        by_plugin: list[list[float]] = []
        if not proposals:
            return totals, by_plugin
        request = self.request
        for weighted in scores:
            plugin = weighted.plugin
            try:
                rate = plugin.score
                raw = [rate(request, proposal) for proposal in proposals]
                normalized = plugin.normalize(raw)
            except Exception as error:
                raise PluginError(plugin.name, error) from error
            if len(normalized) != len(raw):
                raise PluginError(
                    plugin.name,
                    ValueError(f"normalize returned {len(normalized)} scores for {len(raw)}"),
                )
            bounded = [
                value if 0.0 <= value <= MAX_SCORE else min(max(value, 0.0), MAX_SCORE)
                for value in normalized
            ]
            weight = weighted.weight
            totals = [total + weight * value for total, value in zip(totals, bounded, strict=True)]
            by_plugin.append(bounded)
        return [round(total / weight_sum, _SCORE_DIGITS) for total in totals], by_plugin

    def breakdown(self, by_plugin: Sequence[Sequence[float]], index: int) -> list[str]:
        """``"latency 100 x3"`` per score plugin, for the proposal at ``index``."""
        return [
            f"{weighted.plugin.name} {by_plugin[k][index]:.0f} x{weighted.weight:g}"
            for k, weighted in enumerate(self.pipeline.scores)
        ]

    def bind(self, proposal: Proposal, total: float) -> Placement:
        """Bindings for the proposal: the lowest GPU slots of each box, nearest box first,
        on the host's lowest free proxy slots in the same order."""
        host_slots = iter(proposal.host.free_slots())
        bindings = tuple(
            Binding(
                gpu=gpu.name,
                box=gpu.box,
                slot=gpu.slot,
                model=gpu.model,
                host_slot=next(host_slots),
                latency_ns=take.latency_ns,
            )
            for take in proposal.takes
            for gpu in take.supply.gpus[: take.count]
        )
        return Placement(proposal.host.host, bindings, total)

    def report(
        self,
        outcomes: Sequence[_HostOutcome],
        best: dict[str, tuple[float, int]],
        proposals: Sequence[Proposal],
        by_plugin: Sequence[Sequence[float]],
    ) -> tuple[CandidateReport, ...]:
        """Why each host was kept or dropped; made only when someone reads it."""
        kept: list[CandidateReport] = []
        dropped: list[CandidateReport] = []
        for outcome in outcomes:
            name = outcome.host.host
            if name in best:
                total, index = best[name]
                chosen = proposals[index]
                reasons = (
                    f"gpus {chosen.describe()} ({_rule_of(chosen)})",
                    *self.breakdown(by_plugin, index),
                )
                kept.append(CandidateReport(name, True, reasons, total))
            else:
                reasons = outcome.status.reasons or (f"dropped by {outcome.status.plugin}",)
                dropped.append(CandidateReport(name, False, reasons, 0.0))
        room = self.room
        hosts = self.snapshot.hosts
        kept.sort(key=lambda report: (-report.score, room(hosts[report.host]), report.host))
        dropped.sort(key=lambda report: report.host)  # hosts may be visited by room
        return (*kept, *dropped)

    def unsatisfied(self, outcomes: Sequence[_HostOutcome]) -> list[str]:
        """One line per constraint that stood in the way, each with the closest thing."""
        lines: list[str] = []
        funnel = self.supply.funnel
        usable = funnel[-1].count if funnel else 0
        if usable < self.request.count:
            lines.append(supply_line(self.request, funnel))
        for index, plugin in enumerate(self.host_filters):
            failed = self.host_failures[plugin.name]
            if failed:
                line = guarded_text(
                    plugin.name, plugin.explain, self.request, failed, self.host_reached(index)
                )
                if line:
                    lines.append(line)
        if usable >= self.request.count:
            for link_filter in self.link_filters:
                nearest = self.nearest_dropped[link_filter.name]
                if nearest:
                    explain = link_filter.explain
                    line = guarded_text(link_filter.name, explain, self.request, nearest)
                    if line:
                        lines.append(line)
            if self.link_errors:
                lines.append(link_error_line(self.link_errors))
            if self.best_reach is not None and self.best_reach[0] < self.request.count:
                lines.append(reach_line(self.request, *self.best_reach))
            elif self.best_switch is not None:
                lines.append(switch_line(self.request, *self.best_switch))
        for outcome in outcomes:
            if outcome.status.code is Code.ERROR:
                lines.append(f"hosts/{outcome.host.host}: {outcome.status.message()}")
        return lines or [f"no host can take {self.request.count} GPUs"]


def _rule_of(proposal: Proposal) -> str:
    """The proposal's rule as explained: ``nearest-switch`` names its switch."""
    if proposal.rule != selection.NEAREST_SWITCH or not proposal.takes:
        return proposal.rule
    switch = selection.switch_of(proposal.takes[0].supply.box)
    return f"{proposal.rule} {selection.switch_name(switch)}"


@functools.cache
def _is_tiered(model_type: type) -> bool:
    """Whether a latency model's class ranks boxes in bulk (checked once per class)."""
    return all(
        callable(getattr(model_type, method, None))
        for method in ("host_class", "box_class", "ranking")
    )


def _rejected(snapshot: Snapshot, reasons: tuple[str, ...]) -> PlacementResult:
    """A result with no placement: every host dropped for the request-wide ``reasons``."""
    candidates = tuple(CandidateReport(host, False, reasons, 0.0) for host in snapshot.host_ids())
    return PlacementResult(None, candidates, reasons)


def _by_room(snapshot: Snapshot) -> tuple[str, ...]:
    """Every host id by (room, id): the order ties between hosts go in."""

    def ordered() -> tuple[str, ...]:
        hosts = snapshot.hosts
        room = snapshot.resource_scale().room
        return tuple(sorted(hosts, key=lambda host: (room(hosts[host]), host)))

    return snapshot.derived("hosts by room", ordered)
