"""The ``dxpool broker`` command: run one broker in the foreground (also
``python -m dxpool.broker``, which checks for the server extra before it imports this)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

import click

from dxpool.broker.api.agent_server import DEFAULT_AGENT_LISTEN
from dxpool.broker.api.audit import DEFAULT_RETENTION_S as DEFAULT_AUDIT_RETENTION_S
from dxpool.broker.api.server import DEFAULT_LISTEN, BrokerConfig, BrokerServer
from dxpool.broker.control.duties import DEFAULT_RECONNECT_GRACE_S
from dxpool.cli.params import DAEMON_SECONDS, DURATION
from dxpool.errors import InvalidArgument, Unavailable
from dxpool.fabric.models import MODELS
from dxpool.gc_policy import CollectorSettings
from dxpool.logs import configure_logging
from dxpool.request import format_duration_ns
from dxpool.store.keys import DEFAULT_PREFIX
from dxpool.tls import ClientTls, ServerTls


def server_tls(
    cert: Path | None, key: Path | None, client_ca: Path | None, insecure: bool
) -> ServerTls | None:
    """The broker's TLS from its flags; a usage error unless TLS or --insecure is chosen."""
    if insecure:
        if cert or key or client_ca:
            raise click.UsageError(
                "--insecure serves plaintext: leave out --tls-cert, --tls-key and --client-ca, "
                "or drop --insecure"
            )
        return None
    if cert is None or key is None:
        raise click.UsageError(
            "the broker serves TLS: give --tls-cert and --tls-key (create them with "
            "`dxpool certs`), or --insecure for plaintext"
        )
    return ServerTls(cert=cert, key=key, client_ca=client_ca)


def start(server: BrokerServer) -> None:
    """Start ``server``, or say in one line why it cannot start: a usage error (exit 2)
    for a bad token file or TLS file, exit 1 when etcd stays unreachable for
    ``--etcd-connect-timeout`` or the address cannot be listened on."""
    try:
        server.start()
    except InvalidArgument as error:
        server.stop(grace_s=0)
        raise click.UsageError(error.message) from None
    except (Unavailable, OSError) as error:
        server.stop(grace_s=0)
        message = error.message if isinstance(error, Unavailable) else str(error)
        click.echo(f"error: the broker cannot start: {message}", err=True)
        raise click.exceptions.Exit(1) from None


