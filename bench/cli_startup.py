"""How long the ``dxpool`` command takes to start, against a bare Python start.

Usage: ``python bench/cli_startup.py [--runs N]``.

Runs, alternately so a loaded machine weighs on each alike, ``python -c pass`` (the
floor: the interpreter and site), ``dxpool --help`` (the root lists every command from
its table and imports none of them) and ``dxpool node --help`` (one command's module,
which brings gRPC and protobuf). Prints each one's p50 and best wall time, and the
ratio of each p50 to the floor's, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "dxpool --help": [sys.executable, "-m", "dxpool.cli", "--help"],
    "dxpool node --help": [sys.executable, "-m", "dxpool.cli", "node", "--help"],
}


def _run_once(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each command")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.runs):
        for name, command in CASES.items():
            times[name].append(_run_once(command))
    floor = statistics.median(times["python -c pass"])
    print(f"{'command':<22}{'p50 s':>8}{'best s':>8}{'p50/floor':>11}")
    for name, samples in times.items():
        p50 = statistics.median(samples)
        print(f"{name:<22}{p50:>8.3f}{min(samples):>8.3f}{p50 / floor:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
