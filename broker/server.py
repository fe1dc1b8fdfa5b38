"""The broker process: etcd store + cache + controller behind a gRPC server.

``BrokerServer(config).start()`` connects to etcd, lists and watches every record into
the cache, starts the node controller, and serves InventoryService, NodeService,
FabricService, gRPC health checking and reflection on ``config.listen``. Health follows
etcd: NOT_SERVING while etcd is unreachable or the cache too stale (``serving.py``).
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dxpool.api.v1 import (
    fabric_pb2,
    fabric_pb2_grpc,
    inventory_pb2,
    inventory_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
)
from dxpool.broker.cache import Cache
from dxpool.broker.compose import Composer, ComposeSettings
from dxpool.broker.controller import NodeController
from dxpool.broker.fabric_service import FabricService
from dxpool.broker.inventory_service import InventoryService
from dxpool.broker.node_service import MAX_WATCHERS, NodeService
from dxpool.broker.placement_index import PlacementIndex
from dxpool.broker.serving import DEFAULT_MAX_STALENESS_S, ServingState, StalenessGate
from dxpool.broker.store import Store
from dxpool.defaults import DEFAULT_ENDPOINT
from dxpool.fabric.latency import TopologyLatencyModel
from dxpool.fabric.topology import Topology
from dxpool.store.client import connect
from dxpool.store.keys import DEFAULT_PREFIX, KeySchema

log = logging.getLogger(__name__)

DEFAULT_LISTEN = DEFAULT_ENDPOINT
SERVICE_NAMES = (
    inventory_pb2.DESCRIPTOR.services_by_name["InventoryService"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
    fabric_pb2.DESCRIPTOR.services_by_name["FabricService"].full_name,
)
# The services whose answers come from the cache (all of dxpool's); health and
# reflection stay answerable while etcd is away.
GATED_PREFIXES = tuple(f"/{name}/" for name in SERVICE_NAMES)


@dataclass(frozen=True)
class BrokerConfig:
    etcd_endpoints: str
    key_prefix: str = DEFAULT_PREFIX
    listen: str = DEFAULT_LISTEN
    topology_path: Path | None = None
    attach_timeout_s: float = 120.0
    max_workers: int = 32
    controller_sweep_s: float = 1.0
    # Each etcd call gives up after this long (an unanswered call is one to a dead or
    # paused member, or one without quorum; failing it lets the next member be tried).
    etcd_timeout_s: float = 1.0
    # Calls are refused (UNAVAILABLE) once the cache may be this stale; see serving.py.
    max_staleness_s: float = DEFAULT_MAX_STALENESS_S


class BrokerServer:
    """One broker. Several may run against one etcd; correctness comes from transactions."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self._port = 0
        self._server: grpc.Server | None = None
        self._etcd = connect(config.etcd_endpoints, timeout_s=config.etcd_timeout_s)
        schema = KeySchema(config.key_prefix)
        self.store = Store(self._etcd, schema)
        # The cache's watch opens channels of its own, so watch events never queue
        # behind (or ahead of) the transactions on the compose path.
        self.cache = Cache(
            config.etcd_endpoints, schema, on_watch_state=lambda _: self.serving.notify()
        )
        topology = (
            Topology.load(config.topology_path) if config.topology_path else Topology.default()
        )
        self.latency = TopologyLatencyModel(topology)
        self.index: PlacementIndex | None = None
        self.controller: NodeController | None = None
        self._health = health.HealthServicer()
        self.serving = ServingState(
            self.store.health,
            self.cache.lag_s,
            self._health,
            SERVICE_NAMES,
            max_staleness_s=config.max_staleness_s,
            watch_error=lambda: self.cache.watch_error,
        )
        self.store.health.subscribe(self.serving.notify)

    def start(self) -> BrokerServer:
        """Load the cache, start the controller, bind and serve. Returns once serving."""
        self.cache.start()
        self.index = PlacementIndex(self.cache)
        composer = Composer(
            self.store,
            self.cache,
            self.index,
            self.latency,
            ComposeSettings(attach_timeout_s=self.config.attach_timeout_s),
        )
        self.controller = NodeController(
            self.store, self.cache, sweep_interval_s=self.config.controller_sweep_s
        )
        self.controller.start()
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.config.max_workers + MAX_WATCHERS, thread_name_prefix="rpc"
            ),
            options=[("grpc.so_reuseport", 0)],
            interceptors=[StalenessGate(self.serving, GATED_PREFIXES)],
        )
        inventory_pb2_grpc.add_InventoryServiceServicer_to_server(
            InventoryService(self.store, self.cache), server
        )
        nodes_pb2_grpc.add_NodeServiceServicer_to_server(NodeService(composer, self.cache), server)
        fabric_pb2_grpc.add_FabricServiceServicer_to_server(
            FabricService(self.cache, self.latency), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.serving.start()
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        self._port = server.add_insecure_port(self.config.listen)
        if self._port == 0:
            raise OSError(f"cannot listen on {self.config.listen}: address in use or invalid")
        server.start()
        self._server = server
        log.info("broker serving", extra={"endpoint": self.endpoint})
        return self

    @property
    def endpoint(self) -> str:
        host = self.config.listen.rpartition(":")[0] or "127.0.0.1"
        return f"{host}:{self._port}"

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving (in-flight calls get ``grace_s``), then the controller and cache."""
        self.serving.stop()
        self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(grace_s).wait()
        if self.controller is not None:
            self.controller.stop()
        if self.index is not None:
            self.index.close()
        self.cache.stop()
        self.store.health.close()
        self._etcd.close()

    def wait(self) -> None:
        if self._server is not None:
            self._server.wait_for_termination()

    def __enter__(self) -> BrokerServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
