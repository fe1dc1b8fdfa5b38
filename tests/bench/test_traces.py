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


def run_module(
    module: str, *arguments: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m module arguments`` from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


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
        (
            "bench.traces.openb",
            ("unallocated at 100%: dxpool", "| gpuspec33 |", "most-free-model", "targets met"),
        ),
        (
            "bench.traces.philly",
            ("refused jobs / refused GPU-hours", "dxpool, 8 slots/host", "8-GPU servers"),
        ),
    ],
)
def test_quick_run(module: str, expected: tuple[str, ...], tmp_path: Path) -> None:
    """A quick run, placement asked on every refusal the counts make (a disagreement
    stops the run), its figures printed and plotted."""
    plot = tmp_path / "plot.png"
    done = run_module(module, "--quick", "--verify-refusals", "--plot", str(plot), timeout=600)
    assert done.returncode == 0, done.stderr
    for text in expected:
        assert text in done.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.stat().st_size > 0


@pytest.mark.skipif(not have_traces(), reason="no trace folder (set DXPOOL_TRACES)")
def test_every_openb_workload_is_found_and_read_with_its_models() -> None:
    from bench.traces.data import openb_pods, openb_workloads

    traces = traces_dir(None)
    workloads = openb_workloads(traces)
    assert workloads[0] == "default"
    assert {"cpu050", "gpushare40", "gpuspec33", "multigpu50"} <= set(workloads)
    pods = openb_pods(traces, "gpuspec33", cpu_only=True)
    assert any(pod.gpus == 0 for pod in pods)
    sets = {pod.models for pod in pods if pod.models}
    assert ("V100M16", "V100M32") in sets  # "V100M16|V100M32|V100M32", each model once
    assert all(len(set(models)) == len(models) for models in sets)
    assert not any(pod.models for pod in openb_pods(traces, "multigpu50"))


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
    done = run_module("bench.traces.philly", *arguments)
    assert done.returncode == code
    assert message in done.stderr


@pytest.mark.skipif(not have_traces(), reason="no trace folder (set DXPOOL_TRACES)")
def test_the_admission_run_compares_each_reserve_with_fixed_servers() -> None:
    done = run_module(
        "bench.traces.admission", "--quick", "--min-gpus", "4", "--reserves", "2,8", timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("| 8-GPU servers, best fit |") for line in lines)
    assert any(line.startswith("| bound: one pool, refused only for capacity |") for line in lines)
    for kept in (2, 8):
        assert any(
            line.startswith(f"| one pool, nodes of 4+ GPUs leave {kept} free |") for line in lines
        )
    assert lines[-1].startswith("settings below fixed servers in every class: ")
    assert lines[-1].endswith(" of 2")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--size", "100"], "--size: a multiple of 8 GPUs (8-GPU servers), got 100"),
        (["--reserves", "4,768"], "--reserves: fewer than the cluster's 768 GPUs"),
        (["--min-gpus", "0"], "--min-gpus: expected positive whole numbers"),
    ],
)
def test_admission_bad_input_is_a_usage_error(arguments: list[str], message: str) -> None:
    done = run_module("bench.traces.admission", *arguments)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.skipif(not have_traces(), reason="no trace folder (set DXPOOL_TRACES)")
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--workloads", "default,nosuch"], "--workloads: unknown nosuch"),
        (["--clusters", "pool"], "unknown cluster 'pool'"),
        (["--slots", "0"], "--slots: expected a positive whole number"),
    ],
)
def test_openb_bad_input_is_a_usage_error(arguments: list[str], message: str) -> None:
    done = run_module("bench.traces.openb", *arguments)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.skipif(not have_traces(), reason="no trace folder (set DXPOOL_TRACES)")
def test_saved_runs_of_several_files_make_one_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Workloads saved by separate runs print as one table, with the targets judged on
    their means (here: dxpool strands more than most-free-model on b)."""
    import json

    from bench.traces.openb import DXPOOL, MOSTFREE, SERVERS, main

    def line(workload: str, cluster: str, unallocated: list[float], first: list[float]) -> str:
        seeds = list(range(42, 42 + len(unallocated)))
        return json.dumps(
            {
                "workload": workload,
                "cluster": cluster,
                "seeds": seeds,
                "unallocated_at_100": unallocated,
                "first_refusal": first,
            }
        )

    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.write_text(
        "\n".join(
            [
                line("a", DXPOOL, [0.0, 0.2], [100.0, 98.0]),
                line("a", SERVERS, [0.3, 0.3], [97.0, 97.0]),
                line("a", MOSTFREE, [0.1, 0.1], [99.0, 99.0]),
            ]
        )
    )
    two.write_text(
        "\n".join(
            [
                line("b", DXPOOL, [1.0, 1.0], [95.0, 95.0]),
                line("b", SERVERS, [2.0, 2.0], [90.0, 90.0]),
                line("b", MOSTFREE, [0.5, 0.5], [96.0, 96.0]),
            ]
        )
    )
    plot = tmp_path / "plot.png"
    assert main(["--from-saved", str(one), "--from-saved", str(two), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "| a | 0.10 ± 0.10 | 0.30 ± 0.00 | 0.10 ± 0.00 | 99.00 ± 1.00 |" in out
    assert "| b | 1.00 ± 0.00 | 2.00 ± 0.00 | 0.50 ± 0.00 |" in out
    assert "| no: unallocated |" in out
    assert "dxpool meets both targets on every workload: no" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"workload": "a"}\n')
    assert main(["--from-saved", str(bad), "--plot", str(plot)]) == 1
    assert "bad.jsonl:1: not a line --save wrote" in capsys.readouterr().err
