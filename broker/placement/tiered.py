"""The greedy rules of :mod:`.selection`, run once per class of host.

With a :class:`~dxpool.fabric.latency.TieredLatencyModel` the round trip between a host
and a box depends only on their classes (their racks, for the tree model), and the model
ranks every box class for a host class at once. Hosts of one class therefore get the
same choices, and those choices come from walking the ranking nearest tier first, which
usually stops after a tier or two: the cost per class is the tiers walked, not the
number of boxes, and the latency model is not asked about each (host, box) pair.

A round-trip bound (a request's ``max_latency_ns``) cuts the ranking: tiers beyond it
are out of reach, and the nearest box among them is what a failed host is told it missed.

The choices are exactly those of :func:`~dxpool.broker.placement.selection.propose` on
the host's links (same boxes, same takes, same order), which the tests check; with
switch affinity the walk feeds its tiers to the same
:class:`~dxpool.broker.placement.selection.SwitchFill` that rule uses, and a choice then
rests on every class the walk looked at until some switch held the request, as any
other walk does.

A chooser is immutable apart from its memo, and follows the supply: :meth:`advance`
makes the chooser of the next supply from the boxes that changed, sharing every class
of boxes that did not change and keeping each memoized choice that cannot have changed.
A choice records which box classes its walk looked at (the tiers it consumed; of a
large tier it read only the least box, it records that box, and stands while the tier's
least box is the same one, so a commit far away does not make every host class whose
walk reached the rest of the site choose again; when it read that box for the tightest
box alone, a moved least box is put in its place rather than walking again), and,
without a bound, the fewest usable GPUs of a box that holds the request (the
*tightest-single-box* rule's target) and whether the pool holds enough; it is kept when
none of those changed. The tightest box is found from the few classes that hold a box of
that size when there are few of them (the nearest of them, by the model's round trip),
so that rule does not make every choice depend on far tiers; when many classes hold one,
a change of that size is answered by walking the ranking for that rule alone. With few,
a walk does not go on for that rule: the nearest of the few is added when
:meth:`~TieredChooser.choose` reads the choice, and a caller that reads every class's
:meth:`~TieredChooser.parts` keeps the nearest of the few itself, from
:meth:`TieredChooser.tightest_few` (see :mod:`.nearest_few`).

A tightest box the walk found as a large tier's least box (the other rules answered
nearer) is kept as that reference (:class:`FarTightest`) for as long as it holds: the
tier's least box has the pool's fewest usable GPUs and the tiers before it hold none
with that few. The box it stands for may move with every 1-GPU compose; the answer does
not, so advance() names only the classes where it no longer holds, which costs a look
per tier, not per class.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import cast

from dxpool.broker.placement.framework import BoxSupply, Take
from dxpool.broker.placement.selection import (
    NEAREST_FIRST,
    NEAREST_SWITCH,
    Link,
    Option,
    SwitchFill,
    fill_tier,
    options,
)
from dxpool.fabric.latency import Place, TieredLatencyModel, Tiers

MAX_EXAMINED = 64
"""A choice whose walk looked at more box classes than this depends on every class."""

FEW_TIGHTEST = 128
"""At most this many classes holding the tightest box: that rule asks the model for the
round trip to each instead of walking the ranking to the nearest. Each costs a lookup
per host class that :meth:`TieredChooser.choose` reads, none for :meth:`parts` with
``nearest_few`` False (a class table keeps them, see :mod:`.nearest_few`); above it, a
change of the fewest usable GPUs makes every class walk again, and a walk that reads a
neighbouring tier for the tightest box rests on every class of it, so each commit in
that tier makes its readers walk again. The cap is generous: small requests in a busy
pool see tens of classes holding a box of the fewest free GPUs, and a size whose count
crosses the cap goes from one way to the other on many decisions (``bench/few_tightest.py``
times values against each other)."""

LARGE_TIER = 64
"""A ranking tier of more box classes than this (the rest of a site, for the tree model)
is not listed on a walk: its first box that holds the request comes from the chooser's
order of every class's first such box (see :meth:`TieredChooser._least_in`)."""

NO_BOX = 1 << 30
"""Usable GPUs standing for "no box holds the request" where a least count is kept."""

MAX_TIER_SETS = 4096
"""Tiers whose class sets are remembered (see :meth:`TieredChooser._least_in`)."""


def supply_order(supply: BoxSupply) -> tuple[int, str]:
    """The order of a supply: (usable GPUs, box id)."""
    return supply.available, supply.box.box


@dataclass(frozen=True, slots=True)
class _BoxClass:
    """The supply's boxes of one class, by (usable GPUs, box id), how many GPUs they
    hold, and the first box that holds every GPU requested (None if none does)."""

    boxes: tuple[BoxSupply, ...]
    usable: int
    fits: BoxSupply | None

    @staticmethod
    def of(boxes: Sequence[BoxSupply], count: int) -> _BoxClass:
        available = [supply.available for supply in boxes]
        first = bisect_left(available, count)
        fits = boxes[first] if first < len(boxes) else None
        return _BoxClass(tuple(boxes), sum(available), fits)


@dataclass(frozen=True, slots=True)
class Choice:
    """What the rules chose for one class of hosts.

    ``options`` as :func:`~dxpool.broker.placement.selection.options` gives them (empty
    when the boxes within reach hold too few GPUs); ``reach`` counts the usable GPUs
    within the round-trip bound; ``dropped`` is the nearest box beyond it (the first by
    (usable GPUs, box id) among equally near ones), None if none is. With switch
    affinity and no options although ``reach`` would do, ``switch`` is (usable GPUs,
    switch name) of the switch holding the most within reach.
    """

    options: list[Option]
    reach: int
    dropped: Link | None
    switch: tuple[int, str] | None = None


