"""EtcdHealth: one state change per outage, stale outcomes ignored, recovery probed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import etcd3
import pytest

from dxpool.store.errors import Applied, EtcdFailure
from dxpool.store.health import EtcdHealth
from tests.conftest import wait_until

OUTAGE = EtcdFailure("UNAVAILABLE", "connection refused", Applied.NO, outage=True)
REJECTED = EtcdFailure("NOT_FOUND", "requested lease not found", Applied.NO, outage=False)


class Probe:
    """A probe that fails like a refused connection until ``etcd_back`` is set."""

    def __init__(self) -> None:
        self.etcd_back = threading.Event()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if not self.etcd_back.is_set():
            raise etcd3.exceptions.ConnectionFailedError()


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def health(probe: Probe) -> Iterator[EtcdHealth]:
    monitor = EtcdHealth(probe, name="test", min_probe_interval_s=0.01, max_probe_interval_s=0.05)
    yield monitor
    monitor.close()


def test_one_log_line_and_one_notification_per_change(
    health: EtcdHealth, probe: Probe, caplog: pytest.LogCaptureFixture
) -> None:
    changes: list[bool] = []
    health.subscribe(changes.append)
    caplog.set_level(logging.INFO, logger="dxpool.store.health")
    for _ in range(20):  # twenty requests fail during one outage
        health.failed(health.begin(), OUTAGE)
    assert not health.reachable
    assert health.last_failure == OUTAGE
    probe.etcd_back.set()
    wait_until(lambda: health.reachable, timeout_s=5, message="probe notices etcd is back")
    for _ in range(5):
        health.succeeded(health.begin())
    messages = [r.getMessage() for r in caplog.records if r.name == "dxpool.store.health"]
    assert messages == ["etcd unreachable", "etcd reachable again"]
    assert changes == [False, True]


def test_success_of_a_call_begun_before_the_outage_does_not_end_it(health: EtcdHealth) -> None:
    slow_call = health.begin()  # a call starts, etcd fails while it runs
    health.failed(health.begin(), OUTAGE)
    health.succeeded(slow_call)  # the old call's late answer says nothing about now
    assert not health.reachable
    health.succeeded(health.begin())
    assert health.reachable


def test_failure_of_a_call_begun_before_recovery_does_not_start_a_new_outage(
    health: EtcdHealth,
) -> None:
    health.failed(health.begin(), OUTAGE)
    stuck_call = health.begin()  # begun during the outage, fails after recovery
    health.succeeded(health.begin())
    health.failed(stuck_call, OUTAGE)
    assert health.reachable


def test_rejected_request_is_not_an_outage(health: EtcdHealth, probe: Probe) -> None:
    health.failed(health.begin(), REJECTED)
    assert health.reachable
    assert probe.calls == 0


def test_probe_notices_recovery_without_any_call(health: EtcdHealth, probe: Probe) -> None:
    health.failed(health.begin(), OUTAGE)
    wait_until(lambda: probe.calls >= 3, timeout_s=5, message="probing with backoff")
    assert not health.reachable
    assert health.unreachable_for_s() > 0
    probe.etcd_back.set()
    wait_until(lambda: health.reachable, timeout_s=5, message="recovery noticed by the probe")
    assert health.unreachable_for_s() == 0
    calls = probe.calls
    threading.Event().wait(0.2)
    assert probe.calls == calls, "probing stops once etcd is reachable"
