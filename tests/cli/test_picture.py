"""The pool picture: one glyph per GPU in exactly one category, racks and boxes in order,
a legend that counts each category, and an SVG that holds the same."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli import picture


def box(name: str, rack: str, *, active: bool = True) -> pb.Box:
    return pb.Box(
        name=f"boxes/{name}",
        state=pb.BOX_STATE_ACTIVE if active else pb.BOX_STATE_CORDONED,
        location=pb.Location(site="s1", pod="p1", rack=rack),
    )


def gpu(box_id: str, slot: int, state: int, health: int = pb.GPU_HEALTH_HEALTHY) -> pb.Gpu:
    return pb.Gpu(
        name=f"boxes/{box_id}/gpus/{slot}", box=f"boxes/{box_id}", slot=slot, state=state,
        health=health,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("state", "health", "active", "glyph"),
    [
        (pb.GPU_STATE_FREE, pb.GPU_HEALTH_HEALTHY, True, picture.FREE),
        (pb.GPU_STATE_FREE, pb.GPU_HEALTH_DEGRADED, True, picture.FREE),
        (pb.GPU_STATE_FREE, pb.GPU_HEALTH_HEALTHY, False, picture.UNAVAILABLE),
        (pb.GPU_STATE_FREE, pb.GPU_HEALTH_UNHEALTHY, True, picture.FAILING),
        (pb.GPU_STATE_ATTACHING, pb.GPU_HEALTH_HEALTHY, True, picture.ATTACHING),
        (pb.GPU_STATE_ATTACHED, pb.GPU_HEALTH_HEALTHY, False, picture.ATTACHED),
        (pb.GPU_STATE_ATTACHED, pb.GPU_HEALTH_UNHEALTHY, True, picture.FAILING),
        (pb.GPU_STATE_DETACHING, pb.GPU_HEALTH_HEALTHY, True, picture.DETACHING),
        (pb.GPU_STATE_FENCING, pb.GPU_HEALTH_HEALTHY, True, picture.FENCING),
        (pb.GPU_STATE_QUARANTINED, pb.GPU_HEALTH_HEALTHY, True, picture.FAILING),
        (pb.GPU_STATE_FAULTED, pb.GPU_HEALTH_HEALTHY, True, picture.FAILING),
    ],
)
def test_each_gpu_has_one_category(state: int, health: int, active: bool, glyph: object) -> None:
    assert picture.category(gpu("b1", 0, state, health), active) is glyph


def test_glyphs_are_distinct() -> None:
    assert len({g.char for g in picture.GLYPHS}) == len(picture.GLYPHS)


def plain(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(renderable)
    return out.getvalue()


def test_racks_then_boxes_then_slots_and_a_counting_legend() -> None:
    boxes = [box("b2", "r2", active=False), box("b1", "r1")]
    gpus = [gpu("b1", slot, pb.GPU_STATE_FREE) for slot in (3, 1, 2)]
    gpus += [gpu("b1", 0, pb.GPU_STATE_ATTACHED), gpu("b2", 0, pb.GPU_STATE_FREE)]
    lines = plain(picture.render(boxes, gpus)).splitlines()
    assert lines[:4] == [
        "rack s1/p1/r1",
        "  b1  ●○○○  3/4 free",
        "rack s1/p1/r2",
        "  b2  ⊘  0/1 free  cordoned",
    ]
    legend = " ".join(lines[5:])
    assert "○ free 3" in legend and "● attached 1" in legend
    assert "⊘ free in a cordoned box 1" in legend and "◒ fencing 0" in legend


def test_a_large_box_wraps_in_groups_of_eight() -> None:
    gpus = [gpu("b1", slot, pb.GPU_STATE_FREE) for slot in range(40)]
    lines = plain(picture.render([box("b1", "r1")], gpus)).splitlines()
    assert lines[1] == "  b1  " + " ".join(["○" * 8] * 4) + "  40/40 free"
    assert lines[2] == "      " + "○" * 8


def test_svg_holds_every_glyph_once_per_gpu_plus_the_legend(tmp_path: Path) -> None:
    gpus = [gpu("b1", slot, pb.GPU_STATE_FREE) for slot in range(5)]
    gpus.append(gpu("b1", 5, pb.GPU_STATE_QUARANTINED))
    path = tmp_path / "pool.svg"
    picture.save_svg(picture.render([box("b1", "r1")], gpus), str(path))
    svg = path.read_text()
    assert svg.startswith("<svg") and "dxpool&#160;pool" in svg  # the title
    assert svg.count(picture.FREE.char) == 5 + 1
    assert svg.count(picture.FAILING.char) == 1 + 1
    assert svg.count(picture.ATTACHED.char) == 0 + 1
