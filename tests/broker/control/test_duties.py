"""The leader's garbage collection of RELEASED nodes, against a real etcd, pass by pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.duties import DutySettings, SingletonDuties
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.records import timestamp
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn

NOW = 1_000_000.0
RETENTION_S = 100.0


class CountingCache:
    """The cache, counting the node records read through it."""

    def __init__(self, cache: Cache) -> None:
        self._cache = cache
        self.node_reads = 0

    def get(self, collection: str, name: str) -> Any:
        if collection == k.NODES:
            self.node_reads += 1
        return self._cache.get(collection, name)

    @property
    def nodes(self) -> CountedNodes:
        """The typed node collection, its reads counted too."""
        return CountedNodes(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


class CountedNodes:
    """``cache.nodes`` of a :class:`CountingCache`."""

    def __init__(self, counting: CountingCache) -> None:
        self._counting = counting

    def get(self, name: str) -> Any:
        return self._counting.get(k.NODES, name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._counting._cache.nodes, name)


@pytest.fixture
def parts(etcd_client: Any, key_prefix: str) -> Iterator[tuple[Store, Cache]]:
    schema = KeySchema(key_prefix)
    store = Store(etcd_client, schema)
    cache = Cache(etcd_client, schema)
    cache.start()
    yield store, cache
    cache.stop()
    store.health.close()


def released(store: Store, names: list[str], at: float) -> int:
    txn = Txn()
    for name in names:
        node = pb.VirtualNode(
            name=f"nodes/{name}", state=pb.NODE_STATE_RELEASED, update_time=timestamp(at)
        )
        txn.put(store.keys.node(name), node)
    return store.commit(txn).revision


def test_a_pass_reads_only_the_nodes_due_however_many_are_kept(
    parts: tuple[Store, Cache],
) -> None:
    store, cache = parts
    kept = [f"kept-{i}" for i in range(100)]
    released(store, kept[:50], NOW - 50)
    released(store, kept[50:], NOW - 10)
    assert cache.wait_for_revision(released(store, ["old"], NOW - RETENTION_S - 1), 10)
    counting = CountingCache(cache)
    clock = [NOW]
    duties = SingletonDuties(
        store,
        counting,  # type: ignore[arg-type]
        None,
        lambda: False,  # its own loop stays idle: the test runs the passes
        DutySettings(retention_s=RETENTION_S),
        clock=lambda: clock[0],
    )
    duties.start()
    try:
        counting.node_reads = 0
        duties.collect_garbage()
        assert store.get(store.keys.node("old")) is None
        assert 1 <= counting.node_reads <= 3  # the one due, read by its deletion and after it
        counting.node_reads = 0
        duties.collect_garbage()
        assert counting.node_reads == 0
        clock[0] = NOW + 55  # the first 50 are due now
        duties.collect_garbage()
        assert sorted(n for n in kept if store.get(store.keys.node(n)) is not None) == sorted(
            kept[50:]
        )
    finally:
        duties.stop()


def test_a_node_not_deleted_at_its_pass_is_tried_again(
    parts: tuple[Store, Cache], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, cache = parts
    assert cache.wait_for_revision(released(store, ["old"], NOW - RETENTION_S - 1), 10)
    duties = SingletonDuties(
        store, cache, None, lambda: False, DutySettings(retention_s=RETENTION_S), clock=lambda: NOW
    )
    duties.start()
    try:
        applied = duties._apply
        monkeypatch.setattr(duties, "_apply", lambda body, subject: None)  # etcd refused it
        duties.collect_garbage()
        assert store.get(store.keys.node("old")) is not None
        monkeypatch.setattr(duties, "_apply", applied)
        duties.collect_garbage()
        assert store.get(store.keys.node("old")) is None
    finally:
        duties.stop()


# -- host loss: the agents' reconnect grace ---------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def attached_gpu(store: Store, host: str) -> int:
    gpu = pb.Gpu(
        name="boxes/b1/gpus/0",
        state=pb.GPU_STATE_ATTACHED,
        host=f"hosts/{host}",
        node="nodes/n1",
        generation=1,
    )
    return store.commit(Txn().put(store.keys.gpu("b1", 0), gpu)).revision


def losing(
    parts: tuple[Store, Cache], settled: list[bool], grace_s: float, monkeypatch: pytest.MonkeyPatch
) -> tuple[SingletonDuties, Clock, list[str]]:
    """Duties over a host h1 with an attached GPU and no liveness record; records the
    hosts it declares lost instead of losing them."""
    store, cache = parts
    assert cache.wait_for_revision(attached_gpu(store, "h1"), 10)
    clock = Clock()
    duties = SingletonDuties(
        store,
        cache,
        None,
        lambda: False,
        DutySettings(reconnect_grace_s=grace_s),
        settled=lambda: settled[0],
        monotonic=clock,
    )
    lost: list[str] = []
    monkeypatch.setattr(duties, "_lose_host", lost.append)
    duties.start()
    return duties, clock, lost


def test_a_new_leader_gives_agents_the_reconnect_grace(
    parts: tuple[Store, Cache], monkeypatch: pytest.MonkeyPatch
) -> None:
    duties, clock, lost = losing(parts, [True], 30.0, monkeypatch)
    try:
        duties.handle_host_loss()  # leading begins now: the grace starts
        clock.now = 29.9
        duties.handle_host_loss()
        assert lost == []
        clock.now = 30.0
        duties.handle_host_loss()
        assert lost == ["h1"]
    finally:
        duties.stop()


def test_a_host_that_reconnects_within_the_grace_is_never_lost(
    parts: tuple[Store, Cache], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, cache = parts
    duties, clock, lost = losing(parts, [True], 30.0, monkeypatch)
    try:
        duties.handle_host_loss()
        clock.now = 20.0
        revision = store.commit(Txn().put(store.keys.host_lease("h1"), b"")).revision
        assert cache.wait_for_revision(revision, 10)
        for clock.now in (20.0, 31.0, 300.0):
            duties.handle_host_loss()
        assert lost == []
    finally:
        duties.stop()


def test_etcd_away_or_a_stale_cache_restarts_the_grace(
    parts: tuple[Store, Cache], monkeypatch: pytest.MonkeyPatch
) -> None:
    settled = [True]
    duties, clock, lost = losing(parts, settled, 30.0, monkeypatch)
    try:
        duties.handle_host_loss()
        clock.now, settled[0] = 25.0, False  # etcd went away; the cache lags
        duties.handle_host_loss()
        clock.now = 40.0
        duties.handle_host_loss()  # still away: the grace is held
        clock.now, settled[0] = 50.0, True  # back: agents get the grace from here
        duties.handle_host_loss()
        clock.now = 79.9
        duties.handle_host_loss()
        assert lost == []
        clock.now = 80.0
        duties.handle_host_loss()
        assert lost == ["h1"]
    finally:
        duties.stop()


def test_a_settled_leader_loses_a_host_after_the_loss_grace_alone(
    parts: tuple[Store, Cache], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, cache = parts
    duties, clock, lost = losing(parts, [True], 5.0, monkeypatch)
    try:
        revision = store.commit(Txn().put(store.keys.host_lease("h1"), b"")).revision
        assert cache.wait_for_revision(revision, 10)
        duties.handle_host_loss()
        clock.now = 100.0  # long settled; the host is alive
        duties.handle_host_loss()
        store.client.delete(store.keys.host_lease("h1"))  # its agent went silent
        wait = store.current_revision()
        assert cache.wait_for_revision(wait, 10)
        duties.handle_host_loss()
        assert lost == ["h1"]  # at once: host_loss_grace_s is 0 and the leader settled
    finally:
        duties.stop()


def test_leading_again_restarts_the_grace(
    parts: tuple[Store, Cache], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, cache = parts
    leading = [True]
    assert cache.wait_for_revision(attached_gpu(store, "h1"), 10)
    duties = SingletonDuties(
        store,
        cache,
        None,
        lambda: leading[0],
        DutySettings(interval_s=0.02, reconnect_grace_s=0.6),
    )
    lost: list[str] = []
    monkeypatch.setattr(duties, "_lose_host", lost.append)
    monkeypatch.setattr(duties, "reclaim_fencing", lambda: None)
    monkeypatch.setattr(duties, "collect_garbage", lambda: None)
    duties.start()
    try:
        import time

        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost, "the first leader never declared the host lost"
        leading[0] = False  # another broker leads a while
        time.sleep(0.2)
        lost.clear()
        leading[0] = True  # leading again: the grace starts over
        started = time.monotonic()
        while not lost and time.monotonic() < deadline + 10:
            time.sleep(0.02)
        assert lost and time.monotonic() - started >= 0.55
    finally:
        duties.stop()


def held_by(store: Store, cache: Cache, broker: str, registered: bool) -> None:
    """h1's liveness record names ``broker``, registered (alive) or not."""
    from dxpool.api.v1 import resources_pb2

    record = resources_pb2.HostLiveness(broker=broker, session="s1").SerializeToString()
    txn = Txn().put(store.keys.host_lease("h1"), record)
    if registered:
        txn.put(store.keys.broker(broker), b"")
    assert cache.wait_for_revision(store.commit(txn).revision, 10)


