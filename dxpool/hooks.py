"""Running an operator's hook executable: one process per operation, JSON on stdout.

Proxy and fabric vendors differ in how their mapping tables are programmed; a hook lets
an operator plug any of them in with a small program. The host agent's proxy hook
(``dxpool.hostagent.drivers.command_hook``, where the whole contract and its verbs are
written down) and the broker's box fabric hook (``dxpool.broker.control.box_fabric_hook``) run
theirs through :func:`run_hook`, so both follow one contract:

* run without a shell, stdin empty, in a session of its own;
* exit **0** done, **3** conflict, **4** refused for good, anything else a transient
  failure; stderr's text goes into the error;
* stdout is empty or one JSON object; an object's ``"message"`` string is logged;
* a run longer than the timeout has its whole process group killed and counts as a
  transient failure, so a hook must be safe to run again after being killed anywhere.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CONFLICT = 3
EXIT_REFUSED = 4
STDERR_SHOWN = 500  # characters of the hook's stderr put into an error message


class HookOutcome(enum.Enum):
    """Why a run failed, which decides what its caller does next."""

    CONFLICT = "conflict"  # exit 3: something else holds what was asked for
    REFUSED = "refused"  # exit 4: refused for good; do not retry
    UNUSABLE = "unusable"  # the executable could not be started; configuration fixes it
    FAILED = "failed"  # any other exit, a signal, a timeout, bad output: retry


class HookError(Exception):
    """A hook run failed; ``outcome`` says how (see :class:`HookOutcome`)."""

    def __init__(self, message: str, outcome: HookOutcome) -> None:
        super().__init__(message)
        self.message = message
        self.outcome = outcome

    @property
    def retryable(self) -> bool:
        return self.outcome in (HookOutcome.CONFLICT, HookOutcome.FAILED)


def run_hook(hook: Path, args: Sequence[str], *, timeout_s: float, what: str) -> dict[str, Any]:
    """Run ``hook`` with ``args`` and return the JSON object it printed ({} for nothing).

    ``what`` names the run in messages (e.g. ``proxy hook /x map for host h1``). Raises
    :class:`HookError` whose message says what the hook did and how to fix it.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    try:
        process = subprocess.Popen(
            [str(hook), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # so a timeout can kill everything it started
        )
    except OSError as error:
        raise HookError(
            f"{what} could not be started ({error.strerror or error}); check that the "
            "configured hook path names an executable file",
            HookOutcome.UNUSABLE,
        ) from error
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have ended in the meantime
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise HookError(
            f"{what} did not finish within {timeout_s:g}s and was killed; check that the "
            "management interface it drives answers",
            HookOutcome.FAILED,
        ) from None
    return _answer(what, process.returncode, stdout, stderr)


def _answer(what: str, returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    detail = stderr.strip()[-STDERR_SHOWN:]
    said = f": {detail}" if detail else " and wrote nothing to stderr"
    if returncode == EXIT_CONFLICT:
        raise HookError(f"{what} reports a mapping conflict{said}", HookOutcome.CONFLICT)
    if returncode == EXIT_REFUSED:
        raise HookError(f"{what} refused the operation{said}", HookOutcome.REFUSED)
    if returncode < 0:
        raise HookError(f"{what} was killed by signal {-returncode}{said}", HookOutcome.FAILED)
    if returncode != EXIT_OK:
        raise HookError(f"{what} failed with exit status {returncode}{said}", HookOutcome.FAILED)
    text = stdout.strip()
    if not text:
        return {}
    try:
        answer = json.loads(text)
    except json.JSONDecodeError as error:
        raise HookError(
            f"{what} printed output that is not JSON ({error.msg} at line {error.lineno} "
            f"column {error.colno}): {text[:200]!r}; the hook must print one JSON object",
            HookOutcome.FAILED,
        ) from error
    if not isinstance(answer, dict):
        raise HookError(
            f"{what} printed JSON {type(answer).__name__}, not an object; the hook must print "
            "one JSON object",
            HookOutcome.FAILED,
        )
    message = answer.get("message")
    if isinstance(message, str) and message:
        log.info("hook message", extra={"hook": what, "hook_message": message})
    return answer


__all__ = ["EXIT_CONFLICT", "EXIT_OK", "EXIT_REFUSED", "HookError", "HookOutcome", "run_hook"]
