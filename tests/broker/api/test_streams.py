"""Stream budgets: streams over their limits are refused at once, and open streams, idle
or not, never take the workers unary calls need.

Everything runs against a real broker over loopback (or, for a client-streaming method,
which the broker does not have, a real gRPC server with the same interceptor).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.api.streams import (
    HEALTH_WATCH,
    REFLECTION_INFO,
    WATCH_NODES,
    StreamLimiter,
    StreamLimits,
)
from tests.patience import patient
from tests.streaming import wait_for

LIMITS = StreamLimits(
    total=7, per_method={WATCH_NODES: 3, HEALTH_WATCH: 3, REFLECTION_INFO: 2}, default=2
)


class Idle:
    """A request iterator that sends nothing until the test ends."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def __iter__(self) -> Iterator[reflection_pb2.ServerReflectionRequest]:
        return self

    def __next__(self) -> reflection_pb2.ServerReflectionRequest:
        self.done.wait(60)
        raise StopIteration


def refused(calls: list[grpc.Future]) -> list[grpc.Future]:  # type: ignore[type-arg]
    return [c for c in calls if c.done()]


def reason(call: grpc.Call) -> str:
    status = rpc_status.from_call(call)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info.reason


def unary_calls_succeed(channel: grpc.Channel, count: int, deadline_s: float) -> None:
    """``count`` unary calls at once, each within ``deadline_s``."""
    nodes = nodes_pb2_grpc.NodeServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    calls: list[Callable[[], object]] = [
        lambda: nodes.ListNodes(nodes_pb2.ListNodesRequest(), timeout=deadline_s),
        lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=deadline_s),
    ]
    with futures.ThreadPoolExecutor(count) as pool:
        results = list(pool.map(lambda i: calls[i % 2](), range(count)))
    assert len(results) == count


def test_streams_over_their_limits_are_refused_and_unary_calls_stay_served(
    broker_factory: Callable[..., BrokerServer],
) -> None:
    broker = broker_factory(max_workers=2, stream_limits=LIMITS)
    idle = Idle()
    with grpc.insecure_channel(broker.endpoint) as channel:
        nodes = nodes_pb2_grpc.NodeServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        try:
            watches = [
                nodes.WatchNodes(nodes_pb2.WatchNodesRequest(), timeout=60) for _ in range(5)
            ]
            wait_for(lambda: len(refused(watches)) == 2, 5, "two watches refused")
            healths = [health.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(5)]
            wait_for(lambda: len(refused(healths)) == 2, 5, "two health watches refused")
            infos = [reflection.ServerReflectionInfo(idle, timeout=60) for _ in range(5)]
            # Only one more fits: the broker serves 7 streams in all.
            wait_for(lambda: len(refused(infos)) == 4, 5, "four reflection streams refused")
            assert broker.streams.open_streams() == {
                WATCH_NODES: 3,
                HEALTH_WATCH: 3,
                REFLECTION_INFO: 1,
            }
            for call in refused(watches) + refused(healths) + refused(infos):
                assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert reason(call) == "TOO_MANY_STREAMS"
            # The admitted ones are being served: they answered.
            for call in watches:
                if not call.done():
                    assert next(call).type == nodes_pb2.NodeEvent.TYPE_SYNCED
            unary_calls_succeed(channel, count=40, deadline_s=3)
            # Ended streams give their places back.
            for call in watches + healths + infos:
                call.cancel()
            wait_for(lambda: not broker.streams.open_streams(), 5, "every stream to end")
            again = nodes.WatchNodes(nodes_pb2.WatchNodesRequest(), timeout=10)
            assert next(again).type == nodes_pb2.NodeEvent.TYPE_SYNCED
            again.cancel()
        finally:
            idle.done.set()


def test_idle_reflection_streams_cannot_take_the_workers(broker: BrokerServer) -> None:
    """96 idle reflection streams once took all 32 + 64 workers of a broker."""
    idles = [Idle() for _ in range(96)]
    with grpc.insecure_channel(broker.endpoint) as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        try:
            infos = [reflection.ServerReflectionInfo(i, timeout=60) for i in idles]
            limit = broker.config.stream_limits.limit(REFLECTION_INFO)
            wait_for(lambda: len(refused(infos)) == 96 - limit, 10, "the streams over the limit")
            assert broker.streams.open_streams() == {REFLECTION_INFO: limit}
            unary_calls_succeed(channel, count=64, deadline_s=3)
        finally:
            for idle in idles:
                idle.done.set()


def test_client_streaming_calls_are_limited_too() -> None:
    """Any other streaming method gets the default limit (here: a client stream)."""
    release = threading.Event()
    served = threading.Semaphore(0)

    def total(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        served.release()
        return b"%d" % sum(len(r) for r in requests)

    limiter = StreamLimiter(StreamLimits(total=4, per_method={}, default=1))
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[limiter])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "t.Test", {"Total": grpc.stream_unary_rpc_method_handler(total)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def slow_requests() -> Iterator[bytes]:
        yield b"ab"
        release.wait(10)
        yield b"c"

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_unary("/t.Test/Total")
            first = call.future(slow_requests(), timeout=10)
            assert served.acquire(timeout=patient(5))
            with pytest.raises(grpc.RpcError) as refusal:
                call(iter([b"x"]), timeout=5)
            assert refusal.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            release.set()
            assert first.result() == b"3"
            wait_for(lambda: not limiter.open_streams(), 5, "the stream to end")
            assert call(iter([b"x"]), timeout=5) == b"1"
    finally:
        release.set()
        server.stop(0)
