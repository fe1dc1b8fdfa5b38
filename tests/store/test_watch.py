"""PrefixWatch against real etcd members that die, stall and come back."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest

from dxpool.errors import Unavailable
from dxpool.store.client import EtcdAddress, connect
from dxpool.store.embedded import EmbeddedEtcd, EtcdCluster, free_port
from dxpool.store.watch import PrefixWatch
from tests.conftest import wait_until

T = TypeVar("T")


class Seen:
    """What a watch delivered: keys by revision, listings, connection changes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[str, int] = {}
        self.lists: list[int] = []
        self.states: list[bool] = []
        self.lag_when_lost: list[float] = []
        self.error_when_lost: list[str] = []
        self.watch: PrefixWatch | None = None

    def on_list(self, kvs: Sequence[Any], revision: int) -> None:
        with self.lock:
            self.lists.append(revision)
            self.keys = {kv.key.decode(): kv.mod_revision for kv in kvs}

    def on_events(self, response: Any) -> None:
        with self.lock:
            for event in response.events:
                self.keys[event.key.decode()] = event.mod_revision

    def on_state(self, connected: bool) -> None:
        self.states.append(connected)
        if not connected and self.watch is not None:
            self.lag_when_lost.append(self.watch.lag_s())
            self.error_when_lost.append(self.watch.last_error)

    def has(self, key: str) -> bool:
        with self.lock:
            return key in self.keys


@pytest.fixture
def prefix() -> str:
    return f"/watch-test-{uuid.uuid4().hex[:8]}/"


def start_watch(
    addresses: Sequence[EtcdAddress], prefix: str, seen: Seen, **settings: float
) -> PrefixWatch:
    watch = PrefixWatch(
        addresses,
        prefix,
        on_list=seen.on_list,
        on_events=seen.on_events,
        on_state=seen.on_state,
        **settings,  # type: ignore[arg-type]
    )
    seen.watch = watch
    watch.start(timeout_s=10)
    return watch


def watched_follower(cluster: EtcdCluster, watch: PrefixWatch) -> EmbeddedEtcd:
    """The member ``watch`` uses, made a follower so that losing it loses no leader."""
    member = cluster.member(str(watch.endpoint))
    cluster.move_leader(next(m for m in cluster.members if m is not member))
    return member


@pytest.fixture
def writer(etcd_cluster: EtcdCluster) -> Iterator[Any]:
    client = connect(etcd_cluster.endpoints, timeout_s=2)
    yield client
    client.close()


