"""Restart children that die, with exponential backoff, until one crash-loops.

:class:`Supervisor` watches :class:`Child` processes. It has no thread of its own: the
owner calls :meth:`Supervisor.tick` every fraction of a second (``dxpool up`` does so from
its main thread, which is also what keeps :mod:`dxpool.cli.lifeline`'s death signal
tied to the right thread). Every exit is unexpected while the pool runs, whatever its
status: the supervisor reports it, waits, and starts the child again.

The policy (:class:`RestartPolicy`), per child, like systemd's ``RestartSec`` and
``StartLimitBurst``/``StartLimitIntervalSec``:

* a child that has been restarted ``k`` times within the last ``window_s`` seconds waits
  ``min(initial_backoff_s * 2**k, max_backoff_s)`` before its next start, so the first
  restart is quick and a flapping child backs off; once it stays up for a window, the
  delay is back to the first one;
* a child that dies when it has already been restarted ``max_restarts`` times within
  ``window_s`` is crash-looping: :meth:`Supervisor.tick` raises :class:`CrashLoopError`, and
  the owner stops the pool instead of restarting forever;
* a start that fails (raises) counts as a death.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dxpool.errors import InvalidArgument

log = logging.getLogger(__name__)


class Child(Protocol):
    """A process the supervisor can watch and start again."""

    @property
    def name(self) -> str:
        """What the operator reads, e.g. ``host agent h1``."""
        ...

    @property
    def log_path(self) -> Path:
        """Where its output goes."""
        ...

    def start(self) -> None:
        """Start it (again); raise if it does not come up."""
        ...

    def poll(self) -> int | None:
        """None while it runs; its exit status once it ended (negative: killed by that
        signal)."""
        ...


class CrashLoopError(RuntimeError):
    """A child kept dying; the message says which, how often and where its log is."""


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that died starts again, and when to give up; see the module doc."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise InvalidArgument(f"max restarts must be 0 or more, got {self.max_restarts}")
        if self.window_s <= 0:
            raise InvalidArgument(f"restart window must be positive, got {self.window_s:g}s")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise InvalidArgument(
                "restart backoff must satisfy 0 <= initial <= max, got "
                f"{self.initial_backoff_s:g}s and {self.max_backoff_s:g}s"
            )

    def backoff(self, recent_restarts: int) -> float:
        """The wait before the next start of a child restarted ``recent_restarts`` times
        within the window."""
        return min(self.initial_backoff_s * 2.0 ** min(recent_restarts, 62), self.max_backoff_s)


def describe_exit(status: int) -> str:
    """``exited with status 1`` or ``was killed by SIGKILL``, for an exit status as
    :meth:`subprocess.Popen.poll` returns it."""
    if status >= 0:
        return f"exited with status {status}"
    try:
        return f"was killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"was killed by signal {-status}"


@dataclass
class _Watched:
    child: Child
    restarts: deque[float] = field(default_factory=deque)
    restart_at: float | None = None

    def recent(self, now: float, window_s: float) -> int:
        while self.restarts and now - self.restarts[0] >= window_s:
            self.restarts.popleft()
        return len(self.restarts)


class Supervisor:
    """Watches children and restarts them under a :class:`RestartPolicy`.

    ``report`` gets one line per event for the operator (the same events are logged with
    fields). Not thread-safe: one thread calls :meth:`watch` and :meth:`tick`.
    """

    def __init__(
        self,
        policy: RestartPolicy,
        *,
        report: Callable[[str], None] = lambda line: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.report = report
        self._clock = clock
        self._watched: list[_Watched] = []

    def watch(self, child: Child) -> None:
        """Supervise ``child`` (already started) from the next tick on."""
        self._watched.append(_Watched(child))

    def pending(self) -> list[str]:
        """Names of children that died and wait for their restart."""
        return [w.child.name for w in self._watched if w.restart_at is not None]

    def tick(self) -> None:
        """Notice deaths and start children whose backoff has passed. Raises
        :class:`CrashLoopError` for a child that died too often; the others are left as they
        are, for the owner to stop."""
        for watched in self._watched:
            now = self._clock()
            if watched.restart_at is None:
                status = watched.child.poll()
                if status is not None:
                    self._died(watched, describe_exit(status), now)
            elif now >= watched.restart_at:
                self._restart(watched, now)

    def _died(self, watched: _Watched, how: str, now: float) -> None:
        child, policy = watched.child, self.policy
        recent = watched.recent(now, policy.window_s)
        # INFO: the operator reads the death in the report line (or the CrashLoopError).
        log.info("child died", extra={"child": child.name, "how": how, "recent_restarts": recent})
        if recent >= policy.max_restarts:
            raise CrashLoopError(
                f"{child.name} {how} after {recent} restarts within {policy.window_s:g}s; "
                f"giving up (see {child.log_path})"
            )
        delay = policy.backoff(recent)
        watched.restart_at = now + delay
        self.report(
            f"warning: {child.name} {how}; restarting in {delay:g}s "
            f"(restart {recent + 1} of {policy.max_restarts} allowed within "
            f"{policy.window_s:g}s; see {child.log_path})"
        )

    def _restart(self, watched: _Watched, now: float) -> None:
        watched.restart_at = None
        watched.restarts.append(now)
        child = watched.child
        try:
            child.start()
        except Exception as error:
            self._died(watched, f"failed to start ({error})", self._clock())
            return
        log.info("child restarted", extra={"child": child.name})
        self.report(f"{child.name} restarted")


__all__ = ["Child", "CrashLoopError", "RestartPolicy", "Supervisor", "describe_exit"]
