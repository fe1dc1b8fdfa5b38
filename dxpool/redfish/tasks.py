"""Following an operation a Redfish service runs asynchronously, as DSP0266 says.

A service may answer any modification or action with **202 Accepted** and a ``Location``
header naming a *task monitor*, optionally with ``Retry-After``. While the operation runs,
a GET of the monitor answers 202 again - whatever its body, which may be empty. Once it
ends, the monitor answers with the operation's own response: its status and body, which
need not be a Task and need not carry a ``TaskState``.

:func:`await_operation` follows that to the end: it follows ``Location``, waits what
``Retry-After`` asks (bounded by :data:`MAX_RETRY_AFTER_S` and the deadline), and
finishes on the first answer that is not 202, judging it by:

* its status: 4xx and 5xx are failures, with the service's message;
* its ``TaskState`` when present: ``Completed`` succeeds (unless ``TaskStatus`` is
  ``Critical``), ``Exception``, ``Killed``, ``Cancelled`` and ``Interrupted`` fail. A Task
  that says it is still running (``New``, ``Running``, ``Pending``...) is no answer yet
  and is polled again - some services point ``Location`` at the Task itself rather than
  a monitor, and a Task that is running has not ended;
* its ``Messages`` or ``@Message.ExtendedInfo``: one of ``Critical`` severity fails.

A 202 without ``Location`` and a deadline that passes are failures, never successes:
nothing is known about the operation's end. The errors are :class:`RedfishTaskError`,
retryable (the caller decides whether the operation is safe to repeat).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from dxpool.redfish.session import RedfishError, RedfishReply, RedfishSession, RedfishStatusError

DEFAULT_POLL_S = 0.5
MAX_RETRY_AFTER_S = 10.0
TASK_DONE = "Completed"
TASK_FAILED = frozenset({"Exception", "Killed", "Cancelled", "Interrupted"})
TASK_RUNNING = frozenset(
    {"New", "Starting", "Running", "Pending", "Stopping", "Suspended", "Service"}
)


class RedfishTaskError(RedfishError):
    """An asynchronous operation failed, or its end could not be known."""


def await_operation(
    session: RedfishSession,
    reply: RedfishReply,
    *,
    what: str,
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> RedfishReply:
    """The final answer of the operation whose first answer was ``reply``: ``reply``
    itself when it is not a 202, else the task monitor's first answer that is not 202.

    ``what`` names the operation in messages. Raises :class:`RedfishTaskError` when the
    operation failed, gave no monitor, or did not end within ``timeout_s``;
    :class:`RedfishError` when the monitor could not be read.
    """
    deadline = clock() + timeout_s
    monitor = ""
    polls = 0
    while True:
        if reply.status != HTTPStatus.ACCEPTED and not _still_running(reply.body):
            _judge(reply, what, monitor)
            return reply
        monitor = reply.location or monitor
        if not monitor and reply.status != HTTPStatus.ACCEPTED:
            monitor = str(reply.body.get("@odata.id") or "")  # a Task answered in its place
        if not monitor:
            raise RedfishTaskError(
                f"{what} was accepted (202) without a task monitor (no Location header), so "
                "when and how it ends cannot be known"
            )
        wait = DEFAULT_POLL_S if reply.retry_after_s is None else reply.retry_after_s
        wait = min(max(wait, 0.0), MAX_RETRY_AFTER_S)
        left = deadline - clock()
        if left <= 0 or wait > left:
            if left > 0:
                sleep(left)
            raise RedfishTaskError(
                f"{what} did not end within {timeout_s:g}s (task monitor {monitor}, "
                f"{polls} poll(s), last {_state(reply)})"
            )
        sleep(wait)
        polls += 1
        try:
            reply = session.poll(monitor)
        except RedfishStatusError as error:
            raise RedfishTaskError(
                f"{what} failed: its task monitor {monitor} answered {error.status}: "
                f"{error.message}"
            ) from error


def _still_running(body: dict[str, Any]) -> bool:
    return str(body.get("TaskState", "")) in TASK_RUNNING


def _judge(reply: RedfishReply, what: str, monitor: str) -> None:
    where = f" (task monitor {monitor})" if monitor else ""
    state = reply.body.get("TaskState")
    if state is not None:
        if state in TASK_FAILED or reply.body.get("TaskStatus") == "Critical":
            raise RedfishTaskError(f"{what} ended {state}{where}: {_messages(reply.body)}")
        if state != TASK_DONE:
            raise RedfishTaskError(f"{what} ended in task state {state!r}{where}")
    critical = [m for m in _message_list(reply.body) if _severity(m) == "Critical"]
    if critical:
        raise RedfishTaskError(
            f"{what} ended with a critical message{where}: "
            + "; ".join(str(m.get("Message", m.get("MessageId", ""))) for m in critical)
        )


def _state(reply: RedfishReply) -> str:
    state = reply.body.get("TaskState")
    return f"task state {state}" if state else f"status {reply.status}"


def _message_list(body: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for key in ("Messages", "@Message.ExtendedInfo"):
        value = body.get(key)
        if isinstance(value, list):
            found.extend(m for m in value if isinstance(m, dict))
    return found


def _severity(message: dict[str, Any]) -> str:
    return str(message.get("MessageSeverity") or message.get("Severity") or "")


def _messages(body: dict[str, Any]) -> str:
    texts = [str(m.get("Message", m.get("MessageId", ""))) for m in _message_list(body)]
    return "; ".join(t for t in texts if t) or "no message"


__all__ = ["MAX_RETRY_AFTER_S", "RedfishTaskError", "await_operation"]
