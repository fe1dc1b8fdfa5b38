"""Score normalization helpers and the Status type."""

from __future__ import annotations

import pytest

from dxpool.broker.placement.framework import invert_to_best, scale_to_best
from dxpool.broker.placement.status import SUCCESS, Code, Status


def test_scale_to_best_makes_the_highest_100() -> None:
    assert scale_to_best([50.0, 25.0, 0.0]) == [100.0, 50.0, 0.0]
    assert scale_to_best([0.0, 0.0]) == [0.0, 0.0]
    assert scale_to_best([]) == []


def test_invert_to_best_makes_the_lowest_cost_100() -> None:
    assert invert_to_best([1_000.0, 2_000.0, 4_000.0]) == [100.0, 50.0, 25.0]
    assert invert_to_best([0.0, 5.0]) == [100.0, 0.0]
    assert invert_to_best([3.0, 3.0]) == [100.0, 100.0]
    assert invert_to_best([2.0, 3.0])[1] == pytest.approx(200 / 3)


def test_status_constructors() -> None:
    assert SUCCESS.ok and SUCCESS.message() == ""
    dropped = Status.unschedulable("a", "b", plugin="p")
    assert (dropped.code, dropped.reasons, dropped.plugin) == (Code.UNSCHEDULABLE, ("a", "b"), "p")
    assert not dropped.ok and dropped.message() == "a; b"
    assert Status.unresolvable("x").code is Code.UNRESOLVABLE
    assert Status.error("x").code is Code.ERROR
