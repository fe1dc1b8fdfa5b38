"""A broker whose cache has not yet seen a record never answers NOT_FOUND for it.

The interleaving is forced: the broker's cache watch is stopped (as when its etcd member
was lost and the watch has not resumed yet), then a node is written into etcd as another
broker's compose would write it. Every lookup of that node must find it in etcd.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.nodes.compose import ComposeSettings
from dxpool.broker.state import stm
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.stm import TxnView, pause_after_conflict, transact
from dxpool.errors import Aborted
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.streaming import node, write_nodes


@pytest.fixture
def lagging_broker(broker_factory: Callable[..., BrokerServer]) -> BrokerServer:
    """A broker whose cache stopped following etcd (its reads stay within the staleness
    limit for the test)."""
    broker = broker_factory(max_staleness_s=120.0)
    broker.cache.stop()
    return broker


def test_get_node_finds_a_node_the_cache_has_not_seen(
    lagging_broker: BrokerServer,
    etcd_client,
    key_prefix: str,  # type: ignore[no-untyped-def]
) -> None:
    write_nodes(etcd_client, key_prefix, [node("elsewhere")])
    assert lagging_broker.cache.get(k.NODES, "elsewhere") is None

    with grpc.insecure_channel(lagging_broker.endpoint) as channel:
        stub = nodes_pb2_grpc.NodeServiceStub(channel)
        found = stub.GetNode(nodes_pb2.GetNodeRequest(name="nodes/elsewhere"), timeout=5)
        assert (found.name, found.state) == ("nodes/elsewhere", pb.NODE_STATE_READY)
        # The cache took what etcd returned.
        assert lagging_broker.cache.get(k.NODES, "elsewhere") is not None

        with pytest.raises(grpc.RpcError) as missing:
            stub.GetNode(nodes_pb2.GetNodeRequest(name="nodes/nowhere"), timeout=5)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def test_release_of_a_node_the_cache_has_not_seen_goes_through(
    lagging_broker: BrokerServer,
    etcd_client,
    key_prefix: str,  # type: ignore[no-untyped-def]
) -> None:
    write_nodes(etcd_client, key_prefix, [node("elsewhere")])

    with grpc.insecure_channel(lagging_broker.endpoint) as channel:
        stub = nodes_pb2_grpc.NodeServiceStub(channel)
        released = stub.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name="nodes/elsewhere"), timeout=5)
        assert released.state == pb.NODE_STATE_RELEASING
        stored = lagging_broker.store.get(lagging_broker.store.keys.node("elsewhere"))
        # A node without GPUs may already be RELEASED by the controller's next sweep.
        assert stored is not None
        assert stored.value.state in (pb.NODE_STATE_RELEASING, pb.NODE_STATE_RELEASED)


def test_a_named_watch_of_a_node_the_cache_has_not_seen_starts(
    lagging_broker: BrokerServer,
    etcd_client,  # type: ignore[no-untyped-def]
    key_prefix: str,
) -> None:
    """The watch is not refused; it lists at the cache's revision (which does not hold
    the node yet) and says so with TYPE_SYNCED, and the node follows as an event once
    the cache catches up."""
    write_nodes(etcd_client, key_prefix, [node("elsewhere")])

    with grpc.insecure_channel(lagging_broker.endpoint) as channel:
        stub = nodes_pb2_grpc.NodeServiceStub(channel)
        stream = stub.WatchNodes(nodes_pb2.WatchNodesRequest(name="nodes/elsewhere"), timeout=5)
        first = next(stream)
        assert first.type == nodes_pb2.NodeEvent.TYPE_SYNCED
        stream.cancel()


def test_a_lost_compare_runs_the_change_again_and_is_counted_by_operation(
    etcd_client,
    key_prefix: str,  # type: ignore[no-untyped-def]
) -> None:
    schema = KeySchema(key_prefix)
    store = Store(etcd_client, schema)
    key = schema.box("b1")
    store.commit(Txn().put(key, pb.Box(name="boxes/b1", gpu_count=1)))
    cache = Cache(etcd_client, schema)
    cache.start()
    cache.stop()  # the cache no longer follows etcd: only the commit's answer updates it
    labels = {"operation": "test-op"}
    before = REGISTRY.get_sample_value("dxpool_transaction_conflicts_total", labels) or 0.0
    seen: list[int] = []

    def body(view: TxnView) -> int:
        record = view.get(k.BOXES, "b1")
        assert record is not None
        seen.append(record.value.gpu_count)
        if len(seen) == 1:  # another writer commits between this read and our commit
            store.commit(Txn().put(key, pb.Box(name="boxes/b1", gpu_count=2)))
        view.put(k.BOXES, "b1", pb.Box(name="boxes/b1", gpu_count=record.value.gpu_count + 10))
        return record.value.gpu_count

    assert transact(store, cache, body, operation="test-op") == 2

    assert seen == [1, 2]
    stored = store.get(key)
    assert stored is not None and stored.value.gpu_count == 12
    after = REGISTRY.get_sample_value("dxpool_transaction_conflicts_total", labels)
    assert after == before + 1


def test_the_pause_after_a_conflict_is_random_below_a_doubling_ceiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each pause is drawn from [0, ceiling]; the ceiling doubles per attempt from 1 ms
    and stops at 50 ms, so writers that conflicted spread out and none waits long."""
    asked: list[tuple[float, float]] = []
    slept: list[float] = []

    def uniform(low: float, high: float) -> float:
        asked.append((low, high))
        return high

    monkeypatch.setattr(stm.random, "uniform", uniform)
    monkeypatch.setattr(stm.time, "sleep", slept.append)
    for attempt in range(10):
        pause_after_conflict(attempt)
    assert [high for _, high in asked] == pytest.approx(
        [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05, 0.05]
    )
    assert all(low == 0 for low, _ in asked)
    assert slept == [high for _, high in asked]


