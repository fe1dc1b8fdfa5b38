"""Following a 202 to its end (dxpool/redfish/tasks.py) against the project's Redfish
service, with the clock and the sleep taken over so waits are checked, not waited."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dxpool.redfish.fabric_map import RedfishService
from dxpool.redfish.session import RedfishReply, RedfishSession, retry_after
from dxpool.redfish.tasks import MAX_RETRY_AFTER_S, RedfishTaskError, await_operation
from tests.hostagent.redfish_service import (
    FABRIC,
    PASSWORD,
    PROCESSORS,
    RESET_ACTION,
    USERNAME,
    RedfishFabricService,
    install,
    running_service,
)


class Clock:
    """A clock that moves only when slept on; records each sleep."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def started() -> Iterator[Any]:
    sessions: list[RedfishSession] = []
    contexts: list[Any] = []

    def start(**options: Any) -> tuple[RedfishFabricService, RedfishSession]:
        service = RedfishFabricService(**options)
        install(service)
        context = running_service(service)
        contexts.append(context)
        context.__enter__()
        session = RedfishSession(
            RedfishService(url=service.url, fabric=FABRIC, username=USERNAME, password=PASSWORD)
        )
        sessions.append(session)
        return service, session

    yield start
    for session in sessions:
        session.close()
    for context in contexts:
        context.__exit__(None, None, None)


def reset(session: RedfishSession) -> RedfishReply:
    return session.post(f"{PROCESSORS}/GPU-b1-0/{RESET_ACTION}", {"ResetType": "ForceRestart"})


def test_retry_after_is_waited_as_asked(started: Any) -> None:
    _, session = started(retry_after=3, task_polls=2)
    clock = Clock()
    final = await_operation(
        session,
        reset(session),
        what="reset",
        timeout_s=60,
        sleep=clock.sleep,
        clock=lambda: clock.now,
    )
    assert final.status == 200 and "TaskState" not in final.body
    assert clock.slept == [3.0, 3.0, 3.0]  # after the 202, and after each 202 of the monitor


def test_a_long_retry_after_is_bounded(started: Any) -> None:
    _, session = started(retry_after=3600, task_polls=1)
    clock = Clock()
    await_operation(
        session,
        reset(session),
        what="reset",
        timeout_s=60,
        sleep=clock.sleep,
        clock=lambda: clock.now,
    )
    assert clock.slept == [MAX_RETRY_AFTER_S, MAX_RETRY_AFTER_S]


def test_without_retry_after_the_monitor_is_polled_at_the_default_pace(started: Any) -> None:
    _, session = started(retry_after=None, task_polls=1)
    clock = Clock()
    await_operation(
        session,
        reset(session),
        what="reset",
        timeout_s=60,
        sleep=clock.sleep,
        clock=lambda: clock.now,
    )
    assert clock.slept == [0.5, 0.5]


def test_a_wait_past_the_deadline_fails_at_the_deadline(started: Any) -> None:
    service, session = started(retry_after=5, task_polls=10)
    clock = Clock()
    with pytest.raises(RedfishTaskError, match=r"did not end within 12s .* 2 poll\(s\)"):
        await_operation(
            session,
            reset(session),
            what="reset",
            timeout_s=12,
            sleep=clock.sleep,
            clock=lambda: clock.now,
        )
    assert clock.slept == [5.0, 5.0, 2.0]
    assert service.resets_done == []


def test_a_202_without_a_monitor_is_a_failure() -> None:
    with pytest.raises(RedfishTaskError, match="without a task monitor"):
        await_operation(None, RedfishReply(202, {}), what="reset", timeout_s=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"TaskState": "Exception", "Messages": [{"Message": "ECC storm"}]}, "ended Exception"),
        ({"TaskState": "Completed", "TaskStatus": "Critical"}, "ended Completed"),
        ({"TaskState": "Killed"}, "ended Killed"),
        ({"@Message.ExtendedInfo": [{"Message": "no power", "Severity": "Critical"}]}, "critical"),
    ],
)
def test_a_final_answer_that_reports_a_failure_fails(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RedfishTaskError, match=message):
        await_operation(None, RedfishReply(200, body), what="reset", timeout_s=1)  # type: ignore[arg-type]


def test_a_final_answer_with_a_completed_task_or_no_task_succeeds() -> None:
    for body in (
        {},
        {"TaskState": "Completed", "TaskStatus": "OK"},
        {"Messages": [{"Severity": "OK"}]},
    ):
        reply = RedfishReply(200, body)
        assert await_operation(None, reply, what="reset", timeout_s=1) is reply  # type: ignore[arg-type]


def test_retry_after_reads_seconds_and_dates() -> None:
    assert retry_after("7") == 7.0
    assert retry_after(None) is None and retry_after("soon") is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    seconds = retry_after(later)
    assert seconds is not None and 25 <= seconds <= 30
    assert retry_after(email.utils.formatdate(time.time() - 30, usegmt=True)) == 0.0
