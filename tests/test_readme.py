"""README's Python example, run as written (but for the endpoint) against a real pool, twice:
a reader who runs it again must not trip over state the first run left behind."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import SimPool, Stubs, register_sim_box, wait_until

if TYPE_CHECKING:
    from dxpool.broker.server import BrokerServer

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


def test_the_embedding_example_runs_as_written() -> None:
    """README's second Python example: the in-memory pool, no broker."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert len(blocks) >= 2 and "InMemoryPool" in blocks[1]
    scope: dict[str, object] = {}
    exec(compile(blocks[1], "README.md", "exec"), scope)  # our own README, run as written
    pool = scope["pool"]
    assert pool.node("n1") is None  # type: ignore[attr-defined]
    assert pool.node("etl").host == "hosts/h1"  # type: ignore[attr-defined]
