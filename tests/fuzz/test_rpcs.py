"""Hypothesis fuzzing of every broker RPC over real gRPC on loopback, against real etcd.

For each generated request: the call ends in time with one of the codes its RPC may
answer (never INTERNAL or UNKNOWN); a rejection carries a printable message that says
what to do and a dxpool ``ErrorInfo``; and a rejected call, or any call that only
reads, leaves every key under the pool's prefix byte for byte as it was.

The default run draws a few dozen examples per RPC (profile ``ci``, see conftest.py);
``DXPOOL_FUZZ_EXAMPLES=N pytest -m slow tests/fuzz`` draws N per RPC.
"""

from __future__ import annotations

import collections
import logging

import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.fuzz import rpcs
from tests.fuzz.conftest import EXAMPLES_ENV, LONG_EXAMPLES, FuzzPool
from tests.fuzz.strategies import message_class, requests

NAMES = sorted(rpcs.METHODS)
# Payloads a request message does not decode from: a truncated varint, a length past the
# end, a field number 0, a string field 1 that is not UTF-8, an unterminated group.
UNDECODABLE = (
    b"\x08",
    b"\x0a\x05ab",
    b"\x00",
    b"\x0a\x02\xff\xfe",
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\x0b",
)


def check(pool: FuzzPool, name: str, payload: bytes) -> rpcs.Outcome:
    """Send ``payload`` to RPC ``name`` and assert everything the module docstring says."""
    before = pool.snapshot()
    outcome = rpcs.call(pool.channel, rpcs.METHODS[name], payload)
    found = rpcs.problems(name, outcome, len(payload))
    assert not found, found
    if outcome.code == rpcs.C.OK and name in rpcs.MUTATIONS:
        if name in rpcs.FOLLOWED_UP:
            pool.settle()
        return outcome
    after = pool.snapshot()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"{name} answered {outcome.code.name} but changed {changed}"
    return outcome


def fuzz(pool: FuzzPool, name: str, **overrides: int) -> collections.Counter[str]:
    """Fuzz RPC ``name``; returns how many calls ended with each code."""
    method = rpcs.METHODS[name]
    codes: collections.Counter[str] = collections.Counter()

    @settings(**overrides)  # type: ignore[arg-type]
    @given(request=requests(method.input_type, rpcs.BASELINES.get(name)))
    def one(request: Message) -> None:
        codes[check(pool, name, request.SerializeToString()).code.name] += 1

    one()
    return codes


def test_every_rpc_is_classified() -> None:
    """A new RPC must say what it may answer before it is fuzzed."""
    assert sorted(rpcs.EXPECTED) == NAMES
    assert sorted(rpcs.BASELINES) == NAMES
    assert set(NAMES) >= rpcs.MUTATIONS


def test_baselines_succeed(fuzz_pool: FuzzPool) -> None:
    """Each baseline is valid, so the fuzzer's one-field changes probe one check each."""
    # they remove things
    last = ("InventoryService.DeleteBox", "NodeService.ReleaseNode", "NodeService.ReleaseGang")
    for name in [n for n in NAMES if n not in last] + list(last):
        outcome = check(fuzz_pool, name, rpcs.BASELINES[name].SerializeToString())
        assert outcome.code == rpcs.C.OK, (name, outcome)


def _no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Bad input is the caller's problem: the broker logs no error and no traceback."""
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not noisy, [f"{r.name}: {r.getMessage()[:200]}" for r in noisy]


@pytest.mark.parametrize("name", NAMES)
def test_rpc_fuzz(name: str, fuzz_pool: FuzzPool, caplog: pytest.LogCaptureFixture) -> None:
    fuzz(fuzz_pool, name)
    _no_errors_logged(caplog)


@pytest.mark.slow
@pytest.mark.skipif(not LONG_EXAMPLES, reason=f"set {EXAMPLES_ENV}=N for the long run")
@pytest.mark.timeout(300 + LONG_EXAMPLES)  # a second per example is far more than it takes
@pytest.mark.parametrize("name", NAMES)
def test_rpc_fuzz_long(name: str, fuzz_pool: FuzzPool, caplog: pytest.LogCaptureFixture) -> None:
    codes = fuzz(fuzz_pool, name, max_examples=LONG_EXAMPLES)
    _no_errors_logged(caplog)
    print(f"{name}: {sum(codes.values())} calls, {dict(codes.most_common())}")  # for -s runs


def _decodes(name: str, payload: bytes) -> bool:
    try:
        message_class(rpcs.METHODS[name].input_type).FromString(payload)
    except DecodeError:
        return False
    return True


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    noisy = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not noisy, [f"{r.name}: {r.getMessage()[:200]}" for r in noisy]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 1, [r.getMessage()[:200] for r in warnings]


@pytest.mark.parametrize("name", NAMES)
def test_undecodable_payload_is_invalid_argument(
    name: str, fuzz_pool: FuzzPool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    # A string field that is not UTF-8 only fails where field 1 is a string.
    payloads = [payload for payload in UNDECODABLE if not _decodes(name, payload)]
    assert len(payloads) >= len(UNDECODABLE) - 1
    for payload in payloads:
        outcome = check(fuzz_pool, name, payload)
        assert outcome.code == rpcs.C.INVALID_ARGUMENT, outcome
        assert outcome.reason == "UNDECODABLE_REQUEST", outcome
        expected = rpcs.METHODS[name].input_type.full_name
        assert expected in outcome.details, outcome
    _no_tracebacks(caplog)


@pytest.mark.parametrize("name", NAMES)
def test_garbage_bytes_fuzz(
    name: str, fuzz_pool: FuzzPool, caplog: pytest.LogCaptureFixture
) -> None:
    """Random bytes: what decodes is an ordinary request; what does not is rejected."""
    caplog.set_level(logging.DEBUG)
    kinds: collections.Counter[str] = collections.Counter()

    @given(payload=st.binary(max_size=256))
    @example(payload=b"\xff" * 64)
    def one(payload: bytes) -> None:
        outcome = check(fuzz_pool, name, payload)
        if not _decodes(name, payload):
            assert outcome.reason == "UNDECODABLE_REQUEST", outcome
            kinds["undecodable"] += 1
        else:
            kinds[f"decodable {outcome.code.name}"] += 1

    one()
    _no_tracebacks(caplog)
    print(f"{name}: {sum(kinds.values())} payloads, {dict(kinds.most_common())}")  # for -s runs
