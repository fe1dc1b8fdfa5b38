"""What placement carries over from one snapshot of an inventory to the next, kept by
what each part depends on, and the decision read off it.

The broker's placement index hands out snapshots with a version and a journal of which
boxes and hosts each version changed. After a compose only a box or two and a host
differ, so placement does not start again: it brings each part up to the new version by
the records that changed. A stream of requests of many shapes (openb's pods ask for 103
CPU and memory shapes in four sizes) shares these parts as far as their fields allow,
because each part is kept by the fields it reads alone:

* :class:`BoxSide`, per **box key** (the request without its host-side fields, see
  :func:`~dxpool.broker.placement.model.box_key`) and latency model: the supply (each
  usable box's GPUs, :class:`~dxpool.broker.placement.live.LiveSupply`) and the chooser
  (:class:`~dxpool.broker.placement.tiered.TieredChooser`, the greedy rules per host
  class), and the raw scores of proposals by their takes;
* :class:`HostBase`, per **base key** (the values of the fields the base host filters
  read: the host selector, for the default pipeline) and latency model: the hosts those
  filters keep, grouped by (latency class, free proxy slots), each group ordered by
  :meth:`~dxpool.broker.placement.model.ResourceScale.room` then id;
* :class:`ClassTable`, per (box key, base key): the raw scores of each group's options
  and, for each distinct tuple of raw scores, the groups proposing it ordered by their
  first host.

What a request asks of its host beyond those (CPU cores and memory, hosts excluded:
fields that take many values) is checked at decision time, host by host, on the few
groups a decision looks at (:class:`~dxpool.broker.placement.framework.HostCheckPlugin`),
and a pinned request looks at its host alone.

The decision is the one a run over every host makes (the tests compare them): every
host of a group gets the same proposals and raw scores (score plugins declare
``by_host_class``), the totals are normalized by the best raw score of each plugin over
the proposals present, and among the proposals with the best total the host with the
least room wins, the lowest id among equals, with its first such proposal.

The parts are changed in place, under the :class:`Carried` lock, and follow the newest
snapshot: a decision on a snapshot older than a part answers None and the caller
prepares from the snapshot alone, as it does when a part cannot be made (the supply runs
short, a plugin fails, a host's latency class is unknown, nothing fits).

Glossary (the terms of this module and :mod:`.tiered`):

* **signature** (:class:`~dxpool.broker.placement.framework.Signature`): what a carried
  part may depend on; requests with equal parts share it.
* **part**: one carried structure (supply side, box side, host base, class table), kept
  by its key and brought forward by the journal's changed records.
* **host class**: the latency model's class of a host's place (its rack, for the tree
  model): hosts of one class get the same boxes chosen.
* **box class**: the same for a box; a ranking lists box classes by round trip in
  **tiers** (equal round trips), nearest first. A **large tier** (the rest of a site)
  is read through its **least box** (first by (usable GPUs, id) that holds the request).
* **group** (:data:`GroupKey`): the hosts of one host class with the same free proxy
  slots: they get the same proposals and raw scores; a group's **first host** is its
  least by (room, id) (:data:`Rank`), and a group is filed by it (:data:`Entry`).
* **member** (:data:`Member`): a host in its group, with its free CPU and memory.
* **options**: the proposals the greedy rules give a host class (rule, takes).
* **raw scores** (:data:`Raw`): each score plugin's raw score of one option; the class
  table files groups by each distinct tuple of them.
* **tightest box**: the box with the fewest usable GPUs that holds the request (the
  tightest-single-box rule). When few box classes hold one the chooser answers it
  *apart* from the other rules, as the **nearest tightest** box per host class among
  those few, which the class table keeps itself
  (:class:`~dxpool.broker.placement.nearest_few.NearestFew`) and files groups by
  (:data:`TightestKey`, or like the far ones where it is a large tier's least box).
* **far tightest** (:class:`~dxpool.broker.placement.tiered.FarTightest`): a tightest
  box answered as "the least box of this large tier", kept while that box has the
  fewest usable GPUs and the nearer tiers hold none that few; the class table files its
  groups by (round trip, free slots, tier) and scores them when it decides.
* **take shape**: what a score plugin declaring ``by_take_shape`` reads of a proposal (its
  rule and free slots, and per take its GPUs, round trip and box's usable GPUs). When
  every plugin declares it, raw scores are kept by shape, and since the tightest boxes
  all have the fewest usable GPUs a table files groups by their tightest box's round
  trip alone (:data:`ANY_BOX_CLASS`) and scores far tiers once.
* **fewest**: that fewest usable GPUs; **stamp**: what a memoized choice's tightest box
  rests on (the fewest, and the few classes holding such a box).
* **memo**: a host class's choice kept by a chooser with what its walk rested on (the
  box classes it looked at, the large tiers it read through their least box).
* **advance**: the next version of a part from the changed records; **log**: which
  groups or classes each version changed, for parts that read it later.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from typing import TypeGuard, TypeVar, cast

from dxpool.broker.placement import selection
from dxpool.broker.placement.framework import (
    MAX_SCORE,
    BoxFilterPlugin,
    BoxSupply,
    GpuFilterPlugin,
    HostCheckPlugin,
    HostFilterPlugin,
    PreFilterPlugin,
    Proposal,
    ScorePlugin,
    Signature,
    Take,
)
from dxpool.broker.placement.guard import PluginError
from dxpool.broker.placement.live import LiveSupply
from dxpool.broker.placement.model import (
    ChangeJournal,
    HostInfo,
    PlacementRequest,
    Snapshot,
)
from dxpool.broker.placement.nearest_few import Nearest, NearestFew
from dxpool.broker.placement.plugins.hosts import HostNotExcluded, HostResources
from dxpool.broker.placement.status import Code
from dxpool.broker.placement.tiered import FarTightest, TieredChooser
from dxpool.fabric.latency import Place, TieredLatencyModel

MAX_SUPPLIES = 16
"""Supplies kept (least recently used dropped): each judges every box of the pool, tens
of MB at 100,000 GPUs."""
MAX_BOX_SIDES = 32
"""Choosers kept: each holds the boxes of a supply by class."""
MAX_HOST_BASES = 8
MAX_TABLES = 48
LOG_LENGTH = 512
"""Versions a part remembers what it changed for, for the tables that read it later."""
MAX_SCORED = 65536
"""Raw scores a box side keeps by takes; beyond, it starts afresh."""
REFILE_ALL_SHARE = 4
"""When more than one in this many of a table's groups move to another tightest box,
the table files them all afresh in one pass rather than moving each."""

_MISSING = object()

GroupKey = tuple[int, int]
"""(latency class of the host, free proxy slots)."""
Member = tuple[int, str, int, int]
"""A host in its group: (room, host id, free CPU cores, free memory MiB), the free
amounts -1 where the host declares none."""
Rank = tuple[int, str]
"""Where a host stands when ties go: (room, host id)."""
Entry = tuple[int, str, GroupKey]
"""A group in a list of groups: its first member's (room, host id), then the group."""
Raw = tuple[float, ...]
TightestKey = tuple[int, int, int]
"""A tightest-single-box option for a group: (round trip, the class of the tightest box,
which holds one such box, free slots); the class is :data:`ANY_BOX_CLASS` where the
score plugins score by take shape, so the tightest boxes of a round trip score alike."""
ANY_BOX_CLASS = -1


