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

Identical proposals are merged. The score plugins then choose among the proposals of
every host. Every rule breaks ties by box id, so the outcome is deterministic.

Cost per host: the single-box rules bisect the links, which arrive ordered by (usable
GPUs, box id), and scan the boxes large enough; then one stable sort by latency keeps
that order inside each tier for the nearest-first rule.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from operator import itemgetter

from dxpool.broker.placement.framework import BoxSupply, Proposal, Take
from dxpool.broker.placement.model import HostInfo

Link = tuple[int, BoxSupply]
"""A box as seen from one host: (round trip in ns, the box's supply)."""

_latency = itemgetter(0)

NEAREST_FIRST = "nearest-first"
NEAREST_SINGLE_BOX = "nearest-single-box"
TIGHTEST_SINGLE_BOX = "tightest-single-box"


Option = tuple[str, tuple[Take, ...]]
"""One proposal before it is given a host: (rule, takes)."""


def propose(host: HostInfo, free_slots: int, count: int, links: list[Link]) -> list[Proposal]:
    """The distinct proposals for ``count`` GPUs on ``host``; empty if the links hold fewer.

    ``links`` must be ordered by (usable GPUs, box id); it is sorted by latency in place.
    """
    tightest = tightest_single_box(count, links)
    nearest_single = nearest_single_box(count, links) if tightest is not None else None
    links.sort(key=_latency)
    nearest = nearest_first(count, links)
    return [
        Proposal(host, free_slots, takes, rule)
        for rule, takes in options(count, nearest, nearest_single, tightest)
    ]


def options(
    count: int,
    nearest: tuple[Take, ...] | None,
    nearest_single: Link | None,
    tightest: Link | None,
) -> list[Option]:
    """What the three rules chose, identical choices merged, nearest-first first.

    Empty when the nearest-first rule found nothing (the host cannot reach enough).
    """
    if nearest is None:
        return []
    found: list[Option] = [(NEAREST_FIRST, nearest)]
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
