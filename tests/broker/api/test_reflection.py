"""Reflection answers under grpc.reflection.v1 (what grpcurl and newer clients ask
first) as well as v1alpha, with the same services and descriptors."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from dxpool.broker.api.reflection import V1_REFLECTION_INFO, V1ALPHA_REFLECTION_INFO
from dxpool.broker.api.server import BrokerServer


@pytest.mark.parametrize("method", [V1_REFLECTION_INFO, V1ALPHA_REFLECTION_INFO])
def test_reflection_lists_and_describes_the_services(broker: BrokerServer, method: str) -> None:
    with grpc.insecure_channel(broker.endpoint) as channel:
        ask = channel.stream_stream(
            method,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="dxpool.v1.NodeService"),
        ]
        listed, described = list(ask(iter(requests), timeout=60))
    services = {s.name for s in listed.list_services_response.service}
    assert {"dxpool.v1.NodeService", "dxpool.v1.InventoryService"} <= services
    assert {"grpc.reflection.v1.ServerReflection", "grpc.health.v1.Health"} <= services
    files = described.file_descriptor_response.file_descriptor_proto
    parsed = [descriptor_pb2.FileDescriptorProto.FromString(raw) for raw in files]
    assert any(s.name == "NodeService" for f in parsed for s in f.service)