_Sorted = TypeVar("_Sorted", bound=tuple[object, ...])


def remove_sorted(items: list[_Sorted], item: _Sorted) -> None:
    """Removes ``item`` from the sorted list ``items``; ValueError when it is not there."""
    at = bisect_left(items, item)
    if at == len(items) or items[at] != item:
        raise ValueError(f"{item!r} is not in the list")
    del items[at]


class _Log:
    """What each version after ``start`` changed (a set of keys, or None: anything),
    for readers that were brought up to some version and come back later."""

    def __init__(self, start: int) -> None:
        self.start = start  # complete from here: every later change is recorded
        self._entries: deque[tuple[int, frozenset[Hashable] | None]] = deque()

    def add(self, version: int, changed: frozenset[Hashable] | None) -> None:
        self._entries.append((version, changed))
        if len(self._entries) > LOG_LENGTH:
            dropped, _ = self._entries.popleft()
            self.start = dropped

    def since(self, version: int) -> set[Hashable] | None:
        """What changed after ``version``; None when anything may have (the log does
        not reach back that far, or some version changed everything)."""
        if version < self.start:
            return None
        found: set[Hashable] = set()
        for at, changed in reversed(self._entries):
            if at <= version:
                break
            if changed is None:
                return None
            found.update(changed)
        return found


class SupplySide:
    """The supply of one supply key (the box key, with the size left out when no box
    or GPU filter reads it), at one version: requests of every size share it."""

    def __init__(
        self,
        request: PlacementRequest,
        snapshot: Snapshot,
        box_filters: Sequence[BoxFilterPlugin],
        gpu_filters: Sequence[GpuFilterPlugin],
        supply: LiveSupply,
    ) -> None:
        self.request = request
        self.box_filters = tuple(box_filters)
        self.gpu_filters = tuple(gpu_filters)
        self.supply = supply
        self.version = snapshot.version
        self.journal = snapshot.journal

    def advance(self, snapshot: Snapshot, boxes: Iterable[str]) -> bool:
        """Brings the supply up to ``snapshot``, judging the ``boxes`` changed since;
        False (this side then unusable) when it ran short or a plugin failed."""
        supply = self.supply.advance(
            self.request, snapshot, boxes, self.box_filters, self.gpu_filters
        )
        if supply is None:
            return False
        self.supply = supply
        self.version = snapshot.version
        return True


class BoxSide:
    """The chooser of one box key, made from a supply side's supply, at one version.
    It follows that supply side alone: a supply made again holds other objects for the
    same boxes, which the chooser would not recognize as the ones it holds."""

    def __init__(
        self,
        request: PlacementRequest,
        snapshot: Snapshot,
        origin: SupplySide,
        chooser: TieredChooser,
    ) -> None:
        self.request = request
        self.origin = origin
        self.supply = origin.supply  # the supply the chooser holds the boxes of
        self.chooser = chooser
        self.version = snapshot.version
        self.journal = snapshot.journal
        self.log = _Log(snapshot.version)
        self.scored: dict[tuple[object, ...], _Scored] = {}
        # raw scores by the shape of the proposal, for plugins that score by it alone
        self.shape_scored: dict[tuple[object, ...], Raw] = {}
        self.key: Hashable = None  # set by whoever keeps it

    def advance(self, snapshot: Snapshot, boxes: Iterable[str], supply: LiveSupply) -> None:
        """Brings the chooser up to ``supply`` (the supply side's, at ``snapshot``): of
        the ``boxes`` changed since, those whose usable GPUs changed leave it and come
        back as they are now."""
        removed: list[BoxSupply] = []
        added: list[BoxSupply] = []
        before, now = self.supply.parts, supply.parts
        for box_id in boxes:
            old, new = before.get(box_id), now.get(box_id)
            old_supply = old.supply if old is not None else None
            new_supply = new.supply if new is not None else None
            if old_supply is new_supply:
                continue
            if old_supply is not None:
                removed.append(old_supply)
            if new_supply is not None:
                added.append(new_supply)
        if removed or added:
            chooser = self.chooser.advance(removed, added)
            changed = chooser.changed_classes()
            self.log.add(snapshot.version, cast(frozenset[Hashable] | None, changed))
            self.chooser = chooser
        self.supply = supply
        self.version = snapshot.version
        if len(self.scored) >= MAX_SCORED:
            self.scored = {}
        if len(self.shape_scored) >= MAX_SCORED:
            self.shape_scored = {}


@dataclass(frozen=True, slots=True)
class _FarList:
    """The groups of one (round trip, free slots) whose tightest box is a far tier's
    least box (see :class:`~dxpool.broker.placement.tiered.FarTightest`), by first
    member: the tier, and the groups."""

    tier: tuple[int, ...]
    entries: list[Entry]  # sorted


FarLists = dict[tuple[int, int], dict[int, _FarList]]
"""Groups whose tightest box is a far tier's least box: by (round trip, free slots),
then by the tier (id() of its tuple)."""


@dataclass(frozen=True, slots=True)
class _Scored:
    """Raw scores of a proposal with ``takes`` (held, so the supplies' ids stay theirs)."""

    takes: tuple[Take, ...]
    raws: Raw


