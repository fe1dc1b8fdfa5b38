"""Chaos run: real etcd, brokers and host agents on a simulated fabric, broken on purpose.

The default run, part of the full suite (``pytest -m chaos`` runs it alone), keeps faults
going for 75 s against a single etcd member, with a fixed seed, and finishes in about
90 s on two cores.
``DXPOOL_CHAOS_SECONDS=N`` makes it a long run of N seconds of faults against a
3-member etcd cluster (leader kills included). Other knobs: ``DXPOOL_CHAOS_SEED``,
``DXPOOL_CHAOS_ETCD_MEMBERS`` (1 or 3), ``DXPOOL_CHAOS_KINDS`` (comma-separated fault
kinds, see :mod:`tests.chaos.faults`), ``DXPOOL_CHAOS_FENCE_BOUND`` (seconds after lease
expiry by which a lost host must be fenced) and ``DXPOOL_CHAOS_REPORT`` (write the report
as JSON there). The test fails on any violation; the report lists each one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.faults import FAULTS
from tests.chaos.harness import PoolConfig
from tests.chaos.runner import ChaosRun, RunConfig

DEFAULT_SECONDS = 75.0
LONG = bool(os.environ.get("DXPOOL_CHAOS_SECONDS"))
SECONDS = float(os.environ.get("DXPOOL_CHAOS_SECONDS") or DEFAULT_SECONDS)


def run_config() -> RunConfig:
    members = int(os.environ.get("DXPOOL_CHAOS_ETCD_MEMBERS") or (3 if LONG else 1))
    kinds = tuple(k for k in os.environ.get("DXPOOL_CHAOS_KINDS", "").split(",") if k)
    unknown = set(kinds) - FAULTS.keys()
    if unknown:
        raise pytest.UsageError(
            f"unknown DXPOOL_CHAOS_KINDS {sorted(unknown)}: use {sorted(FAULTS)}"
        )
    return RunConfig(
        seed=int(os.environ.get("DXPOOL_CHAOS_SEED") or 20240611),
        seconds=SECONDS,
        fence_bound_s=float(os.environ.get("DXPOOL_CHAOS_FENCE_BOUND") or 6.0),
        kinds=kinds,
        pool=PoolConfig(etcd_members=members),
    )


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(int(SECONDS) + 240)
def test_chaos(tmp_path: Path) -> None:
    run = ChaosRun(tmp_path / "chaos", run_config())
    report = run.run()
    print(report.render())
    destination = os.environ.get("DXPOOL_CHAOS_REPORT")
    if destination:
        report.write(Path(destination))
    assert report.faults, "no fault was injected"
    assert report.workload["acknowledged_composes"] > 0, "the load never composed a node"
    assert not report.violations, "chaos run found violations:\n" + report.render()
