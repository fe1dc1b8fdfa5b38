"""Fuzzing the broker's agent port: every AgentService method, from a caller without a
session, with valid, one-field-changed, random and undecodable requests.

Checked for every call: the answer is one :data:`~tests.fuzz.rpcs.AGENT_EXPECTED` allows,
a refusal says what to do and carries dxpool's ErrorInfo, a request over its method's
limit is refused before it is decoded, the broker logs no error, and a call that is
refused changes nothing in etcd (a ReportStatus without a live session never writes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import given

from tests.fuzz import rpcs
from tests.fuzz.conftest import FuzzPool
from tests.fuzz.strategies import message_class, requests
from tests.fuzz.test_rpcs import UNDECODABLE

NAMES = sorted(rpcs.AGENT_METHODS)


@pytest.fixture
def agent_channel(fuzz_pool: FuzzPool) -> Iterator[grpc.Channel]:
    channel = grpc.insecure_channel(
        fuzz_pool.broker.agent_endpoint, options=[("grpc.max_send_message_length", -1)]
    )
    yield channel
    channel.close()


def check(pool: FuzzPool, channel: grpc.Channel, name: str, payload: bytes) -> rpcs.Outcome:
    """Send ``payload`` to agent RPC ``name`` and assert what the module docstring says."""
    before = pool.snapshot()
    outcome = rpcs.call(channel, rpcs.AGENT_METHODS[name], payload)
    found = rpcs.problems(name, outcome, len(payload))
    assert not found, found
    if outcome.code == rpcs.C.OK:  # a welcome: the session registered its host
        return outcome
    after = pool.snapshot()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"{name} answered {outcome.code.name} but changed {changed}"
    return outcome


def _no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not noisy, [f"{r.name}: {r.getMessage()[:200]}" for r in noisy]


def test_every_agent_rpc_is_classified() -> None:
    assert sorted(rpcs.AGENT_EXPECTED) == NAMES
    assert sorted(rpcs.AGENT_BASELINES) == NAMES


def test_agent_baselines_answer_as_expected(
    fuzz_pool: FuzzPool, agent_channel: grpc.Channel
) -> None:
    """The hello is welcomed; the status write, naming no live session, is refused as
    such - so the fuzzer's one-field changes probe one check each."""
    hello = rpcs.AGENT_BASELINES["AgentService.Connect"].SerializeToString()
    assert check(fuzz_pool, agent_channel, "AgentService.Connect", hello).code == rpcs.C.OK
    status = rpcs.AGENT_BASELINES["AgentService.ReportStatus"].SerializeToString()
    outcome = check(fuzz_pool, agent_channel, "AgentService.ReportStatus", status)
    assert (outcome.code, outcome.reason) == (rpcs.C.FAILED_PRECONDITION, "SESSION_NOT_LIVE")


@pytest.mark.parametrize("name", NAMES)
def test_agent_rpc_fuzz(
    name: str, fuzz_pool: FuzzPool, agent_channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    method = rpcs.AGENT_METHODS[name]

    @given(request=requests(method.input_type, rpcs.AGENT_BASELINES[name]))
    def one(request: Message) -> None:
        check(fuzz_pool, agent_channel, name, request.SerializeToString())

    one()
    _no_errors_logged(caplog)


def _decodes(name: str, payload: bytes) -> bool:
    try:
        message_class(rpcs.AGENT_METHODS[name].input_type).FromString(payload)
    except DecodeError:
        return False
    return True


@pytest.mark.parametrize("name", NAMES)
def test_undecodable_agent_payload_is_invalid_argument(
    name: str, fuzz_pool: FuzzPool, agent_channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    for payload in [p for p in UNDECODABLE if not _decodes(name, p)]:
        outcome = check(fuzz_pool, agent_channel, name, payload)
        assert (outcome.code, outcome.reason) == (
            rpcs.C.INVALID_ARGUMENT,
            "UNDECODABLE_REQUEST",
        ), outcome
    _no_errors_logged(caplog)
