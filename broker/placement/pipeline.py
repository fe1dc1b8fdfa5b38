"""The placement pipeline: runs the phases of :mod:`~dxpool.broker.placement.framework`
over one snapshot and explains the outcome.

A run is a pure function of (request, snapshot, latency model, plugins): it reads the
snapshot, never mutates it, and breaks every tie by name, so the same inputs always give
the same placement and the same explanation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dxpool.broker.placement import selection
from dxpool.broker.placement.explain import (
    FunnelStage,
    link_error_line,
    reach_line,
    supply_line,
    unreached_host_reason,
)
from dxpool.broker.placement.framework import (
    MAX_SCORE,
    BoxFilterPlugin,
    BoxSupply,
    DroppedLink,
    FilterPlugin,
    GpuFilterPlugin,
    HostFilterPlugin,
    LinkFilterPlugin,
    Plugin,
    PreFilterPlugin,
    Proposal,
    ScorePlugin,
)
from dxpool.broker.placement.model import (
    Binding,
    BoxInfo,
    CandidateReport,
    GpuInfo,
    HostInfo,
    LatencyEstimate,
    LatencyModel,
    Place,
    Placement,
    PlacementRequest,
    PlacementResult,
    Snapshot,
)
from dxpool.broker.placement.status import Code, Status

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
    not a positive finite number.
    """

    pre_filters: tuple[PreFilterPlugin, ...] = ()
    gpu_filters: tuple[GpuFilterPlugin, ...] = ()
    box_filters: tuple[BoxFilterPlugin, ...] = ()
    host_filters: tuple[HostFilterPlugin, ...] = ()
    link_filters: tuple[LinkFilterPlugin, ...] = ()
    scores: tuple[WeightedScore, ...] = ()

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
        except _PluginError as failure:
            reason = f"internal: placement plugin {failure.plugin} failed: {failure.error}"
            return _rejected(snapshot, (reason,))


class _PluginError(Exception):
    """A plugin raised in a phase that concerns every host; the run cannot go on."""

    def __init__(self, plugin: str, error: BaseException) -> None:
        super().__init__(plugin, error)
        self.plugin = plugin
        self.error = f"{type(error).__name__}: {error}"


@dataclass
class _HostOutcome:
    """What happened to one host in this run."""

    host: HostInfo
    status: Status = field(default_factory=Status)
    proposals: list[Proposal] = field(default_factory=list)


