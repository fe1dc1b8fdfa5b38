"""The placement pipeline: runs the phases of :mod:`~dxpool.broker.placement.framework`
over one snapshot and explains the outcome.

A run is a pure function of (request, snapshot, latency model, plugins): it reads the
snapshot, never mutates it, and breaks every tie by name, so the same inputs always give
the same placement and the same explanation.

Placement sits on the compose path, so a run does no work it can avoid, none of which
changes what it answers:

- what it works out before looking at hosts (the filters that apply, the pre-filters'
  verdict, the supply) is remembered by the snapshot, for the next run on it;
- box and GPU filter verdicts are remembered by the pipeline per request and box, and
  reused for a new snapshot that holds the same box objects (see
  :class:`~dxpool.broker.placement.supply.BoxVerdicts`);
- with a :class:`~dxpool.fabric.latency.TieredLatencyModel` and no link filter, boxes
  are chosen once per class of host by walking the model's ranking nearest tier first
  (:mod:`~dxpool.broker.placement.tiered`), instead of asking for every (host, box)
  pair;
- a result explains each candidate only when its ``candidates`` are read (a plan reads
  them, a compose does not); what a failed placement answers in ``unsatisfied`` is made
  at once.
- for a snapshot with a journal (the broker's placement index), what it works out before
  looking at hosts is brought forward from the newest one made for an earlier version,
  judging only the boxes and hosts changed since (:mod:`~dxpool.broker.placement.live`),
  with a table of the raw scores of the first host of each group of hosts alike
  (latency class, free slot count; :class:`_GroupTable`); a decision reads that table,
  adds the tightest single box, and totals each distinct tuple of raw scores once
  (``_Run._result_from_table``; ``_Run._result_by_host_group`` visits the groups when
  there is no table).

Plugins must therefore be pure: the same request and candidate give the same verdict.
"""

from __future__ import annotations

import functools
import math
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar, cast

from dxpool.broker.placement import selection
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
    HostFilterPlugin,
    LinkFilterPlugin,
    Plugin,
    PreFilterPlugin,
    Proposal,
    ScorePlugin,
    Take,
    defined_with,
)
from dxpool.broker.placement.guard import PluginError, applying, failure, guarded, guarded_text
from dxpool.broker.placement.live import HostClasses, LiveSupply
from dxpool.broker.placement.model import (
    Binding,
    CandidateReport,
    Candidates,
    ChangeJournal,
    HostInfo,
    LatencyEstimate,
    LatencyModel,
    Placement,
    PlacementRequest,
    PlacementResult,
    Snapshot,
)
from dxpool.broker.placement.plugins.hosts import PinnedHost
from dxpool.broker.placement.status import SUCCESS, Code, Status
from dxpool.broker.placement.supply import BoxVerdicts, Supply, build_supply
from dxpool.broker.placement.tiered import TieredChooser
from dxpool.fabric.latency import Place, TieredLatencyModel

_SCORE_DIGITS = 6  # totals are compared rounded, so float noise never beats a name
_MAX_SCORED = 65536  # raw scores kept by takes, shared along versions; beyond, start afresh


@dataclass(frozen=True, slots=True)
class WeightedScore:
    """A score plugin and the weight of its normalized score in the total."""

    plugin: ScorePlugin
    weight: float


class _LatestPrepared:
    """The newest :class:`_Prepared` per (latency model, request) that follows a journal,
    for the next snapshot to start from. Keeps the 16 requests used last; thread-safe."""

    def __init__(self, max_requests: int = 16) -> None:
        self._lock = threading.Lock()
        self._max = max_requests
        self._by_key: OrderedDict[tuple[int, PlacementRequest], _Prepared] = OrderedDict()

    def get(self, latency: LatencyModel, request: PlacementRequest) -> _Prepared | None:
        with self._lock:
            found = self._by_key.get((id(latency), request))
            if found is None or found.owners[1] is not latency:
                return None
            self._by_key.move_to_end((id(latency), request))
            return found

    def offer(self, latency: LatencyModel, request: PlacementRequest, prepared: _Prepared) -> None:
        """Keeps ``prepared`` unless a newer version of the same journal is kept."""
        live = prepared.live
        if live is None:
            return
        key = (id(latency), request)
        with self._lock:
            kept = self._by_key.get(key)
            if (
                kept is not None
                and kept.live is not None
                and kept.live.journal is live.journal
                and kept.live.version >= live.version
            ):
                return
            self._by_key[key] = prepared
            self._by_key.move_to_end(key)
            if len(self._by_key) > self._max:
                self._by_key.popitem(last=False)