@click.command("broker", context_settings={"auto_envvar_prefix": "DXPOOL_BROKER"})
@click.option("--etcd", "etcd", required=True, help="etcd endpoints, host:port[,host:port...]")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, help="etcd key prefix")
@click.option("--listen", default=DEFAULT_LISTEN, show_default=True, help="gRPC listen address")
@click.option(
    "--agent-listen",
    default=DEFAULT_AGENT_LISTEN,
    show_default=True,
    help="where host agents connect (AgentService; same TLS and client CA as --listen)",
)
@click.option(
    "--topology",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="fabric topology YAML (default: built-in tier latencies)",
)
@click.option(
    "--latency-model",
    type=click.Choice(MODELS),
    default=None,
    help="fabric latency model (default: the topology YAML's latency.model, else topology)",
)
@click.option(
    "--latency-matrix",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="round trips per rack/pod/site pair, YAML or CSV (implies --latency-model matrix)",
)
@click.option(
    "--rtt-staleness",
    type=DURATION,
    default=None,
    help="measured model: agent reports older than this fall back to the topology model "
    "(default 5m)",
)
@click.option(
    "--attach-timeout",
    type=DAEMON_SECONDS,
    default="120s",
    show_default=True,
    help="how long a node may take to become READY before it fails (e.g. 120s, 5m)",
)
@click.option(
    "--fabric",
    default=None,
    help="box side of the fabric, for fencing the GPUs of lost hosts: sim:DIR (the "
    "simulated fabric's state directory), redfish:FILE (the Redfish fabric map the agents "
    "use) or hook:PATH (an executable with the fence-gpu and scrub-gpu verbs); without it "
    "they wait in FENCING",
)
@click.option(
    "--fabric-hook-timeout",
    type=DAEMON_SECONDS,
    default="30s",
    show_default=True,
    help="how long one run of a hook:PATH box fabric may take before it is killed",
)
@click.option(
    "--host-loss-grace",
    type=DAEMON_SECONDS,
    default="0s",
    show_default=True,
    help="how long a host may stay without a live agent session before it is lost",
)
@click.option(
    "--host-reconnect-grace",
    type=DAEMON_SECONDS,
    default=f"{DEFAULT_RECONNECT_GRACE_S:g}s",
    show_default=True,
    help="after this broker becomes the leader or sees etcd again, how long agents have to "
    "reconnect before any host is declared lost",
)
@click.option(
    "--preemption-grace",
    type=DAEMON_SECONDS,
    default="30s",
    show_default=True,
    help="the notice a preemption or a drain gives a node that sets no grace of its own",
)
@click.option(
    "--retention",
    type=DAEMON_SECONDS,
    default="1h",
    show_default=True,
    help="how long RELEASED nodes and their request ids are kept",
)
@click.option(
    "--audit-retention",
    type=DAEMON_SECONDS,
    default=format_duration_ns(round(DEFAULT_AUDIT_RETENTION_S * 1e9)),
    show_default=True,
    help="how long audit records of mutating calls are kept in etcd, e.g. 720h or seconds "
    "(0: keep no audit log)",
)
@click.option(
    "--etcd-connect-timeout",
    type=DAEMON_SECONDS,
    default="60s",
    show_default=True,
    help="how long to keep trying (with backoff) to reach etcd at start before exiting",
)
@click.option(
    "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)"
)
@click.option(
    "--metrics-address",
    default="127.0.0.1",
    show_default=True,
    help="address the metrics port binds (0.0.0.0 for every interface)",
)
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="server certificate (PEM) for TLS",
)
@click.option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="key of --tls-cert (PEM)",
)
@click.option(
    "--client-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="CA (PEM) that signs client certificates: clients must present one (mutual TLS)",
)
@click.option(
    "--etcd-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="CA (PEM) that signed etcd's certificate: talk to etcd over TLS",
)
@click.option(
    "--etcd-cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="client certificate (PEM) for etcd's --client-cert-auth",
)
@click.option(
    "--etcd-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="key of --etcd-cert (PEM)",
)
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="YAML mapping bearer tokens to identities (TOKEN: tenant/team-a); needs TLS "
    "without --client-ca",
)
@click.option(
    "--insecure",
    is_flag=True,
    default=False,
    help="serve plaintext gRPC without TLS (anyone who can reach the port may call any RPC)",
)
@click.option(
    "--gc",
    "gc_mode",
    type=click.Choice(["policy", "default"]),
    default="policy",
    show_default=True,
    help="garbage collection: policy (collect between decisions, never inside placement) "
    "or default (Python's collector, the inventory frozen once after the load)",
)
@click.option(
    "--gc-young-batch",
    type=click.IntRange(min=1),
    default=CollectorSettings.young_batch,
    show_default=True,
    help="with --gc policy: young objects at which a collection runs between decisions",
)
@click.option(
    "--gc-threshold",
    type=click.IntRange(min=1),
    default=CollectorSettings.young_limit,
    show_default=True,
    help="with --gc policy: the collector's own young threshold, the safety net for bursts "
    "(at least --gc-young-batch)",
)
@click.option(
    "--gc-reclaim-interval",
    type=DAEMON_SECONDS,
    default=format_duration_ns(round(CollectorSettings.reclaim_interval_s * 1e9)),
    show_default=True,
    help="with --gc policy: a full collection of everything, frozen objects too, at least "
    "this often (0: only when the frozen set grew by a quarter)",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
)
def broker_command(
    etcd: str,
    prefix: str,
    listen: str,
    agent_listen: str,
    topology: Path | None,
    latency_model: str | None,
    latency_matrix: Path | None,
    rtt_staleness: int | None,
    attach_timeout: float,
    fabric: str | None,
    fabric_hook_timeout: float,
    host_loss_grace: float,
    host_reconnect_grace: float,
    preemption_grace: float,
    retention: float,
    audit_retention: float,
    etcd_connect_timeout: float,
    metrics_port: int,
    metrics_address: str,
    tls_cert: Path | None,
    tls_key: Path | None,
    client_ca: Path | None,
    etcd_ca: Path | None,
    etcd_cert: Path | None,
    etcd_key: Path | None,
    token_file: Path | None,
    insecure: bool,
    gc_mode: str,
    gc_young_batch: int,
    gc_threshold: int,
    gc_reclaim_interval: float,
    log_level: str,
) -> None:
    """Run a dxpool broker: the gRPC API over the etcd inventory.

    Serves TLS with --tls-cert and --tls-key (mutual TLS with --client-ca); plaintext
    only with --insecure. With --client-ca or --token-file every call must authenticate,
    and its role (operator, tenant, agent) decides what it may do.
    """
    tls = server_tls(tls_cert, tls_key, client_ca, insecure)
    etcd_tls = None
    if etcd_ca or etcd_cert or etcd_key:
        try:
            etcd_tls = ClientTls(ca=etcd_ca, cert=etcd_cert, key=etcd_key)
        except InvalidArgument as error:
            raise click.UsageError(error.message) from None
    if token_file is not None and tls is None:
        raise click.UsageError("--token-file needs TLS: bearer tokens must not cross in the clear")
    if token_file is not None and client_ca is not None:
        raise click.UsageError(
            "give --client-ca (certificates) or --token-file (bearer tokens), not both: a "
            "broker authenticates one way; run one of each against the same etcd"
        )
    if gc_threshold < gc_young_batch:
        raise click.UsageError(
            f"--gc-threshold ({gc_threshold}) must be at least --gc-young-batch "
            f"({gc_young_batch}): the collector's own threshold is the safety net behind it"
        )
    collector = CollectorSettings(
        enabled=gc_mode == "policy",
        young_batch=gc_young_batch,
        young_limit=gc_threshold,
        reclaim_interval_s=gc_reclaim_interval,
    )
    configure_logging(log_level)
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=metrics_address)
    try:
        config = BrokerConfig(
            etcd_endpoints=etcd,
            key_prefix=prefix,
            listen=listen,
            agent_listen=agent_listen,
            topology_path=topology,
            latency_model=latency_model,
            latency_matrix=latency_matrix,
            rtt_staleness_s=None if rtt_staleness is None else rtt_staleness / 1e9,
            attach_timeout_s=attach_timeout,
            fabric=fabric,
            fabric_hook_timeout_s=fabric_hook_timeout,
            host_loss_grace_s=host_loss_grace,
            host_reconnect_grace_s=host_reconnect_grace,
            preemption_grace_s=preemption_grace,
            retention_s=retention,
            audit_retention_s=audit_retention,
            etcd_connect_timeout_s=etcd_connect_timeout,
            tls=tls,
            token_file=token_file,
            etcd_tls=etcd_tls,
            gc=collector,
        )
        server = BrokerServer(config)
    except InvalidArgument as error:  # a bad topology, latency model, matrix or box fabric
        raise click.UsageError(error.message) from None
    start(server)
    click.echo(f"broker serving on {server.endpoint}, agents on {server.agent_endpoint}", err=True)
    stopped = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopped.wait()
    server.stop()
