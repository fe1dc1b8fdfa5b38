from __future__ import annotations

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.cache import Cache
from dxpool.broker.store import Store, Txn, Versioned
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from tests.conftest import wait_until


def test_list_then_watch_sees_later_writes(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    etcd_client.put(schema.box("early"), pb.Box(name="boxes/early").SerializeToString())
    cache = Cache(etcd_client, schema)
    cache.start()
    try:
        assert cache.get(k.BOXES, "early") is not None
        etcd_client.put(schema.box("late"), pb.Box(name="boxes/late").SerializeToString())
        wait_until(lambda: cache.get(k.BOXES, "late"), message="watched put")
        etcd_client.delete(schema.box("early"))
        wait_until(lambda: cache.get(k.BOXES, "early") is None, message="watched delete")
    finally:
        cache.stop()


def test_own_commit_is_visible_at_once_and_never_regresses(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    cache = Cache(etcd_client, schema)
    cache.start()
    events: list[tuple[str, str, Versioned[object] | None]] = []
    cache.subscribe(lambda c, n, r: events.append((c, n, r)))
    try:
        store = Store(etcd_client, schema)
        key = schema.box("b1")
        txn = Txn().expect_absent(key).put(key, pb.Box(name="boxes/b1", gpu_count=1))
        result = store.commit(txn)
        cache.apply_commit(result.revision, txn.writes, created={key})
        record = cache.get(k.BOXES, "b1")
        assert record is not None and record.mod_revision == result.revision
        delete = Txn().expect_revision(key, result.revision).delete(key)
        deleted = store.commit(delete)
        cache.apply_commit(deleted.revision, delete.writes)
        assert cache.get(k.BOXES, "b1") is None
        assert cache.wait_for_revision(deleted.revision, 5)
        # The watch delivered the put and the delete late; neither resurrected the box.
        assert cache.get(k.BOXES, "b1") is None
        assert [r is None for c, n, r in events if n == "b1"] == [False, True]
    finally:
        cache.stop()


def test_stale_read_is_ignored(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    cache = Cache(etcd_client, schema)
    cache.start()
    try:
        cache.apply_read(schema.box("b"), Versioned(pb.Box(name="new"), 50, 40), 50)
        cache.apply_read(schema.box("b"), Versioned(pb.Box(name="old"), 45, 40), 45)
        record = cache.get(k.BOXES, "b")
        assert record is not None and record.value.name == "new"
    finally:
        cache.stop()
