"""The nearest of a few tightest boxes, per host class, kept up as the few change.

When at most a few box classes hold a box of the fewest usable GPUs that holds a request,
the tightest-single-box rule's answer for a host is the nearest of those boxes, the
lowest box id among equally near ones (:meth:`.TieredChooser.parts` answers it apart).
A class table files every host class by that answer, and the few change with almost
every compose of that size; :class:`NearestFew` keeps the answers of every host class
and says, on each change, which ones moved.

A host class's answer comes from walking its ranking nearest tier first to the first
tier holding one of the few classes:

* a listed tier (at most ``LARGE_TIER`` classes): the lowest box id among the few
  classes there, as ``(round trip, box class)``;
* a large tier (the rest of a site, for the tree model): a
  :class:`~dxpool.broker.placement.tiered.FarTightest` of that tier. Its least box is
  the lowest-id box of the fewest usable GPUs in it, so the answer stands however the
  few boxes inside that tier change, for as long as it holds one; whoever reads it
  resolves the box (:meth:`.TieredChooser.tier_box`).

Host classes whose rankings are the very same tiers from their first large tier on form
a **group** (a tree model's racks of one pod); the classes of the tiers before that are
the group's **near classes** (the pod). A group whose near classes hold none of the few
answers alike for every member, from its shared remainder, so a pod is answered at once.
What each group's answers rest on is indexed: its near classes, the classes of the
listed tiers its remainder walked, and the large tiers it walked. A change of the few
(a class joins, leaves, or its box of the fewest GPUs is another) answers again only the
groups that rest on a class that changed, or on a large tier that came to hold one of
the few or ceased to; the cost is per group touched, not per host class of the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dxpool.broker.placement.framework import BoxSupply
from dxpool.broker.placement.tiered import LARGE_TIER, FarTightest
from dxpool.fabric.latency import TieredLatencyModel, Tiers

Nearest = tuple[int, int] | FarTightest
"""A host class's nearest tightest box: (round trip, the box class holding it), or the
least box of a large tier (:class:`FarTightest`)."""

TierList = tuple[tuple[int, tuple[int, ...]], ...]
"""Tiers of a ranking, (round trip, box classes) nearest first."""


class _Group:
    """Host classes whose rankings are the same tiers from the first large one on."""

    __slots__ = ("members", "near", "rest", "rest_answer")

    def __init__(self, rest: TierList) -> None:
        self.rest = rest  # the shared tiers, from the first large one on
        # host class -> its tiers before ``rest``, as (round trip, set of classes)
        self.members: dict[int, tuple[tuple[int, frozenset[int]], ...]] = {}
        self.near: set[int] = set()  # the classes of every member's tiers before ``rest``
        self.rest_answer: Nearest | None = None


class NearestFew:
    """Every host class's nearest box among the few classes of the fewest usable GPUs
    (see the module docstring), brought up to date by :meth:`update`.

    Made for one latency model whose rankings do not change: when the model numbers a
    class (a ranking is another object), :meth:`reset` and answer afresh."""

    def __init__(self, model: TieredLatencyModel) -> None:
        self._model = model
        self._few: dict[int, BoxSupply] = {}
        self.answers: dict[int, Nearest] = {}
        self._groups: dict[tuple[tuple[int, int], ...], _Group] = {}
        self._group_of: dict[int, _Group] = {}
        # what groups rest on: a class (near, or in a listed tier their remainder walked),
        # a large tier (by id() of the ranking's tuple, kept with it and its class set)
        self._on_class: dict[int, set[_Group]] = {}
        self._on_tier: dict[int, tuple[tuple[int, ...], frozenset[int], set[_Group]]] = {}
        self._tier_holds: dict[int, bool] = {}  # large tier id -> holds one of the few
        self._unanswered: set[int] = set()  # joined since the last update

    @property
    def few(self) -> dict[int, BoxSupply]:
        """The few as of the last :meth:`update`: box class -> its box of the fewest
        usable GPUs (read it, never write)."""
        return self._few

    def reset(self) -> None:
        """Forgets every answer and group (the model's rankings changed)."""
        self._few = {}
        self.answers = {}
        self._groups.clear()
        self._group_of.clear()
        self._on_class.clear()
        self._on_tier.clear()
        self._tier_holds.clear()
        self._unanswered.clear()

    def join(self, host_classes: Iterable[int]) -> None:
        """Files host classes in their groups (what does not depend on the few), to be
        answered at the next :meth:`update`: a caller that knows its classes early
        spares the update that first answers them the work."""
        for host_class in host_classes:
            if host_class not in self._group_of:
                self._join(host_class)
                self._unanswered.add(host_class)

    def update(
        self, few: Sequence[tuple[int, BoxSupply]], host_classes: Iterable[int] = ()
    ) -> list[int]:
        """Brings the answers up to ``few`` (each class holding a box of the fewest usable
        GPUs, with that box; not empty) for every class joined and ``host_classes``
        (those answered before stay answered). Returns the host classes whose answer is
        new or changed."""
        self.join(host_classes)
        now = dict(few)
        before = self._few
        changed = [n for n in now.keys() | before.keys() if now.get(n) is not before.get(n)]
        self._few = now
        touched: set[_Group] = set()
        if changed:
            on_class = self._on_class
            for number in changed:
                touched.update(on_class.get(number, ()))
            # a large tier comes to hold one of the few or ceases to only as classes
            # join or leave them (not as a class's box of the fewest is another)
            came_or_went = now.keys() ^ before.keys()
            if came_or_went:
                holds = self._tier_holds
                for tier_id, (_, members, groups) in self._on_tier.items():
                    if not members.isdisjoint(came_or_went):
                        held = not members.isdisjoint(now)
                        if held != holds[tier_id]:
                            holds[tier_id] = held
                            touched.update(groups)
        moved: list[int] = []
        unanswered = self._unanswered
        for group in touched:
            self._answer_rest(group)
            near_few = self._near_few(group)
            for host_class in group.members:
                unanswered.discard(host_class)
                if self._set(host_class, _answer(group, host_class, near_few)):
                    moved.append(host_class)
        for host_class in unanswered:
            group = self._group_of[host_class]
            if self._set(host_class, _answer(group, host_class, self._near_few(group))):
                moved.append(host_class)
        unanswered.clear()
        return moved

    def _near_few(self, group: _Group) -> list[tuple[str, int]]:
        """The few classes among the group's near classes, as (box id, class) by box id."""
        near = group.near
        return sorted((box.box.box, number) for number, box in self._few.items() if number in near)

    def _set(self, host_class: int, found: Nearest | None) -> bool:
        """Records a host class's answer (None: none, no class of its ranking holds
        one of the few); whether it differs from the one it had."""
        answers = self.answers
        if found is None:
            return answers.pop(host_class, None) is not None
        if answers.get(host_class) == found:
            return False
        answers[host_class] = found
        return True

    def _join(self, host_class: int) -> _Group:
        """Files a host class in its group, answering the group's remainder when new."""
        ranking: Tiers = self._model.ranking(host_class)
        first_large = next(
            (at for at, (_, tier) in enumerate(ranking) if len(tier) > LARGE_TIER), len(ranking)
        )
        rest = tuple(ranking[first_large:])
        key = tuple((ns, id(tier)) for ns, tier in rest)
        group = self._groups.get(key)
        if group is None or any(
            mine is not theirs for (_, mine), (_, theirs) in zip(group.rest, rest, strict=True)
        ):
            group = self._groups[key] = _Group(rest)
            self._answer_rest(group)
        near = tuple(ranking[:first_large])
        group.members[host_class] = tuple((ns, frozenset(tier)) for ns, tier in near)
        self._group_of[host_class] = group
        on_class = self._on_class
        for _, tier in near:
            for number in tier:
                if number not in group.near:
                    group.near.add(number)
                    on_class.setdefault(number, set()).add(group)
        return group

    def _answer_rest(self, group: _Group) -> None:
        """Finds the answer of the group's remainder, noting what it walked."""
        few = self._few
        answer: Nearest | None = None
        for ns, tier in group.rest:
            if len(tier) > LARGE_TIER:
                if self._holds(tier, group):
                    answer = FarTightest(ns, tier)
                    break
                continue
            on_class = self._on_class
            for number in tier:
                on_class.setdefault(number, set()).add(group)
            answer = _lowest_id(ns, tier, few)
            if answer is not None:
                break
        group.rest_answer = answer

    def _holds(self, tier: tuple[int, ...], group: _Group) -> bool:
        """Whether the large ``tier`` holds one of the few classes; ``group`` rests on it."""
        entry = self._on_tier.get(id(tier))
        if entry is None or entry[0] is not tier:
            entry = (tier, frozenset(tier), set())
            self._on_tier[id(tier)] = entry
            self._tier_holds[id(tier)] = any(number in entry[1] for number in self._few)
        entry[2].add(group)
        return self._tier_holds[id(tier)]


def _answer(group: _Group, host_class: int, near_few: list[tuple[str, int]]) -> Nearest | None:
    """A member's answer: its own tiers before the group's remainder (the first holding
    one of ``near_few``, the few among the group's near classes by box id), then that."""
    if near_few:
        for ns, tier in group.members[host_class]:
            for _, number in near_few:
                if number in tier:
                    return (ns, number)
    return group.rest_answer


def _lowest_id(ns: int, tier: tuple[int, ...], few: dict[int, BoxSupply]) -> tuple[int, int] | None:
    """(``ns``, the class of the lowest box id) among the few classes of a listed tier;
    None when it holds none of them."""
    best: tuple[str, int] | None = None
    for number in tier:
        box = few.get(number)
        if box is not None and (best is None or box.box.box < best[0]):
            best = (box.box.box, number)
    return None if best is None else (ns, best[1])
