"""Tables and plots shared by the trace benchmarks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SIZE_CLASSES = ((1, 1, "1"), (2, 3, "2"), (4, 7, "4"), (8, 8, "8"), (9, 1 << 30, "16+"))
"""(smallest, largest, label) GPUs per job of each size class."""


def size_class(gpus: int) -> str:
    """The label of the size class ``gpus`` falls in (2-3 count as 2, 4-7 as 4)."""
    for low, high, label in SIZE_CLASSES:
        if low <= gpus <= high:
            return label
    raise ValueError(f"no size class for {gpus} GPUs")


def positive_ints(text: str) -> list[int]:
    """An argparse type: ``512,768`` -> [512, 768], every number at least 1."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive whole numbers separated by commas, got {text!r}"
        )
    return values


def positive_int(text: str) -> int:
    """An argparse type: one whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (so it pastes into RESULTS.md as is)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot() -> Any | None:
    """matplotlib's pyplot on a file-only backend, or None (with a message on stderr
    saying how to install it) when matplotlib is missing."""
    try:
        import matplotlib  # optional: only the plot needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed, so no plot is drawn: pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return None
    return plt


def save(figure: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    print(f"plot written to {path}")