@dataclass(slots=True)
class _Tier:
    """The classes of one ranking tier that hold boxes of the supply, as a walk sees it.

    ``least`` is the first box of the tier's (usable GPUs, box id) order that holds the
    whole request (None if none does): the answer of every rule that looks for one box.
    :meth:`classes` lists the tier's classes, which a large tier makes only when a rule
    needs every box (a request no single box of the tier holds)."""

    latency: int
    least: BoxSupply | None
    _classes: list[_BoxClass] | None
    _numbers: tuple[int, ...] = ()
    _present: Callable[[int], _BoxClass | None] | None = None
    listed_large: bool = False  # a large tier whose classes a rule listed

    def classes(self) -> list[_BoxClass]:
        """The tier's classes that hold boxes (ascending class number)."""
        if self._classes is None:
            assert self._present is not None
            present = self._present
            self._classes = [found for n in self._numbers if (found := present(n)) is not None]
            self.listed_large = True
        return self._classes

    @property
    def numbers(self) -> tuple[int, ...]:
        """The class numbers of a large tier (the ranking's tuple)."""
        return self._numbers

    @staticmethod
    def listed(latency: int, classes: list[_BoxClass]) -> _Tier:
        """A tier whose classes are known."""
        least: BoxSupply | None = None
        for found in classes:
            fits = found.fits
            if fits is not None and (
                least is None
                or fits.available < least.available
                or (fits.available == least.available and fits.box.box < least.box.box)
            ):
                least = fits
        return _Tier(latency, least, classes)


TierLeast = tuple[tuple[int, ...], BoxSupply | None]
"""A large tier a walk read through its least box alone: the tier's class numbers (the
ranking's tuple) and the least box it read."""


_TierReaders = tuple[tuple[int, ...], frozenset[int], set[int], set[int]]
"""A large tier's readers (see ``TieredChooser._resting_on_tier``): the ranking's tuple,
its classes as a set, the host classes that read its least box for more than their
tightest box, and those whose tightest box it is (``_Memo.far``)."""


class FarTightest:
    """The tightest single box of a host class as "the least box of this large tier":
    the walk found it there (``latency`` away, the ``tier`` of the ranking, read through
    its least box alone) and the other two rules found theirs in nearer tiers. The
    tightest box then follows that tier's least box for as long as the least box has the
    fewest usable GPUs of the pool, so a box taken or freed far away changes no host
    class's answer: whoever reads it resolves it (:meth:`TieredChooser.tier_box`).

    Equal when the latency is the same and the tier is the very same tuple."""

    __slots__ = ("latency", "tier")

    def __init__(self, latency: int, tier: tuple[int, ...]) -> None:
        self.latency = latency
        self.tier = tier

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, FarTightest)
            and other.latency == self.latency
            and other.tier is self.tier
        )

    def __hash__(self) -> int:
        return hash((self.latency, id(self.tier)))

    def __repr__(self) -> str:
        return f"FarTightest({self.latency}, tier of {len(self.tier)} classes)"


Tightest = Link | FarTightest
"""The tightest single box as :meth:`TieredChooser.parts` gives it apart."""


class _Walk:
    """What a walk over a ranking's tiers rests on, filled in as it consumes them: the
    classes of the listed tiers (until more than ``MAX_EXAMINED``), and the large tiers,
    each read through its least box alone unless a rule listed its classes."""

    __slots__ = ("classes", "fewest", "large")

    def __init__(self) -> None:
        self.classes: list[int] = []
        self.large: list[_Tier] = []
        # (round trip, usable GPUs of its least box) of each tier consumed, in order
        self.fewest: list[tuple[int, int]] = []

    def fewest_before(self, latency: int) -> int:
        """The fewest usable GPUs of a box that holds the request in the tiers consumed
        nearer than ``latency`` (:data:`NO_BOX` when none holds it)."""
        return min((fewest for ns, fewest in self.fewest if ns < latency), default=NO_BOX)

    def rests_on(self) -> tuple[frozenset[int] | None, tuple[TierLeast, ...]]:
        """The classes the walk rests on (None: every class) and the large tiers it read
        through their least box: a large tier whose classes a rule listed rests on all."""
        if len(self.classes) > MAX_EXAMINED or any(tier.listed_large for tier in self.large):
            return None, ()
        return frozenset(self.classes), tuple((tier.numbers, tier.least) for tier in self.large)


_Stamp = tuple[object, tuple[tuple[int, BoxSupply], ...] | None]
"""What an unbounded choice's tightest box rests on: the fewest usable GPUs of a box that
holds the request, and the few classes holding such a box with that box (None when
there are many: the walk found it)."""


@dataclass(frozen=True, slots=True)
class _Memo:
    """A choice and what it rests on: the box classes its walk looked at (None: all),
    the tightest-box stamp it was made with, and the two rules the walk alone decides
    (nearest-first's takes, the nearest single box), kept so that only the tightest box
    is found again when just the stamp changed."""

    choice: Choice
    ranking: Tiers  # the model's ranking it walked: a class numbered since is not in it
    examined: frozenset[int] | None
    stamp: _Stamp | None
    nearest: tuple[Take, ...] | None = None
    single: Link | None = None
    base: list[Option] | None = None  # the options without the tightest rule (unbounded)
    # the large tiers the walk read through their least box alone (with ``examined``
    # not None): the choice stands while each tier's least box is the same
    leasts: tuple[TierLeast, ...] = ()
    # the tightest single box the walk found (unbounded; None where none holds the
    # request, or where it was answered from the few classes holding one); with ``far``
    # it is the box that tier's least was when ``choice`` was made, and may since have
    # moved (see :meth:`TieredChooser._far_current`)
    tightest: Link | None = None
    far: FarTightest | None = None  # the tightest box is a large tier's least box
    # with ``far``: the fewest usable GPUs of a box holding the request in the tiers
    # before it (which the memo rests on); the far answer holds while the pool's fewest
    # is below this and the far tier's least box has it (see TieredChooser._far_holds)
    nearer_fewest: int = NO_BOX


