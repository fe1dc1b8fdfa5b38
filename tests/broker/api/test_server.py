"""BrokerServer.stop is bounded whatever clients do: stalled watchers, idle streams of
every kind, and a stalled watcher that cancels (whose cancel callback once blocked gRPC's
dispatch thread, so even stop hung). The broker's collector policy starts with it and
gets its turn after each compose."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc
from prometheus_client import REGISTRY

from dxpool.api.v1 import inventory_pb2, inventory_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.node_watch import WatchSettings
from dxpool.broker.api.server import STOP_MARGIN_S, BrokerServer
from dxpool.gc_policy import CollectorSettings
from dxpool.store.keys import KeySchema
from tests.broker.api.test_streams import Idle
from tests.conftest import Stubs, add_box, wait_until
from tests.integration.test_quotas import compose_request, register_host
from tests.streaming import SMALL_WINDOW, blocked_watchers, fill_window, wait_for


def rpc_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rpc")]


def test_stop_is_prompt_with_stalled_idle_and_cancelled_streams(  # type: ignore[no-untyped-def]
    broker_factory: Callable[..., BrokerServer], etcd_client, key_prefix: str
) -> None:
    broker = broker_factory(watch=WatchSettings(send_timeout_s=300))
    feed = broker.nodes.feed  # type: ignore[union-attr]
    idle = Idle()
    stall = grpc.insecure_channel(broker.endpoint, options=SMALL_WINDOW)
    quitter = grpc.insecure_channel(broker.endpoint, options=SMALL_WINDOW)
    channel = grpc.insecure_channel(broker.endpoint)
    try:
        # Two watchers stop reading; the broker's sends to both block.
        stalled = [
            nodes_pb2_grpc.NodeServiceStub(c).WatchNodes(nodes_pb2.WatchNodesRequest(), timeout=300)
            for c in (stall, quitter)
        ]
        for stream in stalled:
            next(stream)
        fill_window(
            etcd_client,
            key_prefix,
            lambda r: [f"big{i}" for i in range(10)],
            until=lambda: len(blocked_watchers(feed, 1.0)) == 2,
        )
        # One of them gives up: its cancel must not wedge the server.
        stalled[1].cancel()
        wait_for(lambda: len(feed.watchers()) == 1, 5, "the cancelled watch to end")
        inventory = inventory_pb2_grpc.InventoryServiceStub(channel)
        inventory.ListBoxes(inventory_pb2.ListBoxesRequest(), timeout=2)
        # Idle streams of every kind.
        watch = nodes_pb2_grpc.NodeServiceStub(channel).WatchNodes(
            nodes_pb2.WatchNodesRequest(), timeout=300
        )
        while next(watch).type != nodes_pb2.NodeEvent.TYPE_SYNCED:
            pass  # the listing
        health = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=300
        )
        assert next(health).status == health_pb2.HealthCheckResponse.SERVING
        info = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            idle, timeout=300
        )
        wait_for(lambda: len(broker.streams.open_streams()) == 3, 5, "three kinds of stream")

        started = time.monotonic()
        broker.stop(grace_s=0.5)
        took = time.monotonic() - started
        print(f"stop(grace_s=0.5) took {took:.2f}s")
        # the grace and the margin, not the streams' 300 s deadlines (a loaded machine
        # may add seconds to both)
        assert took < 10 * (0.5 + STOP_MARGIN_S), f"stop took {took:.1f}s"
        assert broker.streams.open_streams() == {}
        assert info.done()
        # Every worker thread is free, so the process can exit.
        wait_for(lambda: not rpc_threads(), 5, "the worker threads to exit")
        # The idle watcher was told why, and can resume elsewhere.
        try:
            next(watch)
            raise AssertionError("the watch did not end")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        idle.done.set()
        for c in (stall, quitter, channel):
            c.close()


def gc_collections(kind: str) -> float:
    return REGISTRY.get_sample_value("dxpool_gc_collections_total", {"kind": kind}) or 0.0


def test_the_collector_policy_starts_with_the_broker_and_runs_after_each_placing_call(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, key_prefix: str
) -> None:
    started = gc_collections("start")
    # a batch of one: every turn after a compose collects, so the metric shows each turn
    broker = broker_factory(gc=CollectorSettings(young_batch=1))
    assert gc_collections("start") == started + 1
    assert (REGISTRY.get_sample_value("dxpool_gc_frozen_objects") or 0) > 0
    assert gc.get_threshold()[0] == CollectorSettings().young_limit
    turns: list[str | None] = []
    between = broker.collector.between

    def spy() -> str | None:
        turns.append(between())
        return turns[-1]

    broker.collector.between = spy  # type: ignore[method-assign]
    channel = grpc.insecure_channel(broker.endpoint)
    stubs = Stubs(channel)
    try:
        register_host(etcd_client, KeySchema(key_prefix), "h1")
        add_box(stubs, "box1", gpus=4, model="H100")
        wait_until(lambda: len(broker.index.snapshot().hosts) == 1, 90, message="host")
        young = gc_collections("young_batch")
        node = stubs.nodes.ComposeNode(compose_request("H100:2", ""))
        assert len(node.gpus) == 2
        assert turns == ["young_batch"]
        assert gc_collections("young_batch") == young + 1
        with pytest.raises(grpc.RpcError) as refused:
            stubs.nodes.ComposeNode(compose_request("H100:8", ""))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert len(turns) == 2, "a refused compose gives the collector its turn too"
        member = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1))
        gang = stubs.nodes.ComposeGang(nodes_pb2.ComposeGangRequest(members=[member]))
        assert len(gang.nodes) == 1
        assert len(turns) == 3, "a gang's compose gives it its turn"
        # a node no agent attached may be refused a resize: the turn comes either way
        with contextlib.suppress(grpc.RpcError):
            stubs.nodes.ResizeNode(nodes_pb2.ResizeNodeRequest(name=node.name, gpu_count=3))
        assert len(turns) == 4, "a resize gives it its turn"
    finally:
        channel.close()
