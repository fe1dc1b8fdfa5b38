"""bench/few_tightest.py on a small pool: the caps run interleaved and decide alike."""

from __future__ import annotations

from tests.bench.scripts import run_script


def test_every_cap_makes_the_same_decisions_and_gets_a_row_per_stream() -> None:
    run = run_script(
        "few_tightest.py", "--caps", "0,2,128", "--boxes", "64", "--decisions", "150",
        "--streams", "sizes,shapes", timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split("|")[1:3] for line in run.stdout.splitlines() if line.startswith("| ")]
    assert [(stream.strip(), cap.strip()) for stream, cap in rows if cap.strip().isdigit()] == [
        (stream, cap) for stream in ("sizes", "shapes") for cap in ("0", "2", "128")
    ]
    assert "same decisions with every cap: yes" in run.stdout


def test_one_cap_is_a_usage_error() -> None:
    run = run_script("few_tightest.py", "--caps", "32", timeout=60)
    assert run.returncode == 2
    assert "--caps takes two or more whole numbers" in run.stderr
