"""The trace benchmarks run end to end in --quick mode (slow), so the harness cannot rot,
and refuse bad input with a message and a non-zero exit."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from bench.traces.data import TraceError, traces_dir

REPO = Path(__file__).resolve().parents[2]


def have_traces() -> bool:
    try:
        traces_dir(None)
    except TraceError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not have_traces(), reason="no trace folder (set DXPOOL_TRACES)")
@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("bench.traces.openb", "allocated at 100%"),
        ("bench.traces.philly", "refused jobs / refused GPU-hours"),
    ],
)
def test_quick_run(module: str, expected: str, tmp_path: Path) -> None:
    plot = tmp_path / "plot.png"
    done = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--verify-refusals", "--plot", str(plot)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout
    assert "dxpool, 8 slots/host" in done.stdout
    assert "8-GPU servers, best fit" in done.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.stat().st_size > 0


@pytest.mark.parametrize(
    ("arguments", "code", "message"),
    [
        (["--traces", "/nonexistent/traces"], 1, "pass --traces DIR or set DXPOOL_TRACES"),
        (["--racks", "0"], 2, "--racks: expected a positive whole number, got '0'"),
        (["--sizes", "512,x"], 2, "--sizes: expected positive whole numbers"),
        (["--sizes", "12"], 2, "cluster sizes are positive multiples of 8 GPUs, got 12"),
    ],
)
def test_bad_input_is_a_clear_error(arguments: list[str], code: int, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.traces.philly", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == code
    assert message in done.stderr