class TieredChooser:
    """Chooses boxes for ``count`` GPUs from ``supplies`` (ordered by (usable, box id)),
    for any host, memoized per host class. With ``bound``, only boxes at most ``bound``
    ns away are within reach, as a link filter with that bound would leave them. With
    ``same_switch`` the first rule is ``nearest-switch`` (every GPU under one switch).

    Safe to share between threads (a class may then be chosen twice, the same way).
    """

    def __init__(
        self,
        model: TieredLatencyModel,
        supplies: Sequence[BoxSupply],
        count: int,
        bound: int | None = None,
        *,
        same_switch: bool = False,
    ) -> None:
        box_class = model.box_class
        grouped: dict[int, list[BoxSupply]] = {}
        for supply in supplies:
            grouped.setdefault(box_class(supply.box.place), []).append(supply)
        classes = {number: _BoxClass.of(boxes, count) for number, boxes in grouped.items()}
        sizes = Counter(supply.available for supply in supplies)
        self._setup(model, count, bound, classes, sizes, same_switch)

    def _setup(
        self,
        model: TieredLatencyModel,
        count: int,
        bound: int | None,
        classes: dict[int, _BoxClass],
        sizes: Counter[int],
        same_switch: bool,
    ) -> None:
        self._model = model
        self._switch = same_switch
        self._first_rule = NEAREST_SWITCH if same_switch else NEAREST_FIRST
        self._count = count
        self._bound = bound
        self._classes = classes
        self._sizes = sizes  # boxes by usable GPUs
        self._usable = sum(size * boxes for size, boxes in sizes.items())
        self._fewest = min((size for size in sizes if size >= count), default=None)
        self._tightest: tuple[tuple[int, BoxSupply], ...] | None = None  # made when asked
        # a class's memo; None where one was dropped (set rather than deleted, so the
        # dict holds no deleted entries and advance() copies it in one flat clone)
        self._chosen: dict[int, _Memo | None] = {}
        # round trip by (host class, box class), shared along advance(): by the model's
        # contract it depends on the two classes only, and a model never changes
        self._class_ns: dict[tuple[int, int], int] = {}
        # (usable GPUs, box id, class) of every class's first box that holds the request,
        # ascending; made when a large tier is first walked, then carried along advance()
        self._fits_order: list[tuple[int, str, int]] | None = None
        # the class set of each large tier walked, by id() of the ranking's tuple (kept
        # with it); shared along advance() like the round trips
        self._tier_sets: dict[int, tuple[tuple[int, ...], frozenset[int]]] = {}
        # each large tier's least box once asked, by id() of the tuple (kept with it):
        # the classes never change, so neither does the answer
        self._tier_leasts: dict[int, tuple[tuple[int, ...], BoxSupply | None]] = {}
        # Which host classes' memos rest on a box class (those whose walk looked at it),
        # and those whose memos rest on every class: shared along advance(), only ever
        # added to, so an entry may name a memo since replaced (advance checks the
        # memo itself). A host class's walks look at the classes near it, so this holds
        # about a tier's worth of classes per host class.
        self._resting_on: dict[int, set[int]] = {}
        self._resting_on_all: set[int] = set()
        # Which host classes' memos read a large tier through its least box, by id() of
        # the tier's tuple (kept with it, and its set of classes): those that read it as
        # their tightest box alone (``_Memo.far``), and the rest; shared and only ever
        # added to, like ``_resting_on``.
        self._resting_on_tier: dict[int, _TierReaders] = {}
        # host classes whose parts() may differ from the previous chooser's; None: any
        self._changed: frozenset[int] | None = None

    def advance(self, removed: Iterable[BoxSupply], added: Iterable[BoxSupply]) -> TieredChooser:
        """The chooser of the supply that differs from this one's by ``removed`` boxes
        (as this supply holds them) and ``added`` ones. This chooser is not changed."""
        box_class = self._model.box_class
        classes = dict(self._classes)
        sizes = self._sizes.copy()
        touched: dict[int, list[BoxSupply]] = {}

        def boxes_of(number: int) -> list[BoxSupply]:
            found = touched.get(number)
            if found is None:
                known = classes.get(number)
                found = touched[number] = list(known.boxes) if known is not None else []
            return found

        for supply in removed:
            boxes = boxes_of(box_class(supply.box.place))
            at = bisect_left(boxes, supply_order(supply), key=supply_order)
            if at < len(boxes) and boxes[at] is supply:
                del boxes[at]
                sizes[supply.available] -= 1
        for supply in added:
            boxes = boxes_of(box_class(supply.box.place))
            boxes.insert(bisect_left(boxes, supply_order(supply), key=supply_order), supply)
            sizes[supply.available] += 1
        for number, boxes in touched.items():
            if boxes:
                classes[number] = _BoxClass.of(boxes, self._count)
            else:
                classes.pop(number, None)
        sizes = +sizes  # drop sizes no box has any more
        following = TieredChooser.__new__(TieredChooser)
        following._setup(self._model, self._count, self._bound, classes, sizes, self._switch)
        following._tightest = self._tightest_after(following, touched)
        following._fits_order = self._fits_order_after(classes, touched)
        following._class_ns = self._class_ns
        following._tier_sets = self._tier_sets
        following._resting_on = self._resting_on
        following._resting_on_all = self._resting_on_all
        following._resting_on_tier = self._resting_on_tier
        following._keep_memos(self, frozenset(touched))
        return following

    def _tightest_after(
        self, following: TieredChooser, touched: Mapping[int, object]
    ) -> tuple[tuple[int, BoxSupply], ...] | None:
        """``following``'s (class, tightest box) pairs from this chooser's, when both
        have the same fewest usable GPUs and few classes hold such a box here: only the
        ``touched`` classes can have gained or lost one. None (found when asked, from
        every class) otherwise."""
        few = self._tightest
        fewest = following._fewest
        if few is None or fewest != self._fewest or len(few) > FEW_TIGHTEST:
            return None
        pairs = [pair for pair in few if pair[0] not in touched]
        for number in touched:
            found = following._classes.get(number)
            if found is not None and found.fits is not None and found.fits.available == fewest:
                pairs.append((number, found.fits))
        return tuple(sorted(pairs, key=lambda pair: pair[0]))

    def _fits_order_after(
        self, classes: Mapping[int, _BoxClass], touched: Iterable[int]
    ) -> list[tuple[int, str, int]] | None:
        """The order of first fitting boxes (see ``_fits_order``) of the chooser whose
        classes are ``classes``, which differ from this one's in the ``touched`` ones;
        None when this chooser has not made its own."""
        order = self._fits_order
        if order is None:
            return None
        order = order.copy()
        for number in touched:
            known = self._classes.get(number)
            if known is not None and known.fits is not None:
                entry = _fits_entry(known.fits, number)
                at = bisect_left(order, entry)
                if at == len(order) or order[at] != entry:
                    return None  # not this chooser's order: the next makes its own
                del order[at]
            found = classes.get(number)
            if found is not None and found.fits is not None:
                insort(order, _fits_entry(found.fits, number))
        return order

    def _first_fits(self) -> list[tuple[int, str, int]]:
        """The order of every class's first box that holds the request (``_fits_order``),
        made now unless this chooser has it."""
        order = self._fits_order
        if order is None:
            order = sorted(
                _fits_entry(found.fits, number)
                for number, found in self._classes.items()
                if found.fits is not None
            )
            self._fits_order = order
        return order

    def _least_in(self, numbers: tuple[int, ...]) -> BoxSupply | None:
        """The first box by (usable GPUs, box id) among the classes ``numbers`` that holds
        the request (None if none does), from the order of every class's first such box:
        for a large tier that order's first entry of the tier is usually its first."""
        found = self._tier_leasts.get(id(numbers))
        if found is not None and found[0] is numbers:
            return found[1]
        order = self._first_fits()
        known = self._tier_sets.get(id(numbers))
        if known is None or known[0] is not numbers:
            if len(self._tier_sets) >= MAX_TIER_SETS:
                self._tier_sets.clear()
            known = self._tier_sets[id(numbers)] = (numbers, frozenset(numbers))
        members = known[1]
        least: BoxSupply | None = None
        for _, _, number in order:
            if number in members:
                least = self._classes[number].fits
                break
        self._tier_leasts[id(numbers)] = (numbers, least)
        return least

    def _keep_memos(self, before: TieredChooser, touched: frozenset[int]) -> None:
        """Keeps ``before``'s choices whose walk looked at no class that changed (see the
        module docstring); :meth:`choose` finds the tightest box again when its stamp
        changed."""
        if self._bound is None and (
            (self._usable >= self._count) != (before._usable >= before._count)
            # with no box holding the request, walks did not look for a single box
            or (self._fewest is None) != (before._fewest is None)
        ):
            return
        # a copy taken at once: decisions on ``before`` may add to its memo meanwhile
        chosen = dict(before._chosen)
        # the memos that rest on a touched class, or on every class, found from the
        # index of what memos rest on rather than by looking at every memo
        dropped: list[int] = [
            host_class
            for host_class in tuple(self._resting_on_all)
            if (memo := chosen.get(host_class)) is not None and memo.examined is None
        ]
        for number in touched:
            for host_class in tuple(self._resting_on.get(number, ())):
                memo = chosen.get(host_class)
                if memo is not None and memo.examined is not None and number in memo.examined:
                    dropped.append(host_class)
        gone = set(dropped)
        # a class whose walk read a large tier through its least box for the tightest
        # box alone gets that box again from the tier's new least box; the rest choose
        # again
        refresh = (
            self._bound is None
            and self._fewest == before._fewest
            and not before.few_tightest()
            and not self.few_tightest()
        )
        stamp = self._stamp() if refresh else None
        retightened: list[int] = []
        moved, far_lost = self._moved_leasts(before, touched, chosen)
        for host_class in far_lost:
            if host_class not in gone:
                dropped.append(host_class)
                gone.add(host_class)
        for host_class, numbers in moved:
            if host_class in gone:
                continue
            memo = chosen[host_class]
            assert memo is not None  # _moved_leasts names classes with a memo
            again = self._after_moved_least(memo, numbers, stamp) if stamp is not None else None
            if again is None:
                dropped.append(host_class)
                gone.add(host_class)
                continue
            chosen[host_class] = again
            if again.choice.options is not memo.choice.options:
                retightened.append(host_class)
        for host_class in dropped:
            if chosen.get(host_class) is not None:
                chosen[host_class] = None
        dropped.extend(retightened)
        self._chosen = chosen
        if self._bound is None and (
            self.few_tightest() != before.few_tightest()
            # many classes hold the tightest box: choose() finds it again when it moved
            or (not self.few_tightest() and self._fewest != before._fewest)
        ):
            fewest = self._fewest if before.few_tightest() else before._fewest
            if fewest is None:
                return
            if self.few_tightest() == before.few_tightest():
                # Many classes hold the tightest box before and after, and its usable
                # GPUs changed: a class whose tightest box is within its options finds
                # it again. A far one keeps its answer: those that lost it are dropped.
                dropped.extend(
                    c for c, memo in self._chosen.items() if memo is not None and memo.far is None
                )
            else:
                # The tightest box goes from apart (few classes hold one) to within the
                # options (many do), or back. A class's options within are its options
                # apart exactly when its nearest single box is a box of the fewest
                # usable GPUs (then it is the tightest box, see _retighten); a far
                # class answers its far tier either way; the rest may differ.
                for host_class, memo in self._chosen.items():
                    if (
                        memo is not None
                        and memo.far is None
                        and (memo.single is None or memo.single[1].available != fewest)
                    ):
                        dropped.append(host_class)
        self._changed = frozenset(dropped)

    def _moved_leasts(
        self, before: TieredChooser, touched: frozenset[int], chosen: Mapping[int, _Memo | None]
    ) -> tuple[list[tuple[int, tuple[int, ...]]], list[int]]:
        """The host classes among ``chosen`` whose walk read a large tier through its
        least box (:data:`TierLeast`) when that box is another here than in
        ``before``, each with that tier (a class once per tier that moved), apart from
        those whose tightest box it is (``_Memo.far``); and the far classes whose answer
        no longer holds (:meth:`_far_holds`). A far class whose tier's least box moved
        to another with the pool's fewest usable GPUs is not named: its answer, "that
        tier's least box", stands, and costs nothing here however many classes read
        the tier.
        Every memo of ``before`` that reads a tier for more than its tightest box read
        the box ``before`` holds (a memo that read another was dropped when the tier's
        least box moved), so a tier whose least box stayed leaves its readers alone, and
        only tiers holding a ``touched`` class can have moved. Every far memo of
        ``before`` holds there, so it can stop holding only where its tier's least box
        moved or the pool's fewest usable GPUs changed."""
        moved: list[tuple[int, tuple[int, ...]]] = []
        lost: list[int] = []
        fewest = self._fewest
        fewest_moved = fewest != before._fewest
        for numbers, members, readers, far_readers in tuple(self._resting_on_tier.values()):
            touched_tier = not members.isdisjoint(touched)
            if not touched_tier and not (fewest_moved and far_readers):
                continue
            least = self._least_in(numbers)
            tier_moved = touched_tier and before._least_in(numbers) is not least
            if not tier_moved and not (fewest_moved and far_readers):
                continue
            if tier_moved:
                for host_class in tuple(readers):
                    memo = chosen.get(host_class)
                    if (
                        memo is not None
                        and any(read is numbers for read, _ in memo.leasts)
                        and (memo.far is None or memo.far.tier is not numbers)
                    ):
                        moved.append((host_class, numbers))
            whole_tier = fewest is None or least is None or least.available != fewest
            if not whole_tier and not fewest_moved:
                continue  # the far readers' answer stands
            for host_class in tuple(far_readers):
                memo = chosen.get(host_class)
                if (
                    memo is not None
                    and memo.far is not None
                    and memo.far.tier is numbers
                    and (whole_tier or memo.nearer_fewest <= cast(int, fewest))
                ):
                    lost.append(host_class)
        return moved, lost

    def _after_moved_least(
        self, memo: _Memo, numbers: tuple[int, ...], stamp: _Stamp
    ) -> _Memo | None:
        """``memo`` after the least box of its large tier ``numbers`` moved, when the
        other two rules found their boxes in nearer tiers and the memo's tightest box is
        current (``stamp``, many classes holding such a box, the same before and
        after): the tiers before this one did not change (the memo rests on them), so
        the tightest box is this tier's new least box if it has the fewest usable GPUs,
        or else stays where the walk found it unless that was this tier. None when that
        does not hold (the class must choose again)."""
        if not _same_stamp(memo.stamp, stamp) or not self._far_holds(memo):
            return None
        memo = self._far_current(memo)
        nearest, single = memo.nearest, memo.single
        if nearest is None or single is None:
            return None
        latency = next((ns for ns, tier in memo.ranking if tier is numbers), None)
        if latency is None or single[0] >= latency:
            return None
        if any(take.latency_ns >= latency for take in nearest):
            return None
        least = self._least_in(numbers)
        tightest = memo.tightest
        if least is not None and least.available == stamp[0]:
            if tightest is None or tightest[0] >= latency:
                tightest = (latency, least)
        elif tightest is not None and tightest[0] == latency:
            return None  # the tier no longer holds the tightest box: a walk beyond it
        found = options(self._count, memo.nearest, memo.single, tightest, self._first_rule)
        if found == memo.choice.options:
            found = memo.choice.options  # the same object: what was derived from it holds
        leasts = tuple((read, least if read is numbers else box) for read, box in memo.leasts)
        choice = replace(memo.choice, options=found)
        if memo.far is not None and tightest is not None and tightest[0] == memo.far.latency:
            # still another tier's least box, which this move did not touch; a tier
            # before it now holding fewer usable GPUs lowers what the far answer needs
            nearer = memo.nearer_fewest
            if least is not None and latency < memo.far.latency:
                nearer = min(nearer, least.available)
            return replace(
                memo, choice=choice, leasts=leasts, tightest=tightest, nearer_fewest=nearer
            )
        return replace(
            memo, choice=choice, leasts=leasts, tightest=tightest, far=None, nearer_fewest=NO_BOX
        )

    def changed_classes(self) -> frozenset[int] | None:
        """The host classes whose :meth:`parts` (first part) may differ from what the
        chooser this one was advanced from answered, as of that advance: the classes
        whose memo was not carried over. None when any may differ (a chooser built from
        scratch, a tightest box that every walk must find again). A class the previous
        chooser never chose for is not named: the caller must know it was not asked."""
        return self._changed

    def few_tightest(self) -> bool:
        """Whether :meth:`parts` answers the tightest single box apart (unbounded, and
        at most ``FEW_TIGHTEST`` classes hold a box of the fewest usable GPUs)."""
        return self._bound is None and self._tightest_classes() is not None

    def tightest_few(self) -> tuple[tuple[int, BoxSupply], ...] | None:
        """(class, its tightest box) for each class holding a box of the fewest usable
        GPUs that holds the request, by class, when :meth:`few_tightest` (the second
        part of :meth:`parts` is then the nearest of those boxes, the lowest box id
        among equally near ones; see :mod:`.nearest_few`); None otherwise."""
        if self._bound is not None:
            return None
        return self._tightest_classes()

    @property
    def model(self) -> TieredLatencyModel:
        """The latency model the chooser ranks boxes with."""
        return self._model

    def host_class(self, host: Place) -> int:
        """The class of a host's place: hosts of one class get the same choice."""
        return self._model.host_class(host)

    def choose(self, host: Place) -> Choice:
        """What the rules choose for a host at ``host``."""
        host_class, memo = self._current(host)
        if memo.far is not None:
            current = self._far_current(memo)
            if current is not memo:
                self._chosen[host_class] = memo = current
        choice = memo.choice
        if self._bound is None and choice.reach != self._usable:
            choice = replace(choice, reach=self._usable)  # the same options, kept memoized
        return choice

    def _current(self, host: Place) -> tuple[int, _Memo]:
        """The host's class and its memo, made or brought up to this chooser's stamp
        (its tightest box found again) when it is not."""
        host_class = self._model.host_class(host)
        memo = self._chosen.get(host_class)
        ranking = self._model.ranking(host_class)
        if memo is not None and memo.ranking is not ranking:
            memo = None  # the model has numbered classes since: the walk may miss them
        if memo is not None and self._bound is None and memo.choice.options:
            if memo.far is not None:
                fresh = self._far_holds(memo)
            else:
                fresh = _same_stamp(memo.stamp, self._stamp())
            if not fresh:
                memo = self._retighten(host, host_class, memo, self._stamp())
                self._remember(host_class, memo)
        if memo is None:
            memo = self._choose(host, ranking)
            if memo.stamp is None and self._bound is None and memo.choice.options:
                memo = self._retighten(host, host_class, memo, self._stamp())  # deferred
            self._remember(host_class, memo)
        return host_class, memo

    def _far_holds(self, memo: _Memo) -> bool:
        """Whether a far memo's answer stands (see :class:`FarTightest`): its far tier's
        least box has the pool's fewest usable GPUs, and no tier before it holds a box
        with that few (they did not change since the memo was made, and held none with
        fewer than ``nearer_fewest``). Then that box is the tightest one however the
        fewest moved, and whether or not few classes hold such a box. True of a memo
        without a far tier."""
        if memo.far is None:
            return True
        fewest = self._fewest
        if fewest is None or memo.nearer_fewest <= fewest:
            return False
        least = self._least_in(memo.far.tier)
        return least is not None and least.available == fewest

    def _far_current(self, memo: _Memo) -> _Memo:
        """``memo`` with its options made from its far tier's least box as it is now
        (``memo`` itself when that box has not moved since they were made)."""
        far = memo.far
        if far is None:
            return memo
        least = self._least_in(far.tier)
        if memo.tightest is not None and memo.tightest[1] is least:
            return memo
        assert least is not None  # advance() drops a far memo whose tier holds none
        tightest = (far.latency, least)
        found = options(self._count, memo.nearest, memo.single, tightest, self._first_rule)
        leasts = tuple((read, least if read is far.tier else box) for read, box in memo.leasts)
        choice = replace(memo.choice, options=found)
        return replace(memo, choice=choice, tightest=tightest, leasts=leasts)

    def tier_box(self, tier: tuple[int, ...]) -> BoxSupply:
        """The box a :class:`FarTightest` of ``tier`` from this chooser's :meth:`parts`
        stands for now: the tier's least box."""
        least = self._least_in(tier)
        assert least is not None  # advance() drops a far memo whose tier holds none
        return least

    def tightest_link(self, tightest: Tightest | None) -> Link | None:
        """The second part of :meth:`parts` as a link (its far tier's least box now)."""
        if isinstance(tightest, FarTightest):
            return (tightest.latency, self.tier_box(tightest.tier))
        return tightest

    def parts(
        self, host: Place, *, nearest_few: bool = True
    ) -> tuple[list[Option], Tightest | None]:
        """:meth:`choose`'s options in two parts: the options of the nearest-first and
        nearest-single-box rules, and the tightest single box when it comes after them
        (None when it is one of their boxes, or is already among the options). The
        options are the first part, plus the tightest box's option when there is one.

        Lets a caller that remembers what it made of the first part keep it while only
        the tightest box moves (a 1-GPU compose into the box with the fewest free GPUs
        moves it for every host class). When few classes hold a box of the fewest usable
        GPUs (:meth:`few_tightest`) the second part is the nearest of those boxes (a
        :class:`FarTightest` where the class's walk found it as a large tier's least
        box and the rules before it answered nearer); when many do, it is a
        :class:`FarTightest` where the host class's walk found it as a large tier's
        least box (resolve it with :meth:`tier_box`), and None otherwise, the tightest
        box then being within the first part. :meth:`changed_classes` names a class
        whose two parts may differ, a :class:`FarTightest` compared by ``==``: a far
        tier's least box that moved changes neither. With ``nearest_few`` False the
        second part is None where it would be the nearest of the few (for a caller that
        keeps those itself, see :mod:`.nearest_few`)."""
        if self._bound is not None:
            return self.choose(host).options, None
        if self._tightest_classes() is None:
            _, current = self._current(host)
            if current.far is not None:
                assert current.base is not None  # every unbounded memo has one
                return current.base, current.far
            return current.choice.options, None
        host_class = self._model.host_class(host)
        memo = self._chosen.get(host_class)
        ranking = self._model.ranking(host_class)
        if memo is None or memo.ranking is not ranking or memo.base is None:
            memo = self._choose(host, ranking)
            self._remember(host_class, memo)
        base = memo.base
        assert base is not None  # every unbounded memo has one
        if memo.far is not None and self._far_holds(memo):
            return base, memo.far  # the nearest of the few is that tier's least box
        if not base or not nearest_few:
            return base, None
        tightest = self._nearest_tightest(host, host_class)
        if tightest is None:
            return base, None
        box = tightest[1].box.box
        for _, takes in base:
            if len(takes) == 1 and takes[0].supply.box.box == box:
                return base, None  # options() merges it with that one
        return base, tightest

    def _remember(self, host_class: int, memo: _Memo) -> None:
        """Keeps ``memo`` for ``host_class`` and notes what it rests on."""
        self._chosen[host_class] = memo
        if memo.examined is None:
            self._resting_on_all.add(host_class)
            return
        resting_on = self._resting_on
        for number in memo.examined:
            found = resting_on.get(number)
            if found is None:
                found = resting_on.setdefault(number, set())
            found.add(host_class)
        far = memo.far.tier if memo.far is not None else None
        for numbers, _ in memo.leasts:
            entry = self._resting_on_tier.get(id(numbers))
            if entry is None or entry[0] is not numbers:
                entry = (numbers, frozenset(numbers), set(), set())
                self._resting_on_tier[id(numbers)] = entry
            (entry[3] if numbers is far else entry[2]).add(host_class)

    def _tightest_classes(self) -> tuple[tuple[int, BoxSupply], ...] | None:
        """(class, its tightest box) for each class holding a box of the fewest usable
        GPUs that holds the request, by class; None when more than ``FEW_TIGHTEST``."""
        if self._tightest is None:
            # The classes holding such a box lead the order of first fitting boxes; past
            # FEW_TIGHTEST of them the answer is None whatever the rest, so the record
            # keeps only the first FEW_TIGHTEST + 1 (nothing reads them then).
            fewest = self._fewest
            found: list[tuple[int, BoxSupply]] = []
            for available, _, number in self._first_fits():
                if available != fewest or len(found) > FEW_TIGHTEST:
                    break
                fits = self._classes[number].fits
                assert fits is not None  # the order holds classes with a first fitting box
                found.append((number, fits))
            self._tightest = tuple(sorted(found, key=lambda pair: pair[0]))
        if len(self._tightest) > FEW_TIGHTEST:
            return None
        return self._tightest

    def _stamp(self) -> _Stamp:
        """What a choice's tightest box rests on here (see :data:`_Stamp`)."""
        return (self._fewest, self._tightest_classes())

    def _retighten(self, host: Place, host_class: int, memo: _Memo, stamp: _Stamp) -> _Memo:
        """``memo`` with the tightest box found again: from the few classes holding one,
        or, when they are many, by walking the ranking for that rule alone (the other
        two rules' answers stand while the classes their walk looked at did not change);
        the classes that walk looks at are added to what the memo rests on."""
        examined, leasts = memo.examined, memo.leasts
        far: FarTightest | None = None
        nearer = NO_BOX
        if stamp[1] is None:
            walk = _Walk()
            tightest: Link | None = None
            for tier in self._present(memo.ranking, walk):
                # the least box of a tier has its fewest usable GPUs: the tightest if any
                least = tier.least
                if least is not None and least.available == stamp[0]:
                    tightest = (tier.latency, least)
                    break
            walked, read = walk.rests_on()
            if examined is not None and walked is not None:
                examined = examined.union(walked)
                known = {id(numbers) for numbers, _ in leasts}
                leasts = (*leasts, *(pair for pair in read if id(pair[0]) not in known))
                if len(examined) > MAX_EXAMINED:
                    examined, leasts = None, ()
                else:
                    far, nearer = _far_in(tightest, walk, memo.nearest, memo.single)
            else:
                examined, leasts = None, ()
        else:
            tightest = self._nearest_tightest(host, host_class)
        found = options(self._count, memo.nearest, memo.single, tightest, self._first_rule)
        if found == memo.choice.options:
            found = memo.choice.options  # the same object: what was derived from it holds
        choice = Choice(found, self._usable, None)
        return replace(
            memo,
            choice=choice,
            examined=examined,
            stamp=stamp,
            leasts=leasts,
            tightest=tightest if stamp[1] is None else None,
            far=far,
            nearer_fewest=nearer,
        )

    def _choose(self, host: Place, ranking: Tiers) -> _Memo:
        walk = _Walk()
        tiers = self._present(ranking, walk)
        bound = self._bound
        if bound is None:
            stamp: _Stamp | None = self._stamp()
            if self._usable < self._count:
                empty: list[Option] = []
                choice = Choice(empty, self._usable, None)
                return _Memo(choice, ranking, examined=frozenset(), stamp=stamp, base=empty)
            direct: Callable[[], Link | None] | None = None
            deferred: list[bool] = []
            if self._tightest_classes() is not None:
                # the nearest of the few is asked for when choose() reads the choice:
                # parts() answers it apart, and a class table keeps it itself
                def direct() -> Link | None:
                    deferred.append(True)
                    return None

            options_, nearest, single, tightest, most = self._rules(tiers, self._fewest, direct)
            choice = Choice(options_, self._usable, None, most)
            if deferred:
                stamp = None  # the choice lacks its tightest box: choose() adds it
            base = options(self._count, nearest, single, None, self._first_rule)
            examined, leasts = walk.rests_on()
            far, nearer = None, NO_BOX
            if direct is None and examined is not None:
                far, nearer = _far_in(tightest, walk, nearest, single)
            return _Memo(
                choice,
                ranking,
                examined=examined,
                stamp=stamp,
                nearest=nearest,
                single=single,
                base=base,
                leasts=leasts,
                tightest=None if direct is not None else tightest,
                far=far,
                nearer_fewest=nearer,
            )
        within: list[_Tier] = []
        dropped: Link | None = None
        for tier in tiers:
            classes = tier.classes()
            if not classes:
                continue  # a large tier with no box of the supply
            if tier.latency > bound:
                dropped = (tier.latency, min((c.boxes[0] for c in classes), key=supply_order))
                break
            within.append(tier)
        reach = sum(c.usable for tier in within for c in tier.classes())
        if reach < self._count:
            choice = Choice([], reach, dropped)
            return _Memo(choice, ranking, examined=walk.rests_on()[0], stamp=None)
        fitting = [tier.least for tier in within if tier.least is not None]
        fewest = min(fits.available for fits in fitting) if fitting else None
        options_, _, _, _, most = self._rules(iter(within), fewest, None)
        choice = Choice(options_, reach, dropped, most)
        return _Memo(choice, ranking, examined=walk.rests_on()[0], stamp=None)

    def _nearest_tightest(self, host: Place, host_class: int) -> Link | None:
        """The tightest-single-box rule from the few classes holding such a box: the
        nearest of their tightest boxes (lowest box id among equally near ones)."""
        class_ns = self._class_ns
        best: Link | None = None
        for number, supply in self._tightest_classes() or ():
            ns = class_ns.get((host_class, number))
            if ns is None:
                # by the model's contract the classes alone decide it, as the ranking
                # files it (asking for the pair builds its path: many times slower)
                ns = self._model.class_round_trip_ns(host_class, number)
                class_ns[(host_class, number)] = ns
            if best is None or (ns, supply.box.box) < (best[0], best[1].box.box):
                best = (ns, supply)
        return best

    def _present(self, ranking: Tiers, walk: _Walk) -> Iterator[_Tier]:
        """The ranking's tiers that hold boxes of the supply, noting each tier consumed
        in ``walk``: the class numbers of a listed tier (until more than
        ``MAX_EXAMINED``: then the walk rests on every class anyway), a large tier (more
        than ``LARGE_TIER`` classes) as itself. A large tier is yielded unlisted, and may
        hold no box at all."""
        present = self._classes.get
        examined = walk.classes
        for latency, numbers in ranking:
            if len(numbers) > LARGE_TIER:
                tier = _Tier(latency, self._least_in(numbers), None, numbers, present)
                walk.large.append(tier)
            else:
                if len(examined) <= MAX_EXAMINED:  # beyond, the walk rests on every class
                    examined.extend(numbers)
                listed = [found for number in numbers if (found := present(number)) is not None]
                if not listed:
                    continue
                tier = _Tier.listed(latency, listed)
            walk.fewest.append((latency, tier.least.available if tier.least else NO_BOX))
            yield tier

    def _rules(
        self,
        tiers: Iterator[_Tier],
        fewest: int | None,
        tightest_direct: Callable[[], Link | None] | None,
    ) -> tuple[
        list[Option], tuple[Take, ...] | None, Link | None, Link | None, tuple[int, str] | None
    ]:
        """The three rules over ``tiers`` (nearest first), which hold at least ``count``
        GPUs; ``fewest`` is the fewest usable GPUs of a box among them that holds every
        GPU requested (None if no box does). With ``tightest_direct``, the walk does not
        go on for the tightest-single-box rule alone: when the tiers it needs for the
        other rules hold no such box, ``tightest_direct()`` answers. Returns the options,
        the first rule's (nearest-first, or nearest-switch), the nearest-single-box and
        the tightest-single-box rules' answers, and, when the nearest-switch rule found
        nothing, the switch holding the most (see :attr:`Choice.switch`)."""
        remaining = self._count
        fill = SwitchFill(remaining) if self._switch else None
        takes: list[Take] = []
        single: Link | None = None
        tightest: Link | None = None
        want_single = want_tightest = fewest is not None
        for tier in tiers:
            latency, least = tier.latency, tier.least
            if remaining:
                if fill is None and remaining == self._count and least is not None:
                    # Best fit of the whole request in this tier is its first box that
                    # holds it: no need to merge the classes' boxes.
                    takes.append(Take(least, remaining, latency))
                    remaining = 0
                else:
                    classes = tier.classes()
                    if len(classes) == 1:
                        boxes = list(classes[0].boxes)
                    else:
                        boxes = sorted(
                            chain.from_iterable(c.boxes for c in classes), key=supply_order
                        )
                    if fill is None:
                        remaining = fill_tier(remaining, latency, boxes, takes)
                    else:
                        filled = fill.add(latency, boxes)
                        if filled is not None:
                            takes.extend(filled)
                            remaining = 0
            if least is not None:
                # the least box holds the request with the tier's fewest usable GPUs
                if want_single:
                    single = (latency, least)
                    want_single = False
                if want_tightest and least.available == fewest:
                    tightest = (latency, least)
                    want_tightest = False
            if not (remaining or want_single or (want_tightest and tightest_direct is None)):
                break
        if want_tightest and tightest_direct is not None:
            tightest = tightest_direct()
        nearest = tuple(takes) if remaining == 0 else None
        most = fill.most() if fill is not None and nearest is None else None
        chosen = options(self._count, nearest, single, tightest, self._first_rule)
        return chosen, nearest, single, tightest, most


