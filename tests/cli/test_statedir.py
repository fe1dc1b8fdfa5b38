"""The data directory's lock, the child records, and what counts as a leftover."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dxpool.cli.statedir import (
    ChildRecords,
    PoolBusyError,
    ProcessIdentity,
    StateLock,
    cmdline,
    find_leftovers,
    paths_in_cmdline,
    stop_leftovers,
)
from dxpool.store.embedded import EmbeddedEtcd
from tests.patience import patient

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

HOLD_LOCK = """
import sys, time
from pathlib import Path
from dxpool.cli.statedir import StateLock
lock = StateLock(Path(sys.argv[1]))
lock.acquire()
print("locked", flush=True)
time.sleep(120)
"""


class Processes:
    """Processes a test starts; all killed at the end."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def start(
        self, *args: str, cwd: Path | None = None, stdout: int | None = None
    ) -> subprocess.Popen[str]:
        process = subprocess.Popen(list(args), cwd=cwd, stdout=stdout, text=True)
        self.started.append(process)
        return process

    def sleeper(self, *extra: str, cwd: Path | None = None) -> subprocess.Popen[str]:
        """A process that sleeps, with ``extra`` on its command line (readable in /proc
        when this returns)."""
        process = self.start(sys.executable, "-c", "import time; time.sleep(120)", *extra, cwd=cwd)
        # Popen returns once the child's exec has replaced its memory, which can be just
        # before the kernel has set up the new argv: /proc/PID/cmdline is briefly empty.
        deadline = time.monotonic() + 10
        while not cmdline(process.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        return process

    def stop(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def processes() -> Iterator[Processes]:
    started = Processes()
    yield started
    started.stop()


def test_a_second_holder_fails_at_once_naming_the_first(
    tmp_path: Path, processes: Processes
) -> None:
    holder = processes.start(sys.executable, "-c", HOLD_LOCK, str(tmp_path), stdout=subprocess.PIPE)
    assert holder.stdout is not None
    assert holder.stdout.readline() == "locked\n"

    started = time.monotonic()
    with pytest.raises(PoolBusyError) as raised:
        StateLock(tmp_path).acquire()
    assert time.monotonic() - started < 30  # refused, not queued behind the holder
    assert raised.value.pid == holder.pid
    assert str(raised.value) == (
        f"another `dxpool up` (pid {holder.pid}) is already running on {tmp_path}; stop it "
        f"first (Ctrl-C in its terminal, or `kill {holder.pid}`), or use another --data-dir"
    )


def test_the_lock_of_a_killed_holder_is_free_at_once(tmp_path: Path, processes: Processes) -> None:
    holder = processes.start(sys.executable, "-c", HOLD_LOCK, str(tmp_path), stdout=subprocess.PIPE)
    assert holder.stdout is not None
    assert holder.stdout.readline() == "locked\n"
    holder.kill()
    holder.wait()

    lock = StateLock(tmp_path)
    lock.acquire()  # the stale pid in the file does not matter
    assert (tmp_path / "up.lock").read_text() == f"{os.getpid()}\n"
    lock.release()
    assert (tmp_path / "up.lock").read_text() == ""
    lock.release()  # idempotent


def test_a_holder_caught_between_locking_and_writing_its_pid_is_still_named(
    tmp_path: Path,
) -> None:
    # Hold the holder at the point right after its flock, before it writes its pid: the
    # loser must wait for the pid rather than report an unknown holder.
    path = tmp_path / "up.lock"
    with open(path, "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        raising = threading.Event()

        def write_pid_late() -> None:
            raising.wait(5)
            time.sleep(0.1)
            held.write("4242\n")
            held.flush()

        writer = threading.Thread(target=write_pid_late)
        writer.start()
        try:
            raising.set()
            with pytest.raises(PoolBusyError) as raised:
                StateLock(tmp_path).acquire()
        finally:
            writer.join()
    assert raised.value.pid == 4242


def test_a_record_proves_a_child_only_while_that_very_process_runs(
    tmp_path: Path, processes: Processes
) -> None:
    records = ChildRecords(tmp_path)
    child = processes.sleeper("--sim-state", str(tmp_path / "fabric"))
    records.save("agent-h1", "host agent h1", child.pid)

    [found] = records.proven()
    assert (found.pid, found.what, found.proven) == (child.pid, "host agent h1", True)

    child.kill()
    child.wait()
    assert records.proven() == []


def test_a_reused_pid_is_not_mistaken_for_the_recorded_child(
    tmp_path: Path, processes: Processes
) -> None:
    records = ChildRecords(tmp_path)
    child = processes.sleeper("--sim-state", str(tmp_path / "fabric"))
    records.save("agent-h1", "host agent h1", child.pid)
    identity = ProcessIdentity.of(child.pid)
    assert identity is not None
    # The same pid with another start time is another process.
    record = (tmp_path / "run" / "agent-h1.json").read_text()
    (tmp_path / "run" / "agent-h1.json").write_text(
        record.replace(f'"start_ticks": {identity.start_ticks}', '"start_ticks": 1')
    )
    assert records.proven() == []


def test_a_recorded_process_that_no_longer_names_the_directory_is_not_proven(
    tmp_path: Path, processes: Processes
) -> None:
    records = ChildRecords(tmp_path)
    child = processes.sleeper("--sim-state", "/elsewhere/fabric")
    records.save("agent-h1", "host agent h1", child.pid)
    assert records.proven() == []


def test_an_unrecorded_etcd_on_the_directory_is_found_but_not_proven(tmp_path: Path) -> None:
    # What a version without records left behind when it was killed.
    with EmbeddedEtcd(tmp_path / "etcd") as etcd:
        records = ChildRecords(tmp_path)
        [found] = find_leftovers(tmp_path, records)
        assert (found.pid, found.what, found.proven) == (etcd.pid, "etcd", False)
        with pytest.raises(ValueError, match="only leftovers proven by a record"):
            stop_leftovers([found])
        assert etcd.poll() is None


def test_an_unrecorded_agent_named_by_a_relative_path_is_found(
    tmp_path: Path, processes: Processes
) -> None:
    data_dir = tmp_path / "pool"
    data_dir.mkdir()
    agent = processes.sleeper("--sim-state", "pool/fabric", cwd=tmp_path)
    unrelated = processes.sleeper("--sim-state", "pool/fabric-other", cwd=tmp_path)
    found = find_leftovers(data_dir, ChildRecords(data_dir))
    assert [(p.pid, p.what, p.proven) for p in found] == [(agent.pid, "host agent", False)]
    assert unrelated.poll() is None


def test_recorded_leftovers_are_stopped_with_sigkill_when_sigterm_is_ignored(
    tmp_path: Path, processes: Processes
) -> None:
    stubborn = processes.start(
        sys.executable,
        "-c",
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)",
        "--data-dir",
        str(tmp_path / "etcd" / "member-data"),
        stdout=subprocess.PIPE,
    )
    assert stubborn.stdout is not None
    assert stubborn.stdout.readline() == "ready\n"
    records = ChildRecords(tmp_path)
    records.save("etcd", "etcd", stubborn.pid)
    [found] = find_leftovers(tmp_path, records)
    assert found.proven

    started = time.monotonic()
    stop_leftovers([found], grace_s=0.5)
    assert time.monotonic() - started < 30  # killed after the grace, not waited for
    assert stubborn.wait(patient(5)) == -signal.SIGKILL


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["etcd", "--data-dir=/d/etcd/member-data"], ["/d/etcd/member-data"]),
        (["python", "--sim-state", "/d/fabric", "--slots", "8"], ["/d/fabric"]),
        (["python", "--sim-state-dir=/d/x/../fabric"], ["/d/fabric"]),
        (["python", "--sim-state"], []),
        (["python", "--data-directory=/d"], []),
    ],
)
def test_paths_in_cmdline(args: list[str], expected: list[str]) -> None:
    assert [str(p) for p in paths_in_cmdline(args, os.getpid())] == expected
