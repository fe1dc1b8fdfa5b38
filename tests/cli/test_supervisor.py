"""The restart policy, with real child processes and a clock the test moves."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dxpool.cli.supervisor import CrashLoopError, RestartPolicy, Supervisor, describe_exit
from dxpool.errors import InvalidArgument


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptChild:
    """A real process running ``code``; ``starts`` counts its starts, and a start raises
    while ``fail_starts`` is set."""

    def __init__(self, code: str, log_path: Path) -> None:
        self.name = "worker w1"
        self.log_path = log_path
        self._code = code
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.fail_starts = False

    def start(self) -> None:
        self.starts += 1
        if self.fail_starts:
            raise RuntimeError("port 1234 is taken")
        self.process = subprocess.Popen([sys.executable, "-c", self._code])

    def poll(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def wait_exit(self) -> None:
        assert self.process is not None
        self.process.wait(timeout=10)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def exits_at_once(tmp_path: Path) -> Iterator[ScriptChild]:
    child = ScriptChild("raise SystemExit(3)", tmp_path / "w1.log")
    yield child
    child.kill()


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[ScriptChild]:
    child = ScriptChild("import time; time.sleep(60)", tmp_path / "w1.log")
    yield child
    child.kill()


def test_a_dead_child_is_restarted_after_the_first_backoff_and_reported(
    runs: ScriptChild, clock: Clock
) -> None:
    lines: list[str] = []
    supervisor = Supervisor(RestartPolicy(initial_backoff_s=0.5), report=lines.append, clock=clock)
    runs.start()
    supervisor.watch(runs)
    supervisor.tick()
    assert runs.starts == 1

    runs.kill()
    supervisor.tick()
    assert supervisor.pending() == ["worker w1"]
    assert lines == [
        f"warning: worker w1 was killed by SIGKILL; restarting in 0.5s "
        f"(restart 1 of 5 allowed within 60s; see {runs.log_path})"
    ]
    clock.now += 0.4
    supervisor.tick()
    assert runs.starts == 1  # still backing off
    clock.now += 0.1
    supervisor.tick()
    assert runs.starts == 2
    assert runs.poll() is None
    assert supervisor.pending() == []
    assert lines[-1] == "worker w1 restarted"


def test_backoff_doubles_while_a_child_flaps_and_resets_after_a_quiet_window(
    exits_at_once: ScriptChild, clock: Clock
) -> None:
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3.0, max_restarts=10, window_s=60)
    supervisor = Supervisor(policy, clock=clock)
    exits_at_once.start()
    supervisor.watch(exits_at_once)
    delays = []
    for _ in range(5):
        exits_at_once.wait_exit()
        died_at = clock.now
        supervisor.tick()  # notices the exit
        before = exits_at_once.starts
        while exits_at_once.starts == before:
            clock.now += 0.25
            supervisor.tick()
        delays.append(clock.now - died_at)
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]  # capped at max_backoff_s

    exits_at_once.wait_exit()
    clock.now += 61  # the restarts fall out of the window
    supervisor.tick()
    before = exits_at_once.starts
    clock.now += 0.5
    supervisor.tick()
    assert exits_at_once.starts == before + 1


def test_a_child_that_keeps_dying_stops_with_a_crash_loop_error(
    exits_at_once: ScriptChild, clock: Clock
) -> None:
    policy = RestartPolicy(initial_backoff_s=0.1, max_restarts=2, window_s=60)
    supervisor = Supervisor(policy, clock=clock)
    exits_at_once.start()
    supervisor.watch(exits_at_once)
    for _ in range(2):
        exits_at_once.wait_exit()
        supervisor.tick()
        clock.now += 10
        supervisor.tick()
    exits_at_once.wait_exit()
    with pytest.raises(CrashLoopError) as raised:
        supervisor.tick()
    assert str(raised.value) == (
        f"worker w1 exited with status 3 after 2 restarts within 60s; giving up "
        f"(see {exits_at_once.log_path})"
    )
    assert exits_at_once.starts == 3


def test_a_failed_start_counts_as_a_death_and_is_retried(
    exits_at_once: ScriptChild, clock: Clock
) -> None:
    lines: list[str] = []
    supervisor = Supervisor(RestartPolicy(initial_backoff_s=1), report=lines.append, clock=clock)
    exits_at_once.start()
    supervisor.watch(exits_at_once)
    exits_at_once.wait_exit()
    supervisor.tick()
    exits_at_once.fail_starts = True
    clock.now += 1
    supervisor.tick()
    assert lines[-1].startswith(
        "warning: worker w1 failed to start (port 1234 is taken); restarting in 2s"
    )
    exits_at_once.fail_starts = False
    clock.now += 2
    supervisor.tick()
    assert exits_at_once.starts == 3


def test_zero_restarts_allowed_means_the_first_death_stops_the_pool(
    runs: ScriptChild, clock: Clock
) -> None:
    supervisor = Supervisor(RestartPolicy(max_restarts=0), clock=clock)
    runs.start()
    supervisor.watch(runs)
    runs.kill()
    with pytest.raises(CrashLoopError, match="killed by SIGKILL after 0 restarts"):
        supervisor.tick()


@pytest.mark.parametrize(
    ("status", "text"),
    [
        (0, "exited with status 0"),
        (1, "exited with status 1"),
        (-signal.SIGKILL, "was killed by SIGKILL"),
        (-signal.SIGTERM, "was killed by SIGTERM"),
        (-200, "was killed by signal 200"),
    ],
)
def test_describe_exit(status: int, text: str) -> None:
    assert describe_exit(status) == text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_restarts": -1}, "max restarts must be 0 or more, got -1"),
        ({"window_s": 0}, "restart window must be positive, got 0s"),
        ({"initial_backoff_s": 5, "max_backoff_s": 1}, "0 <= initial <= max, got 5s and 1s"),
    ],
)
def test_a_policy_that_cannot_work_is_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_with_no_backoff_a_child_is_back_on_the_next_tick(runs: ScriptChild) -> None:
    supervisor = Supervisor(RestartPolicy(initial_backoff_s=0))
    runs.start()
    supervisor.watch(runs)
    first = runs.process
    runs.kill()
    supervisor.tick()  # notices the death
    supervisor.tick()  # starts it again
    assert runs.process is not first
    assert runs.poll() is None
