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
the host's links (same boxes, same takes, same order), which the tests check.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

from dxpool.broker.placement.framework import BoxSupply, Take
from dxpool.broker.placement.selection import Link, Option, fill_tier, options
from dxpool.fabric.latency import Place, TieredLatencyModel, Tiers


@dataclass(slots=True)
class _BoxClass:
    """The supply's boxes of one class, by (usable GPUs, box id), with their positions in
    the supply (so tiers of several classes merge by position), how many GPUs they hold,
    and the position of the first box that holds every GPU requested."""

    boxes: list[BoxSupply]
    positions: list[int]
    usable: int
    fits: int | None


@dataclass(frozen=True, slots=True)
class Choice:
    """What the rules chose for one class of hosts.

    ``options`` as :func:`~dxpool.broker.placement.selection.options` gives them (empty
    when the boxes within reach hold too few GPUs); ``reach`` counts the usable GPUs
    within the round-trip bound; ``dropped`` is the nearest box beyond it (the first by
    (usable GPUs, box id) among equally near ones), None if none is.
    """

    options: list[Option]
    reach: int
    dropped: Link | None


class TieredChooser:
    """Chooses boxes for ``count`` GPUs from ``supplies`` (ordered by (usable, box id)),
    for any host, memoized per host class. With ``bound``, only boxes at most ``bound``
    ns away are within reach, as a link filter with that bound would leave them.

    Safe to share between threads (a class may then be chosen twice, the same way).
    """

    def __init__(
        self,
        model: TieredLatencyModel,
        supplies: Sequence[BoxSupply],
        count: int,
        bound: int | None = None,
    ) -> None:
        self._model = model
        self._supplies = supplies
        self._count = count
        self._bound = bound
        available = [supply.available for supply in supplies]
        self._usable = sum(available)
        first = bisect_left(available, count)
        self._fewest = available[first] if first < len(available) else None
        box_class = model.box_class
        classes: dict[int, _BoxClass] = {}
        for position, supply in enumerate(supplies):
            number = box_class(supply.box.place)
            found = classes.get(number)
            fits = position if supply.available >= count else None
            if found is None:
                classes[number] = _BoxClass([supply], [position], supply.available, fits)
            else:
                found.boxes.append(supply)
                found.positions.append(position)
                found.usable += supply.available
                if found.fits is None:
                    found.fits = fits
        self._classes = classes
        self._chosen: dict[int, Choice] = {}

    def host_class(self, host: Place) -> int:
        """The class of a host's place: hosts of one class get the same choice."""
        return self._model.host_class(host)

    def choose(self, host: Place) -> Choice:
        """What the rules choose for a host at ``host``."""
        host_class = self._model.host_class(host)
        chosen = self._chosen.get(host_class)
        if chosen is None:
            chosen = self._choose(self._model.ranking(host_class))
            self._chosen[host_class] = chosen
        return chosen

    def _choose(self, ranking: Tiers) -> Choice:
        tiers = self._present(ranking)
        bound = self._bound
        if bound is None:
            if self._usable < self._count:
                return Choice([], self._usable, None)
            return Choice(self._rules(tiers, self._fewest), self._usable, None)
        within: list[tuple[int, list[_BoxClass]]] = []
        dropped: Link | None = None
        for latency, tier in tiers:
            if latency > bound:
                dropped = (latency, self._supplies[min(c.positions[0] for c in tier)])
                break
            within.append((latency, tier))
        reach = sum(c.usable for _, tier in within for c in tier)
        if reach < self._count:
            return Choice([], reach, dropped)
        fitting = [c.fits for _, tier in within for c in tier if c.fits is not None]
        fewest = self._supplies[min(fitting)].available if fitting else None
        return Choice(self._rules(iter(within), fewest), reach, dropped)

    def _present(self, ranking: Tiers) -> Iterator[tuple[int, list[_BoxClass]]]:
        """The ranking's tiers that hold boxes of the supply, as those boxes' classes."""
        present = self._classes.get
        for latency, numbers in ranking:
            tier = [found for number in numbers if (found := present(number)) is not None]
            if tier:
                yield latency, tier

    def _rules(
        self, tiers: Iterator[tuple[int, list[_BoxClass]]], fewest: int | None
    ) -> list[Option]:
        """The three rules over ``tiers`` (nearest first), which hold at least ``count``
        GPUs; ``fewest`` is the fewest usable GPUs of a box among them that holds every
        GPU requested (None if no box does)."""
        supplies = self._supplies
        remaining = self._count
        takes: list[Take] = []
        single: Link | None = None
        tightest: Link | None = None
        want_single = want_tightest = fewest is not None
        for latency, tier in tiers:
            if remaining:
                if len(tier) == 1:
                    boxes = tier[0].boxes.copy()
                else:
                    merged = sorted(chain.from_iterable(c.positions for c in tier))
                    boxes = [supplies[position] for position in merged]
                remaining = fill_tier(remaining, latency, boxes, takes)
            if want_single or want_tightest:
                fits = [c.fits for c in tier if c.fits is not None]
                if fits and want_single:
                    single = (latency, supplies[min(fits)])
                    want_single = False
                tight = [f for f in fits if supplies[f].available == fewest]
                if tight and want_tightest:
                    tightest = (latency, supplies[min(tight)])
                    want_tightest = False
            if not (remaining or want_single or want_tightest):
                break
        nearest = tuple(takes) if remaining == 0 else None
        return options(self._count, nearest, single, tightest)
