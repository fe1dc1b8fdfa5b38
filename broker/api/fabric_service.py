"""FabricService: host-to-box latency from the fabric model, and predicted slowdowns."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from dxpool.api.v1 import fabric_pb2, fabric_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.rpc import handler
from dxpool.broker.placement.model import PlacementRequest, Snapshot
from dxpool.broker.placement.placer import place
from dxpool.broker.state.cache import Cache
from dxpool.errors import InvalidArgument, NotFound, ResourceExhausted
from dxpool.fabric.latency import LatencyEstimate, LatencyModel, LatencySource, Place, as_source
from dxpool.fabric.overhead import PROFILES, WorkloadProfile, parse_workload
from dxpool.names import parse_box, parse_host
from dxpool.request import validate_gpu_request
from dxpool.store.typed import Versioned
from dxpool.text import check_text


class FabricService(fabric_pb2_grpc.FabricServiceServicer):
    """Answers from ``cache`` and the ``latency`` source's current model; ``snapshot``
    gives the placement view on which Predict places a GPU request."""

    def __init__(
        self,
        cache: Cache,
        latency: LatencyModel | LatencySource,
        snapshot: Callable[[], Snapshot],
    ) -> None:
        self._cache = cache
        self._latency = as_source(latency)
        self._snapshot = snapshot

    @handler("FabricService.GetLatency")
    def GetLatency(
        self, request: fabric_pb2.GetLatencyRequest, context: grpc.ServicerContext
    ) -> fabric_pb2.Latency:
        host = self._host(request.host)
        box = self._box(request.box)
        estimate = self._latency.current().round_trip(Place.of(host.value), Place.of(box.value))
        return fabric_pb2.Latency(
            host=request.host,
            box=request.box,
            round_trip_ns=estimate.round_trip_ns,
            path=list(estimate.path),
        )

    @handler("FabricService.Predict")
    def Predict(
        self, request: fabric_pb2.PredictRequest, context: grpc.ServicerContext
    ) -> fabric_pb2.Prediction:
        """One box: its round trip. A GPU request: placement pinned to the host, and each
        box it would take GPUs from. The slowdown is predicted from the farthest box (a
        step waits for its slowest GPU)."""
        profiles = _profiles(request.workload)
        wants_gpus = request.HasField("gpus")
        if bool(request.box) == wants_gpus:
            raise InvalidArgument(
                "give exactly one of box (a box to predict for) and gpus (a GPU request "
                "placement would serve from the host)",
                reason="INVALID_PREDICTION",
            )
        if wants_gpus:
            gpus = request.gpus
            validate_gpu_request(gpus.model, gpus.count, gpus.min_memory_mib, gpus.mixed_models)
        host = self._host(request.host)
        model = self._latency.current()  # one model for the whole answer
        host_place = Place.of(host.value)
        if wants_gpus:
            links = self._placed_links(request, model)
        else:
            box = self._box(request.box)
            estimate = model.round_trip(host_place, Place.of(box.value))
            links = [(request.box, estimate, 1)]
        farthest_box, farthest, _ = max(links, key=lambda link: link[1].round_trip_ns)
        return fabric_pb2.Prediction(
            host=request.host,
            box=farthest_box,
            round_trip_ns=farthest.round_trip_ns,
            path=list(farthest.path),
            slowdowns=[
                fabric_pb2.WorkloadSlowdown(
                    workload=profile.name,
                    slowdown=profile.slowdown(farthest.round_trip_ns),
                    profile=profile.describe(),
                )
                for profile in profiles
            ],
            links=[
                fabric_pb2.PredictedLink(
                    box=box_name,
                    round_trip_ns=estimate.round_trip_ns,
                    path=list(estimate.path),
                    gpus=count,
                )
                for box_name, estimate, count in links
            ],
            latency_model=self._latency.name,
        )

    def _placed_links(
        self, request: fabric_pb2.PredictRequest, model: LatencyModel
    ) -> list[tuple[str, LatencyEstimate, int]]:
        snapshot = self._snapshot()
        host_id = parse_host(request.host)
        gpus = request.gpus
        placement_request = PlacementRequest(
            model=gpus.model,
            count=gpus.count,
            min_memory_mib=gpus.min_memory_mib,
            mixed_models=gpus.mixed_models,
            host=host_id,
        )
        result = place(placement_request, snapshot, model)
        if result.placement is None:
            raise ResourceExhausted(
                f"placement cannot serve {gpus.model or 'any'}:{gpus.count} GPUs from "
                f"{request.host} now: {'; '.join(result.unsatisfied)}; ask for fewer GPUs, "
                "or give box to predict for one box",
                reason="NO_CAPACITY",
            )
        host_place = snapshot.hosts[host_id].place
        counts: dict[str, int] = {}
        for binding in result.placement.bindings:
            counts[binding.box] = counts.get(binding.box, 0) + 1
        return [
            (
                f"boxes/{box}",
                model.round_trip(host_place, snapshot.boxes[box].place),
                count,
            )
            for box, count in counts.items()
        ]

    def _host(self, name: str) -> Versioned[pb.Host]:
        host = self._cache.hosts.get(parse_host(name))
        if host is None:
            raise NotFound(
                f"host {name} is not registered; see `dxpool host list`",
                reason="HOST_NOT_FOUND",
            )
        return host

    def _box(self, name: str) -> Versioned[pb.Box]:
        box = self._cache.boxes.get(parse_box(name))
        if box is None:
            raise NotFound(
                f"box {name} does not exist; see `dxpool box list`",
                reason="BOX_NOT_FOUND",
            )
        return box


def _profiles(workload: str) -> list[WorkloadProfile]:
    """The workload asked for, or every named profile when none is."""
    check_text(workload, "workload")
    if not workload:
        return [PROFILES[name] for name in sorted(PROFILES)]
    return [parse_workload(workload)]
