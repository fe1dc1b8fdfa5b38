"""The loaning replay's harness: a small made-up trace through the broker's queue,
loaning and preemption code (fast), and the real traces' quick run (slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.sharing.replay import (
    DAY_S,
    INFERENCE,
    TRAINING,
    Replay,
    Settings,
    table,
    timeline,
)
from bench.sharing.traces import TraceError, TraceJob, openb, traces_dir

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


def test_the_timeline_says_how_many_wait_and_why() -> None:
    """Sampled every two hours under hard quotas: the samples cover the day, every
    waiting job has a reason, the training jobs beyond the guarantee wait for their
    quota, and the offered load (had every job started on arrival) exceeds what
    training holds while they wait."""
    settings = Settings(gpus=128, inference_share=0.5, grace_s=30.0, detach_s=10.0)
    run = Replay(made_up_jobs(), settings, loaning_on=False, end=DAY_S, sample_every=7200.0)
    run.run()
    samples = run.figures("made up", 1.0).samples
    assert [s.at for s in samples] == [7200.0 * i for i in range(13)]
    queued = [s for s in samples if s.waiting[TRAINING]]
    assert queued
    for sample in queued:
        assert sum(sample.reasons.values()) == sample.waiting[TRAINING] + sample.waiting[INFERENCE]
        assert sample.reasons.get("quota", 0) > 0
        assert sample.held[TRAINING] <= 64
    assert any(s.offered > s.held[TRAINING] for s in queued)
    assert 0 < sum(s.passes for s in samples) <= run.passes  # events at the last sample follow it
    assert "why training waits" in timeline(run.figures("made up", 1.0))


def write_openb(folder: Path, pods: list[tuple[int, int, int]]) -> None:
    """An openb pod list of ``(created, deleted, GPUs)`` rows."""
    target = folder / "alibaba-gpu-v2023"
    target.mkdir(parents=True)
    lines = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time"]
    for i, (created, deleted, gpus) in enumerate(pods):
        lines.append(f"p{i},1000,1024,{gpus},1000,{created},{deleted}")
    (target / "openb_pod_list_default.csv").write_text("\n".join(lines) + "\n")


def test_openb_replays_the_busy_part_and_starts_earlier_pods_with_what_they_had_left(
    tmp_path: Path,
) -> None:
    """Two pods over a long quiet start (one still alive when the busy part starts, one
    gone by then), then 298 pods a minute apart: the window starts at the busy part,
    the live pod arrives at once with the time it had left, the gone one not at all,
    and CPU-only pods are left out."""
    quiet = 100 * 86400
    pods = [(0, quiet + 600, 1), (3600, 7200, 2), (5, quiet + 10, 0)]
    pods += [(quiet + 60 * i, quiet + 60 * i + 300, 1 + i % 2) for i in range(298)]
    write_openb(tmp_path, pods)
    jobs = openb(tmp_path, 1.0)
    assert len(jobs) == 299
    assert jobs[0] == TraceJob(0.0, 600.0, 1)
    busy = sorted(job.arrival_s for job in jobs[1:])
    assert busy[0] == 0.0 and busy[-1] == 60.0 * 297
    assert all(job.duration_s == 300.0 for job in jobs[1:])
    squeezed = openb(tmp_path, 2.0)
    assert max(job.arrival_s for job in squeezed) == 30.0 * 297


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
