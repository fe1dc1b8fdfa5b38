"""bench/placement_stream.py on a small pool: both collector modes run from one build and
report the collector's time inside and outside decisions."""

from __future__ import annotations

import re

from tests.bench.scripts import run_script


def collector_rows(output: str, mode: str) -> list[list[str]]:
    table = output.split(f"| gc {mode}: collector |", 1)[1].split("\n")[2:]
    return [row.strip("|").split("|") for row in table if row.startswith("| sizes")][:1]


def test_both_collector_modes_report_their_collections_inside_and_outside() -> None:
    run = run_script(
        "placement_stream.py", "--boxes", "32", "--decisions", "300", "--streams", "sizes",
        "--gc", "default,policy", timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert re.search(r"gc default: set up .* thresholds \(700, 10, 10\)", run.stdout)
    assert re.search(r"gc policy: set up .* thresholds \(50000, 20, 100\)", run.stdout)
    assert "one full reclaim (unfreeze, collect, freeze) now" in run.stdout
    ((_, inside, *_),) = collector_rows(run.stdout, "policy")
    assert int(inside) == 0, "with the policy no collection runs inside a decision"
    ((_, inside, *_),) = collector_rows(run.stdout, "default")
    assert int(inside) > 0, "with Python's thresholds collections land inside decisions"


def test_an_unknown_collector_mode_is_a_usage_error() -> None:
    run = run_script("placement_stream.py", "--gc", "off", timeout=60)
    assert run.returncode == 2
    assert "--gc takes default, policy" in run.stderr
