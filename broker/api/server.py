"""The broker process: etcd store + cache + controller behind a gRPC server.

``BrokerServer(config).start()`` connects to etcd, lists and watches every record into
the cache, starts the node controller, and serves InventoryService, NodeService,
FabricService, gRPC health checking and reflection on ``config.listen``. Health follows
etcd: NOT_SERVING while etcd is unreachable or the cache too stale (``serving.py``).
Host agents reach the broker on a port of their own, ``config.agent_listen``
(AgentService on an asynchronous server, see ``agent_server.py``).

Threads: unary calls get ``max_workers`` workers of their own; streams (WatchNodes, health
Watch, reflection) are admitted within ``stream_limits`` and can hold at most
``stream_limits.total`` more, so open streams, idle or stalled, never starve unary calls
(see ``broker/api/streams.py``).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from dxpool.api.v1 import (
    audit_pb2,
    audit_pb2_grpc,
    fabric_pb2,
    fabric_pb2_grpc,
    inventory_pb2,
    inventory_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
)
from dxpool.broker.api.agent_server import DEFAULT_AGENT_LISTEN, ETCD_WORKERS, AgentServer
from dxpool.broker.api.agent_service import AgentService
from dxpool.broker.api.audit import DEFAULT_RETENTION_S as DEFAULT_AUDIT_RETENTION_S
from dxpool.broker.api.audit import AuditLog, AuditRecorder
from dxpool.broker.api.audit_service import AuditService
from dxpool.broker.api.auth import Authenticator, Authorizer, TokenTable
from dxpool.broker.api.decoding import Interceptor, RequestDecodingGuard
from dxpool.broker.api.fabric_service import FabricService
from dxpool.broker.api.inventory_service import InventoryService
from dxpool.broker.api.node_service import NodeService
from dxpool.broker.api.node_watch import WatchSettings
from dxpool.broker.api.reflection import enable_reflection
from dxpool.broker.api.request_limits import SERVER_MAX_RECEIVE_BYTES
from dxpool.broker.api.serving import DEFAULT_MAX_STALENESS_S, ServingState, StalenessGate
from dxpool.broker.api.sharing import Sharing
from dxpool.broker.api.sharing_status import SharingStatus
from dxpool.broker.api.streams import StreamLimiter, StreamLimits
from dxpool.broker.control.agent_sessions import AgentSessions, SessionSettings
from dxpool.broker.control.box_fabrics import open_box_fabric
from dxpool.broker.control.controller import NodeController
from dxpool.broker.control.dispatcher import Dispatcher
from dxpool.broker.control.duties import DEFAULT_RECONNECT_GRACE_S, DutySettings, SingletonDuties
from dxpool.broker.control.leader import LeaderElection
from dxpool.broker.control.maintenance import Maintenance
from dxpool.broker.control.notices import DEFAULT_GRACE_S, Notices
from dxpool.broker.control.planning import Planner
from dxpool.broker.control.sharing_duties import SharingDuties, SharingSettings, Step
from dxpool.broker.nodes.admission import Admitter
from dxpool.broker.nodes.compose import Composer
from dxpool.broker.nodes.compose_gate import ComposeGate
from dxpool.broker.nodes.compose_settings import ComposeSettings
from dxpool.broker.nodes.enqueue import QueuedComposer
from dxpool.broker.nodes.gang_chunks import ChunkedGangs
from dxpool.broker.state import metrics, pool_metrics
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.measured_feed import MeasuredFeed, place_lookup
from dxpool.broker.state.placement_index import PlacementIndex
from dxpool.broker.state.pool_tally import PoolTally
from dxpool.broker.state.queue_index import QueueIndex
from dxpool.defaults import DEFAULT_ENDPOINT
from dxpool.errors import InvalidArgument
from dxpool.fabric.measured import MeasuredLatency
from dxpool.fabric.models import LatencySettings, build_latency_source
from dxpool.fabric.topology import Topology
from dxpool.gc_policy import CollectorPolicy, CollectorSettings
from dxpool.store import keys as k
from dxpool.store.client import connect, parse_endpoints
from dxpool.store.keys import DEFAULT_PREFIX, KeySchema
from dxpool.store.typed import Store
from dxpool.tls import ClientTls, ServerTls, is_loopback_listen

log = logging.getLogger(__name__)

DEFAULT_LISTEN = DEFAULT_ENDPOINT
SERVICE_NAMES = (
    inventory_pb2.DESCRIPTOR.services_by_name["InventoryService"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
    fabric_pb2.DESCRIPTOR.services_by_name["FabricService"].full_name,
    audit_pb2.DESCRIPTOR.services_by_name["AuditService"].full_name,
)
# How long stop() waits, beyond the grace period, for calls and stream threads to end.
STOP_MARGIN_S = 3.0
# Ping idle connections so a vanished client's streams end instead of holding a thread.
# No request larger than the largest method's limit reaches Python (request_limits.py).
_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", SERVER_MAX_RECEIVE_BYTES),
]
# The services whose answers come from the cache (all of dxpool's); health and
# reflection stay answerable while etcd is away.
GATED_PREFIXES = tuple(f"/{name}/" for name in SERVICE_NAMES)


@dataclass(frozen=True)
class BrokerConfig:
    etcd_endpoints: str
    key_prefix: str = DEFAULT_PREFIX
    listen: str = DEFAULT_LISTEN
    topology_path: Path | None = None
    # The latency model (topology, matrix, measured); None: the topology YAML's
    # ``latency`` section, else topology. See dxpool.fabric.models.
    latency_model: str | None = None
    latency_matrix: Path | None = None
    rtt_staleness_s: float | None = None
    attach_timeout_s: float = 120.0
    max_workers: int = 32
    # The node controller's tick (attach deadlines) and its sweep of all work in flight.
    controller_sweep_s: float = 1.0
    controller_full_sweep_s: float = 30.0
    # The box side of the fabric, for fencing (``sim:DIR``, ``redfish:MAP``,
    # ``hook:PATH``; see broker/control/box_fabrics.py); None: GPUs of lost hosts wait in FENCING
    # until one is configured.
    fabric: str | None = None
    # How long one run of a ``hook:`` box fabric may take; None: 30 s.
    fabric_hook_timeout_s: float | None = None
    host_loss_grace_s: float = 0.0
    # After this broker becomes the leader, or its cache comes back from an etcd outage,
    # agents get this long to reconnect before any host is declared lost.
    host_reconnect_grace_s: float = DEFAULT_RECONNECT_GRACE_S
    retention_s: float = 3600.0
    leader_ttl_s: float = 5.0
    duty_interval_s: float = 0.25
    stream_limits: StreamLimits = field(default_factory=StreamLimits)
    watch: WatchSettings = field(default_factory=WatchSettings)
    # Each etcd call gives up after this long (an unanswered call is one to a dead or
    # paused member, or one without quorum; failing it lets the next member be tried).
    etcd_timeout_s: float = 1.0
    # How long start tries, with backoff, to list and watch etcd the first time before it
    # gives up (Unavailable): etcd may be starting too, or a first handshake may fail.
    etcd_connect_timeout_s: float = 60.0
    # TLS to etcd (its CA, and a client certificate for --client-cert-auth); None: plaintext.
    etcd_tls: ClientTls | None = None
    # How long audit records are kept (broker/api/audit.py); 0 keeps no audit log.
    audit_retention_s: float = DEFAULT_AUDIT_RETENTION_S
    # Calls are refused (UNAVAILABLE) once the cache may be this stale; see serving.py.
    max_staleness_s: float = DEFAULT_MAX_STALENESS_S
    # TLS for the gRPC endpoint; None serves plaintext (an explicit choice: ``--insecure``).
    tls: ServerTls | None = None
    # Bearer tokens (``TOKEN: ROLE/NAME`` YAML); needs ``tls`` without a client CA.
    # Authentication is on when this or ``tls.client_ca`` is set (see broker/api/auth.py).
    token_file: Path | None = None
    # Where host agents connect (AgentService), with the same TLS and authentication.
    agent_listen: str = DEFAULT_AGENT_LISTEN
    # Agents' liveness TTL bounds and the broker lease that carries their liveness records.
    agent_sessions: SessionSettings = field(default_factory=SessionSettings)
    # The notice a preemption or a drain gives a node that sets no grace of its own.
    preemption_grace_s: float = DEFAULT_GRACE_S
    # How often the leader looks at the queue, notices and drains without being woken.
    sharing: SharingSettings = field(default_factory=SharingSettings)
    # The garbage collector's policy (dxpool/gc_policy.py): collections between decisions.
    gc: CollectorSettings = field(default_factory=CollectorSettings)


class BrokerServer:
    """One broker. Several may run against one etcd; correctness comes from transactions."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self._port = 0
        self._server: grpc.Server | None = None
        # First: a bad --fabric is a usage error before anything connects.
        self.box_fabric = open_box_fabric(
            config.fabric, hook_timeout_s=config.fabric_hook_timeout_s
        )
        etcd_addresses = parse_endpoints(config.etcd_endpoints, config.etcd_tls)
        self._etcd = connect(etcd_addresses, timeout_s=config.etcd_timeout_s)
        schema = KeySchema(config.key_prefix)
        self.store = Store(self._etcd, schema)
        # The cache's watch opens channels of its own, so watch events never queue
        # behind (or ahead of) the transactions on the compose path.
        self.cache = Cache(etcd_addresses, schema, on_watch_state=lambda _: self.serving.notify())
        topology = (
            Topology.load(config.topology_path) if config.topology_path else Topology.default()
        )
        settings = (
            LatencySettings.from_topology_file(config.topology_path)
            if config.topology_path
            else LatencySettings()
        ).overridden(
            model=config.latency_model,
            matrix_path=config.latency_matrix,
            staleness_s=config.rtt_staleness_s,
        )
        self.latency = build_latency_source(
            topology,
            settings,
            host_place=place_lookup(self.cache, k.HOSTS),
            box_place=place_lookup(self.cache, k.BOXES),
        )
        self._measured_feed: MeasuredFeed | None = None
        self.index: PlacementIndex | None = None
        self.pool_tally: PoolTally | None = None
        self.controller: NodeController | None = None
        self.election = LeaderElection(
            self.store,
            schema.election("duties"),
            f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}",
            ttl_s=config.leader_ttl_s,
        )
        self.duties: SingletonDuties | None = None
        self.agent_sessions = AgentSessions(
            self.store, self.cache, self.election.identity, config.agent_sessions
        )
        self.agent_server: AgentServer | None = None
        self.nodes: NodeService | None = None
        self.composer: Composer | None = None
        self.collector = CollectorPolicy(config.gc, metrics.observe_collection)
        self.queue: QueueIndex | None = None
        self.notices: Notices | None = None
        self.maintenance: Maintenance | None = None
        self.dispatcher: Dispatcher | None = None
        self.gangs: ChunkedGangs | None = None
        self.sharing_duties: SharingDuties | None = None
        self._sharing_status: SharingStatus | None = None
        self.streams = StreamLimiter(config.stream_limits)
        self._executor: futures.ThreadPoolExecutor | None = None
        self._stopped = False
        self._detach_pool_metrics: Callable[[], None] = lambda: None
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
        """Load the cache, start the controller, bind and serve. Returns once serving.

        TLS files are read first: a missing one raises InvalidArgument before anything
        starts. etcd is tried, with backoff, for ``etcd_connect_timeout_s``; then
        :class:`~dxpool.errors.Unavailable` says what failed."""
        authenticator = self._authenticator()
        tls = self.config.tls
        credentials = tls.credentials() if tls is not None else None
        self.cache.start(self.config.etcd_connect_timeout_s, wait_for_etcd=True)
        self.pool_tally = PoolTally(self.cache)
        self._detach_pool_metrics = pool_metrics.COLLECTOR.attach(self.cache, self.pool_tally)
        self.index = PlacementIndex(self.cache)
        if isinstance(self.latency, MeasuredLatency):
            self._measured_feed = MeasuredFeed(self.cache, self.latency)
        # The loaded inventory lives as long as the broker: freeze it out of the garbage
        # collector's generations, and from now on collect between decisions, not inside
        # them (dxpool/gc_policy.py; bench/placement_stream.py --gc compares).
        self.collector.start()
        composer = self.composer = Composer(
            self.store,
            self.cache,
            self.index,
            self.latency,
            ComposeSettings(attach_timeout_s=self.config.attach_timeout_s),
            collector=self.collector,
        )
        self.controller = NodeController(
            self.store,
            self.cache,
            sweep_interval_s=self.config.controller_sweep_s,
            full_sweep_interval_s=self.config.controller_full_sweep_s,
            is_leader=self.election.is_leader,
        )
        self.controller.start()
        self.duties = SingletonDuties(
            self.store,
            self.cache,
            self.box_fabric,
            self.election.is_leader,
            DutySettings(
                interval_s=self.config.duty_interval_s,
                host_loss_grace_s=self.config.host_loss_grace_s,
                reconnect_grace_s=self.config.host_reconnect_grace_s,
                retention_s=self.config.retention_s,
            ),
            settled=self._settled,
        )
        self.duties.start()
        sharing = self._start_sharing(composer)
        self.election.start()
        self._executor = futures.ThreadPoolExecutor(
            max_workers=self.config.max_workers + self.config.stream_limits.total,
            thread_name_prefix="rpc",
        )
        interceptors: list[Interceptor] = [
            self.streams,
            StalenessGate(self.serving, GATED_PREFIXES),
        ]
        if authenticator is not None:  # checks each call before its servicer runs
            interceptors.insert(1, Authorizer(authenticator))
        audit = (
            AuditLog(self._etcd, self.config.key_prefix, retention_s=self.config.audit_retention_s)
            if self.config.audit_retention_s > 0
            else None
        )
        if audit is not None:  # outside the others: it sees every outcome, denials included
            identify = authenticator.identify if authenticator is not None else None
            interceptors.insert(0, AuditRecorder(audit, identify))
        # Outermost: a request too large for its method, or not decodable, is refused
        # before anything else looks at it (see decoding.py).
        interceptors.insert(0, RequestDecodingGuard())
        server = grpc.server(self._executor, interceptors=interceptors, options=_SERVER_OPTIONS)
        inventory_pb2_grpc.add_InventoryServiceServicer_to_server(
            InventoryService(
                self.store,
                self.cache,
                self.pool_tally,
                maintenance=self.maintenance,
                sharing=self._sharing_status,
            ),
            server,
        )
        self.nodes = NodeService(
            composer,
            self.cache,
            self.config.watch,
            identify=authenticator.identify if authenticator is not None else None,
            sharing=sharing,
        )
        nodes_pb2_grpc.add_NodeServiceServicer_to_server(self.nodes, server)
        fabric_pb2_grpc.add_FabricServiceServicer_to_server(
            FabricService(self.cache, self.latency, self.index.snapshot), server
        )
        audit_pb2_grpc.add_AuditServiceServicer_to_server(AuditService(audit), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.serving.start()
        enable_reflection((*SERVICE_NAMES, health.SERVICE_NAME), server)
        self._port = self._bind(server, credentials)
        if self._port == 0:
            raise OSError(f"cannot listen on {self.config.listen}: address in use or invalid")
        server.start()
        self._server = server
        self._start_agent_port(authenticator)
        log.info("broker serving", extra={"endpoint": self.endpoint})
        return self

    def _start_agent_port(self, authenticator: Authenticator | None) -> None:
        """Serve AgentService on ``config.agent_listen``, with the broker's TLS and
        authentication, and keep this broker's agent sessions."""
        self.agent_sessions.start()
        executor = futures.ThreadPoolExecutor(ETCD_WORKERS, thread_name_prefix="agent-etcd")
        service = AgentService(self.agent_sessions, self.cache, executor, authenticator)
        self.agent_server = AgentServer(
            self.config.agent_listen, service, self.config.tls, executor
        )
        self.agent_server.start()

    def _settled(self) -> bool:
        """Whether this broker sees etcd as it is now: reachable, the cache current."""
        return self.store.health.reachable and self.cache.lag_s() == 0

    @property
    def agent_endpoint(self) -> str:
        """Where host agents connect (``host:port``), once started."""
        return self.agent_server.endpoint if self.agent_server is not None else ""

    def _start_sharing(self, composer: Composer) -> Sharing:
        """The queue, preemption notices and maintenance, and the leader's thread that
        serves them (see broker/control/dispatcher.py, broker/control/notices.py and
        broker/control/maintenance.py)."""
        queue = self.queue = QueueIndex(self.cache)
        gate = ComposeGate(self.cache, queue)
        notices = self.notices = Notices(
            self.store,
            self.cache,
            composer.host_locks,
            default_grace_s=self.config.preemption_grace_s,
        )
        self.maintenance = Maintenance(self.store, self.cache, notices, composer.resizer())
        self._sharing_status = SharingStatus(self.cache, queue, notices)
        gangs = self.gangs = ChunkedGangs(
            composer, gate, broker=self.election.identity, retention_s=self.config.retention_s
        )
        self.dispatcher = Dispatcher(
            composer, queue, gate, Admitter(composer, gate), notices, gangs=gangs
        )
        self.sharing_duties = SharingDuties(
            self.cache,
            self.election.is_leader,
            [
                Step("queue", self.dispatcher.serve),
                Step("notices", notices.carry_out_due),
                Step("drains", self.maintenance.step),
                Step("gangs", gangs.reap),
            ],
            self.config.sharing,
        )
        self.sharing_duties.start()
        return Sharing(
            self.cache, queue, QueuedComposer(composer, gate), gangs, gate, Planner(composer, gate)
        )

    def _authenticator(self) -> Authenticator | None:
        """Who calls, when authentication is on (a client CA or a token file); None
        otherwise. InvalidArgument for tokens without TLS or with a client CA, or an
        unreadable token file.

        A broker authenticates one way: gRPC's Python server can only require client
        certificates or not ask for them, so it cannot serve certificate holders and token
        holders on one port. Run a broker of each kind against the same etcd for both.
        """
        config = self.config
        if config.token_file is not None and config.tls is None:
            raise InvalidArgument(
                "bearer tokens need TLS (they would cross the network in the clear): give "
                "the broker a certificate and key, or no token file",
                reason="INVALID_TLS_CONFIG",
            )
        if config.token_file is not None and config.tls is not None and config.tls.client_ca:
            raise InvalidArgument(
                "a broker authenticates by client certificates (client CA) or by bearer "
                "tokens, not both: run one broker of each kind against the same etcd",
                reason="INVALID_TLS_CONFIG",
            )
        tokens = TokenTable.load(config.token_file) if config.token_file is not None else None
        certificates = config.tls is not None and config.tls.client_ca is not None
        if tokens is None and not certificates:
            return None
        return Authenticator(tokens=tokens, certificates=certificates)

    def _bind(self, server: grpc.Server, credentials: grpc.ServerCredentials | None) -> int:
        """Add the listening port, with TLS when configured; warn about plaintext that
        leaves the machine."""
        listen = self.config.listen
        if credentials is not None:
            return server.add_secure_port(listen, credentials)
        if not is_loopback_listen(listen):
            log.warning(
                "serving plaintext gRPC without TLS on a non-loopback address: any client "
                "on the network can call every RPC; configure TLS for production",
                extra={"listen": listen},
            )
        return server.add_insecure_port(listen)

    @property
    def endpoint(self) -> str:
        host = self.config.listen.rpartition(":")[0] or "127.0.0.1"
        return f"{host}:{self._port}"

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving (in-flight calls get ``grace_s``), then the controller and cache.

        Bounded, whatever clients do: watches end at once (UNAVAILABLE, so clients watch
        again elsewhere), calls still running after ``grace_s`` are cancelled, including
        sends stuck on clients that stopped reading, and stop waits at most
        ``STOP_MARGIN_S`` more for them and for stream threads to finish. Stopping
        twice is a no-op.
        """
        if self._stopped:
            return
        self._stopped = True
        self._stop_agent_port()
        self.serving.stop()
        self._health.enter_graceful_shutdown()
        if self.nodes is not None:
            self.nodes.close()
        if self._server is not None and not self._server.stop(grace_s).wait(
            grace_s + STOP_MARGIN_S
        ):
            log.warning("gRPC server did not finish stopping; going on")
        if not self.streams.wait_idle(STOP_MARGIN_S):
            log.warning("streams still running after stop", extra=self.streams.open_streams())
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self.election.stop()
        if self.duties is not None:
            self.duties.stop()
        if self.sharing_duties is not None:
            self.sharing_duties.stop()
        for part in (self.notices, self.maintenance, self._sharing_status, self.queue):
            if part is not None:
                part.close()
        if self.box_fabric is not None:
            self.box_fabric.close()
        if self.controller is not None:
            self.controller.stop()
        if self.index is not None:
            self.index.close()
        if self._measured_feed is not None:
            self._measured_feed.close()
        self._detach_pool_metrics()
        self.collector.stop()
        if self.pool_tally is not None:
            self.pool_tally.close()
        self.cache.stop()
        self.store.health.close()
        self._etcd.close()

    def _stop_agent_port(self) -> None:
        """End the agents' sessions (they reconnect to another broker, which takes their
        liveness records over) and stop the agent port."""
        self.agent_sessions.stop()
        if self.agent_server is not None:
            self.agent_server.stop()

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