def _store_and_cache(etcd_client: Any, key_prefix: str) -> tuple[Store, Cache]:
    """A store, and a cache that no longer follows etcd (only commits update it)."""
    schema = KeySchema(key_prefix)
    store = Store(etcd_client, schema)
    cache = Cache(etcd_client, schema)
    cache.start()
    cache.stop()
    return store, cache


def test_a_change_that_loses_every_compare_is_aborted_after_the_last_attempt(
    etcd_client: Any, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, cache = _store_and_cache(etcd_client, key_prefix)
    key = store.keys.box("b1")
    store.commit(Txn().put(key, pb.Box(name="boxes/b1", gpu_count=1)))
    cache.apply_reads(store.read([key]))
    monkeypatch.setattr(stm.time, "sleep", lambda _: None)
    runs: list[int] = []

    def body(view: TxnView) -> None:
        record = view.get(k.BOXES, "b1")
        assert record is not None
        runs.append(record.mod_revision)
        store.commit(Txn().put(key, pb.Box(name="boxes/b1", gpu_count=len(runs) + 1)))
        view.put(k.BOXES, "b1", pb.Box(name="boxes/b1", gpu_count=100))

    with pytest.raises(Aborted) as aborted:
        transact(store, cache, body, what="resizing boxes/b1")

    assert aborted.value.reason == "COMMIT_CONFLICT"
    assert "resizing boxes/b1 kept conflicting" in aborted.value.message
    assert len(runs) == stm.COMMIT_ATTEMPTS
    assert runs == sorted(set(runs))  # each attempt read the value the last one lost to
    stored = store.get(key)
    assert stored is not None and stored.value.gpu_count == stm.COMMIT_ATTEMPTS + 1


def test_typed_view_reads_record_the_same_compares_as_untyped_reads(
    etcd_client: Any, key_prefix: str
) -> None:
    """``view.boxes.get``, ``view.gpus.latest`` and ``view.host_leases.exists`` read what
    ``view.get``, ``view.latest`` and ``view.exists`` read and have the commit compare
    exactly the same revisions (present, absent, merely existing)."""
    store, cache = _store_and_cache(etcd_client, key_prefix)
    keys = store.keys
    store.commit(
        Txn()
        .put(keys.box("b1"), pb.Box(name="boxes/b1", gpu_count=1))
        .put(keys.gpu("b1", 0), pb.Gpu(name="gpus/b1/0", host="hosts/h1"))
        .put(keys.key(k.HOST_LEASES, "h1"), b"")
    )
    cache.apply_reads(
        store.read([keys.box("b1"), keys.gpu("b1", 0), keys.key(k.HOST_LEASES, "h1")])
    )

    def compares(view: TxnView) -> list[tuple[str, str, Any, Any]]:
        txn, _ = view.build()
        return [(type(c).__name__, c.key, c.op, c.value) for c in txn.compares]

    typed = TxnView(store, cache)
    box = typed.boxes.get("b1")
    gpu = typed.gpus.latest("b1/0")
    alive = typed.host_leases.exists("h1")
    missing = typed.nodes.get("n1")
    untyped = TxnView(store, cache)
    assert box == untyped.get(k.BOXES, "b1")
    assert gpu == untyped.latest(k.GPUS, "b1/0")
    assert alive is untyped.exists(k.HOST_LEASES, "h1") is True
    assert missing is untyped.get(k.NODES, "n1") is None
    assert box is not None and box.value.gpu_count == 1
    assert gpu is not None and gpu.host == "hosts/h1"
    assert compares(typed) == compares(untyped)
    assert len(compares(typed)) == 4  # box and GPU at their revisions, lease, node absent
    assert typed.absent_keys == untyped.absent_keys == [keys.key(k.NODES, "n1")]


def test_a_required_revision_read_elsewhere_is_compared(etcd_client: Any, key_prefix: str) -> None:
    """``require`` compares a revision the body read from etcd itself, not the cache's."""
    store, cache = _store_and_cache(etcd_client, key_prefix)
    request_key = store.keys.request("r1")
    store.commit(Txn().put(request_key, "boxes/old"))
    seen: list[str] = []

    def body(view: TxnView) -> str:
        found = store.get(request_key)
        assert found is not None
        seen.append(bytes(found.value).decode())
        if len(seen) == 1:  # another writer moves the key after this read
            store.commit(Txn().put(request_key, "boxes/other"))
        view.require(k.REQUESTS, "r1", found.mod_revision)
        view.put(k.REQUESTS, "r1", "boxes/mine")
        return seen[-1]

    assert transact(store, cache, body) == "boxes/other"
    assert seen == ["boxes/old", "boxes/other"]
    stored = store.get(request_key)
    assert stored is not None and bytes(stored.value) == b"boxes/mine"


def test_a_staged_commit_keeps_the_cache_on_either_outcome(
    etcd_client: Any, key_prefix: str
) -> None:
    """Parts staged apart and joined commit as one; a lost compare brings the current
    values of every compared key into the cache, for the caller to stage again on."""
    store, cache = _store_and_cache(etcd_client, key_prefix)
    keys = store.keys
    first = stm.expect(Txn(), keys.box("b1"), 0).put(keys.box("b1"), pb.Box(name="boxes/b1"))
    second = stm.expect(Txn(), keys.box("b2"), 0).put(keys.box("b2"), pb.Box(name="boxes/b2"))
    won = stm.commit_staged(store, cache, stm.joined([first, second]))
    assert won.succeeded
    for box_id in ("b1", "b2"):
        record = cache.get(k.BOXES, box_id)
        assert record is not None
        assert (record.mod_revision, record.create_revision) == (won.revision, won.revision)

    held = cache.get(k.BOXES, "b1")
    assert held is not None
    # Another writer changes b1 between this staging's read and its commit.
    store.commit(Txn().put(keys.box("b1"), pb.Box(name="boxes/b1", gpu_count=5)))
    lost_part = stm.expect(Txn(), keys.box("b1"), held.mod_revision)
    lost_part.put(keys.box("b1"), pb.Box(name="boxes/b1", gpu_count=1))
    stm.expect_exists(lost_part, keys.host_lease("h1"))
    lost = stm.commit_staged(store, cache, lost_part)
    assert not lost.succeeded
    assert set(lost.current) == {keys.box("b1"), keys.host_lease("h1")}
    fresh = cache.get(k.BOXES, "b1")
    assert fresh is not None and fresh.value.gpu_count == 5  # the other writer's value
    assert fresh.mod_revision > held.mod_revision
    stored = store.get(keys.box("b1"))
    assert stored is not None and stored.value.gpu_count == 5


def test_every_commit_loop_draws_its_attempts_from_one_place() -> None:
    """No commit loop of the broker names its own attempt limit: every ``attempts=`` and
    ``max_attempts`` given is one of stm's named limits, whose docstrings say why each
    differs."""
    broker = Path(__file__).resolve().parents[3] / "broker"
    literal: list[str] = []
    for path in sorted(broker.rglob("*.py")):
        for found in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(found, ast.keyword)
                and found.arg in {"attempts", "max_attempts"}
                and isinstance(found.value, ast.Constant)
            ):
                literal.append(f"{path.relative_to(broker)}:{found.value.lineno}")
    assert literal == []
    assert ComposeSettings().max_attempts == stm.PLACE_ATTEMPTS