def gone(store: Store, cache: Cache, *keys: str) -> None:
    for key in keys:
        store.client.delete(key)
    assert cache.wait_for_revision(store.current_revision(), 10)


def test_a_dead_brokers_hosts_get_the_reconnect_grace(
    parts: tuple[Store, Cache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker holding h1's session dies: its lease takes its registration and h1's
    record together. h1's agent is reconnecting elsewhere, so h1 is not lost at once."""
    store, cache = parts
    held_by(store, cache, "b-dead", registered=True)
    duties, clock, lost = losing(parts, [True], 30.0, monkeypatch)
    try:
        duties.handle_host_loss()
        clock.now = 100.0  # long settled
        duties.handle_host_loss()
        gone(store, cache, store.keys.host_lease("h1"), store.keys.broker("b-dead"))
        duties.handle_host_loss()
        clock.now = 129.9
        duties.handle_host_loss()
        assert lost == []
        clock.now = 130.0
        duties.handle_host_loss()
        assert lost == ["h1"]
    finally:
        duties.stop()


def test_a_live_broker_that_let_a_silent_agent_go_loses_its_host_at_once(
    parts: tuple[Store, Cache], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, cache = parts
    held_by(store, cache, "b-alive", registered=True)
    duties, clock, lost = losing(parts, [True], 30.0, monkeypatch)
    try:
        duties.handle_host_loss()
        clock.now = 100.0
        duties.handle_host_loss()
        gone(store, cache, store.keys.host_lease("h1"))  # the broker deleted it
        duties.handle_host_loss()
        assert lost == ["h1"]
    finally:
        duties.stop()
