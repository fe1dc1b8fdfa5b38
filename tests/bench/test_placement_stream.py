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


def test_a_pool_of_several_models_is_dealt_them_and_asked_for_each() -> None:
    run = run_script(
        "placement_stream.py", "--boxes", "32", "--decisions", "200", "--streams", "shapes",
        "--models", "4", timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "32 boxes x 8 GPUs of H100, A100, L40S, H200" in run.stdout
    # the decisions table's row (the collector table's comes after it)
    row = next(line for line in run.stdout.splitlines() if line.startswith("| shapes |"))
    distinct = int(row.strip("|").split("|")[2])
    assert distinct > 128, "four models make more distinct shapes than one model's 128"


def test_more_models_than_it_knows_is_a_usage_error() -> None:
    run = run_script("placement_stream.py", "--models", "5", timeout=60)
    assert run.returncode == 2
    assert "--models 1 to 4" in run.stderr
