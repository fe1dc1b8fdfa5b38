"""``dxpool up`` as a real process: start, compose a node with the CLI, Ctrl-C, nothing left."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from dxpool.cli.main import cli
from dxpool.store.embedded import free_port


def processes_mentioning(text: str) -> list[str]:
    """Command lines of running processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


def read_until(process: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """Stdout of ``process`` up to the line containing ``marker``; fails on exit or timeout."""
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    seen = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if selector.select(timeout=0.2):
            line = process.stdout.readline()
            seen += line
            if marker in line:
                return seen
            if not line:
                break
    raise AssertionError(f"no {marker!r} from dxpool up (exit {process.poll()}); got {seen!r}")


def test_up_serves_a_pool_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    data_dir = tmp_path / "pool"
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        sys.executable, "-m", "dxpool.cli", "up",
        "--data-dir", str(data_dir), "--listen", endpoint,
        "--boxes", "2", "--gpus-per-box", "4", "--hosts", "2", "--slots", "4",
    ]  # fmt: skip
    with open(tmp_path / "up.err", "w") as stderr:
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        banner = read_until(process, "dxpool is up at", timeout_s=60)
        assert f"dxpool is up at {endpoint}: 2 hosts, 2 boxes of 4 H100" in banner
        assert process.stdout is not None
        assert "node create --gpus H100:2 --wait" in process.stdout.readline()  # the hint

        runner = CliRunner()
        created = runner.invoke(
            cli,
            ["--endpoint", endpoint, "node", "create", "--gpus", "H100:2", "--wait", "-o", "json"],
        )
        assert created.exit_code == 0, created.output
        assert json.loads(created.stdout)["state"] == "NODE_STATE_READY"
        assert len(processes_mentioning(str(data_dir))) == 4  # up itself, etcd, two agents

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert processes_mentioning(str(data_dir)) == []
    assert "stopped" in (tmp_path / "up.err").read_text()
    assert (data_dir / "logs" / "agent-h1.log").exists()
