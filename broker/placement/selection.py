"""Which boxes one host takes its GPUs from: a few greedy rules, each a proposal.

Work is per box, not per GPU: a host sees each box of the supply once, with one latency.
For one host the rules are:

``nearest-first``
    Walk the boxes nearest first, one latency tier (boxes at the same round trip) at a
    time. Inside a tier, take the remaining GPUs from the box whose usable count fits
    them most tightly; if no box can hold them all, empty the box with the most usable
    GPUs and go on. Near boxes are used first, and within a tier the fewest boxes are
    broken and the tightest ones used up.
``nearest-single-box``
    The nearest box that can hold every GPU (fewest usable GPUs among equally near).
``tightest-single-box``
    The box that can hold every GPU with the fewest usable GPUs (nearest among equals),
    so a whole box stays whole for a larger node.

With switch affinity (``--affinity switch``) every GPU must come from boxes under one
top-of-rack switch, and ``nearest-first`` gives way to

``nearest-switch``
    Walk the boxes nearest first, one latency tier at a time, adding up each switch's
    usable GPUs; at the first tier where some switch holds every GPU, take that switch
    (the one holding the fewest usable GPUs so far among those, then the lowest switch
    name) and fill it as ``nearest-first`` fills, tier by tier, from its boxes alone.
    The node's farthest GPU is then as near as any one switch allows.

The single-box rules already keep to one switch, so they stay.

Identical proposals are merged. The score plugins then choose among the proposals of
every host. Every rule breaks ties by box id, so the outcome is deterministic.

Cost per host: the single-box rules bisect the links, which arrive ordered by (usable
GPUs, box id), and scan the boxes large enough; then one stable sort by latency keeps
that order inside each tier for the nearest-first rule.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from operator import itemgetter

from dxpool.broker.placement.framework import BoxSupply, Proposal, Take
from dxpool.broker.placement.model import BoxInfo, HostInfo

Link = tuple[int, BoxSupply]
"""A box as seen from one host: (round trip in ns, the box's supply)."""

_latency = itemgetter(0)

_NEVER_MET = 1 << 62
"""A count no switch holds: :func:`most_in_one_switch` only adds up."""

NEAREST_FIRST = "nearest-first"
NEAREST_SWITCH = "nearest-switch"
NEAREST_SINGLE_BOX = "nearest-single-box"
TIGHTEST_SINGLE_BOX = "tightest-single-box"


Option = tuple[str, tuple[Take, ...]]
"""One proposal before it is given a host: (rule, takes)."""


def propose(
    host: HostInfo, free_slots: int, count: int, links: list[Link], *, same_switch: bool = False
) -> list[Proposal]:
    """The distinct proposals for ``count`` GPUs on ``host``; empty if the links hold fewer
    (with ``same_switch``: if no switch's boxes among them do).

    ``links`` must be ordered by (usable GPUs, box id); it is sorted by latency in place.
    """
    tightest = tightest_single_box(count, links)
    nearest_single = nearest_single_box(count, links) if tightest is not None else None
    links.sort(key=_latency)
    if same_switch:
        nearest = nearest_switch(count, links)
        first = NEAREST_SWITCH
    else:
        nearest = nearest_first(count, links)
        first = NEAREST_FIRST
    return [
        Proposal(host, free_slots, takes, rule)
        for rule, takes in options(count, nearest, nearest_single, tightest, first)
    ]


def options(
    count: int,
    nearest: tuple[Take, ...] | None,
    nearest_single: Link | None,
    tightest: Link | None,
    first_rule: str = NEAREST_FIRST,
) -> list[Option]:
    """What the three rules chose, identical choices merged, the first rule's first.

    ``first_rule`` names the rule that chose ``nearest`` (``nearest-first``, or
    ``nearest-switch`` with switch affinity). Empty when that rule found nothing (the
    host cannot reach enough).
    """
    if nearest is None:
        return []
    found: list[Option] = [(first_rule, nearest)]
    chosen = [nearest[0].supply.box.box] if len(nearest) == 1 else []
    for rule, link in ((NEAREST_SINGLE_BOX, nearest_single), (TIGHTEST_SINGLE_BOX, tightest)):
        if link is not None and link[1].box.box not in chosen:
            chosen.append(link[1].box.box)
            found.append((rule, (Take(link[1], count, link[0]),)))
    return found


def nearest_first(count: int, links: Sequence[Link]) -> tuple[Take, ...] | None:
    """The nearest-first rule over ``links`` sorted by latency, then (usable, box id)."""
    takes: list[Take] = []
    remaining = count
    start = 0
    while remaining > 0 and start < len(links):
        latency = links[start][0]
        end = start
        while end < len(links) and links[end][0] == latency:
            end += 1
        remaining = fill_tier(remaining, latency, [link[1] for link in links[start:end]], takes)
        start = end
    return tuple(takes) if remaining == 0 else None


Switch = tuple[str, str, str, str]
"""A top-of-rack switch: (site, pod, rack, "") of a box's registered location; a box
without a full location is a switch of its own, ("", "", "", box id)."""


def switch_of(box: BoxInfo) -> Switch:
    """The switch ``box`` sits under (see :data:`Switch`)."""
    place = box.place
    if place.site and place.pod and place.rack:
        return (place.site, place.pod, place.rack, "")
    return ("", "", "", box.box)


def switch_name(switch: Switch) -> str:
    """``"dc1/p1/r1"``, or ``"boxes/b1 (no rack given)"`` for a box of its own."""
    site, pod, rack, box = switch
    return f"boxes/{box} (no rack given)" if box else f"{site}/{pod}/{rack}"


class SwitchFill:
    """The ``nearest-switch`` rule, fed one latency tier at a time, nearest first.

    :meth:`add` takes a tier's boxes and answers the takes once some switch holds
    ``count`` usable GPUs among the tiers seen (None before); :meth:`most` says which
    switch held the most when none did. Both selection paths (every link of one host,
    and the tiered chooser's walk) feed it the same tiers, so they choose alike.
    """

    __slots__ = ("_count", "_tiers", "_usable")

    def __init__(self, count: int) -> None:
        self._count = count
        self._tiers: dict[Switch, list[tuple[int, list[BoxSupply]]]] = {}
        self._usable: dict[Switch, int] = {}

    def add(self, latency: int, tier: Iterable[BoxSupply]) -> tuple[Take, ...] | None:
        """Adds a tier ``latency`` away (boxes ordered by (usable GPUs, box id)); the
        takes of the switch that now holds ``count`` GPUs, or None if none does yet.
        Call it again only while it answers None."""
        touched: dict[Switch, list[BoxSupply]] = {}
        for supply in tier:
            key = switch_of(supply.box)
            group = touched.get(key)
            if group is None:
                touched[key] = [supply]
            else:
                group.append(supply)
        complete: list[tuple[int, Switch]] = []
        usable = self._usable
        for key, group in touched.items():
            self._tiers.setdefault(key, []).append((latency, group))
            total = usable.get(key, 0) + sum(supply.available for supply in group)
            usable[key] = total
            if total >= self._count:
                complete.append((total, key))
        if not complete:
            return None
        _, chosen = min(complete)
        takes: list[Take] = []
        remaining = self._count
        for ns, group in self._tiers[chosen]:
            remaining = fill_tier(remaining, ns, list(group), takes)
            if not remaining:
                break
        return tuple(takes)

    def most(self) -> tuple[int, str] | None:
        """(usable GPUs, switch name) of the switch holding the most among the tiers
        seen, the lowest switch on ties; None before any box was seen."""
        if not self._usable:
            return None
        total, key = min((-total, key) for key, total in self._usable.items())
        return -total, switch_name(key)


def nearest_switch(count: int, links: Sequence[Link]) -> tuple[Take, ...] | None:
    """The nearest-switch rule over ``links`` sorted by latency, then (usable, box id)."""
    fill = SwitchFill(count)
    start = 0
    while start < len(links):
        latency = links[start][0]
        end = start
        while end < len(links) and links[end][0] == latency:
            end += 1
        found = fill.add(latency, [link[1] for link in links[start:end]])
        if found is not None:
            return found
        start = end
    return None


def most_in_one_switch(links: Iterable[Link]) -> tuple[int, str] | None:
    """(usable GPUs, switch name) of the switch whose boxes among ``links`` hold the
    most, the lowest switch on ties; None for no links."""
    fill = SwitchFill(_NEVER_MET)
    fill.add(0, (supply for _, supply in links))
    return fill.most()


def fill_tier(remaining: int, latency: int, tier: list[BoxSupply], takes: list[Take]) -> int:
    """Best fit inside one tier (ordered by usable, box id), ``latency`` away: appends to
    ``takes`` and returns how many GPUs are still needed. Consumes ``tier``."""
    usable = [supply.available for supply in tier]
    while remaining > 0 and tier:
        fits = bisect_left(usable, remaining)
        if fits < len(tier):
            takes.append(Take(tier[fits], remaining, latency))
            return 0
        largest = bisect_left(usable, usable[-1])  # lowest box id among the largest
        supply = tier.pop(largest)
        del usable[largest]
        takes.append(Take(supply, supply.available, latency))
        remaining -= supply.available
    return remaining


def nearest_single_box(count: int, links: Sequence[Link]) -> Link | None:
    """The nearest link whose box holds ``count`` usable GPUs, fewest usable on ties.

    ``links`` must be ordered by (usable GPUs, box id).
    """
    first = bisect_left(links, count, key=_available)
    return min(links[first:], key=_latency, default=None)


def tightest_single_box(count: int, links: Sequence[Link]) -> Link | None:
    """The link whose box holds ``count`` usable GPUs with the fewest, nearest on ties.

    ``links`` must be ordered by (usable GPUs, box id).
    """
    first = bisect_left(links, count, key=_available)
    if first == len(links):
        return None
    last = bisect_right(links, links[first][1].available, lo=first, key=_available)
    return min(links[first:last], key=_latency)


def _available(link: Link) -> int:
    return link[1].available
