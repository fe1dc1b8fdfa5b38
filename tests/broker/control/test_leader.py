"""Leader election for the singleton duties, against a real etcd."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from dxpool.broker.control.leader import LeaderElection
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store
from tests.conftest import wait_until

Elect = Callable[..., LeaderElection]


@pytest.fixture
def elect(key_prefix: str) -> Iterator[Callable[[str, str], LeaderElection]]:
    made: list[tuple[LeaderElection, Store]] = []

    def make(endpoint: str, identity: str, ttl_s: float = 3.0) -> LeaderElection:
        store = Store(connect(endpoint, timeout_s=1.0), KeySchema(key_prefix))
        election = LeaderElection(
            store, KeySchema(key_prefix).election("duties"), identity, ttl_s=ttl_s
        )
        made.append((election, store))
        election.start()
        return election

    yield make
    for election, store in made:
        election.stop()
        store.health.close()
        store.client.close()


def test_one_leads_and_the_other_takes_over_when_it_stops(
    etcd_server: EmbeddedEtcd, elect: Elect
) -> None:
    first = elect(etcd_server.endpoint, "a")
    second = elect(etcd_server.endpoint, "b")
    assert first.is_leader() and not second.is_leader()

    first.stop()  # resigns: revokes its lease
    assert second.wait_until_leader(3.0)


def test_a_leader_cut_off_from_etcd_resumes_on_its_own_lease_when_etcd_returns(
    private_etcd: EmbeddedEtcd, elect: Elect
) -> None:
    """etcd extends leases when it restarts, so the stepped-down leader's key outlives the
    outage by a whole TTL; it used to leave every duty idle that long."""
    ttl_s = 9.0
    election = elect(private_etcd.endpoint, "a", ttl_s=ttl_s)
    assert election.is_leader()

    private_etcd.kill()
    wait_until(lambda: not election.is_leader(), timeout_s=ttl_s, message="step down")
    private_etcd.start()
    back = time.monotonic()

    wait_until(election.is_leader, timeout_s=ttl_s, message="leading again")
    assert time.monotonic() - back < ttl_s  # not a whole TTL after etcd came back