@dataclass(frozen=True)
class Pipeline:
    """The plugins of each phase, in the order they run, and the score weights.

    Construction raises ``ValueError`` for two plugins of one name or a weight that is
    not a positive finite number. A pipeline remembers its filters' verdicts per request
    (see the module docstring); it is safe to share between threads.
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
    _latest: _LatestPrepared = field(
        default_factory=_LatestPrepared, init=False, repr=False, compare=False
    )

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
    live: _Live | None = None  # what a later snapshot of the same inventory starts from


@dataclass(frozen=True, slots=True)
class _Live:
    """The parts of a :class:`_Prepared` that follow the inventory change by change
    (see :mod:`~dxpool.broker.placement.live`), and the version they are as of.

    ``proposals`` memoizes, per host group, the proposals of its first host and their
    raw scores; an entry is used only while the chooser's options and the host are the
    very objects it was made from; it is copied into the next version. ``scored`` keeps
    raw scores by takes and free slot count (see :func:`_propose`); an entry depends on
    its key alone (the takes' supplies by identity, which the entry keeps alive, and
    supplies never change), so the next version shares it rather than copying up to
    ``_MAX_SCORED`` entries per change, until it holds that many.
    ``table`` is the groups' raw scores for this version (None: visit the groups).
    """

    journal: ChangeJournal
    version: int
    supply: LiveSupply
    hosts: HostClasses
    chooser: TieredChooser
    proposals: dict[str, _Proposed]
    scored: dict[tuple[object, ...], _Scored]
    table: _GroupTable | None = None


@dataclass(frozen=True, slots=True)
class _Proposed:
    """The raw scores of a host's proposals made from ``options``, one tuple per option
    with one score per score plugin."""

    host: HostInfo
    options: list[selection.Option]
    raws: list[tuple[float, ...]]


def _prepared_for(
    pipeline: Pipeline, request: PlacementRequest, snapshot: Snapshot, latency: LatencyModel
) -> _Prepared:
    """What a run on ``snapshot`` starts from: brought forward from the newest one made
    for an earlier version of the same inventory when the journal says what changed
    since, else made from the snapshot alone. Either way the same answer."""
    journal = snapshot.journal
    if journal is not None:
        advanced = _brought_forward(pipeline, request, snapshot, latency, request)
        if advanced is None and request.host is not None:
            advanced = _pinned_from_unpinned(pipeline, request, snapshot, latency)
        if advanced is not None:
            pipeline._latest.offer(latency, request, advanced)
            return advanced
    prepared = _prepare(pipeline, request, snapshot, latency)
    pipeline._latest.offer(latency, request, prepared)
    return prepared


def _brought_forward(
    pipeline: Pipeline,
    request: PlacementRequest,
    snapshot: Snapshot,
    latency: LatencyModel,
    made_for: PlacementRequest,
) -> _Prepared | None:
    """The newest preparation for ``made_for`` brought up to ``snapshot`` for
    ``request`` (the same request, or the one it pins), or None."""
    base = pipeline._latest.get(latency, made_for)
    live = base.live if base is not None else None
    if (
        base is None
        or live is None
        or live.journal is not snapshot.journal
        or live.version > snapshot.version
        or snapshot.journal is None
    ):
        return None
    changes = snapshot.journal.changed_since(live.version, snapshot.version)
    if changes is None:
        return None
    return _advance(pipeline, base, live, request, snapshot, changes)


def _pinned_from_unpinned(
    pipeline: Pipeline, request: PlacementRequest, snapshot: Snapshot, latency: LatencyModel
) -> _Prepared | None:
    """A pinned request's preparation from the same request unpinned (a compose re-placed
    on the host it waited for, after another compose changed the inventory): box and GPU
    filters judge whatever the host, so the supply and the chooser are the same, and the
    pin keeps one host, so only that host is filtered. None when the unpinned one is not
    at hand, or no host filter of the pipeline enforces the pin."""
    assert request.host is not None
    unpinned = replace(request, host=None)
    base = _brought_forward(pipeline, unpinned, snapshot, latency, unpinned)
    if base is None or base.live is None:
        return None
    pipeline._latest.offer(latency, unpinned, base)
    host_filters = applying(pipeline.host_filters, request)
    if not any(isinstance(plugin, PinnedHost) for plugin in host_filters):
        return None
    for plugin in pipeline.pre_filters:
        try:
            if plugin.pre_filter(request, snapshot).code is not Code.SUCCESS:
                return None
        except Exception:
            return None
    live = base.live
    try:
        hosts = HostClasses.build_for(
            snapshot,
            (request.host,),
            functools.partial(_host_dropped, host_filters, request),
            _host_class_of(live.chooser),
        )
    except Exception:
        return None
    scored: dict[tuple[object, ...], _Scored] = {}
    plugins = [weighted.plugin for weighted in pipeline.scores]
    table = _GroupTable.made(None, request, snapshot, hosts, live.chooser, plugins, scored)
    pinned = _Live(live.journal, live.version, live.supply, hosts, live.chooser, {}, scored, table)
    return _Prepared(
        base.owners,
        base.gpu_filters,
        base.box_filters,
        host_filters,
        applying(pipeline.link_filters, request),
        (),
        live.supply.supply,
        live.chooser,
        pinned,
    )


def _advance(
    pipeline: Pipeline,
    base: _Prepared,
    live: _Live,
    request: PlacementRequest,
    snapshot: Snapshot,
    changes: tuple[frozenset[str], frozenset[str]],
) -> _Prepared | None:
    """``base`` brought up to ``snapshot``, judging only the boxes and hosts changed;
    None when it must be made from the snapshot alone (a pre-filter now rejects, the
    supply ran short, a plugin failed)."""
    for plugin in pipeline.pre_filters:
        try:
            status = plugin.pre_filter(request, snapshot)
        except Exception:
            return None
        if status.code is not Code.SUCCESS:
            return None
    changed_boxes, changed_hosts = changes
    removed: list[BoxSupply] = []
    added: list[BoxSupply] = []
    supply = live.supply.advance(
        request, snapshot, changed_boxes, base.box_filters, base.gpu_filters, removed, added
    )
    if supply is None:
        return None
    try:
        chooser = live.chooser.advance(removed, added)
        hosts = live.hosts.advance(
            snapshot,
            changed_hosts,
            functools.partial(_host_dropped, base.host_filters, request),
            _host_class_of(chooser),
        )
    except Exception:
        return None  # made again from the snapshot, which finds and reports the failure
    scored = live.scored if len(live.scored) < _MAX_SCORED else {}
    proposals = dict(live.proposals)
    table = _GroupTable.made(
        live.table,
        request,
        snapshot,
        hosts,
        chooser,
        [weighted.plugin for weighted in pipeline.scores],
        scored,
    )
    following = _Live(
        live.journal, snapshot.version, supply, hosts, chooser, proposals, scored, table
    )
    return _Prepared(
        base.owners,
        base.gpu_filters,
        base.box_filters,
        base.host_filters,
        base.link_filters,
        (),
        supply.supply,
        chooser,
        following,
    )


# The tightest single box the chooser gives each host class, as (round trip, index) into
# the (class, box) pairs; see TieredChooser.tightest_near.
_Near = tuple[dict[int, tuple[int, int]], tuple[tuple[int, BoxSupply], ...]]
# A tightest box option for a group: (round trip, index into those pairs, free slots).
_TightKey = tuple[int, int, int]
_Key = TypeVar("_Key", bound=Hashable)


@dataclass(frozen=True, slots=True)
class _GroupTable:
    """The raw scores of every host group's proposals but the tightest single box's,
    for one version: what a decision reads instead of visiting each group.

    ``options`` is, per host class, the first part of the chooser's
    :meth:`~dxpool.broker.placement.tiered.TieredChooser.parts` (the same for every
    host of the class); ``raws`` the raw scores of those options for each group
    (host class, free slot count), whose first host is ``firsts``; ``proposers`` the
    first hosts proposing each distinct raw tuple, by id, and ``lowest`` the first of
    them. ``near`` is the chooser's
    :meth:`~dxpool.broker.placement.tiered.TieredChooser.tightest_near` for the classes
    of ``places`` (None unless ``few``); ``tight_firsts`` the first hosts of the groups
    that get each tightest box option, keyed (round trip, index into the tightest boxes,
    free slots), by id, and ``tight_lowest`` the first of them: the one host per key a
    decision proposes that option for. ``ranking`` is one class's ranking when the
    table was made: the model numbers a class for every new place, which changes every
    ranking, and the chooser then chooses again for every class. Nothing here changes
    once made; :meth:`made` makes the next.
    """

    few: bool  # the chooser answers the tightest box apart (see TieredChooser.parts)
    ranking: tuple[int, object]
    options: dict[int, list[selection.Option]]
    raws: dict[tuple[int, int], tuple[tuple[float, ...], ...]]
    firsts: dict[tuple[int, int], HostInfo]
    places: dict[int, Place]  # a place of a host of each class
    proposers: dict[tuple[float, ...], tuple[str, ...]]
    lowest: dict[tuple[float, ...], str]
    near: _Near | None
    tight_firsts: dict[_TightKey, tuple[str, ...]]
    tight_lowest: dict[_TightKey, str]

    @staticmethod
    def made(
        before: _GroupTable | None,
        request: PlacementRequest,
        snapshot: Snapshot,
        hosts: HostClasses,
        chooser: TieredChooser,
        plugins: Sequence[ScorePlugin],
        scored: dict[tuple[object, ...], _Scored],
    ) -> _GroupTable | None:
        """The table of ``hosts`` and ``chooser``, from ``before`` (the table of the
        groups and chooser they were advanced from): the options of the classes whose
        chooser memo was not carried over (every class when the chooser cannot say, or
        the model numbered a class) are asked again, and only the groups ``hosts``
        touched and those of the classes whose options differ are scored again. None
        when groups must be visited one by one (a host whose class the model could not
        tell, a class with no options); raises what the chooser or a score plugin
        raises."""
        if None in hosts.groups:
            return None
        few = chooser.few_tightest()
        changed = chooser.changed_classes()
        ranking = before.ranking if before is not None else (-1, None)
        if ranking[1] is not None and chooser.model.ranking(ranking[0]) is not ranking[1]:
            changed = None  # a class was numbered since: every walk may have missed it
        if (ranking[1] is None or changed is None) and hosts.groups:
            probe = cast(tuple[int, int], next(iter(hosts.groups)))[0]
            ranking = (probe, chooser.model.ranking(probe))
        table = before or _GroupTable(few, ranking, {}, {}, {}, {}, {}, {}, None, {}, {})
        options = dict(table.options)
        raws = dict(table.raws)
        firsts = dict(table.firsts)
        places = table.places  # shared until a class is added (tightest_near knows it)
        proposers = dict(table.proposers)
        lowest = dict(table.lowest)
        redo = {cast(tuple[int, int], key) for key in (hosts.touched if before else hosts.groups)}
        # the classes whose options may have moved, judged again; equal options (by
        # value) propose the same takes, hence the same raw scores, so their groups stay
        check = list(options) if changed is None else [c for c in changed if c in options]
        moved: set[int] = set()
        for host_class in check:
            again, _ = chooser.parts(places[host_class])
            if again != options[host_class]:
                options[host_class] = again
                moved.add(host_class)
        if moved:
            redo.update(key for key in firsts if key[0] in moved)
        before_firsts: dict[tuple[int, int], HostInfo] = {}
        for key in redo:  # what the groups judged again proposed before
            old = firsts.pop(key, None)
            if old is not None:
                before_firsts[key] = old
                _withdraw(proposers, lowest, old.host, raws.pop(key))
        groups = hosts.groups
        hosts_now = snapshot.hosts
        for key in redo:
            members = groups.get(key)
            if not members:
                continue
            host = hosts_now[members[0]]
            found = options.get(key[0])
            if found is None:
                found, _ = chooser.parts(host.place)
                if not found:
                    return None
                options[key[0]] = found
                if places is table.places:
                    places = dict(places)
                places[key[0]] = host.place
            raws[key] = tuple(_propose(request, host, found, plugins, scored).raws)
            firsts[key] = host
            _enter(proposers, lowest, host.host, raws[key])
        near = chooser.tightest_near(places) if few else None
        tight_firsts, tight_lowest = _tight_firsts(table, near, before_firsts, firsts, redo)
        return _GroupTable(
            few,
            ranking,
            options,
            raws,
            firsts,
            places,
            proposers,
            lowest,
            near,
            tight_firsts,
            tight_lowest,
        )


def _tight_firsts(
    before: _GroupTable,
    near: _Near | None,
    gone: dict[tuple[int, int], HostInfo],
    firsts: dict[tuple[int, int], HostInfo],
    redo: Iterable[tuple[int, int]],
) -> tuple[dict[_TightKey, tuple[str, ...]], dict[_TightKey, str]]:
    """The first hosts of ``firsts``'s groups per tightest box option (see
    :class:`_GroupTable`), by id, and the first of each; empty without ``near``.

    When ``near`` is the mapping ``before`` was made with (the chooser only adds classes
    to it while its tightest boxes stay in the same classes), no group's key changed but
    those judged again (``redo``; ``gone`` their first hosts before), so only those
    move; otherwise every group is counted."""
    if near is None:
        return {}, {}
    nearest = near[0]
    if before.near is not None and nearest is before.near[0]:
        tight_firsts = dict(before.tight_firsts)
        tight_lowest = dict(before.tight_lowest)
        for key, old in gone.items():
            _withdraw(tight_firsts, tight_lowest, old.host, [(*nearest[key[0]], key[1])])
        for key in redo:
            host = firsts.get(key)
            if host is not None:
                _enter(tight_firsts, tight_lowest, host.host, [(*nearest[key[0]], key[1])])
        return tight_firsts, tight_lowest
    by_key: dict[_TightKey, list[str]] = {}
    for (host_class, free), host in firsts.items():
        by_key.setdefault((*nearest[host_class], free), []).append(host.host)
    tight_firsts = {key: tuple(sorted(ids)) for key, ids in by_key.items()}
    return tight_firsts, {key: ids[0] for key, ids in tight_firsts.items()}


def _withdraw(
    proposers: dict[_Key, tuple[str, ...]],
    lowest: dict[_Key, str],
    host_id: str,
    raws: Iterable[_Key],
) -> None:
    """Takes ``host_id`` out of the proposers of each of ``raws``."""
    for raw in set(raws):
        ids = proposers[raw]
        at = bisect_left(ids, host_id)
        rest = ids[:at] + ids[at + 1 :]
        if rest:
            proposers[raw] = rest
            lowest[raw] = rest[0]
        else:
            del proposers[raw]
            del lowest[raw]


def _enter(
    proposers: dict[_Key, tuple[str, ...]],
    lowest: dict[_Key, str],
    host_id: str,
    raws: Iterable[_Key],
) -> None:
    """Adds ``host_id`` to the proposers of each of ``raws``."""
    for raw in set(raws):
        ids = proposers.get(raw, ())
        at = bisect_left(ids, host_id)
        proposers[raw] = (*ids[:at], host_id, *ids[at:])
        if at == 0:
            lowest[raw] = host_id


def _host_dropped(
    host_filters: Sequence[HostFilterPlugin], request: PlacementRequest, host: HostInfo
) -> bool:
    """Whether any host filter drops ``host`` (an error included)."""
    for plugin in host_filters:
        try:
            if plugin.filter_host(request, host).code is not Code.SUCCESS:
                return True
        except Exception:
            return True
    return False


def _host_class_of(chooser: TieredChooser) -> functools.partial[int]:
    return functools.partial(_place_class, chooser)


def _place_class(chooser: TieredChooser, host: HostInfo) -> int:
    return chooser.host_class(host.place)


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
    journal = snapshot.journal
    live_supply = None
    if journal is not None and _by_host_class(pipeline) and _is_tiered(type(latency)):
        live_supply = LiveSupply.build(request, snapshot, box_filters, gpu_filters)
    if live_supply is not None:
        supply = live_supply.supply
    else:
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
    live = None
    if journal is not None and live_supply is not None and chooser is not None:
        try:
            hosts = HostClasses.build(
                snapshot,
                functools.partial(_host_dropped, host_filters, request),
                _host_class_of(chooser),
            )
            scored: dict[tuple[object, ...], _Scored] = {}
            plugins = [weighted.plugin for weighted in pipeline.scores]
            table = _GroupTable.made(None, request, snapshot, hosts, chooser, plugins, scored)
            live = _Live(journal, snapshot.version, live_supply, hosts, chooser, {}, scored, table)
        except Exception:
            live = None  # the runs below go host by host and report what failed
    return _Prepared(owners, *filters, (), supply, chooser, live)


def _by_host_class(pipeline: Pipeline) -> bool:
    """Whether every score plugin lets hosts of one class be scored once."""
    return all(getattr(w.plugin, "by_host_class", False) for w in pipeline.scores)


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
        key = ("placement", id(pipeline), id(latency), request)
        prepared = snapshot.derived(
            key, lambda: _prepared_for(pipeline, request, snapshot, latency)
        )
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
        if self.prepared.rejected:
            return _rejected(self.snapshot, self.prepared.rejected)
        hosts = self.snapshot.hosts
        by_class = _by_host_class(self.pipeline)
        if self.share_classes and by_class and self.prepared.live is not None:
            live = self.prepared.live
            if live.table is not None:
                indexed = self._result_from_table(live.table, live.chooser)
            else:
                indexed = self._result_by_host_group(live)
            if indexed is not None:
                return indexed
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
        winner = min(best.items(), key=lambda item: (-item[1][0], item[0]), default=None)
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

    def _result_by_host_group(self, live: _Live) -> PlacementResult | None:
        """The decision from the first host of each group (see
        :class:`~dxpool.broker.placement.live.HostClasses`), scored by distinct raw
        scores: score plugins that work by host class normalize by the best raw score
        alone, so proposals with equal raw scores get equal totals, and among the
        proposals with the best total the lowest host id wins, its first such proposal
        (as in a run over every host). None when no host gets a proposal or the model
        fails for one (a run host by host then gives the account)."""
        chooser = live.chooser
        memo = live.proposals
        hosts = self.snapshot.hosts
        request = self.request
        plugins = [weighted.plugin for weighted in self.pipeline.scores]
        lowest: dict[tuple[float, ...], str] = {}  # raw scores -> lowest host proposing them
        tightest: dict[str, tuple[selection.Option, tuple[float, ...]]] = {}
        scored = live.scored
        for host_id in live.hosts.firsts():
            host = hosts[host_id]
            try:
                base, tight = chooser.parts(host.place)
            except Exception:
                return None
            made = memo.get(host_id)
            if made is None or made.options is not base or made.host is not host:
                made = _propose(request, host, base, plugins, scored)
                memo[host_id] = made
            for raw in made.raws:
                seen = lowest.get(raw)
                if seen is None or host_id < seen:
                    lowest[raw] = host_id
            if tight is not None:
                option = (selection.TIGHTEST_SINGLE_BOX, (Take(tight[1], request.count, tight[0]),))
                (raw,) = _propose(request, host, [option], plugins, scored).raws
                tightest[host_id] = (option, raw)
                seen = lowest.get(raw)
                if seen is None or host_id < seen:
                    lowest[raw] = host_id
        if not lowest:
            return None
        totals = self._totals_of(list(lowest))
        best = max(totals.values())
        winner = min(lowest[raw] for raw, total in totals.items() if total == best)
        made = memo[winner]
        options = list(made.options)
        raws = list(made.raws)
        if winner in tightest:  # options() puts the tightest box after the others
            options.append(tightest[winner][0])
            raws.append(tightest[winner][1])
        index = next(i for i, raw in enumerate(raws) if totals[raw] == best)
        rule, takes = options[index]
        proposal = Proposal(made.host, made.host.free_slot_count(), takes, rule)
        placement = self.bind(proposal, best)
        return PlacementResult(placement, self._explain_every_host, ())

    def _result_from_table(
        self, table: _GroupTable, chooser: TieredChooser
    ) -> PlacementResult | None:
        """The decision of :meth:`_result_by_host_group`, read from ``table`` instead of
        visiting each group: the raw scores of the groups' proposals are kept per version,
        and only the tightest single box (which a 1-GPU compose moves every time) is
        added here. Its proposal for a group depends only on the box, its round trip
        from the group's class and the group's free slot count, so it is scored once per
        distinct (round trip, box, free slots), for the lowest first host among the groups
        that get it. :meth:`~dxpool.broker.placement.tiered.TieredChooser.parts` leaves
        that box out for a host when it is already one of the host's single-box options,
        which proposes the same takes, hence the same raw scores: counting it in changes
        no lowest host. None when no group proposes anything."""
        request = self.request
        plugins = [weighted.plugin for weighted in self.pipeline.scores]
        scored = self.prepared.live.scored if self.prepared.live is not None else {}
        lowest = dict(table.lowest)
        near = table.near
        hosts = self.snapshot.hosts
        tight_raws: dict[_TightKey, tuple[float, ...]] = {}
        if near is not None:
            few = near[1]
            for (ns, index, free), host_id in table.tight_lowest.items():
                option = self._tight_option(few[index][1], ns)
                (raw,) = _propose(request, hosts[host_id], [option], plugins, scored).raws
                tight_raws[(ns, index, free)] = raw
                seen = lowest.get(raw)
                if seen is None or host_id < seen:
                    lowest[raw] = host_id
        if not lowest:
            return None
        totals = self._totals_of(list(lowest))
        best = max(totals.values())
        winner = min(lowest[raw] for raw, total in totals.items() if total == best)
        host = hosts[winner]
        key = (chooser.host_class(host.place), host.free_slot_count())
        options = list(table.options[key[0]])
        raws = list(table.raws[key])
        if near is not None:
            ns, index = near[0][key[0]]
            box = near[1][index][1]
            if not any(
                len(takes) == 1 and takes[0].supply.box.box == box.box.box for _, takes in options
            ):  # options() puts the tightest box after the others
                options.append(self._tight_option(box, ns))
                raws.append(tight_raws[(ns, index, key[1])])
        index = next(i for i, raw in enumerate(raws) if totals[raw] == best)
        rule, takes = options[index]
        proposal = Proposal(host, host.free_slot_count(), takes, rule)
        placement = self.bind(proposal, best)
        return PlacementResult(placement, self._explain_every_host, ())

    def _tight_option(self, supply: BoxSupply, ns: int) -> selection.Option:
        """The tightest-single-box option: every GPU requested from ``supply``."""
        return (selection.TIGHTEST_SINGLE_BOX, (Take(supply, self.request.count, ns),))

    def _totals_of(self, raws: list[tuple[float, ...]]) -> dict[tuple[float, ...], float]:
        """The weighted total of each distinct raw score tuple, computed as
        :meth:`score` computes a proposal's."""
        scores = self.pipeline.scores
        weight_sum = sum(score.weight for score in scores) or 1.0
        totals = [0.0] * len(raws)
        for position, weighted in enumerate(scores):
            plugin = weighted.plugin
            raw = [scores_of[position] for scores_of in raws]
            try:
                normalized = plugin.normalize(raw)
            except Exception as error:
                raise PluginError(plugin.name, error) from error
            if len(normalized) != len(raw):
                raise PluginError(
                    plugin.name,
                    ValueError(f"normalize returned {len(normalized)} scores for {len(raw)}"),
                )
            weight = weighted.weight
            totals = [
                total
                + weight * (value if 0.0 <= value <= MAX_SCORE else min(max(value, 0.0), MAX_SCORE))
                for total, value in zip(totals, normalized, strict=True)
            ]
        return {
            raw: round(total / weight_sum, _SCORE_DIGITS)
            for raw, total in zip(raws, totals, strict=True)
        }

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
        drop are skipped without a record. Returns the outcomes of the hosts looked at
        and how many were skipped; when none got a proposal the caller asks a full run
        for the account of why."""
        chooser = self.chooser
        assert chooser is not None
        hosts = self.snapshot.hosts
        served: set[tuple[int, int]] = set()
        outcomes: list[_HostOutcome] = []
        shared = 0
        for host_id in self.snapshot.host_ids():
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
        if self.best_reach is None or reach > self.best_reach[0]:
            self.best_reach = (reach, host.host)  # hosts come by id: the first best stays
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

    def no_switch_holds(self, host: HostInfo, most: tuple[int, str] | None) -> _HostOutcome:
        """The outcome of a host that reaches enough GPUs, but no switch's boxes among
        them hold the node (switch affinity); ``most`` is the switch holding the most."""
        held, name = most if most is not None else (0, "none")
        if self.best_switch is None or held > self.best_switch[0]:
            self.best_switch = (held, name, host.host)  # hosts come by id: the first stays
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
        if self.best_reach is None or reach > self.best_reach[0]:
            self.best_reach = (reach, host.host)  # hosts come by id: the first best stays
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
        kept.sort(key=lambda report: (-report.score, report.host))
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


def _propose(
    request: PlacementRequest,
    host: HostInfo,
    options: list[selection.Option],
    plugins: Sequence[ScorePlugin],
    scored: dict[tuple[object, ...], _Scored],
) -> _Proposed:
    """``host``'s proposals from the chooser's ``options`` and their raw scores. Raw
    scores of plugins that work by host class depend only on a proposal's takes and free
    slot count, so ``scored`` keeps them by those (by the identity of each take's supply,
    which the entry holds) and hosts of different classes with the same takes share them.
    """
    free = host.free_slot_count()
    raws: list[tuple[float, ...]] = []
    for rule, takes in options:
        key = (rule, free, *((id(t.supply), t.count, t.latency_ns) for t in takes))
        found = scored.get(key)
        if found is None:
            proposal = Proposal(host, free, takes, rule)
            raw: list[float] = []
            for plugin in plugins:
                try:
                    raw.append(plugin.score(request, proposal))
                except Exception as error:
                    raise PluginError(plugin.name, error) from error
            found = scored[key] = _Scored(takes, tuple(raw))
        raws.append(found.raws)
    return _Proposed(host, options, raws)


@dataclass(frozen=True, slots=True)
class _Scored:
    """Raw scores of a proposal with ``takes`` (held, so the supplies' ids stay theirs)."""

    takes: tuple[Take, ...]
    raws: tuple[float, ...]


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