class HostBase:
    """The hosts the base filters keep, grouped by :data:`GroupKey`, each group by
    (room, id), at one version."""

    def __init__(
        self,
        request: PlacementRequest,
        snapshot: Snapshot,
        filters: Sequence[HostFilterPlugin],
        model: TieredLatencyModel,
    ) -> None:
        self.request = request
        self.filters = tuple(filters)
        self.model = model
        self.scale = snapshot.resource_scale()
        self.groups: dict[GroupKey, list[Member]] = {}  # each sorted
        self.where: dict[str, tuple[GroupKey, Member]] = {}
        self.unknown: set[str] = set()  # kept hosts whose latency class the model failed
        self.version = snapshot.version
        self.journal = snapshot.journal
        self.log = _Log(snapshot.version)
        self.key: Hashable = None  # set by whoever keeps it
        hosts = snapshot.hosts
        for host_id in hosts:
            self._enter(hosts[host_id], None)

    def advance(self, snapshot: Snapshot, changed: Iterable[str]) -> None:
        touched: set[GroupKey] = set()
        hosts = snapshot.hosts
        for host_id in changed:
            self._leave(host_id, touched)
            host = hosts.get(host_id)
            if host is not None:
                self._enter(host, touched)
        self.version = snapshot.version
        if touched:
            self.log.add(snapshot.version, cast(frozenset[Hashable], frozenset(touched)))

    def _leave(self, host_id: str, touched: set[GroupKey]) -> None:
        self.unknown.discard(host_id)
        found = self.where.pop(host_id, None)
        if found is None:
            return
        key, member = found
        members = self.groups[key]
        remove_sorted(members, member)
        if not members:
            del self.groups[key]
        touched.add(key)

    def _enter(self, host: HostInfo, touched: set[GroupKey] | None) -> None:
        request = self.request
        for plugin in self.filters:
            try:
                if plugin.filter_host(request, host).code is not Code.SUCCESS:
                    return
            except Exception:
                return  # dropped; a run host by host reports the failure if it matters
        try:
            key = (self.model.host_class(host.place), host.free_slot_count())
        except Exception:
            self.unknown.add(host.host)
            return
        member = (
            self.scale.room(host),
            host.host,
            host.cpu_cores - host.used_cpu_cores if host.cpu_cores else -1,
            host.memory_mib - host.used_memory_mib if host.memory_mib else -1,
        )
        members = self.groups.get(key)
        if members is None:
            members = self.groups[key] = []
        insort(members, member)
        self.where[host.host] = (key, member)
        if touched is not None:
            touched.add(key)


