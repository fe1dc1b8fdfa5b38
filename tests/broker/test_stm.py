"""A broker whose cache has not yet seen a record never answers NOT_FOUND for it.

The interleaving is forced: the broker's cache watch is stopped (as when its etcd member
was lost and the watch has not resumed yet), then a node is written into etcd as another
broker's compose would write it. Every lookup of that node must find it in etcd.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from prometheus_client import REGISTRY

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker import stm
from dxpool.broker.cache import Cache
from dxpool.broker.server import BrokerServer
from dxpool.broker.stm import TxnView, pause_after_conflict, transact
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
