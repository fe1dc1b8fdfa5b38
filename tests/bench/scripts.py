"""Runs a benchmark script as a user would, for the tests of ``bench/``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_script(name: str, *arguments: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python bench/NAME ARGUMENTS...``, its output captured; never raises on its exit."""
    return subprocess.run(
        [sys.executable, str(BENCH / name), *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
