"""BrokerServer.stop is bounded whatever clients do: stalled watchers, idle streams of
every kind, and a stalled watcher that cancels (whose cancel callback once blocked gRPC's
dispatch thread, so even stop hung)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from dxpool.api.v1 import inventory_pb2, inventory_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from dxpool.broker.api.node_watch import WatchSettings
from dxpool.broker.api.server import STOP_MARGIN_S, BrokerServer
from tests.broker.api.test_streams import Idle
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
