"""The loaning replay's harness: a small made-up trace through the broker's queue,
loaning and preemption code (fast), and the real traces' quick run (slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.sharing.replay import DAY_S, INFERENCE, TRAINING, Replay, Settings, table
from bench.sharing.traces import TraceError, TraceJob, traces_dir

REPO = Path(__file__).resolve().parents[2]


def made_up_jobs() -> list[TraceJob]:
    """Training that alone would fill the pool for most of a day: 16 jobs of 8 GPUs
    for 20 hours each (elastic down to 4), and a stream of short 1-GPU jobs."""
    jobs = [TraceJob(60.0 * i, 20 * 3600.0, 8) for i in range(16)]
    jobs += [TraceJob(3600.0 + 300.0 * i, 1800.0, 1) for i in range(100)]
    return jobs


def replay(loaning: bool) -> Replay:
    settings = Settings(gpus=128, inference_share=0.5, grace_s=30.0, detach_s=10.0)
    run = Replay(made_up_jobs(), settings, loaning_on=loaning, end=DAY_S)
    run.run()
    return run


def test_hard_quotas_never_preempt_and_cap_training_at_its_guarantee() -> None:
    run = replay(False)
    figures = run.figures("made up", 1.0)
    assert figures.preempted_jobs == figures.shrinks == 0
    assert run.tenants[TRAINING].usage.borrowed_gpus == 0
    assert figures.delays[TRAINING] and max(figures.delays[TRAINING]) > 3600  # it queued
    assert not figures.reclaim_waits


def test_loaning_lends_idle_inference_capacity_and_takes_it_back_in_grace() -> None:
    hard = replay(False).figures("made up", 1.0)
    run = replay(True)
    lent = run.figures("made up", 1.0)
    assert lent.utilisation > hard.utilisation
    assert lent.shrinks + lent.preempted_jobs > 0  # the services' evening peak reclaimed
    assert lent.reclaim_waits
    # the owner gets its GPUs back within the borrowers' notice and a detach
    assert max(lent.reclaim_waits) <= 30.0 + 10.0 + 300.0
    usage = run.tenants[INFERENCE].usage
    assert usage.borrowed_gpus == 0  # inference never borrows
    assert "| made up | loaning |" in table([hard, lent])


def have_traces() -> bool:
    try:
        traces_dir(None)
    except TraceError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not have_traces(), reason="no trace folder (set DXPOOL_TRACES)")
def test_the_trace_replay_runs_end_to_end() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.sharing.replay",
            "--trace",
            "both",
            "--days",
            "0.5",
            "--gpus",
            "256",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "| philly | loaning |" in done.stdout and "| openb" in done.stdout


def test_a_missing_trace_folder_is_a_usage_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.sharing.replay", "--traces", str(tmp_path / "none")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "no trace folder" in done.stderr
