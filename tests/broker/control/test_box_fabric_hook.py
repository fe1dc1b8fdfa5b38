"""HookBoxFabric (the broker's fence and scrub through an operator's executable), run
against the test proxy hook: a real program keeping a real mapping table, the same one
the agent's command-hook mapper programs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dxpool.broker.control.box_fabric import BoxFabricError
from dxpool.broker.control.box_fabric_hook import HookBoxFabric
from dxpool.errors import InvalidArgument
from dxpool.hostagent.drivers.command_hook import CommandHookMapper
from dxpool.hostagent.errors import DriverError
from dxpool.names import GpuRef
from tests.hostagent.proxy_hook import (
    box_log,
    fail_box_side,
    read_table,
    write_proxy_hook,
    write_script,
)

GPU0 = GpuRef("b1", 0)
GPU1 = GpuRef("b1", 1)


@pytest.fixture
def hook(tmp_path: Path) -> Path:
    return write_proxy_hook(tmp_path / "proxy")


def test_fence_revokes_the_gpu_wherever_it_is_mapped_and_refuses_its_generation(
    hook: Path,
) -> None:
    CommandHookMapper(hook, "h1").map(GPU0, 0, generation=5)
    CommandHookMapper(hook, "h2").map(GPU1, 0, generation=2)
    box = HookBoxFabric(hook)

    box.fence(GPU0, generation=5)
    box.fence(GPU0, generation=5)  # idempotent

    assert read_table(hook) == {"h1": {}, "h2": {0: GPU1}}
    assert [entry["mapped"] for entry in box_log(hook)] == [[["h1", 0]], []]
    # A stale agent's late map of the fenced generation is refused by the proxy.
    with pytest.raises(DriverError, match="generation 5 of b1/0 is fenced") as late:
        CommandHookMapper(hook, "h1").map(GPU0, 0, generation=5)
    assert not late.value.retryable
    CommandHookMapper(hook, "h2").map(GPU0, 1, generation=6)  # the next assignment maps


def test_a_late_fence_leaves_a_newer_assignments_mapping_alone(hook: Path) -> None:
    CommandHookMapper(hook, "h2").map(GPU0, 0, generation=7)

    HookBoxFabric(hook).fence(GPU0, generation=6)  # a deposed leader's late fence

    assert read_table(hook) == {"h2": {0: GPU0}}


def test_scrub_runs_after_the_fence_and_is_refused_while_mapped(hook: Path) -> None:
    CommandHookMapper(hook, "h1").map(GPU0, 0, generation=1)
    box = HookBoxFabric(hook)

    with pytest.raises(BoxFabricError, match=r"reports a mapping conflict: b1/0 is mapped to h1"):
        box.scrub(GPU0, generation=1)
    box.fence(GPU0, generation=1)
    box.scrub(GPU0, generation=1)

    assert [(e["op"], e["generation"]) for e in box_log(hook)] == [
        ("fence-gpu", 1),
        ("scrub-gpu", 1),
    ]


def test_a_failing_hook_fails_the_fence_with_its_stderr(hook: Path) -> None:
    CommandHookMapper(hook, "h1").map(GPU0, 0, generation=1)
    fail_box_side(hook, "fence-gpu", True)

    with pytest.raises(BoxFabricError, match=r"failed with exit status 1: .*injected failure"):
        HookBoxFabric(hook).fence(GPU0, generation=1)

    assert read_table(hook) == {"h1": {0: GPU0}}  # nothing revoked, nothing claimed
    fail_box_side(hook, "fence-gpu", False)
    HookBoxFabric(hook).fence(GPU0, generation=1)
    assert read_table(hook) == {"h1": {}}


def test_the_hook_gets_the_gpu_and_generation(tmp_path: Path) -> None:
    seen = tmp_path / "argv"
    script = write_script(
        tmp_path / "hook",
        f"import json, sys\nopen({str(seen)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n",
    )
    box = HookBoxFabric(script)
    box.fence(GpuRef("box-7", 3), generation=12)
    box.scrub(GpuRef("box-7", 3), generation=12)
    assert seen.read_text().splitlines() == [
        '["fence-gpu", "box-7", "3", "12"]',
        '["scrub-gpu", "box-7", "3", "12"]',
    ]


@pytest.mark.parametrize(
    ("body", "timeout_s", "expected"),
    [
        # A hook that finishes is given time to start even on a loaded machine; only the
        # one that never finishes is held to a short bound.
        ("import sys\nsys.exit(4)\n", 60.0, "refused the operation and wrote nothing to stderr"),
        ("print('done')\n", 60.0, "printed output that is not JSON"),
        ("import time\ntime.sleep(30)\n", 0.3, r"did not finish within 0\.3s and was killed"),
    ],
)
def test_hook_failures_are_box_fabric_errors(
    tmp_path: Path, body: str, timeout_s: float, expected: str
) -> None:
    box = HookBoxFabric(write_script(tmp_path / "hook", body), timeout_s=timeout_s)
    with pytest.raises(BoxFabricError, match=expected):
        box.fence(GPU0, generation=1)


def test_a_path_that_is_not_an_executable_is_refused_up_front(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="is not an executable file"):
        HookBoxFabric(tmp_path / "missing")
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(InvalidArgument, match="is not an executable file"):
        HookBoxFabric(plain)
    with pytest.raises(InvalidArgument, match="timeout must be > 0"):
        HookBoxFabric(write_script(tmp_path / "ok", ""), timeout_s=0)
