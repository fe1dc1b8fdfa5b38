from __future__ import annotations

import threading

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.state.cache import Cache, ChangeRoutes, Routes
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn, Versioned
from tests.conftest import wait_until
from tests.patience import patient


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


def test_change_listeners_get_each_change_with_its_revision(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    etcd_client.put(schema.box("early"), pb.Box(name="boxes/early").SerializeToString())
    cache = Cache(etcd_client, schema)
    cache.start()
    changes: list[tuple[str, str, Versioned[object] | None, int]] = []
    subscription = cache.subscribe_changes(lambda *change: changes.append(change))
    try:
        # Nothing at or below `since` is replayed; everything above it is delivered.
        assert subscription.since == cache.revision
        store = Store(etcd_client, schema)
        key = schema.box("b1")
        put = Txn().expect_absent(key).put(key, pb.Box(name="boxes/b1"))
        put_revision = store.commit(put).revision
        cache.apply_commit(put_revision, put.writes, created={key})
        delete = Txn().expect_revision(key, put_revision).delete(key)
        delete_revision = store.commit(delete).revision
        cache.apply_commit(delete_revision, delete.writes)
        assert cache.wait_for_revision(delete_revision, 5)
        seen = [(c, n, r is None, rev) for c, n, r, rev in changes]
        assert seen == [
            (k.BOXES, "b1", False, put_revision),
            (k.BOXES, "b1", True, delete_revision),
        ]
        subscription.close()
        etcd_client.put(schema.box("late"), pb.Box(name="boxes/late").SerializeToString())
        wait_until(lambda: cache.get(k.BOXES, "late"), message="watched put")
        assert len(changes) == 2
    finally:
        cache.stop()


def test_notified_revision_stays_below_a_change_whose_listeners_still_run(  # type: ignore[no-untyped-def]
    etcd_client, key_prefix: str
) -> None:
    """A commit applied ahead of the watch: while its listeners run, the watch passes its
    revision (its copy of the event is skipped as already applied). The notified revision
    must not pass the change until the listeners have returned, or a watcher could be
    given a resume position beyond a change it was never sent.

    The order is forced: the watch thread is held on an earlier key ("gate") while the
    commit is applied, then let go while the commit's listener is held."""
    schema = KeySchema(key_prefix)
    cache = Cache(etcd_client, schema)
    cache.start()
    gate_held, open_gate = threading.Event(), threading.Event()
    entered, release = threading.Event(), threading.Event()

    def held(collection: str, name: str, record: Versioned[object] | None) -> None:
        if name == "gate":
            gate_held.set()
            open_gate.wait(10)
        elif name == "b1":
            entered.set()
            release.wait(10)

    cache.subscribe(held)
    try:
        etcd_client.put(schema.box("gate"), pb.Box(name="boxes/gate").SerializeToString())
        assert gate_held.wait(patient(5))  # the watch thread is held
        store = Store(etcd_client, schema)
        key = schema.box("b1")
        txn = Txn().expect_absent(key).put(key, pb.Box(name="boxes/b1"))
        revision = store.commit(txn).revision
        applying = threading.Thread(
            target=cache.apply_commit, args=(revision, txn.writes, {key}), daemon=True
        )
        applying.start()
        assert entered.wait(patient(5))  # the commit is applied, its listener is running
        open_gate.set()
        assert cache.wait_for_revision(revision, 5)  # the watch has passed it
        assert cache.notified_revision == revision - 1
        release.set()
        applying.join(5)
        assert cache.notified_revision >= revision
    finally:
        open_gate.set()
        release.set()
        cache.stop()


def test_scan_pages_in_listing_order_without_sorting(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    """GPUs list by box, then slot as a number (slot 10 after slot 9); a scan resumes
    after an id, skips what ``keep`` rejects, and says whether more follow."""
    schema = KeySchema(key_prefix)
    txn = Txn()
    for box in ("b1", "b2"):
        for slot in range(12):
            state = pb.GPU_STATE_FREE if slot % 2 == 0 else pb.GPU_STATE_ATTACHED
            txn.put(schema.gpu(box, slot), pb.Gpu(name=f"boxes/{box}/gpus/{slot}", state=state))
    Store(etcd_client, schema).commit(txn)
    cache = Cache(etcd_client, schema)
    cache.start()
    try:
        ids = [name for name, _ in cache.items(k.GPUS)]
        assert ids == [f"{box}/{slot}" for box in ("b1", "b2") for slot in range(12)]

        def free(record: Versioned[pb.Gpu]) -> bool:
            return record.value.state == pb.GPU_STATE_FREE

        first, more = cache.scan(k.GPUS, None, 5, free)
        assert [n for n, _ in first] == ["b1/0", "b1/2", "b1/4", "b1/6", "b1/8"] and more
        second, more = cache.scan(k.GPUS, first[-1][0], 5, free)
        assert [n for n, _ in second] == ["b1/10", "b2/0", "b2/2", "b2/4", "b2/6"] and more
        last, more = cache.scan(k.GPUS, second[-1][0], 5, free)
        assert [n for n, _ in last] == ["b2/8", "b2/10"] and not more
        boxes, more = cache.scan(k.BOXES, None, 5)
        assert boxes == [] and not more
    finally:
        cache.stop()


def test_walk_reads_every_record_in_listing_order_a_page_at_a_time(
    etcd_client, key_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    for slot in (10, 2, 0, 1, 3):
        gpu = pb.Gpu(name=f"boxes/b1/gpus/{slot}", model="H100")
        etcd_client.put(schema.gpu("b1", slot), gpu.SerializeToString())
    cache = Cache(etcd_client, schema)
    cache.start()
    pages: list[int] = []
    scan = cache.scan

    def counting_scan(*args, **kwargs):  # type: ignore[no-untyped-def]
        found, more = scan(*args, **kwargs)
        pages.append(len(found))
        return found, more

    cache.scan = counting_scan  # type: ignore[method-assign]
    try:
        walked = [name for name, _ in cache.walk(k.GPUS, page=2)]
        assert walked == ["b1/0", "b1/1", "b1/2", "b1/3", "b1/10"]
        assert pages == [2, 2, 1]
        assert [name for name, _ in cache.walk(k.BOXES)] == []
    finally:
        cache.stop()


def test_the_first_listing_is_stored_whole_in_listing_order(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    """A start's listing goes in at once; it must hold what record-by-record applying
    holds: every collection, GPUs by slot as a number, each record's revisions."""
    schema = KeySchema(key_prefix)
    for slot in (10, 2, 9):
        etcd_client.put(
            schema.gpu("b1", slot), pb.Gpu(name=f"boxes/b1/gpus/{slot}").SerializeToString()
        )
    etcd_client.put(schema.box("b1"), pb.Box(name="boxes/b1").SerializeToString())
    etcd_client.put(schema.host_lease("h1"), b"token")
    cache = Cache(etcd_client, schema)
    cache.start()
    try:
        assert [name for name, _ in cache.items(k.GPUS)] == ["b1/2", "b1/9", "b1/10"]
        box = cache.get(k.BOXES, "b1")
        raw = etcd_client.get(schema.box("b1"))[1]
        assert box is not None and box.mod_revision == raw.mod_revision
        assert cache.get(k.HOST_LEASES, "h1") is not None
        assert cache.wait_for_revision(raw.mod_revision, 5)
        etcd_client.delete(schema.gpu("b1", 9))
        wait_until(lambda: cache.get(k.GPUS, "b1/9") is None, message="watched delete")
    finally:
        cache.stop()


def test_a_listener_subscribed_before_the_start_hears_every_listed_record(
    etcd_client, key_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    etcd_client.put(schema.box("b1"), pb.Box(name="boxes/b1").SerializeToString())
    etcd_client.put(schema.box("b2"), pb.Box(name="boxes/b2").SerializeToString())
    cache = Cache(etcd_client, schema)
    heard: list[str] = []
    cache.subscribe(lambda collection, name, record: heard.append(name))
    cache.start()
    try:
        assert sorted(heard) == ["b1", "b2"]
    finally:
        cache.stop()


def test_typed_collections_read_what_the_cache_holds(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    schema = KeySchema(key_prefix)
    for slot in (10, 2, 1):
        gpu = pb.Gpu(name=f"boxes/b1/gpus/{slot}", model="H100")
        etcd_client.put(schema.gpu("b1", slot), gpu.SerializeToString())
    etcd_client.put(schema.box("b1"), pb.Box(name="boxes/b1").SerializeToString())
    cache = Cache(etcd_client, schema)
    cache.start()
    try:
        gpu = cache.gpus.get("b1/2")
        assert gpu is not None and gpu.value.model == "H100"
        assert gpu is cache.get(k.GPUS, "b1/2")
        assert cache.gpus.get("b1/3") is None
        assert [name for name, _ in cache.gpus.items()] == ["b1/1", "b1/2", "b1/10"]
        assert cache.gpus.items() == cache.items(k.GPUS)
        assert cache.gpus.scan("b1/1", 1) == cache.scan(k.GPUS, "b1/1", 1)
        assert [name for name, _ in cache.gpus.walk(page=1)] == ["b1/1", "b1/2", "b1/10"]
        assert (cache.gpus.count(), cache.boxes.count(), cache.nodes.count()) == (3, 1, 0)
        etcd_client.put(schema.box("b2"), pb.Box(name="boxes/b2").SerializeToString())
        wait_until(lambda: cache.boxes.get("b2") is not None, message="watched put")
    finally:
        cache.stop()


def test_a_typed_read_waits_for_a_change_being_applied(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    """A collection reads under the cache's lock: a read that starts while a change is
    being applied (the lock held) sees the state after it, never half of it."""
    schema = KeySchema(key_prefix)
    cache = Cache(etcd_client, schema)
    cache.start()
    try:
        applying = cache._lock  # the lock every apply holds
        seen: list[Versioned[pb.Box] | None] = []
        with applying:
            reader = threading.Thread(target=lambda: seen.append(cache.boxes.get("b1")))
            reader.start()
            reader.join(timeout=0.5)
            assert reader.is_alive() and seen == []  # held at the lock, not reading
            cache.apply_read(schema.box("b1"), Versioned(pb.Box(name="boxes/b1"), 9, 9), 9)
        reader.join(timeout=patient(30))
        assert [r.value.name if r else None for r in seen] == ["boxes/b1"]
    finally:
        cache.stop()


def test_routes_hand_each_change_to_its_collections_handler(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    """A box change reaches the boxes handler with its record, a GPU change the GPUs
    handler with its revision; a change of a collection without a handler reaches none."""
    schema = KeySchema(key_prefix)
    cache = Cache(etcd_client, schema)
    cache.start()
    boxes: list[tuple[str, str | None]] = []
    gpus: list[tuple[str, str | None, int]] = []

    def on_box(name: str, record: Versioned[pb.Box] | None) -> None:
        boxes.append((name, record.value.name if record is not None else None))

    def on_gpu(name: str, record: Versioned[pb.Gpu] | None, revision: int) -> None:
        gpus.append((name, record.value.host if record is not None else None, revision))

    cache.subscribe(Routes().on(cache.boxes, on_box))
    cache.subscribe_changes(ChangeRoutes().on(cache.gpus, on_gpu))
    try:
        store = Store(etcd_client, schema)
        put = (
            Txn()
            .put(schema.box("b1"), pb.Box(name="boxes/b1"))
            .put(schema.gpu("b1", 0), pb.Gpu(name="gpus/b1/0", host="hosts/h1"))
            .put(schema.key(k.HOSTS, "h1"), pb.Host(name="hosts/h1"))
        )
        put_revision = store.commit(put).revision
        cache.apply_commit(put_revision, put.writes)
        delete = Txn().delete(schema.box("b1"))
        delete_revision = store.commit(delete).revision
        cache.apply_commit(delete_revision, delete.writes)
        assert cache.wait_for_revision(delete_revision, 30)
        assert boxes == [("b1", "boxes/b1"), ("b1", None)]
        assert gpus == [("b1/0", "hosts/h1", put_revision)]
    finally:
        cache.stop()