class ClassTable:
    """The raw scores of every group of one host base under one box side's chooser,
    and the groups proposing each distinct raw tuple, by first member."""

    def __init__(
        self,
        side: BoxSide,
        base: HostBase,
        plugins: Sequence[ScorePlugin],
        min_free: int,
        by_shape: bool,
    ) -> None:
        self.plugins = tuple(plugins)
        self.min_free = min_free  # groups with fewer free slots propose nothing
        # every plugin scores by take shape: the few tightest boxes (all of the fewest
        # usable GPUs) score alike at one round trip, whichever box a group gets
        self.by_shape = by_shape
        self.box_version = -1
        self.host_version = -1
        self.chooser: TieredChooser | None = None
        self.ranking: tuple[int, object] = (-1, None)
        self.options: dict[int, list[selection.Option]] = {}
        self.places: dict[int, Place] = {}
        self.of_class: dict[int, set[GroupKey]] = {}
        self.raws: dict[GroupKey, tuple[Raw, ...]] = {}
        self.entry_of: dict[GroupKey, Entry] = {}  # each group as its lists file it
        self.by_raw: dict[Raw, list[Entry]] = {}  # each sorted
        # The tightest box, when the chooser answers it apart (see the glossary): the
        # nearest of the few per host class, kept up as the few change, and the groups
        # of the classes without a far answer of the chooser's filed by it: by
        # (round trip, box class, free slots) when it lies in a listed tier, like the
        # far groups when it is a large tier's least box; by take shape, by (round
        # trip, free slots) alone either way
        self.few_active = False  # the chooser answers the tightest box apart now
        # while it does not: groups judged again and not filed by it yet, or (True)
        # the whole filing to be made again
        self.pending: set[GroupKey] = set()
        self.refile_pending = False
        self.nearest = NearestFew(side.chooser.model)
        self.tightest_of_group: dict[GroupKey, TightestKey] = {}
        self.groups_by_tightest: dict[TightestKey, list[Entry]] = {}  # each sorted
        self.few_far_groups: FarLists = {}
        self.few_far_of_group: dict[GroupKey, tuple[tuple[int, int], int]] = {}
        # the raw scores of each key's option with the box they were made for
        self.tight_scored: dict[TightestKey, tuple[BoxSupply, Raw]] = {}
        # The tightest box, where the chooser answers it as a far tier's least box (see
        # the glossary): host class -> that answer; the groups of those classes by
        # (round trip, free slots), then by tier (id() of its tuple), scored at decision
        # time from the tier's least box then; and where each such group is filed
        self.far: dict[int, FarTightest] = {}
        self.far_groups: FarLists = {}
        self.far_of_group: dict[GroupKey, tuple[tuple[int, int], int]] = {}
        self.side = side
        self.base = base

    # -- keeping up ------------------------------------------------------------------

    def sync(self, side: BoxSide, base: HostBase, snapshot: Snapshot) -> None:
        """Brings the table up to ``side`` and ``base``: the options of the classes whose
        chooser memo may have moved are asked again (every class when the chooser cannot
        say, or the model numbered a class), and only the groups whose first member or
        options changed are scored again. Raises what the chooser or a score plugin
        raises."""
        chooser = side.chooser
        if self.chooser is None:
            classes_changed: set[Hashable] | None = None
            groups_changed: set[Hashable] | None = None
        else:
            classes_changed = set() if chooser is self.chooser else side.log.since(self.box_version)
            groups_changed = base.log.since(self.host_version)
        probe, ranking = self.ranking
        if ranking is not None and chooser.model.ranking(probe) is not ranking:
            classes_changed = None  # a class was numbered since: every walk may miss it
            self.nearest.reset()
            self.nearest.join(self.places)
            self._unfile_few()
        if groups_changed is None:
            self._clear()
            redo: set[GroupKey] = {key for key in base.groups if key[1] >= self.min_free}
            classes_changed = None
        else:
            # a group with fewer free slots than the request's size is never filed
            min_free = self.min_free
            changed = cast(set[GroupKey], groups_changed)
            redo = {key for key in changed if key[1] >= min_free}
        if (self.ranking[1] is None or classes_changed is None) and base.groups:
            probe = next(iter(base.groups))[0]
            self.ranking = (probe, chooser.model.ranking(probe))
        check = (
            list(self.options)
            if classes_changed is None
            else [c for c in cast(set[int], classes_changed) if c in self.options]
        )
        for host_class in check:
            again, tight = chooser.parts(self.places[host_class], nearest_few=False)
            far = tight if isinstance(tight, FarTightest) else None
            if again != self.options[host_class] or far != self.far.get(host_class):
                self.options[host_class] = again
                self._set_far(host_class, far)
                redo.update(self.of_class.get(host_class, ()))
        # most groups judged again: their lists are made afresh in one pass
        everything = len(redo) * REFILE_ALL_SHARE > len(self.raws)
        for key in redo:
            self._drop(key, keep_lists=everything)
        for key in redo:
            members = base.groups.get(key)
            if members and key[1] >= self.min_free:
                room, host_id, _, _ = members[0]
                self._add(key, (room, host_id), side, snapshot, keep_lists=everything)
        if everything:
            self._file_all_by_raw()
        self.chooser = chooser
        self.box_version = side.version
        self.host_version = base.version
        self._refile_tightest(chooser, redo, everything)

    def _clear(self) -> None:
        self.options.clear()
        self.places.clear()
        self.of_class.clear()
        self.raws.clear()
        self.entry_of.clear()
        self.by_raw.clear()
        self._unfile_few()
        self.far.clear()
        self.far_groups.clear()
        self.far_of_group.clear()

    def _unfile_few(self) -> None:
        """Forgets the filing of groups by the nearest of the few tightest boxes."""
        self.few_active = False
        self.pending.clear()
        self.refile_pending = False
        self.tight_scored.clear()
        self.tightest_of_group.clear()
        self.groups_by_tightest.clear()
        self.few_far_groups.clear()
        self.few_far_of_group.clear()

    def _set_far(self, host_class: int, far: FarTightest | None) -> None:
        """Records that ``host_class``'s tightest box is ``far`` (None: none apart); the
        caller files its groups again."""
        if far is None:
            self.far.pop(host_class, None)
        else:
            self.far[host_class] = far

    def _drop(self, key: GroupKey, *, keep_lists: bool = False) -> None:
        """Forgets a group; with ``keep_lists`` it stays in the lists of groups (by raw
        scores, by tightest box), which the caller then makes afresh."""
        raws = self.raws.pop(key, None)
        if raws is None:
            return
        entry = self.entry_of.pop(key)
        self.of_class[key[0]].discard(key)
        filed = self.far_of_group.pop(key, None)
        if filed is not None:
            _unfile_far(self.far_groups, filed, entry)
        if keep_lists:
            self.tightest_of_group.pop(key, None)
            self.few_far_of_group.pop(key, None)
            return
        for raw in _distinct(raws):
            entries = self.by_raw[raw]
            remove_sorted(entries, entry)
            if not entries:
                del self.by_raw[raw]
        self._unfile_nearest(key, entry)

    def _add(
        self, key: GroupKey, rank: Rank, side: BoxSide, snapshot: Snapshot, *, keep_lists: bool
    ) -> None:
        """Scores a group; with ``keep_lists`` it is not filed in the lists by raw
        scores, which the caller then makes afresh."""
        host_class = key[0]
        found = self.options.get(host_class)
        if found is None:
            host = snapshot.hosts[rank[1]]
            found, tight = side.chooser.parts(host.place, nearest_few=False)
            self.options[host_class] = found
            self._set_far(host_class, tight if isinstance(tight, FarTightest) else None)
            self.places[host_class] = host.place
            self.nearest.join((host_class,))
        # a class that reaches too little gets no option: its hosts propose nothing
        by_shape = self.by_shape
        raws = tuple(raw_scores(side, self.plugins, option, key[1], by_shape) for option in found)
        entry = (*rank, key)
        far = self.far.get(host_class)
        if far is not None and raws:
            self.far_of_group[key] = _file_far(self.far_groups, far, key, entry)
        self.raws[key] = raws
        self.entry_of[key] = entry
        self.of_class.setdefault(host_class, set()).add(key)
        if keep_lists:
            return
        for raw in _distinct(raws):
            entries = self.by_raw.get(raw)
            if entries is None:
                entries = self.by_raw[raw] = []
            insort(entries, entry)

    def _file_all_by_raw(self) -> None:
        """Files every group by each of its raw score tuples afresh, in one pass."""
        entry_of = self.entry_of
        filed: dict[Raw, list[Entry]] = {}
        for key, raws in self.raws.items():
            entry = entry_of[key]
            for raw in _distinct(raws):
                entries = filed.get(raw)
                if entries is None:
                    entries = filed[raw] = []
                entries.append(entry)
        self.by_raw = {raw: sorted(entries) for raw, entries in filed.items()}

    def _refile_tightest(
        self, chooser: TieredChooser, redo: set[GroupKey], everything: bool
    ) -> None:
        """Files each group by the tightest box of its class, when the chooser answers it
        apart (see :class:`~dxpool.broker.placement.nearest_few.NearestFew`): only the
        groups of host classes whose answer changed move, and the groups judged again
        (``redo``) are filed afresh; with ``everything`` (most groups were judged again,
        and none is filed now) every group is."""
        few = chooser.tightest_few()
        if not few:
            # Many classes hold the tightest box (or none does): the decision does not
            # read this filing. It stays as the answers of the last few left it, the
            # groups judged again meanwhile waiting, so that coming back to few costs
            # only those and the classes whose answer moved.
            self.few_active = False
            if everything:
                self.refile_pending = True
            elif not self.refile_pending:
                self.pending.update(redo)
            return
        self.few_active = True
        moved = self.nearest.update(few)
        shifted: list[GroupKey] = []
        if not (everything or self.refile_pending):
            # the groups of the classes whose answer moved that file elsewhere now (by
            # take shape, a group stays where its new box has the old one's shape)
            answers = self.nearest.answers
            filed_as = self._filed_as
            for host_class in moved:
                answer = answers.get(host_class)
                shifted.extend(
                    key for key in self.of_class.get(host_class, ()) if not filed_as(key, answer)
                )
        if (
            everything
            or self.refile_pending
            or (len(shifted) + len(self.pending)) * REFILE_ALL_SHARE > len(self.raws)
        ):
            self._refile_all()
            return
        waiting, self.pending = self.pending, set()
        far = self.far
        for key in shifted:
            entry = self.entry_of[key]
            self._unfile_nearest(key, entry)
            # a group with no option has no tightest box; a far one has its own
            if self.raws.get(key) and key[0] not in far:
                self._file_nearest(key, entry)
        for key in chain(redo, waiting):
            if (
                self.raws.get(key)
                and key[0] not in far
                and key not in self.tightest_of_group
                and key not in self.few_far_of_group
            ):
                self._file_nearest(key, self.entry_of[key])

    def _refile_all(self) -> None:
        """Files every group with an option by the tightest box of its class afresh, in
        one pass: what filing the groups that moved one by one ends in, for when most
        of them moved (the few tightest boxes were answered afresh)."""
        answers = self.nearest.answers
        entry_of = self.entry_of
        of_group: dict[GroupKey, TightestKey] = {}
        filed: dict[TightestKey, list[Entry]] = {}
        far_of_group: dict[GroupKey, tuple[tuple[int, int], int]] = {}
        far_filed: dict[tuple[int, int], dict[int, tuple[tuple[int, ...], list[Entry]]]] = {}
        far = self.far
        for key, raws in self.raws.items():
            # a group with no option has no tightest box; a far one has its own
            if not raws or key[0] in far:
                continue
            answer = answers.get(key[0])
            if answer is None:
                continue
            entry = entry_of[key]
            if self._by_tier(answer):
                where = (answer.latency, key[1])
                by_tier = far_filed.setdefault(where, {})
                by_tier.setdefault(id(answer.tier), (answer.tier, []))[1].append(entry)
                far_of_group[key] = (where, id(answer.tier))
                continue
            tight = self._tight_key(answer, key[1])
            of_group[key] = tight
            entries = filed.get(tight)
            if entries is None:
                entries = filed[tight] = []
            entries.append(entry)
        self.tightest_of_group = of_group
        self.groups_by_tightest = {tight: sorted(entries) for tight, entries in filed.items()}
        self.few_far_of_group = far_of_group
        self.pending.clear()
        self.refile_pending = False
        self.few_far_groups = {
            where: {
                tier_id: _FarList(tier, sorted(entries))
                for tier_id, (tier, entries) in lists.items()
            }
            for where, lists in far_filed.items()
        }

    def _unfile_nearest(self, key: GroupKey, entry: Entry) -> None:
        """Takes a group out of the lists by the nearest of the few tightest boxes."""
        tight = self.tightest_of_group.pop(key, None)
        if tight is not None:
            entries = self.groups_by_tightest[tight]
            remove_sorted(entries, entry)
            if not entries:
                del self.groups_by_tightest[tight]
        filed = self.few_far_of_group.pop(key, None)
        if filed is not None:
            _unfile_far(self.few_far_groups, filed, entry)

    def _by_tier(self, answer: Nearest) -> TypeGuard[FarTightest]:
        """Whether a group whose nearest of the few tightest boxes is ``answer`` is filed
        by its far tier (a far tier's least box, plugins not scoring by take shape)
        rather than by :meth:`_tight_key`."""
        return isinstance(answer, FarTightest) and not self.by_shape

    def _tight_key(self, answer: Nearest, free: int) -> TightestKey:
        """The key a group with ``free`` slots is filed by when the nearest of the few
        tightest boxes of its class is ``answer``: (round trip, box class), or by take
        shape also a far tier's least box (which has the fewest usable GPUs too)."""
        if isinstance(answer, FarTightest):
            return (answer.latency, ANY_BOX_CLASS, free)
        return (answer[0], ANY_BOX_CLASS if self.by_shape else answer[1], free)

    def _filed_as(self, key: GroupKey, answer: Nearest | None) -> bool:
        """Whether a group is filed already as its class's nearest of the few tightest
        boxes, ``answer``, files it (a group with no option, or of a class with a far
        answer of the chooser's, or none, is not filed by it)."""
        if answer is None or key[0] in self.far or not self.raws.get(key):
            return key not in self.tightest_of_group and key not in self.few_far_of_group
        if self._by_tier(answer):
            filed = self.few_far_of_group.get(key)
            return filed == ((answer.latency, key[1]), id(answer.tier))
        return self.tightest_of_group.get(key) == self._tight_key(answer, key[1])

    def _file_nearest(self, key: GroupKey, entry: Entry) -> None:
        """Files a group by the nearest of the few tightest boxes of its class."""
        answer = self.nearest.answers.get(key[0])
        if answer is None:
            return
        if self._by_tier(answer):
            self.few_far_of_group[key] = _file_far(self.few_far_groups, answer, key, entry)
            return
        tight = self._tight_key(answer, key[1])
        self.tightest_of_group[key] = tight
        entries = self.groups_by_tightest.get(tight)
        if entries is None:
            entries = self.groups_by_tightest[tight] = []
        insort(entries, entry)


