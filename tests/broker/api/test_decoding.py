"""RequestDecodingGuard: a payload that is not the method's request message is rejected
as INVALID_ARGUMENT, once-a-minute logged, never with a traceback, for every kind of
method. The server here carries the broker's real InventoryService (over real etcd),
health checking and reflection, as the broker serves them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from prometheus_client import REGISTRY

from dxpool.api.v1 import inventory_pb2, inventory_pb2_grpc, resources_pb2
from dxpool.broker.api.decoding import RequestDecodingGuard, Undecodable, guard_deserializer
from dxpool.broker.api.inventory_service import InventoryService
from dxpool.broker.api.log_throttle import LogThrottle
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.metrics import method_label
from dxpool.broker.state.pool_tally import PoolTally
from dxpool.store.client import connect
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store

GARBAGE = b"\x0a\x05ab"  # field 1, length 5, then only 2 bytes
NOT_UTF8 = b"\x0a\x02\xff\xfe"  # field 1 (a string) holding bytes that are not UTF-8
CREATE_BOX = "/dxpool.v1.InventoryService/CreateBox"


def _echo_count(requests: Iterator[Any], context: grpc.ServicerContext) -> bytes:
    """A client-streaming method (the broker serves none): counts what it receives."""
    return str(sum(1 for _ in requests)).encode()


@pytest.fixture
def server(etcd_server: Any, key_prefix: str) -> Iterator[str]:
    schema = KeySchema(key_prefix)
    etcd, watch = connect(etcd_server.endpoint), connect(etcd_server.endpoint)
    cache = Cache(watch, schema)
    cache.start()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), interceptors=[RequestDecodingGuard()]
    )
    inventory_pb2_grpc.add_InventoryServiceServicer_to_server(
        InventoryService(Store(etcd, schema), cache, PoolTally(cache)), server
    )
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((reflection.SERVICE_NAME,), server)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Count",
                {
                    "Count": grpc.stream_unary_rpc_method_handler(
                        _echo_count,
                        request_deserializer=inventory_pb2.GetBoxRequest.FromString,
                        response_serializer=lambda raw: raw,
                    )
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)
    cache.stop()
    etcd.close()
    watch.close()


@pytest.fixture
def channel(server: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server) as channel:
        yield channel


def _rejection(error: grpc.RpcError) -> tuple[grpc.StatusCode, str, str]:
    call: Any = error
    status = rpc_status.from_call(call)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    return call.code(), call.details(), info.reason


@pytest.mark.parametrize("payload", [GARBAGE, NOT_UTF8, b"\xff" * 11])
def test_unary_garbage_is_invalid_argument(
    payload: bytes, channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    call = channel.unary_unary(CREATE_BOX, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as error:
        call(payload, timeout=10)
    code, details, reason = _rejection(error.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert reason == "UNDECODABLE_REQUEST"
    assert "dxpool.v1.CreateBoxRequest" in details and "send a serialized" in details
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_well_formed_requests_pass_through(channel: grpc.Channel) -> None:
    stub = inventory_pb2_grpc.InventoryServiceStub(channel)
    box = stub.CreateBox(
        inventory_pb2.CreateBoxRequest(
            box_id="box1", box=resources_pb2.Box(gpu_count=1), gpu_model="H100"
        ),
        timeout=10,
    )
    assert box.name == "boxes/box1"
    with pytest.raises(grpc.RpcError) as error:  # the servicer's own checks still answer
        stub.GetBox(inventory_pb2.GetBoxRequest(name="boxes/nope"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_server_streaming_garbage_is_invalid_argument(channel: grpc.Channel) -> None:
    watch = channel.unary_stream(
        "/grpc.health.v1.Health/Watch", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as error:
        list(watch(GARBAGE, timeout=10))
    code, details, reason = _rejection(error.value)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "UNDECODABLE_REQUEST")
    assert "grpc.health.v1.HealthCheckRequest" in details


def test_bidi_streaming_garbage_is_invalid_argument(channel: grpc.Channel) -> None:
    info = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=None,
        response_deserializer=None,
    )
    with pytest.raises(grpc.RpcError) as error:
        list(info(iter([NOT_UTF8]), timeout=10))
    code, _details, reason = _rejection(error.value)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "UNDECODABLE_REQUEST")


def test_client_streaming_garbage_after_good_messages(channel: grpc.Channel) -> None:
    count = channel.stream_unary(
        "/test.Count/Count", request_serializer=None, response_deserializer=None
    )
    good = inventory_pb2.GetBoxRequest(name="boxes/b").SerializeToString()
    assert count(iter([good, good]), timeout=10) == b"2"
    with pytest.raises(grpc.RpcError) as error:
        count(iter([good, NOT_UTF8, good]), timeout=10)
    assert _rejection(error.value)[2] == "UNDECODABLE_REQUEST"


def test_a_burst_logs_one_short_line_and_counts_every_call(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    def counted() -> float:
        labels = {"method": method_label(CREATE_BOX)}
        return REGISTRY.get_sample_value("dxpool_rpc_undecodable_total", labels) or 0.0

    before = counted()
    call = channel.unary_unary(CREATE_BOX, request_serializer=None, response_deserializer=None)
    for _ in range(200):
        with pytest.raises(grpc.RpcError):
            call(GARBAGE, timeout=10)
    assert counted() - before == 200
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].getMessage() == "undecodable request rejected" and not lines[0].exc_info
    assert sum(len(r.getMessage()) for r in caplog.records) < 200


def test_the_throttle_reports_what_it_held_back() -> None:
    now = [0.0]
    throttle = LogThrottle(60.0, clock=lambda: now[0])
    assert throttle.admit() == 0
    assert throttle.admit() is None and throttle.admit() is None
    now[0] = 61.0
    assert throttle.admit() == 2


def test_a_guarded_deserializer_never_raises() -> None:
    decode = guard_deserializer(inventory_pb2.GetBoxRequest.FromString)
    assert decode(inventory_pb2.GetBoxRequest(name="boxes/b").SerializeToString()).name == (
        "boxes/b"
    )
    rejected = decode(NOT_UTF8)
    assert isinstance(rejected, Undecodable)
    assert rejected.expected == "dxpool.v1.GetBoxRequest" and "\n" not in rejected.error
