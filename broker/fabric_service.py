"""FabricService: host-to-box latency from the fabric model."""

from __future__ import annotations

import grpc

from dxpool.api.v1 import fabric_pb2, fabric_pb2_grpc
from dxpool.broker.cache import Cache
from dxpool.broker.rpc import handler
from dxpool.errors import NotFound
from dxpool.fabric.latency import LatencyModel, LatencySource, Place, as_source
from dxpool.names import parse_box, parse_host
from dxpool.store import keys as k


class FabricService(fabric_pb2_grpc.FabricServiceServicer):
    def __init__(self, cache: Cache, latency: LatencyModel | LatencySource) -> None:
        self._cache = cache
        self._latency = as_source(latency)

    @handler("FabricService.GetLatency")
    def GetLatency(
        self, request: fabric_pb2.GetLatencyRequest, context: grpc.ServicerContext
    ) -> fabric_pb2.Latency:
        host = self._cache.get(k.HOSTS, parse_host(request.host))
        if host is None:
            raise NotFound(
                f"host {request.host} is not registered; see `dxpool host list`",
                reason="HOST_NOT_FOUND",
            )
        box = self._cache.get(k.BOXES, parse_box(request.box))
        if box is None:
            raise NotFound(
                f"box {request.box} does not exist; see `dxpool box list`",
                reason="BOX_NOT_FOUND",
            )
        estimate = self._latency.current().round_trip(Place.of(host.value), Place.of(box.value))
        return fabric_pb2.Latency(
            host=request.host,
            box=request.box,
            round_trip_ns=estimate.round_trip_ns,
            path=list(estimate.path),
        )