def _distinct(raws: tuple[Raw, ...]) -> Iterable[Raw]:
    """A group's raw score tuples, each once (most groups have one option)."""
    return raws if len(raws) == 1 else set(raws)


def _file_far(
    lists: FarLists, far: FarTightest, key: GroupKey, entry: Entry
) -> tuple[tuple[int, int], int]:
    """Files a group under its far tier; returns where (for :func:`_unfile_far`)."""
    where = (far.latency, key[1])
    by_tier = lists.get(where)
    if by_tier is None:
        by_tier = lists[where] = {}
    far_list = by_tier.get(id(far.tier))
    if far_list is None:
        far_list = by_tier[id(far.tier)] = _FarList(far.tier, [])
    insort(far_list.entries, entry)
    return where, id(far.tier)


def _unfile_far(lists: FarLists, filed: tuple[tuple[int, int], int], entry: Entry) -> None:
    """Takes a group filed by :func:`_file_far` out of its list."""
    by_tier = lists[filed[0]]
    far_list = by_tier[filed[1]]
    remove_sorted(far_list.entries, entry)
    if not far_list.entries:
        del by_tier[filed[1]]
        if not by_tier:
            del lists[filed[0]]


def raw_scores(
    side: BoxSide,
    plugins: Sequence[ScorePlugin],
    option: selection.Option,
    free: int,
    by_shape: bool,
) -> Raw:
    """The raw scores of ``option`` on a host with ``free`` slots; the plugins work by
    host class, so they depend on the takes and free slots alone and are kept by them:
    by the identity of each take's supply (which the entry holds), or with ``by_shape``
    (every plugin scores by take shape) by each take's GPUs, round trip and box's usable
    GPUs."""
    rule, takes = option
    if by_shape:
        shape = (rule, free, *((t.count, t.latency_ns, t.supply.available) for t in takes))
        raws = side.shape_scored.get(shape)
        if raws is None:
            raws = side.shape_scored[shape] = _score(side, plugins, option, free)
        return raws
    key = (rule, free, *((id(t.supply), t.count, t.latency_ns) for t in takes))
    found = side.scored.get(key)
    if found is None:
        found = side.scored[key] = _Scored(takes, _score(side, plugins, option, free))
    return found.raws


def _score(
    side: BoxSide, plugins: Sequence[ScorePlugin], option: selection.Option, free: int
) -> Raw:
    """Every plugin's raw score of ``option`` on a host with ``free`` slots."""
    rule, takes = option
    proposal = Proposal(_NO_HOST, free, takes, rule)
    raw: list[float] = []
    request = side.request
    for plugin in plugins:
        try:
            raw.append(plugin.score(request, proposal))
        except Exception as error:
            raise PluginError(plugin.name, error) from error
    return tuple(raw)


_NO_HOST = HostInfo("", Place(""), 0, frozenset(), True)
"""The host a proposal is scored on: plugins that work by host class never read it."""


@dataclass(frozen=True, slots=True)
class Chosen:
    """A decision: the host, the proposal's rule and takes, and its total."""

    host: HostInfo
    rule: str
    takes: tuple[Take, ...]
    total: float


MAX_PARTS = 4096
"""Requests whose :class:`Parts` are remembered; beyond, the record starts afresh."""


