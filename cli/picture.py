"""``dxpool status --picture``: the pool drawn as racks of boxes of GPU glyphs.

Each GPU is one glyph, in slot order, boxes grouped by the rack of their location
(``site/pod/rack``). Every GPU falls in exactly one category (:func:`category`), so the
legend's counts add up to the pool. The same picture renders to a terminal (with colour),
to plain text, and to SVG (``Console(record=True).save_svg``).
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby

from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.text import Text

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.views import location, short

# Glyphs per row of a box before it wraps (a box of 64 GPUs takes 2 rows).
GLYPHS_PER_ROW = 32
_GROUP = 8  # a blank after every 8 glyphs, so slots can be counted at a glance


@dataclass(frozen=True)
class Glyph:
    """How one category of GPU is drawn."""

    key: str
    char: str
    style: str
    label: str


FREE = Glyph("free", "○", "green", "free")
ATTACHING = Glyph("attaching", "◔", "cyan", "attaching")
ATTACHED = Glyph("attached", "●", "blue", "attached")
DETACHING = Glyph("detaching", "◑", "yellow", "detaching")
FENCING = Glyph("fencing", "◒", "magenta", "fencing")
FAILING = Glyph("failing", "✖", "bold red", "quarantined/faulted/unhealthy")
UNAVAILABLE = Glyph("unavailable", "⊘", "bright_black", "free in a cordoned box")
GLYPHS: tuple[Glyph, ...] = (FREE, ATTACHING, ATTACHED, DETACHING, FENCING, FAILING, UNAVAILABLE)

_BY_STATE = {
    pb.GPU_STATE_ATTACHING: ATTACHING,
    pb.GPU_STATE_ATTACHED: ATTACHED,
    pb.GPU_STATE_DETACHING: DETACHING,
    pb.GPU_STATE_FENCING: FENCING,
    pb.GPU_STATE_QUARANTINED: FAILING,
    pb.GPU_STATE_FAULTED: FAILING,
}


def category(gpu: pb.Gpu, box_active: bool) -> Glyph:
    """The one glyph of ``gpu``: unhealthy, quarantined or faulted GPUs are FAILING
    whatever their state; otherwise by state, and a FREE GPU of a cordoned box is
    UNAVAILABLE (a compose may not take it)."""
    if gpu.health == pb.GPU_HEALTH_UNHEALTHY:
        return FAILING
    if gpu.state == pb.GPU_STATE_FREE:
        return FREE if box_active else UNAVAILABLE
    return _BY_STATE.get(gpu.state, FAILING)


def counts(boxes: Sequence[pb.Box], gpus: Iterable[pb.Gpu]) -> Counter[str]:
    """How many GPUs fall in each category (by :attr:`Glyph.key`)."""
    active = {b.name: b.state == pb.BOX_STATE_ACTIVE for b in boxes}
    return Counter(category(g, active.get(g.box, False)).key for g in gpus)


def _glyph_rows(glyphs: Sequence[Glyph]) -> list[Text]:
    rows = []
    for start in range(0, len(glyphs), GLYPHS_PER_ROW):
        row = Text()
        for index, glyph in enumerate(glyphs[start : start + GLYPHS_PER_ROW]):
            if index and index % _GROUP == 0:
                row.append(" ")
            row.append(glyph.char, style=glyph.style)
        rows.append(row)
    return rows or [Text("(no GPUs)", style="bright_black")]


def render(boxes: Sequence[pb.Box], gpus: Sequence[pb.Gpu]) -> RenderableType:
    """The picture: per rack, per box, its GPUs in slot order; then the legend with the
    number of GPUs in each category."""
    by_box: dict[str, list[pb.Gpu]] = {}
    for gpu in gpus:
        by_box.setdefault(gpu.box, []).append(gpu)
    width = max((len(short(b.name)) for b in boxes), default=0)
    parts: list[RenderableType] = []

    def rack_of(box: pb.Box) -> str:
        return location(box.location)

    for rack, members in groupby(sorted(boxes, key=lambda b: (rack_of(b), b.name)), rack_of):
        parts.append(Text(f"rack {rack}", style="bold"))
        for box in members:
            active = box.state == pb.BOX_STATE_ACTIVE
            slots = sorted(by_box.get(box.name, []), key=lambda g: g.slot)
            glyphs = [category(g, active) for g in slots]
            free = sum(1 for g in glyphs if g is FREE)
            note = "" if active else "  cordoned"
            for index, row in enumerate(_glyph_rows(glyphs)):
                line = Text(f"  {(short(box.name) if index == 0 else ''):<{width}}  ")
                line.append_text(row)
                if index == 0:
                    line.append(f"  {free}/{len(slots)} free{note}", style="bright_black")
                parts.append(line)
    if not boxes:
        parts.append(Text("no boxes registered", style="bright_black"))
    tally = counts(boxes, gpus)
    legend = [
        Text.assemble((glyph.char, glyph.style), f" {glyph.label} {tally.get(glyph.key, 0)}")
        for glyph in GLYPHS
    ]
    parts += [Text(""), Columns(legend, padding=(0, 3))]
    return Group(*parts)


def save_svg(picture: RenderableType, path: str, *, title: str = "dxpool pool") -> None:
    """Write ``picture`` to ``path`` as SVG (rich's terminal export, colours kept)."""
    console = Console(record=True, width=120, file=io.StringIO(), force_terminal=True)
    console.print(picture)
    console.save_svg(path, title=title)


__all__ = [
    "ATTACHED",
    "ATTACHING",
    "DETACHING",
    "FAILING",
    "FENCING",
    "FREE",
    "GLYPHS",
    "UNAVAILABLE",
    "Glyph",
    "category",
    "counts",
    "render",
    "save_svg",
]
