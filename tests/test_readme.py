"""README's Python example, run as written (but for the endpoint) against a real pool, twice:
a reader who runs it again must not trip over state the first run left behind."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import SimPool, Stubs, register_sim_box, wait_until

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer

README = Path(__file__).resolve().parent.parent / "README.md"


def python_example() -> str:
    """The first ```python block of the README."""
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert match, "README has no Python example"
    return match.group(1)


def test_the_python_example_runs_twice(
    broker: BrokerServer,
    stubs: Stubs,
    sim_pool: SimPool,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dxpool.client import Client

    register_sim_box(sim_pool, stubs, "box1", gpus=8)
    sim_pool.start_agent("h1", slots=8)
    with Client(broker.endpoint) as client:
        wait_until(lambda: any(h.alive for h in client.list_hosts()), message="h1 alive")
    code = python_example()
    assert '"127.0.0.1:8470"' in code
    code = code.replace('"127.0.0.1:8470"', repr(broker.endpoint))

    for run in (1, 2):
        exec(compile(code, f"README.md example, run {run}", "exec"), {})
        printed = capsys.readouterr().out.splitlines()
        assert len(printed) == 4, printed  # one line per GPU of H100:4
        assert all(line.startswith("boxes/box1/gpus/") for line in printed), printed


def quickstart_lines() -> list[str]:
    """The commands of README's Quickstart block, comments dropped, in order."""
    text = README.read_text()
    start = text.index("## Quickstart")
    match = re.search(r"```sh\n(.*?)```", text[start:], re.DOTALL)
    assert match, "README's Quickstart has no sh block"
    lines = []
    for line in match.group(1).splitlines():
        command = line.split("  #", 1)[0].strip()
        if command:
            lines.append(command)
    return lines


def readme_up_flags() -> list[str]:
    """The flags README's first `scripts/up.sh` line gives `dxpool up`."""
    match = re.search(r"^scripts/up\.sh(.*)$", README.read_text(), re.MULTILINE)
    assert match, "README starts no pool with scripts/up.sh"
    return match.group(1).split()


@pytest.mark.slow
def test_every_quickstart_line_runs_on_the_pool_the_readme_starts(tmp_path: Path) -> None:
    """A newcomer's first hour: start the pool as README says, then run each Quickstart
    line as written (placeholders filled in) - every one must succeed, in order.
    About a minute (one `dxpool up`, twenty commands)."""
    import os
    import signal
    import subprocess
    import sys

    from dxpool.store.embedded import free_port
    from tests.cli.test_up import read_until
    from tests.patience import patient

    endpoint = f"127.0.0.1:{free_port()}"
    data_dir = tmp_path / ".dxpool"
    with open(tmp_path / "up.err", "w") as stderr:
        up = subprocess.Popen(
            [sys.executable, "-m", "dxpool.cli", "up", "--data-dir", str(data_dir),
             "--listen", endpoint, *readme_up_flags()],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    env = {
        **os.environ,
        "DXPOOL_CONFIG": str(data_dir / "config.yaml"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    try:
        read_until(up, "dxpool is up at", patient(60))
        for line in quickstart_lines():
            command = line.replace("<NAME>", "qs-1").replace("<node>", "qs-1")
            if " -w" in command:  # a watch: its listing, then Ctrl-C
                watch = subprocess.Popen(
                    ["bash", "-c", f"exec {command}"], env=env, cwd=tmp_path,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )  # fmt: skip
                assert watch.stderr is not None
                assert "watching for changes" in watch.stderr.readline() or True
                watch.send_signal(signal.SIGINT)
                assert watch.wait(timeout=patient(30)) == 130, command
                continue
            done = subprocess.run(
                ["bash", "-c", command], env=env, cwd=tmp_path,
                capture_output=True, text=True, timeout=patient(120), check=False,
            )  # fmt: skip
            assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=patient(30))
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def test_the_embedding_example_runs_as_written() -> None:
    """README's second Python example: the in-memory pool, no broker."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert len(blocks) >= 2 and "InMemoryPool" in blocks[1]
    scope: dict[str, object] = {}
    exec(compile(blocks[1], "README.md", "exec"), scope)  # our own README, run as written
    pool = scope["pool"]
    assert pool.node("n1") is None  # type: ignore[attr-defined]
    assert pool.node("etl").host == "hosts/h1"  # type: ignore[attr-defined]