class Carried:
    """Every part a pipeline carries over, by key, least recently used dropped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._parts: dict[PlacementRequest, Parts | None] = {}
        self.supplies: OrderedDict[Hashable, SupplySide] = OrderedDict()
        self.box_sides: OrderedDict[Hashable, BoxSide] = OrderedDict()
        self.host_bases: OrderedDict[Hashable, HostBase] = OrderedDict()
        self.tables: OrderedDict[Hashable, ClassTable] = OrderedDict()

    def parts_of(self, request: PlacementRequest, make: Callable[[], Parts | None]) -> Parts | None:
        """What a decision needs of the pipeline for ``request`` (``make()``, which
        depends on the request alone), remembered per request: a stream repeats its
        shapes. Safe from several threads (it may then be made twice)."""
        found = self._parts.get(request, _MISSING)
        if found is _MISSING:
            found = make()
            if len(self._parts) >= MAX_PARTS:
                self._parts.clear()
            self._parts[request] = found
        return cast(Parts | None, found)


def kept(cache: OrderedDict[Hashable, object], key: Hashable, limit: int) -> None:
    """Marks ``key`` used last and drops the least recently used beyond ``limit``."""
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


def journal_changes(
    journal: ChangeJournal | None, version: int, snapshot: Snapshot
) -> tuple[frozenset[str], frozenset[str]] | None:
    if journal is None or journal is not snapshot.journal or version > snapshot.version:
        return None
    return journal.changed_since(version, snapshot.version)


# -- the decision ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Parts:
    """What a decision needs of the pipeline, sorted by how it is carried over."""

    pre_filters: tuple[PreFilterPlugin, ...]
    box_filters: tuple[BoxFilterPlugin, ...]
    gpu_filters: tuple[GpuFilterPlugin, ...]
    base_filters: tuple[HostFilterPlugin, ...]  # grouped once per base key
    checks: tuple[HostCheckPlugin, ...]  # checked host by host at decision time
    pinned: bool  # the request pins a host, and a filter keeps that host alone
    min_free: int  # groups with fewer free slots propose nothing (0: no slot filter)
    bound: int | None  # the round-trip bound the link filters apply
    plugins: tuple[ScorePlugin, ...]
    weights: tuple[float, ...]
    by_shape: bool  # every score plugin scores by take shape (``by_take_shape``)
    signature: Signature  # the keys of the parts carried over (see sign())


def decide(
    carried: Carried,
    parts: Parts,
    request: PlacementRequest,
    snapshot: Snapshot,
    model: TieredLatencyModel,
) -> Chosen | None:
    """The decision a run over every host makes on ``snapshot``, from the parts carried
    over; None when they cannot answer (see the module docstring), also when a plugin or
    the latency model fails: the caller then runs host by host, which reports it."""
    for plugin in parts.pre_filters:
        try:
            if plugin.pre_filter(request, snapshot).code is not Code.SUCCESS:
                return None
        except Exception:
            return None
    signature = parts.signature
    with carried.lock:
        try:
            side = _box_side(carried, parts, signature, snapshot, model)
            if side is None:
                return None
            base = _host_base(carried, parts, request, signature, snapshot, model)
            if base is None:
                return None
            if parts.pinned:  # its host alone: no table to read
                return _pinned(parts, request, snapshot, side, base)
            table = _table(carried, parts, side, base, snapshot)
            return _best(parts, request, snapshot, side, base, table)
        except Exception:
            # a plugin or the latency model failed: a run host by host says which
            return None


def _supply_side(
    carried: Carried, parts: Parts, signature: Signature, snapshot: Snapshot
) -> SupplySide | None:
    key = signature.supply
    side = carried.supplies.get(key)
    if side is not None:
        if side.version > snapshot.version and side.journal is snapshot.journal:
            return None  # an older snapshot: prepared from itself
        changes = journal_changes(side.journal, side.version, snapshot)
        if changes is not None:
            if changes[0] and not side.advance(snapshot, changes[0]):
                del carried.supplies[key]
                return None
            side.version = snapshot.version
            kept(cast(OrderedDict[Hashable, object], carried.supplies), key, MAX_SUPPLIES)
            return side
        del carried.supplies[key]
    try:
        supply = LiveSupply.build(key, snapshot, parts.box_filters, parts.gpu_filters)
    except Exception:
        return None
    if supply is None:
        return None
    side = SupplySide(key, snapshot, parts.box_filters, parts.gpu_filters, supply)
    carried.supplies[key] = side
    kept(cast(OrderedDict[Hashable, object], carried.supplies), key, MAX_SUPPLIES)
    return side


def _box_side(
    carried: Carried,
    parts: Parts,
    signature: Signature,
    snapshot: Snapshot,
    model: TieredLatencyModel,
) -> BoxSide | None:
    request = signature.boxes
    supplies = _supply_side(carried, parts, signature, snapshot)
    if supplies is None or supplies.supply.supply.usable < request.count:
        return None  # short of GPUs: a run host by host gives the account
    supply = supplies.supply
    key = (id(model), request)
    side = carried.box_sides.get(key)
    if side is not None:
        if side.version > snapshot.version and side.journal is snapshot.journal:
            return None
        changes = journal_changes(side.journal, side.version, snapshot)
        if changes is not None and side.chooser.model is model and side.origin is supplies:
            side.advance(snapshot, changes[0], supply)
            kept(cast(OrderedDict[Hashable, object], carried.box_sides), key, MAX_BOX_SIDES)
            return side
        del carried.box_sides[key]
    chooser = TieredChooser(
        model, supply.supply.boxes, request.count, parts.bound, same_switch=request.same_switch
    )
    side = BoxSide(request, snapshot, supplies, chooser)
    side.key = key
    carried.box_sides[key] = side
    kept(cast(OrderedDict[Hashable, object], carried.box_sides), key, MAX_BOX_SIDES)
    return side


def _host_base(
    carried: Carried,
    parts: Parts,
    request: PlacementRequest,
    signature: Signature,
    snapshot: Snapshot,
    model: TieredLatencyModel,
) -> HostBase | None:
    key = (id(model), signature.hosts)
    base = carried.host_bases.get(key)
    if base is not None:
        if base.version > snapshot.version and base.journal is snapshot.journal:
            return None
        changes = journal_changes(base.journal, base.version, snapshot)
        if changes is not None and base.model is model and base.scale == snapshot.resource_scale():
            base.advance(snapshot, changes[1])
            kept(cast(OrderedDict[Hashable, object], carried.host_bases), key, MAX_HOST_BASES)
            return base if not base.unknown else None
        del carried.host_bases[key]
    base = HostBase(request, snapshot, parts.base_filters, model)
    base.key = key
    carried.host_bases[key] = base
    kept(cast(OrderedDict[Hashable, object], carried.host_bases), key, MAX_HOST_BASES)
    return base if not base.unknown else None


def _table(
    carried: Carried, parts: Parts, side: BoxSide, base: HostBase, snapshot: Snapshot
) -> ClassTable:
    key = (side.key, base.key)
    table = carried.tables.get(key)
    if table is None or table.side is not side or table.base is not base:
        table = ClassTable(side, base, parts.plugins, parts.min_free, parts.by_shape)
        carried.tables[key] = table
    try:
        table.sync(side, base, snapshot)
    except Exception:
        del carried.tables[key]
        raise
    kept(cast(OrderedDict[Hashable, object], carried.tables), key, MAX_TABLES)
    return table


class _Fitting:
    """Finds the first host, by (room, id), that the request's own checks keep, among
    the groups of a list (each group's hosts by (room, id)).

    The checks of the default pipeline (CPU and memory free, hosts excluded) are read
    off the members themselves; any other check is asked host by host."""

    def __init__(
        self,
        parts: Parts,
        request: PlacementRequest,
        snapshot: Snapshot,
        base: HostBase,
    ) -> None:
        checks = [check for check in parts.checks if check.applies(request)]
        self.any = bool(checks)
        self.cpu = self.memory = 0
        self.excluded: frozenset[str] = frozenset()
        self.least = 0
        self.others: list[HostCheckPlugin] = []
        for check in checks:
            if type(check) is HostResources:
                self.cpu, self.memory = request.cpu_cores, request.host_memory_mib
                self.least = check.least_room(request, base.scale)
            elif type(check) is HostNotExcluded:
                self.excluded = request.exclude_hosts
            else:
                self.others.append(check)
        self.request = request
        self.hosts = snapshot.hosts
        self.groups = base.groups

    def keeps(self, member: Member) -> bool:
        """Whether the request's checks keep the host ``member`` stands for."""
        cpu, memory = self.cpu, self.memory
        if (cpu and member[2] < cpu) or (memory and member[3] < memory):
            return False
        if member[1] in self.excluded:
            return False
        others = self.others
        if others:
            host = self.hosts[member[1]]
            return all(check.keeps(self.request, host) for check in others)
        return True

    def first(self, entries: list[Entry], exact: bool, below: Rank | None = None) -> Rank | None:
        """The first host kept among the groups of ``entries`` (each entry a group by
        its first host); with ``exact`` the least of them all, else any (the first
        found). None when no group holds one, or (with ``below``) none that ranks
        before ``below``."""
        if not entries:
            return None
        if not self.any:
            first = (entries[0][0], entries[0][1])
            return first if below is None or first < below else None
        best = below  # a host must rank before this one
        floor: Member = (self.least, "", -1, -1)
        for room, host_id, key in entries:
            if best is not None and (room, host_id) >= best:
                break  # every host of this group and those after has more room
            members = self.groups[key]
            start = bisect_left(members, floor) if self.least else 0
            kept = self._first_kept(members, start, best)
            if kept is not None:
                best = kept
                if not exact:
                    return best
        return best if best is not below else None

    def _first_kept(self, members: list[Member], start: int, below: Rank | None) -> Rank | None:
        """The first of a group's ``members`` from position ``start`` on that the checks
        keep, if it ranks before ``below`` (None otherwise). The first member usually
        is kept: it is read by position, cheaper than an iterator."""
        if start >= len(members):
            return None
        member = members[start]
        rank = (member[0], member[1])
        if below is not None and rank >= below:
            return None
        if self.keeps(member):
            return rank
        for member in islice(members, start + 1, None):
            rank = (member[0], member[1])
            if below is not None and rank >= below:
                return None
            if self.keeps(member):
                return rank
        return None


def _best(
    parts: Parts,
    request: PlacementRequest,
    snapshot: Snapshot,
    side: BoxSide,
    base: HostBase,
    table: ClassTable,
) -> Chosen | None:
    fitting = _Fitting(parts, request, snapshot, base)
    found: dict[Raw, Rank] = {}
    sources: dict[Raw, list[list[Entry]]] = {}
    for raw, entries in table.by_raw.items():
        member = fitting.first(entries, exact=False)
        if member is not None:
            found[raw] = member
            sources[raw] = [entries]
    tight_raws: dict[TightestKey, Raw] = {}
    if table.few_active:
        scored = table.tight_scored
        few = table.nearest.few
        # where the plugins score by take shape, any of the few stands for them all
        any_few = next(iter(few.values()))
        for tight, entries in table.groups_by_tightest.items():
            box = any_few if tight[1] == ANY_BOX_CLASS else few[tight[1]]
            known = scored.get(tight)
            if known is not None and known[0] is box:
                raw = known[1]
            else:
                option = _tight_option(box, request.count, tight[0])
                raw = raw_scores(side, table.plugins, option, tight[2], table.by_shape)
                scored[tight] = (box, raw)
            tight_raws[tight] = raw
            seen = found.get(raw)
            if seen is not None and fitting.any:
                # with checks a found raw's hosts are looked for among its sources
                # again (exactly) if it wins: this list need not be searched now
                sources[raw].append(entries)
                continue
            member = fitting.first(entries, exact=False)
            if member is None:
                continue
            if seen is None or member < seen:
                found[raw] = member
            sources.setdefault(raw, []).append(entries)
    far_raws = _far_found(table, side, fitting, found, sources, request.count)
    if not found:
        return None
    totals = totals_of(parts.plugins, parts.weights, list(found))
    best = max(totals.values())
    winners = [raw for raw, total in totals.items() if total == best]
    if fitting.any:
        # the least kept host of every list of the winners: each list is searched only
        # for a host before the least found so far
        least: Rank | None = None
        for raw in winners:
            for entries in sources[raw]:
                least = fitting.first(entries, exact=True, below=least) or least
        assert least is not None  # every winner was found with a host kept
        winner = least
    else:
        winner = min(found[raw] for raw in winners)
    host = snapshot.hosts[winner[1]]
    key = base.where[host.host][0]
    options, raws = _options_of(table, side, key, request.count, far_raws, tight_raws)
    index = next(i for i, raw in enumerate(raws) if totals[raw] == best)
    rule, takes = options[index]
    return Chosen(host, rule, takes, best)


def _options_of(
    table: ClassTable,
    side: BoxSide,
    key: GroupKey,
    count: int,
    far_raws: dict[tuple[int, int, int], Raw],
    tight_raws: dict[TightestKey, Raw],
) -> tuple[list[selection.Option], list[Raw]]:
    """A group's options in the order :meth:`~.TieredChooser.parts` gives them (the
    tightest box last, unless it is one of the others), with their raw scores."""
    options = list(table.options[key[0]])
    raws = list(table.raws[key])
    far = table.far.get(key[0])
    if far is not None and options:  # parts() puts the far tier's least box last
        option = _tight_option(side.chooser.tier_box(far.tier), count, far.latency)
        options.append(option)
        raws.append(far_raws[_far_at(table, far.latency, key[1], option[1][0].supply)])
        return options, raws
    if not table.few_active:
        return options, raws  # the tightest box is within the options
    tight: tuple[BoxSupply, int, Raw] | None = None
    few_far = table.few_far_of_group.get(key)
    if few_far is not None:  # the nearest of the few tightest boxes is a far tier's least
        (ns, free), tier_id = few_far
        supply = side.chooser.tier_box(table.few_far_groups[(ns, free)][tier_id].tier)
        tight = supply, ns, far_raws[_far_at(table, ns, free, supply)]
    tight_key = table.tightest_of_group.get(key)
    if tight_key is not None:
        ns, box_class, _ = tight_key
        if box_class != ANY_BOX_CLASS:
            supply = table.nearest.few[box_class]
        else:  # filed by take shape: the class's own nearest box
            answer = table.nearest.answers[key[0]]
            if isinstance(answer, FarTightest):
                supply = side.chooser.tier_box(answer.tier)
            else:
                supply = table.nearest.few[answer[1]]
        tight = supply, ns, tight_raws[tight_key]
    if tight is not None:
        supply, ns, raw = tight
        if not any(
            len(takes) == 1 and takes[0].supply.box.box == supply.box.box for _, takes in options
        ):  # parts() puts the tightest box after the others
            options.append(_tight_option(supply, count, ns))
            raws.append(raw)
    return options, raws


def _far_found(
    table: ClassTable,
    side: BoxSide,
    fitting: _Fitting,
    found: dict[Raw, Rank],
    sources: dict[Raw, list[list[Entry]]],
    count: int,
) -> dict[tuple[int, int, int], Raw]:
    """Adds the far groups' tightest options to ``found`` and ``sources`` (as
    :func:`_best` files the others), each scored from its tier's least box now; returns
    their raw scores by (round trip, free slots, id() of the box). A tier's least box is
    asked once, an option scored once per box, and a raw present once a group of it
    keeps a host. Where the plugins score by take shape, every far tier's least box (of
    the fewest usable GPUs, see :class:`~.tiered.FarTightest`) scores alike, so the
    first one asked stands for all."""
    chooser = side.chooser
    least_of: dict[int, BoxSupply] = {}
    raws: dict[tuple[int, int, int], Raw] = {}
    plugins = table.plugins
    by_shape = table.by_shape
    both = (table.far_groups, table.few_far_groups) if table.few_active else (table.far_groups,)
    for (ns, free), lists in chain.from_iterable(far_lists.items() for far_lists in both):
        for tier_id, far_list in lists.items():
            slot = 0 if by_shape else tier_id  # by take shape one least box stands for all
            least = least_of.get(slot)
            if least is None:
                least = least_of[slot] = chooser.tier_box(far_list.tier)
            at = _far_at(table, ns, free, least)
            raw = raws.get(at)
            if raw is None:
                option = _tight_option(least, count, ns)
                raw = raws[at] = raw_scores(side, plugins, option, free, by_shape)
            entries = far_list.entries
            sources.setdefault(raw, []).append(entries)
            if fitting.any:
                if raw not in found:
                    member = fitting.first(entries, exact=False)
                    if member is not None:
                        found[raw] = member
            elif entries:
                first = (entries[0][0], entries[0][1])
                seen = found.get(raw)
                if seen is None or first < seen:
                    found[raw] = first
    return raws


def _far_at(table: ClassTable, ns: int, free: int, box: BoxSupply) -> tuple[int, int, int]:
    """Where :func:`_far_found` keeps the raw scores of ``box``'s tightest option at
    ``ns`` for ``free`` slots."""
    return (ns, free, 0 if table.by_shape else id(box))


def _pinned(
    parts: Parts,
    request: PlacementRequest,
    snapshot: Snapshot,
    side: BoxSide,
    base: HostBase,
) -> Chosen | None:
    """A pinned request: its host alone, as a run that looks at it alone answers."""
    assert request.host is not None
    host = snapshot.hosts.get(request.host)
    where = base.where.get(request.host)
    if host is None or where is None or where[0][1] < parts.min_free:
        return None
    if not all(check.keeps(request, host) for check in parts.checks if check.applies(request)):
        return None  # the run that looks at it alone says why
    first, far = side.chooser.parts(host.place)
    tight = side.chooser.tightest_link(far)
    options = list(first)
    if tight is not None:
        options.append(_tight_option(tight[1], request.count, tight[0]))
    if not options:
        return None
    free = where[0][1]
    raws = [raw_scores(side, parts.plugins, option, free, parts.by_shape) for option in options]
    totals = totals_of(parts.plugins, parts.weights, list(dict.fromkeys(raws)))
    best = max(totals.values())
    index = next(i for i, raw in enumerate(raws) if totals[raw] == best)
    rule, takes = options[index]
    return Chosen(host, rule, takes, best)


def _tight_option(supply: BoxSupply, count: int, ns: int) -> selection.Option:
    """The tightest-single-box option: every GPU requested from ``supply``."""
    return (selection.TIGHTEST_SINGLE_BOX, (Take(supply, count, ns),))


SCORE_DIGITS = 6
"""Totals are compared rounded, so float noise never beats a name."""


def totals_of(
    plugins: Sequence[ScorePlugin], weights: Sequence[float], raws: list[Raw]
) -> dict[Raw, float]:
    """The weighted total (0-100) of each distinct raw score tuple among ``raws``, as a
    run scores its proposals: each plugin normalizes its raw scores over them all,
    bounded to 0-100. Raises :class:`PluginError` for a plugin that fails."""
    weight_sum = sum(weights) or 1.0
    totals = [0.0] * len(raws)
    for position, (plugin, weight) in enumerate(zip(plugins, weights, strict=True)):
        raw = [scores[position] for scores in raws]
        try:
            normalized = plugin.normalize(raw)
        except Exception as error:
            raise PluginError(plugin.name, error) from error
        if len(normalized) != len(raw):
            raise PluginError(
                plugin.name,
                ValueError(f"normalize returned {len(normalized)} scores for {len(raw)}"),
            )
        totals = [
            total
            + weight * (value if 0.0 <= value <= MAX_SCORE else min(max(value, 0.0), MAX_SCORE))
            for total, value in zip(totals, normalized, strict=True)
        ]
    return {
        raw: round(total / weight_sum, SCORE_DIGITS)
        for raw, total in zip(raws, totals, strict=True)
    }
