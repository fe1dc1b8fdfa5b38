"""Tie a child's life to its parent's: a launcher that execs the child.

``python -m dxpool.cli.lifeline --parent PID --signal KILL -- PROGRAM ARGS...`` asks Linux
(``prctl(PR_SET_PDEATHSIG)``) to send ``--signal`` to this process when its parent dies,
checks that the parent is still ``PID``, then execs ``PROGRAM``. The exec keeps the pid and
the death signal (Linux clears it only for set-user-ID programs, which dxpool never
starts), so ``PROGRAM`` itself dies with the parent, even when the parent is killed with
SIGKILL and has no chance to stop it. ``dxpool up`` starts etcd and every host agent this
way.

Contracts:

* The check against ``--parent`` closes the race where the parent dies between the fork
  and the ``prctl``: then the launcher exits with :data:`EXIT_PARENT_GONE` and
  ``PROGRAM`` never starts.
* Linux sends the signal when the *thread* that forked the child ends, not the process:
  the parent must start children from a thread that lives as long as it does (``dxpool
  up`` starts and restarts them from its main thread).
* Where there is no ``prctl`` (not Linux), the launcher only execs; children then outlive
  a killed parent, and the pid records of :mod:`dxpool.cli.statedir` are what the next
  ``dxpool up`` uses to find them.

The launcher is an exec wrapper rather than a ``preexec_fn`` because ``dxpool up`` starts
children while the broker's threads run, and Python code between fork and exec in a
threaded process can deadlock.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
EXIT_PARENT_GONE = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL}


def lifeline_argv(
    parent_pid: int, death_signal: signal.Signals, python: str = sys.executable
) -> list[str]:
    """The argv prefix that starts a program tied to ``parent_pid`` by ``death_signal``
    (SIGTERM or SIGKILL); append the program's own argv."""
    names = {number: name for name, number in SIGNALS.items()}
    if death_signal not in names:
        raise ValueError(f"death signal must be SIGTERM or SIGKILL, got {death_signal!r}")
    return [
        python,
        "-m",
        "dxpool.cli.lifeline",
        "--parent",
        str(parent_pid),
        "--signal",
        names[death_signal],
        "--",
    ]


def set_parent_death_signal(death_signal: int) -> bool:
    """Ask the kernel to send ``death_signal`` to this process when its parent thread ends.

    True when set; False where the platform has no ``prctl`` (not Linux). Raises OSError
    if the call is refused.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, set the death signal, exec the program; returns only on failure."""
    parser = argparse.ArgumentParser(
        prog="python -m dxpool.cli.lifeline",
        description="Run PROGRAM so that it gets a signal when this process's parent dies.",
    )
    parser.add_argument("--parent", type=int, required=True, help="pid of the parent")
    parser.add_argument("--signal", choices=sorted(SIGNALS), default="KILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no program given; expected -- PROGRAM [ARGS...]")
    set_parent_death_signal(SIGNALS[args.signal])
    if os.getppid() != args.parent:
        print(f"lifeline: parent {args.parent} is gone; not starting {command[0]}", file=sys.stderr)
        return EXIT_PARENT_GONE
    try:
        os.execvp(command[0], command)
    except FileNotFoundError as error:
        print(f"lifeline: cannot run {command[0]}: {error.strerror}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except OSError as error:
        print(f"lifeline: cannot run {command[0]}: {error.strerror}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE


if __name__ == "__main__":
    sys.exit(main())
