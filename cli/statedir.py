"""Who owns a ``dxpool up`` data directory, and which processes it left behind.

* :class:`StateLock` is an exclusive ``flock`` on ``<data-dir>/up.lock``, held for the
  life of a pool; the file holds the holder's pid. The kernel drops the lock when the
  holder dies, even by SIGKILL, so a stale file never blocks the next run, and a second
  ``dxpool up`` on the same directory fails at once with :class:`PoolBusyError`, naming the pid.
* :class:`ChildRecords` keeps one record per child process in ``<data-dir>/run/``: its
  pid, its start time (``/proc/<pid>/stat`` field 22, clock ticks since boot) and the boot
  id. A record proves a process is this pool's child only while all three match and its
  command line still names the data directory, so a reused pid is never mistaken for
  one.
* :func:`find_leftovers` runs while holding the lock, so no live pool uses the directory:
  recorded processes that still run are proven leftovers of a killed run and may be
  stopped (:func:`stop_leftovers`); any other process whose command line points into the
  data directory (an etcd on ``etcd/member-data``, an agent on ``fabric``, as versions
  without records left them) is reported, never signalled.

Proof needs ``/proc`` (Linux); elsewhere nothing is recorded, found or stopped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

LOCK_FILE = "up.lock"
RUN_DIR = "run"
PROC = Path("/proc")
# Options whose value, resolved, names a path a pool process works in.
_PATH_OPTIONS = ("--data-dir", "--sim-state", "--sim-state-dir")


class PoolBusyError(RuntimeError):
    """Another live process holds the data directory's lock."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid else "a process whose pid it did not record"
        stop = f"Ctrl-C in its terminal, or `kill {pid}`" if pid else "Ctrl-C in its terminal"
        super().__init__(
            f"another `dxpool up` ({who}) is already running on {data_dir}; "
            f"stop it first ({stop}), or use another --data-dir"
        )
        self.pid = pid


class LeftoverProcessesError(RuntimeError):
    """Processes work in the data directory that no record proves are this pool's own."""

    def __init__(self, data_dir: Path, leftovers: list[Leftover]) -> None:
        listed = ", ".join(f"{p.what} (pid {p.pid})" for p in leftovers)
        pids = " ".join(str(p.pid) for p in leftovers)
        super().__init__(
            f"{listed} still running on {data_dir}, most likely left behind by an older "
            f"`dxpool up` that was killed; stop them with `kill {pids}` and run `dxpool up` "
            "again"
        )
        self.leftovers = leftovers


class StateLock:
    """An exclusive, non-blocking ``flock`` on ``<data-dir>/up.lock``; see the module doc.

    The lock file is never removed: removing a flocked file lets two processes lock two
    different inodes under one name.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / LOCK_FILE
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock and write this pid into the file, or raise :class:`PoolBusyError`."""
        if self._file is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")  # noqa: SIM115 - held open for the life of the lock
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            file.close()
            if error.errno in (errno.EAGAIN, errno.EACCES):
                raise PoolBusyError(self.data_dir, self._holder()) from None
            raise
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()}\n")
        file.flush()
        self._file = file

    def _holder(self, settle_s: float = 0.5) -> int | None:
        """The pid in the lock file; the holder writes it right after locking, so an empty
        file is read again for up to ``settle_s``."""
        deadline = time.monotonic() + settle_s
        while True:
            with contextlib.suppress(OSError, ValueError):
                return int(self.path.read_text().strip())
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def release(self) -> None:
        """Empty the file and drop the lock. Idempotent."""
        file, self._file = self._file, None
        if file is None:
            return
        with contextlib.suppress(OSError):
            file.truncate(0)
        file.close()  # closing the only descriptor drops the flock


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as the kernel tells it apart from any later one with the same pid."""

    pid: int
    start_ticks: int
    boot_id: str

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The identity of running process ``pid``; None if it is gone (or no ``/proc``)."""
        try:
            stat = (PROC / str(pid) / "stat").read_text()
        except OSError:
            return None
        # The command name (field 2) is in parentheses and may hold spaces or ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        return cls(pid, int(fields[19]), _boot_id())

    def alive(self) -> bool:
        """Whether this very process still runs (and is not a zombie)."""
        return ProcessIdentity.of(self.pid) == self and _state(self.pid) not in ("Z", "X", "")


def _boot_id() -> str:
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2 :].split()[0]