def retrying(call: Callable[[], T]) -> T:
    """Run ``call`` until some member answers (the client fails over on the next call)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return call()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def put_retrying(client: Any, key: str) -> None:
    retrying(lambda: client.put(key, b"v"))


def test_killed_member_is_left_for_another_without_listing_again(
    etcd_cluster: EtcdCluster, writer: Any, prefix: str
) -> None:
    seen = Seen()
    writer.put(prefix + "before", b"v")
    watch = start_watch([m.address for m in etcd_cluster.members], prefix, seen)
    try:
        victim = watched_follower(etcd_cluster, watch)
        victim.kill()
        killed_at = time.monotonic()
        put_retrying(writer, prefix + "after")
        wait_until(lambda: seen.has(prefix + "after"), timeout_s=5, message="event via another")
        assert time.monotonic() - killed_at < 30  # failed over, not waiting on the dead one
        assert watch.connected and watch.lag_s() == 0
        assert watch.endpoint != victim.address
        assert len(seen.lists) == 1, "resumed from its revision, not listed again"
        assert seen.states == [True, False, True]
        assert seen.has(prefix + "before")
    finally:
        watch.stop()


def test_silent_member_is_abandoned(etcd_cluster: EtcdCluster, writer: Any, prefix: str) -> None:
    seen = Seen()
    watch = start_watch(
        [m.address for m in etcd_cluster.members],
        prefix,
        seen,
        progress_interval_s=0.2,
        progress_timeout_s=0.5,
    )
    try:
        victim = watched_follower(etcd_cluster, watch)
        victim.pause()  # its connections stay open; nothing answers
        paused_at = time.monotonic()
        put_retrying(writer, prefix + "during-pause")
        wait_until(lambda: seen.has(prefix + "during-pause"), timeout_s=5, message="failover")
        assert time.monotonic() - paused_at < 30  # noticed the silence, not a TCP timeout
        assert seen.states == [True, False, True]
        # When the silence was noticed, the watch counted as stale since the member
        # last answered, not since the silence was noticed.
        assert seen.lag_when_lost[0] >= 0.5
        assert "answered nothing" in watch.last_error
    finally:
        watch.stop()


def test_compacted_history_is_listed_again(
    etcd_cluster: EtcdCluster, writer: Any, prefix: str
) -> None:
    seen = Seen()
    writer.put(prefix + "gone", b"v")
    member = etcd_cluster.members[0]
    etcd_cluster.move_leader(etcd_cluster.members[1])
    watch = start_watch([member.address], prefix, seen, max_backoff_s=0.2)
    try:
        member.kill()
        wait_until(lambda: False in seen.states, timeout_s=5, message="watch lost")
        retrying(lambda: writer.delete(prefix + "gone"))
        put_retrying(writer, prefix + "new")
        revision = retrying(lambda: writer.get_prefix_response(prefix)).header.revision
        retrying(lambda: writer.compact(revision))
        member.start()
        wait_until(lambda: seen.has(prefix + "new"), timeout_s=10, message="re-listed")
        assert len(seen.lists) == 2
        assert not seen.has(prefix + "gone"), "the listing replaced what the history lost"
        # the listing comes first; the watch is connected once etcd confirms its stream
        wait_until(lambda: watch.connected, timeout_s=5, message="watching after the listing")
    finally:
        watch.stop()


def test_start_fails_with_unavailable_when_no_member_answers(prefix: str) -> None:
    seen = Seen()
    addresses = [EtcdAddress("127.0.0.1", free_port()) for _ in range(3)]
    watch = PrefixWatch(addresses, prefix, on_list=seen.on_list, on_events=seen.on_events)
    started = time.monotonic()
    with pytest.raises(Unavailable) as raised:
        watch.start(timeout_s=10)
    assert time.monotonic() - started < 3
    assert "cannot list and watch etcd" in raised.value.message
    assert "Connection refused" in raised.value.message
    assert seen.lists == []


def test_restarted_single_member_is_watched_again(private_etcd: EmbeddedEtcd, prefix: str) -> None:
    seen = Seen()
    watch = start_watch([private_etcd.address], prefix, seen)
    writer = connect(private_etcd.endpoint, timeout_s=2)
    try:
        private_etcd.kill()
        wait_until(lambda: False in seen.states, timeout_s=5, message="watch lost")
        private_etcd.start()
        back_at = time.monotonic()
        wait_until(lambda: watch.connected, timeout_s=5, message="watch back")
        assert time.monotonic() - back_at < 60  # not the 300 s an endpoint was once benched
        put_retrying(writer, prefix + "after-restart")
        wait_until(lambda: seen.has(prefix + "after-restart"), timeout_s=5, message="event")
        assert len(seen.lists) == 1
    finally:
        writer.close()
        watch.stop()


@pytest.mark.slow
def test_member_that_lost_its_leader_ends_the_watch(etcd_cluster: EtcdCluster, prefix: str) -> None:
    # A member cut off from its peers still answers progress requests itself; only the
    # require-leader metadata makes it end the watch instead of leaving it quietly stale.
    seen = Seen()
    watch = start_watch([m.address for m in etcd_cluster.members], prefix, seen)
    try:
        alone = etcd_cluster.member(str(watch.endpoint))
        for member in etcd_cluster.members:
            if member is not alone:
                member.kill()
        lost_at = time.monotonic()
        wait_until(lambda: False in seen.states, timeout_s=10, message="watch ended")
        assert time.monotonic() - lost_at < 60
        assert not watch.connected
        assert "etcdserver: no leader" in seen.error_when_lost[0]
        for member in etcd_cluster.members:
            if member is not alone:
                member.start(wait=False)
        wait_until(lambda: watch.connected, timeout_s=15, message="watch back with a quorum")
    finally:
        watch.stop()
