"""gRPC server reflection, as ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

``grpcurl``, ``grpcui`` and the other tools of the ecosystem list and describe a server's
services through reflection. Newer clients ask the ``v1`` service first and fall back to
``v1alpha`` (with a warning) when it is missing; the ``grpcio-reflection`` package serves
only ``v1alpha``. The two services are one protocol under two names: ``v1`` is
``v1alpha``'s messages, field for field, in another package. So one servicer answers
both, the ``v1`` method decoding and encoding the same messages.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
V1_REFLECTION_INFO = f"/{V1_SERVICE_NAME}/ServerReflectionInfo"
V1ALPHA_REFLECTION_INFO = f"/{V1ALPHA_SERVICE_NAME}/ServerReflectionInfo"


def enable_reflection(service_names: tuple[str, ...], server: grpc.Server) -> None:
    """Serve reflection of ``service_names`` (and of reflection itself, both versions)
    on ``server`` before it starts."""
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer: Any = reflection.ReflectionServicer(names)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                V1_SERVICE_NAME,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        servicer.ServerReflectionInfo,
                        request_deserializer=v1alpha.ServerReflectionRequest.FromString,
                        response_serializer=v1alpha.ServerReflectionResponse.SerializeToString,
                    )
                },
            ),
        )
    )
    reflection.enable_server_reflection(names, server)


__all__ = [
    "V1ALPHA_REFLECTION_INFO",
    "V1ALPHA_SERVICE_NAME",
    "V1_REFLECTION_INFO",
    "V1_SERVICE_NAME",
    "enable_reflection",
]