def cmdline(pid: int) -> list[str]:
    """The argv of process ``pid``; empty if it is gone or unreadable."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0")[:-1]]


def _resolve(path: str, pid: int) -> Path:
    """``path`` as process ``pid`` sees it (relative paths against its working dir)."""
    candidate = Path(path)
    if not candidate.is_absolute():
        try:
            candidate = Path(os.readlink(PROC / str(pid) / "cwd")) / candidate
        except OSError:
            return candidate
    return Path(os.path.normpath(candidate))


def paths_in_cmdline(args: list[str], pid: int) -> Iterator[Path]:
    """The resolved values of ``--data-dir``, ``--sim-state`` and ``--sim-state-dir``
    (``--opt value`` or ``--opt=value``) in ``args``."""
    for index, arg in enumerate(args):
        option, sep, value = arg.partition("=")
        if option not in _PATH_OPTIONS:
            continue
        if not sep:
            if index + 1 >= len(args):
                continue
            value = args[index + 1]
        yield _resolve(value, pid)


@dataclass(frozen=True)
class Leftover:
    """A process still running in the data directory when a pool starts."""

    pid: int
    what: str
    identity: ProcessIdentity | None
    """Set when a record proves the process is a child of an earlier run of this pool."""

    @property
    def proven(self) -> bool:
        return self.identity is not None


class ChildRecords:
    """One JSON record per child in ``<data-dir>/run/<name>.json``; see the module doc."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.dir = data_dir / RUN_DIR

    def save(self, name: str, what: str, pid: int) -> None:
        """Record child ``name`` (a file-name-safe key), described as ``what``, at ``pid``.
        Atomic (write, then rename); a process already gone is not recorded."""
        identity = ProcessIdentity.of(pid)
        if identity is None:
            self.remove(name)
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        record = {
            "pid": pid,
            "start_ticks": identity.start_ticks,
            "boot_id": identity.boot_id,
            "what": what,
        }
        temporary = self.dir / f".{name}.json.tmp"
        temporary.write_text(json.dumps(record) + "\n")
        temporary.replace(self.dir / f"{name}.json")

    def remove(self, name: str) -> None:
        (self.dir / f"{name}.json").unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove every record."""
        for path in self._paths():
            path.unlink(missing_ok=True)

    def _paths(self) -> list[Path]:
        return sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []

    def proven(self) -> list[Leftover]:
        """Recorded children that still run: same pid, start time and boot, and a command
        line that still names the data directory."""
        found = []
        for path in self._paths():
            try:
                record = json.loads(path.read_text())
                identity = ProcessIdentity(
                    int(record["pid"]), int(record["start_ticks"]), str(record["boot_id"])
                )
                what = str(record["what"])
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("unreadable child record ignored", extra={"path": str(path)})
                continue
            if identity.alive() and _names_dir(identity.pid, self.data_dir):
                found.append(Leftover(identity.pid, what, identity))
        return found


def _names_dir(pid: int, data_dir: Path) -> bool:
    root = Path(os.path.normpath(data_dir.resolve()))
    return any(path == root or root in path.parents for path in paths_in_cmdline(cmdline(pid), pid))


def _pids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for entry in PROC.iterdir():
            if entry.name.isdigit():
                yield int(entry.name)


def find_leftovers(data_dir: Path, records: ChildRecords) -> list[Leftover]:
    """Processes of this user still working in ``data_dir``: the recorded ones (proven)
    and any other etcd or agent whose ``--data-dir``/``--sim-state`` points into it
    (unproven). Call it only while holding the :class:`StateLock`."""
    proven = records.proven()
    seen = {p.pid for p in proven} | {os.getpid()}
    root = Path(os.path.normpath(data_dir.resolve()))
    wanted = {root / "etcd" / "member-data", root / "fabric"}
    others = []
    for pid in _pids():
        if pid in seen:
            continue
        try:
            if (PROC / str(pid)).stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        args = cmdline(pid)
        if any(path in wanted for path in paths_in_cmdline(args, pid)):
            what = "etcd" if Path(args[0]).name == "etcd" else "host agent"
            others.append(Leftover(pid, what, None))
    return proven + others


def stop_leftovers(leftovers: Iterable[Leftover], grace_s: float = 5.0) -> None:
    """SIGTERM each proven leftover, SIGKILL what is left after ``grace_s``, and wait until
    they are gone. Unproven ones are refused (ValueError): only a record proves a process
    is this pool's to stop."""
    targets = list(leftovers)
    if any(not p.proven for p in targets):
        raise ValueError("only leftovers proven by a record may be stopped")
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        running = [p for p in targets if p.identity is not None and p.identity.alive()]
        for process in running:
            log.warning(
                "stopping a process left by an earlier run",
                extra={"pid": process.pid, "what": process.what, "signal": signum.name},
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)
        deadline = time.monotonic() + wait_s
        while running and time.monotonic() < deadline:
            time.sleep(0.05)
            running = [p for p in running if p.identity is not None and p.identity.alive()]
        if not running:
            return
    raise RuntimeError(
        "processes left by an earlier run did not stop: "
        + ", ".join(f"{p.what} (pid {p.pid})" for p in running)
    )


__all__ = [
    "ChildRecords",
    "Leftover",
    "LeftoverProcessesError",
    "PoolBusyError",
    "ProcessIdentity",
    "StateLock",
    "cmdline",
    "find_leftovers",
    "paths_in_cmdline",
    "stop_leftovers",
]