class _Run:
    """The state of one placement (like a scheduling cycle's state)."""

    def __init__(
        self,
        pipeline: Pipeline,
        request: PlacementRequest,
        snapshot: Snapshot,
        latency: LatencyModel,
    ) -> None:
        self.pipeline = pipeline
        self.request = request
        self.snapshot = snapshot
        self.latency = latency
        self.gpu_filters = [f for f in pipeline.gpu_filters if _applies(f, request)]
        self.box_filters = [f for f in pipeline.box_filters if _applies(f, request)]
        self.host_filters = [f for f in pipeline.host_filters if _applies(f, request)]
        self.link_filters = [f for f in pipeline.link_filters if _applies(f, request)]
        self.funnel: list[FunnelStage] = []
        self.supplies: list[BoxSupply] = []
        self.supply_places: list[tuple[BoxSupply, Place]] = []
        self.usable = 0  # GPUs in the supply
        self.host_failures: dict[str, list[HostInfo]] = {f.name: [] for f in self.host_filters}
        self.host_reached: dict[str, int] = {f.name: 0 for f in self.host_filters}
        self.nearest_dropped: dict[str, list[DroppedLink]] = {f.name: [] for f in self.link_filters}
        self.link_errors: list[str] = []
        self.best_reach: tuple[int, str] | None = None  # (GPUs within reach, host id)

    # -- phases ------------------------------------------------------------------------

    def result(self) -> PlacementResult:
        rejected = self.pre_filter()
        if rejected:
            return _rejected(self.snapshot, rejected)
        self.build_supply()
        outcomes = [
            self.filter_and_select(self.snapshot.hosts[h]) for h in sorted(self.snapshot.hosts)
        ]
        proposals = [p for outcome in outcomes for p in outcome.proposals]
        totals, by_plugin = self.score(proposals)
        best: dict[str, tuple[float, int]] = {}
        for index, proposal in enumerate(proposals):
            host = proposal.host.host
            if host not in best or totals[index] > best[host][0]:
                best[host] = (totals[index], index)
        winner = min(best.items(), key=lambda item: (-item[1][0], item[0]), default=None)
        placement = None
        if winner is not None:
            total, index = winner[1]
            placement = self.bind(proposals[index], total)
        candidates = self.report(outcomes, best, proposals, by_plugin)
        unsatisfied = () if placement is not None else tuple(self.unsatisfied(outcomes))
        return PlacementResult(placement, candidates, unsatisfied)

    def pre_filter(self) -> tuple[str, ...]:
        reasons: list[str] = []
        for plugin in self.pipeline.pre_filters:
            status = _guarded(plugin.name, plugin.pre_filter, self.request, self.snapshot)
            if status.code is not Code.SUCCESS:
                reasons.extend(status.reasons or (f"rejected by {plugin.name}",))
        return tuple(reasons)

    def build_supply(self) -> None:
        """Runs the box filters, then the GPU filters on the GPUs of the boxes kept, and
        counts what each stage leaves. The supply is ordered by (usable GPUs, box id)."""
        request = self.request
        snapshot = self.snapshot
        boxes: list[BoxInfo] = []
        pool = 0
        for box_id in sorted(snapshot.gpus_by_box):
            pool += len(snapshot.gpus_by_box[box_id])
            box = snapshot.boxes.get(box_id)
            if box is not None and all(self.box_passes(plugin, box) for plugin in self.box_filters):
                boxes.append(box)
        gpus = [gpu for box in boxes for gpu in snapshot.gpus_by_box[box.box]]
        labels = [plugin.label(request) for plugin in self.box_filters]
        self.funnel.append(FunnelStage("in the pool", pool, None))
        self.funnel.append(
            FunnelStage(" and ".join(labels) or "in registered boxes", len(gpus), None)
        )
        inputs: list[list[GpuInfo]] = []
        for plugin in self.gpu_filters:
            inputs.append(gpus)
            gpus = self.gpu_stage(plugin, gpus)
        if len(gpus) < request.count:
            self.add_hints(inputs)
        by_box: dict[str, list[GpuInfo]] = {}
        for gpu in gpus:
            by_box.setdefault(gpu.box, []).append(gpu)
        supplies = [
            BoxSupply(box, tuple(sorted(by_box[box.box], key=_slot)))
            for box in boxes
            if box.box in by_box
        ]
        supplies.sort(key=lambda supply: (supply.available, supply.box.box))
        self.supplies = supplies
        self.supply_places = [(supply, supply.box.place) for supply in supplies]
        self.usable = len(gpus)

    def gpu_stage(self, plugin: GpuFilterPlugin, gpus: list[GpuInfo]) -> list[GpuInfo]:
        """The GPUs ``plugin`` keeps of ``gpus``; records the stage."""
        request = self.request
        keep = plugin.filter_gpu
        success = Code.SUCCESS
        try:
            kept = [gpu for gpu in gpus if keep(request, gpu).code is success]
            label = plugin.label(request)
        except Exception as error:
            raise _PluginError(plugin.name, error) from error
        self.funnel.append(FunnelStage(label, len(kept), None))
        return kept

    def add_hints(self, inputs: Sequence[list[GpuInfo]]) -> None:
        """When the supply is short, asks each GPU filter for the closest thing among the
        GPUs it dropped (``inputs[i]`` is what the i-th filter was given)."""
        request = self.request
        offset = len(self.funnel) - len(inputs)
        for index, (plugin, gpus) in enumerate(zip(self.gpu_filters, inputs, strict=True)):
            try:
                dropped = [
                    g for g in gpus if plugin.filter_gpu(request, g).code is not Code.SUCCESS
                ]
                closest = plugin.closest(request, dropped) if dropped else None
            except Exception as error:
                raise _PluginError(plugin.name, error) from error
            stage = self.funnel[offset + index]
            self.funnel[offset + index] = FunnelStage(stage.label, stage.count, closest)

    def box_passes(self, plugin: BoxFilterPlugin, box: BoxInfo) -> bool:
        status = _guarded(plugin.name, plugin.filter_box, self.request, box)
        if status.code is Code.ERROR:
            raise _PluginError(plugin.name, RuntimeError(status.message()))
        return status.code is Code.SUCCESS

    def filter_and_select(self, host: HostInfo) -> _HostOutcome:
        outcome = _HostOutcome(host)
        for plugin in self.host_filters:
            self.host_reached[plugin.name] += 1
            status = _guarded(plugin.name, plugin.filter_host, self.request, host)
            if status.code is not Code.SUCCESS:
                if status.code is not Code.ERROR:  # errors are reported per host
                    self.host_failures[plugin.name].append(host)
                outcome.status = status
                return outcome
        links, nearest, errors = self.links(host)
        if len(links) == len(self.supplies):
            reach = self.usable
        else:
            reach = sum(supply.available for _, supply in links)
        if self.best_reach is None or reach > self.best_reach[0]:
            self.best_reach = (reach, host.host)  # hosts come by id: the first best stays
        if reach >= self.request.count:
            outcome.proposals = selection.propose(
                host, host.free_slot_count(), self.request.count, links
            )
        if not outcome.proposals:
            outcome.status = Status.unschedulable(
                unreached_host_reason(self.request, reach, nearest, errors), plugin="selection"
            )
        return outcome

    def links(self, host: HostInfo) -> tuple[list[selection.Link], DroppedLink | None, list[str]]:
        """The host's view of the supply: (latency, supply) for every box it may use."""
        round_trip = self.latency.round_trip
        place = host.place
        link_filters = self.link_filters
        if not link_filters:  # the common case, kept lean: no pair is filtered
            fast: list[selection.Link] | None
            try:
                fast = [(round_trip(place, p).round_trip_ns, s) for s, p in self.supply_places]
            except Exception:
                fast = None  # the loop below finds and records the pair that failed
            if fast is not None:
                return fast, None, []
        links: list[selection.Link] = []
        nearest: dict[str, DroppedLink] = {}
        errors: list[str] = []
        for supply in self.supplies:
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
            status = _guarded(
                plugin.name, plugin.filter_link, self.request, host, supply.box, estimate
            )
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
        for weighted in scores:
            plugin = weighted.plugin
            try:
                raw = [plugin.score(self.request, proposal) for proposal in proposals]
                normalized = plugin.normalize(raw)
            except Exception as error:
                raise _PluginError(plugin.name, error) from error
            if len(normalized) != len(raw):
                raise _PluginError(
                    plugin.name,
                    ValueError(f"normalize returned {len(normalized)} scores for {len(raw)}"),
                )
            bounded = [min(max(value, 0.0), MAX_SCORE) for value in normalized]
            for index, value in enumerate(bounded):
                totals[index] += weighted.weight * value
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
        kept: list[CandidateReport] = []
        dropped: list[CandidateReport] = []
        for outcome in outcomes:
            name = outcome.host.host
            if name in best:
                total, index = best[name]
                chosen = proposals[index]
                reasons = (
                    f"gpus {chosen.describe()} ({chosen.rule})",
                    *self.breakdown(by_plugin, index),
                )
                kept.append(CandidateReport(name, True, reasons, total))
            else:
                reasons = outcome.status.reasons or (f"dropped by {outcome.status.plugin}",)
                dropped.append(CandidateReport(name, False, reasons, 0.0))
        kept.sort(key=lambda report: (-report.score, report.host))
        return (*kept, *dropped)

    def unsatisfied(self, outcomes: Sequence[_HostOutcome]) -> list[str]:
        """One line per constraint that stood in the way, each with the closest thing."""
        lines: list[str] = []
        usable = self.funnel[-1].count if self.funnel else 0
        if usable < self.request.count:
            lines.append(supply_line(self.request, self.funnel))
        for plugin in self.host_filters:
            failed = self.host_failures[plugin.name]
            if failed:
                line = _guarded_text(
                    plugin.name,
                    plugin.explain,
                    self.request,
                    failed,
                    self.host_reached[plugin.name],
                )
                if line:
                    lines.append(line)
        if usable >= self.request.count:
            for link_filter in self.link_filters:
                nearest = self.nearest_dropped[link_filter.name]
                if nearest:
                    line = _guarded_text(
                        link_filter.name, link_filter.explain, self.request, nearest
                    )
                    if line:
                        lines.append(line)
            if self.link_errors:
                lines.append(link_error_line(self.link_errors))
            if self.best_reach is not None and self.best_reach[0] < self.request.count:
                lines.append(reach_line(self.request, *self.best_reach))
        for outcome in outcomes:
            if outcome.status.code is Code.ERROR:
                lines.append(f"hosts/{outcome.host.host}: {outcome.status.message()}")
        return lines or [f"no host can take {self.request.count} GPUs"]


def _applies(plugin: FilterPlugin, request: PlacementRequest) -> bool:
    try:
        return plugin.applies(request)
    except Exception as error:
        raise _PluginError(plugin.name, error) from error


def _guarded(plugin: str, call: Callable[..., Status], *args: object) -> Status:
    """Calls a plugin phase; an exception becomes an ERROR status naming the plugin."""
    try:
        return call(*args)
    except Exception as error:
        return Status.error(
            f"placement plugin {plugin} failed: {type(error).__name__}: {error}", plugin=plugin
        )


def _guarded_text(plugin: str, call: Callable[..., str | None], *args: object) -> str | None:
    try:
        return call(*args)
    except Exception as error:
        return f"placement plugin {plugin} could not explain: {type(error).__name__}: {error}"


def _rejected(snapshot: Snapshot, reasons: tuple[str, ...]) -> PlacementResult:
    """A result with no placement: every host dropped for the request-wide ``reasons``."""
    candidates = tuple(
        CandidateReport(host, False, reasons, 0.0) for host in sorted(snapshot.hosts)
    )
    return PlacementResult(None, candidates, reasons)


def _slot(gpu: GpuInfo) -> int:
    return gpu.slot