def _far_of(
    tightest: Link | None,
    latency: int,
    tier: tuple[int, ...],
    nearest: tuple[Take, ...] | None,
    single: Link | None,
) -> FarTightest | None:
    """The :class:`FarTightest` of a walk whose tightest box is the least box of the
    large ``tier`` (``latency`` away), when the other two rules found theirs nearer;
    None otherwise."""
    if tightest is None or tightest[0] != latency or nearest is None or single is None:
        return None
    if single[0] >= latency or any(take.latency_ns >= latency for take in nearest):
        return None
    return FarTightest(latency, tier)


def _far_in(
    tightest: Link | None,
    walk: _Walk,
    nearest: tuple[Take, ...] | None,
    single: Link | None,
) -> tuple[FarTightest | None, int]:
    """:func:`_far_of` for the large tiers ``walk`` read through their least box, with
    the fewest usable GPUs of a box holding the request in the tiers before that one
    (:data:`NO_BOX` without a far tier)."""
    if tightest is None:
        return None, NO_BOX
    for tier in walk.large:
        if tier.latency == tightest[0] and tier.least is tightest[1] and not tier.listed_large:
            far = _far_of(tightest, tier.latency, tier.numbers, nearest, single)
            return far, walk.fewest_before(tier.latency) if far is not None else NO_BOX
    return None, NO_BOX


def _fits_entry(supply: BoxSupply, number: int) -> tuple[int, str, int]:
    """A class's entry in a chooser's order of first fitting boxes."""
    return supply.available, supply.box.box, number


def _same_stamp(made: _Stamp | None, now: _Stamp) -> bool:
    """Whether a memo's stamp is ``now`` (the very same boxes, not equal ones)."""
    if made is None or made[0] != now[0]:
        return False
    few, current = made[1], now[1]
    if few is None or current is None:
        return few is None and current is None
    return len(few) == len(current) and all(
        a[0] == b[0] and a[1] is b[1] for a, b in zip(few, current, strict=True)
    )
