"""The lifeline launcher: a child started through it dies with its parent, even on SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dxpool.cli.lifeline import EXIT_NOT_FOUND, EXIT_PARENT_GONE, lifeline_argv
from tests.patience import patient

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")

# A parent that starts a sleeper through the lifeline, prints the sleeper's pid and waits.
PARENT = """
import os, signal, subprocess, sys, time
from dxpool.cli.lifeline import lifeline_argv
death = signal.Signals[sys.argv[1]]
child = subprocess.Popen(
    [*lifeline_argv(os.getpid(), death), sys.executable, "-c", "import time; time.sleep(120)"]
)
print(child.pid, flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie nobody reaped yet counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + patient(timeout_s)
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("death_signal", ["SIGKILL", "SIGTERM"])
def test_the_program_dies_when_its_parent_is_killed(death_signal: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, death_signal], stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        # Wait for the exec: from then on the pid runs the sleeper, not the launcher (whose
        # parent check would otherwise end it and hide a missing death signal).
        assert wait_until(lambda: b"dxpool.cli.lifeline" not in cmdline(child), 10)
        parent.kill()
        parent.wait()
        assert wait_until(lambda: gone(child), 5), f"pid {child} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child and not gone(child):
            os.kill(child, signal.SIGKILL)  # the failure is reported; leave nothing behind


def test_the_program_keeps_the_launchers_pid(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    launched = subprocess.Popen(
        [*lifeline_argv(os.getpid(), signal.SIGKILL), "sh", "-c", f"echo $$ > {pidfile}"]
    )
    assert launched.wait(patient(10)) == 0
    assert int(pidfile.read_text()) == launched.pid


def test_a_parent_that_died_before_the_launcher_ran_means_no_program(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # --parent names a pid that is not the launcher's parent: as if the parent had died
    # between the fork and the prctl (the launcher was then adopted by another process).
    argv = lifeline_argv(os.getpid() + 1_000_000, signal.SIGKILL)
    done = subprocess.run(
        [*argv, "touch", str(marker)], check=False, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == EXIT_PARENT_GONE
    assert "is gone; not starting touch" in done.stderr
    assert not marker.exists()


def test_a_program_that_does_not_exist_is_reported() -> None:
    done = subprocess.run(
        [*lifeline_argv(os.getpid(), signal.SIGKILL), "no-such-program-xyz"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == EXIT_NOT_FOUND
    assert "cannot run no-such-program-xyz" in done.stderr


def test_only_sigterm_and_sigkill_are_offered() -> None:
    with pytest.raises(ValueError, match="SIGTERM or SIGKILL"):
        lifeline_argv(1, signal.SIGHUP)
