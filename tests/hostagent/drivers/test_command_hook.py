"""CommandHookMapper against small real executables written by the tests."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from dxpool.hostagent.drivers.command_hook import CommandHookMapper
from dxpool.hostagent.errors import AttachConflictError, DriverError
from dxpool.names import GpuRef
from tests.hostagent.proxy_hook import read_table, write_proxy_hook, write_script
from tests.patience import patient

GPU = GpuRef("b1", 2)


@pytest.fixture
def hook(tmp_path: Path) -> Path:
    return write_proxy_hook(tmp_path / "proxy")


def test_map_status_unmap_round_trip(hook: Path) -> None:
    mapper = CommandHookMapper(hook, "h1", timeout_s=10)

    mapper.map(GPU, 3, generation=7)
    mapper.map(GPU, 3, generation=7)  # idempotent
    mapper.map(GpuRef("b2", 0), 1, generation=1)

    assert mapper.mappings() == {1: GpuRef("b2", 0), 3: GPU}
    mapper.unmap(GPU)
    mapper.unmap(GPU)  # not mapped: a no-op
    assert mapper.mappings() == {1: GpuRef("b2", 0)}


def test_fence_revokes_every_mapping_of_the_host_only(hook: Path) -> None:
    h1 = CommandHookMapper(hook, "h1", timeout_s=10)
    h2 = CommandHookMapper(hook, "h2", timeout_s=10)
    h1.map(GPU, 0, generation=1)
    h1.map(GpuRef("b1", 3), 1, generation=1)
    h2.map(GpuRef("b2", 0), 0, generation=1)

    assert h1.fence("h1") == [GPU, GpuRef("b1", 3)]

    assert read_table(hook) == {"h1": {}, "h2": {0: GpuRef("b2", 0)}}
    assert h1.fence("h1") == []


def test_the_hook_gets_the_documented_arguments(tmp_path: Path) -> None:
    log = tmp_path / "argv"
    script = write_script(
        tmp_path / "hook",
        "import json, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "print(json.dumps({'mappings': []}) if sys.argv[1] == 'status' else '')\n",
    )
    mapper = CommandHookMapper(script, "h1")

    mapper.map(GPU, 5, generation=9)
    mapper.unmap(GPU)
    mapper.mappings()
    mapper.fence("h1")

    calls = [line for line in log.read_text().splitlines()]
    assert calls == [
        '["map", "h1", "b1", "2", "5", "9"]',
        '["unmap", "h1", "b1", "2"]',
        '["status", "h1"]',
        '["status", "h1"]',
        '["fence", "h1"]',
    ]


def test_exit_3_is_a_conflict_with_the_hooks_explanation(hook: Path) -> None:
    CommandHookMapper(hook, "h2", timeout_s=10).map(GPU, 0, generation=1)

    with pytest.raises(AttachConflictError, match="b1/2 is mapped to h2 slot 0") as caught:
        CommandHookMapper(hook, "h1", timeout_s=10).map(GPU, 0, generation=2)
    assert caught.value.retryable


def script_exiting(tmp_path: Path, code: int, stderr: str = "", stdout: str = "") -> Path:
    return write_script(
        tmp_path / "hook",
        f"import sys\nsys.stdout.write({stdout!r})\n"
        f"sys.stderr.write({stderr!r})\nsys.exit({code})\n",
    )


def test_exit_4_is_refused_for_good(tmp_path: Path) -> None:
    mapper = CommandHookMapper(script_exiting(tmp_path, 4, "generation 3 of b1/2 is fenced"), "h1")

    with pytest.raises(DriverError, match="refused the operation: generation 3 of b1/2") as caught:
        mapper.map(GPU, 0, generation=3)
    assert caught.value.retryable is False


def test_another_non_zero_exit_is_a_retryable_failure_with_stderr(tmp_path: Path) -> None:
    mapper = CommandHookMapper(script_exiting(tmp_path, 1, "proxy mgmt 10.0.0.5 unreachable"), "h1")

    with pytest.raises(DriverError) as caught:
        mapper.unmap(GPU)
    assert caught.value.retryable
    assert "failed with exit status 1: proxy mgmt 10.0.0.5 unreachable" in str(caught.value)
    assert "unmap for host h1" in str(caught.value)


def test_a_silent_failure_says_the_hook_wrote_nothing(tmp_path: Path) -> None:
    mapper = CommandHookMapper(script_exiting(tmp_path, 2), "h1")

    with pytest.raises(DriverError, match="exit status 2 and wrote nothing to stderr"):
        mapper.fence("h1")


@pytest.mark.parametrize(
    ("stdout", "message"),
    [
        ("mapped ok", "printed output that is not JSON"),
        ("[1, 2]", "printed JSON list, not an object"),
        ('{"maps": []}', 'printed no "mappings" list'),
        ('{"mappings": [{"host_slot": -1, "box": "b1", "slot": 0}]}', "mappings[0] is"),
        ('{"mappings": [{"host_slot": 0, "box": "B 1", "slot": 0}]}', "invalid box id"),
        ('{"mappings": [{"host_slot": true, "box": "b1", "slot": 0}]}', "host_slot (an integer"),
        (
            '{"mappings": [{"host_slot": 0, "box": "b1", "slot": 0},'
            ' {"host_slot": 0, "box": "b1", "slot": 1}]}',
            "host slot 0 is listed twice",
        ),
    ],
)
def test_bad_status_output_is_a_driver_error_saying_what_is_expected(
    tmp_path: Path, stdout: str, message: str
) -> None:
    mapper = CommandHookMapper(script_exiting(tmp_path, 0, stdout=stdout), "h1")

    with pytest.raises(DriverError, match=re.escape(message)):
        mapper.mappings()


def test_a_hook_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    script = write_script(
        tmp_path / "hook",
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n",
    )
    # Long enough for the hook (a Python start, on a busy machine) to start its child.
    mapper = CommandHookMapper(script, "h1", timeout_s=5)

    started = time.monotonic()
    with pytest.raises(DriverError, match=r"did not finish within 5s and was killed") as caught:
        mapper.map(GPU, 0, generation=1)

    assert time.monotonic() - started < 45  # killed, not waited for (the hook sleeps 60 s)
    assert caught.value.retryable
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + patient(5)
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), "the hook's own child outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hook_that_cannot_be_run_is_a_configuration_error(tmp_path: Path) -> None:
    missing = CommandHookMapper(tmp_path / "nowhere", "h1")
    not_executable = tmp_path / "plain"
    not_executable.write_text("#!/bin/sh\n")

    with pytest.raises(DriverError, match=r"could not be started.*names an executable") as caught:
        missing.mappings()
    assert caught.value.retryable is False
    with pytest.raises(DriverError, match="could not be started"):
        CommandHookMapper(not_executable, "h1").mappings()


def test_a_hook_killed_by_a_signal_is_reported(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "hook", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"
    )

    with pytest.raises(DriverError, match="killed by signal 11"):
        CommandHookMapper(script, "h1").unmap(GPU)


def test_bad_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        CommandHookMapper(Path("/bin/true"), "h1", timeout_s=0)
    assert os.path.exists("/bin/true")


def test_fence_without_a_revoked_list_reports_what_status_listed(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "hook",
        "import json, sys\n"
        "if sys.argv[1] == 'status':\n"
        "    print(json.dumps({'mappings': [{'host_slot': 1, 'box': 'b1', 'slot': 2}]}))\n",
    )

    assert CommandHookMapper(script, "h1").fence("h7") == [GPU]


def test_a_malformed_revoked_list_is_an_error_naming_the_entry(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "hook",
        "import json, sys\n"
        "print(json.dumps({'mappings': []} if sys.argv[1] == 'status'"
        " else {'revoked': [{'box': 'b1'}]}))\n",
    )

    with pytest.raises(DriverError, match=r"revoked\[0\] is \{'box': 'b1'\}"):
        CommandHookMapper(script, "h1").fence("h1")
