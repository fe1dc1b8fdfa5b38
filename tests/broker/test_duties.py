"""The leader's garbage collection of RELEASED nodes, against a real etcd, pass by pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.cache import Cache
from dxpool.broker.duties import DutySettings, SingletonDuties
from dxpool.broker.records import timestamp
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

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


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
        assert counting.node_reads <= 3  # the one due, read by its deletion and after it
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
