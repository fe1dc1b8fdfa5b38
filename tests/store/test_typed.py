from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.errors import InvalidArgument, Unavailable
from dxpool.limits import MAX_TXN_OPS
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, EtcdCluster
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.conftest import wait_until


def test_txn_over_etcd_limit_is_refused_before_sending() -> None:
    txn = Txn()
    for index in range(MAX_TXN_OPS + 1):
        txn.expect_absent(f"/k/{index}")
    with pytest.raises(InvalidArgument, match="limit of 128"):
        txn.check_size()


def test_commit_compares_revisions(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    store = Store(etcd_client, KeySchema(key_prefix))
    key = store.keys.box("b1")
    first = store.commit(Txn().expect_absent(key).put(key, pb.Box(name="boxes/b1")))
    assert first.succeeded and first.revision > 0
    stale = store.commit(
        Txn().expect_absent(key).put(key, pb.Box(name="boxes/b1")).read_on_failure(key)
    )
    assert not stale.succeeded
    current = stale.current[key]
    assert current is not None and current.mod_revision == first.revision
    assert current.value.name == "boxes/b1"
    update = store.commit(Txn().expect_revision(key, first.revision).put(key, pb.Box(name="x")))
    assert update.succeeded and update.revision > first.revision
    record = store.get(key)
    assert record is not None and record.value.name == "x"


# -- etcd failures -------------------------------------------------------------------------


@pytest.fixture
def cluster_store(etcd_cluster: EtcdCluster, key_prefix: str) -> Iterator[Store]:
    """A store over three members whose calls give up after 0.5 s."""
    client = connect(etcd_cluster.endpoints, timeout_s=0.5)
    store = Store(client, KeySchema(key_prefix))
    store.get(store.keys.box("warm-up"))  # the client settles on one member
    yield store
    store.health.close()
    client.close()


def member_in_use(cluster: EtcdCluster, store: Store) -> EmbeddedEtcd:
    """The member ``store`` talks to, made a follower so stopping it loses no leader."""
    member = cluster.member(store.client.endpoint_in_use.netloc)
    cluster.move_leader(next(m for m in cluster.members if m is not member))
    return member


def test_losing_the_member_in_use_costs_no_failed_call(
    etcd_cluster: EtcdCluster, cluster_store: Store
) -> None:
    member_in_use(etcd_cluster, cluster_store).kill()
    time.sleep(0.2)  # the client's connection to it has seen the reset
    key = cluster_store.keys.box("b1")
    result = cluster_store.commit(Txn().expect_absent(key).put(key, pb.Box(name="boxes/b1")))
    assert result.succeeded
    assert cluster_store.health.reachable


def test_read_is_retried_on_the_next_member_but_an_unconfirmed_write_is_not(
    etcd_cluster: EtcdCluster, cluster_store: Store
) -> None:
    key = cluster_store.keys.box("b1")
    cluster_store.commit(Txn().put(key, pb.Box(name="boxes/b1")))
    paused = member_in_use(etcd_cluster, cluster_store)
    paused.pause()
    started = time.monotonic()
    record = cluster_store.get(key)  # times out on the paused member, then asks another
    assert record is not None and record.value.name == "boxes/b1"
    assert time.monotonic() - started >= 0.5  # it did wait out the paused member first
    paused.resume()

    paused = member_in_use(etcd_cluster, cluster_store)
    paused.pause()
    started = time.monotonic()
    with pytest.raises(Unavailable) as raised:
        cluster_store.commit(Txn().put(key, pb.Box(name="boxes/b1", gpu_count=2)))
    # Sent, never answered: etcd may have applied it, so it is not sent again (sent
    # again, it would have succeeded on a member that answers).
    assert raised.value.reason == "ETCD_OUTCOME_UNKNOWN"
    assert time.monotonic() - started >= 0.5


def test_a_call_waits_out_the_pause_other_calls_put_on_every_member(
    cluster_store: Store,
) -> None:
    # What an election leaves behind: calls that failed a moment ago (one on the lost
    # member, a slow one that failed late on a healthy member after a write succeeded
    # there) have paused every member, though two of them answer.
    key = cluster_store.keys.box("b1")
    for call in (
        lambda: cluster_store.commit(Txn().put(key, pb.Box(name="boxes/b1"))).succeeded,
        lambda: cluster_store.get(key) is not None,
    ):
        for endpoint in cluster_store.client.endpoints.values():
            endpoint.fail()
        started = time.monotonic()
        assert call()
        assert time.monotonic() - started >= 0.2  # the 0.25 s pause, then the call
    assert cluster_store.health.reachable


def test_every_failure_is_unavailable_and_fast_once_etcd_is_known_away(
    private_etcd: EmbeddedEtcd, key_prefix: str
) -> None:
    # A long call timeout: a failure that waited for it is plainly told from a fast one.
    client = connect(private_etcd.endpoint, timeout_s=20.0)
    store = Store(client, KeySchema(key_prefix))
    key = store.keys.box("b1")
    try:
        store.commit(Txn().put(key, pb.Box(name="boxes/b1")))
        private_etcd.kill()
        for call in (
            lambda: store.get(key),
            lambda: store.commit(Txn().put(key, pb.Box(name="x"))),
            lambda: store.get(key),
        ):
            started = time.monotonic()
            with pytest.raises(Unavailable) as raised:
                call()
            assert raised.value.reason == "ETCD_UNAVAILABLE"
            assert time.monotonic() - started < 10  # refused, not timed out after 20 s
        assert not store.health.reachable
        private_etcd.start()
        wait_until(lambda: store.health.reachable, timeout_s=3, message="probe sees etcd back")
        assert store.get(key) is not None
    finally:
        store.health.close()
        client.close()


def test_read_returns_keys_and_prefix_ranges(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    store = Store(etcd_client, KeySchema(key_prefix))
    keys = store.keys
    txn = Txn().put(keys.box("b1"), pb.Box(name="boxes/b1")).put(keys.request("r1"), "boxes/b1")
    for slot in (0, 1):
        txn.put(keys.gpu("b1", slot), pb.Gpu(name=f"boxes/b1/gpus/{slot}", slot=slot))
    txn.put(keys.gpu("b10", 0), pb.Gpu(name="boxes/b10/gpus/0"))  # not under b1's prefix
    committed = store.commit(txn)
    found = store.read(
        [keys.request("r1"), keys.box("b1"), keys.box("nope")], [keys.box_gpus("b1")]
    )
    assert set(found) == {
        keys.request("r1"),
        keys.box("b1"),
        keys.gpu("b1", 0),
        keys.gpu("b1", 1),
    }
    assert bytes(found[keys.request("r1")].value) == b"boxes/b1"
    assert found[keys.gpu("b1", 1)].value.slot == 1
    assert {record.mod_revision for record in found.values()} == {committed.revision}


def test_last_write_revision_follows_puts_in_its_collection_only(
    etcd_client, key_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    store = Store(etcd_client, KeySchema(key_prefix))
    keys = store.keys
    assert store.last_write_revision("gpus") == 0
    first = store.commit(Txn().put(keys.gpu("b1", 0), pb.Gpu(name="boxes/b1/gpus/0")))
    second = store.commit(Txn().put(keys.gpu("b2", 0), pb.Gpu(name="boxes/b2/gpus/0")))
    store.commit(Txn().put(keys.box("b3"), pb.Box(name="boxes/b3")))  # another collection
    etcd_client.put(f"{key_prefix.rstrip('/')}-audit/x", b"outside the pool's prefix")

    assert store.last_write_revision("gpus") == second.revision > first.revision
    assert store.current_revision() > second.revision + 1
