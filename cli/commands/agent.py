"""The ``dxpool agent`` command: run one host agent in the foreground (also
``python -m dxpool.hostagent``).

Every option has an environment variable ``DXPOOL_AGENT_<NAME>`` (for example
``DXPOOL_AGENT_HOST``); a flag wins over the environment. The agent talks to the pool's
brokers only (``--broker``, their agent ports), never to etcd: the etcd options of older
versions are a usage error that says what replaced them. SIGTERM and SIGINT stop the
agent cleanly: it says goodbye to its broker (without a state directory the host shows
as gone at once; with one, it stays alive for the liveness TTL, for the next run to take
over). Exit status: 0 after a clean stop, 1 when the agent cannot start (no broker
answers, the host is held by another agent, the fabric is not there), 2 for bad options.
The agent's process life is :func:`dxpool.hostagent.run.run_agent`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dxpool.cli.params import DAEMON_SECONDS
from dxpool.errors import InvalidArgument
from dxpool.hostagent.config import DEFAULT_BROKERS, AgentConfig
from dxpool.hostagent.drivers import DRIVERS
from dxpool.hostagent.run import run_agent
from dxpool.logs import configure_logging
from dxpool.request import parse_host_memory_mib

ENV_PREFIX = "DXPOOL_AGENT_"


def _option(*names: str, env: str, **kwargs: Any) -> Callable[[Any], Any]:
    return click.option(*names, envvar=ENV_PREFIX + env, show_envvar=True, **kwargs)


_REMOVED_ETCD_OPTIONS = (
    ("--etcd-endpoints", "--etcd", "ETCD_ENDPOINTS"),
    ("--etcd-ca", None, "ETCD_CA"),
    ("--etcd-cert", None, "ETCD_CERT"),
    ("--etcd-key", None, "ETCD_KEY"),
    ("--key-prefix", "--prefix", "KEY_PREFIX"),
)


def _refuse_etcd_option(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is None:
        return
    source = ctx.get_parameter_source(param.name or "")
    given = (
        f"${param.envvar}"
        if source is click.core.ParameterSource.ENVIRONMENT
        else "/".join(param.opts)
    )
    raise click.UsageError(
        f"{given}: host agents no longer talk to etcd (hosts hold no etcd credentials). "
        "Give --broker HOST:PORT[,HOST:PORT...], the agent ports of the pool's brokers "
        "(dxpool broker --agent-listen, default port 8471), and this host's certificate "
        "with --tls-ca, --tls-cert and --tls-key; the broker knows the key prefix.",
        ctx=ctx,
    )


def _removed_etcd_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Hidden options of older versions that only explain what replaced them."""
    for long_name, alias, env in _REMOVED_ETCD_OPTIONS:
        names = [long_name, alias] if alias else [long_name]
        command = click.option(
            *names,
            f"removed_{long_name.lstrip('-').replace('-', '_')}",
            envvar=ENV_PREFIX + env,
            hidden=True,
            expose_value=False,
            callback=_refuse_etcd_option,
            is_eager=True,
        )(command)
    return command


def _parse_labels(labels: tuple[str, ...]) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"{item!r} is not KEY=VALUE, e.g. --label gpu-class=training", param_hint="--label"
            )
        parsed[key] = value
    return parsed


def _parse_ports(ports: tuple[str, ...]) -> dict[int, str]:
    parsed: dict[int, str] = {}
    for item in ports:
        slot, sep, bridge = item.partition("=")
        if not sep or not slot.strip().isascii() or not slot.strip().isdigit() or not bridge:
            raise click.BadParameter(
                f"{item!r} is not SLOT=BRIDGE, e.g. --linux-port 0=0000:40:01.0",
                param_hint="--linux-port",
            )
        if int(slot) in parsed:
            raise click.BadParameter(
                f"host slot {int(slot)} is given twice", param_hint="--linux-port"
            )
        parsed[int(slot)] = bridge.strip().lower()
    return parsed


@click.command(name="agent", context_settings={"show_default": True})
@_option("--host", "host_id", env="HOST", required=True, help="Host id (DNS label).")
@_option(
    "--broker",
    "brokers",
    env="BROKER",
    default=DEFAULT_BROKERS,
    help="The pool's brokers, their agent ports: host:port[,host:port...]. The agent holds "
    "a session with one and fails over to the next.",
)
@_option(
    "--tls-ca",
    env="TLS_CA",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="CA (PEM) that signed the brokers' certificates: talk to them over TLS.",
)
@_option(
    "--tls-cert",
    env="TLS_CERT",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="This agent's client certificate (PEM), dxpool://agent/HOST "
    "(`dxpool certs issue agent/HOST`).",
)
@_option(
    "--tls-key",
    env="TLS_KEY",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Key of --tls-cert (PEM).",
)
@_option(
    "--tls-server-name",
    env="TLS_SERVER_NAME",
    default=None,
    help="Name to check the brokers' certificates against, if not their address.",
)
@_option(
    "--token-file",
    env="TOKEN_FILE",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="File holding a bearer token (agent/HOST) for brokers that take tokens; needs TLS.",
)
@_removed_etcd_options
@_option("--site", env="SITE", default="", help="Site of the host.")
@_option("--pod", env="POD", default="", help="Pod of the host.")
@_option("--rack", env="RACK", default="", help="Rack of the host.")
@_option(
    "--slot-capacity",
    "--slots",
    env="SLOT_CAPACITY",
    type=int,
    default=8,
    help="Proxy slots on the host: the most GPUs attached at once.",
)
@_option(
    "--label",
    "labels",
    env="LABELS",
    multiple=True,
    metavar="KEY=VALUE",
    help="Host label; repeat for several (environment: space-separated).",
)
@_option(
    "--cpus",
    "cpu_cores",
    env="CPUS",
    type=click.IntRange(min=0),
    default=0,
    help="CPU cores the host offers to nodes (0: not declared; --cpus requests skip it).",
)
@_option(
    "--memory",
    "memory_mib",
    env="MEMORY",
    default="0",
    metavar="SIZE",
    help="Memory the host offers to nodes, e.g. 512GiB (0: not declared).",
)
@_option(
    "--driver",
    env="DRIVER",
    type=click.Choice(sorted(DRIVERS)),
    default="sim",
    help="Fabric driver.",
)
@_option(
    "--sim-state-dir",
    "--sim-state",
    env="SIM_STATE_DIR",
    type=click.Path(path_type=Path),
    help="State directory of the simulated fabric (driver sim).",
)
@_option(
    "--sim-map-delay",
    "--map-delay",
    "sim_map_delay_s",
    env="SIM_MAP_DELAY",
    type=DAEMON_SECONDS,
    default=0.0,
    help="Simulated proxy mapping delay, seconds.",
)
@_option(
    "--sim-hotplug-delay",
    "--hotplug-delay",
    "sim_hotplug_delay_s",
    env="SIM_HOTPLUG_DELAY",
    type=DAEMON_SECONDS,
    default=0.0,
    help="Simulated hotplug delay, seconds.",
)
@_option(
    "--sim-bind-delay",
    "--bind-delay",
    "sim_bind_delay_s",
    env="SIM_BIND_DELAY",
    type=DAEMON_SECONDS,
    default=0.0,
    help="Simulated driver bind delay, seconds.",
)
@_option(
    "--redfish-map",
    env="REDFISH_MAP",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Redfish fabric map (YAML): map GPUs at the box side through a Redfish fabric "
    "manager instead of the driver's own mapper.",
)
@_option(
    "--linux-port",
    "linux_ports",
    env="LINUX_PORTS",
    multiple=True,
    metavar="SLOT=BRIDGE",
    help="Driver linux: the PCIe downstream port (bridge address) behind which the proxy "
    "presents host slot SLOT; repeat per slot (environment: space-separated).",
)
@_option(
    "--proxy-hook",
    env="PROXY_HOOK",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Driver linux: executable that programs the host's proxy (map, unmap, status, fence).",
)
@_option(
    "--proxy-hook-timeout",
    "proxy_hook_timeout_s",
    env="PROXY_HOOK_TIMEOUT",
    type=float,
    default=30.0,
    help="Driver linux: seconds a proxy hook run may take before it is killed.",
)
@_option(
    "--sysfs-root",
    env="SYSFS_ROOT",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/sys"),
    help="Driver linux: where sysfs is mounted.",
)
@_option(
    "--fabric-p2p/--no-fabric-p2p",
    "fabric_p2p",
    env="FABRIC_P2P",
    default=False,
    help="Driver linux: the fabric carries peer-to-peer traffic between GPUs.",
)
@_option(
    "--lease-ttl",
    "lease_ttl_s",
    env="LEASE_TTL",
    type=DAEMON_SECONDS,
    default=10.0,
    help="Liveness TTL, seconds: the host is gone once its broker has had no heartbeat for "
    "this long (one is sent every third of it).",
)
@_option(
    "--detach-attempts",
    env="DETACH_ATTEMPTS",
    type=int,
    default=5,
    help="Failed detaches in a row before the GPU is reported FAILED (the broker then "
    "quarantines it); the agent keeps retrying.",
)
@_option(
    "--drain-timeout",
    "drain_timeout_s",
    env="DRAIN_TIMEOUT",
    type=float,
    default=300.0,
    help="Seconds a released GPU that still runs compute processes is waited for before "
    "it is detached anyway.",
)
@_option(
    "--state-dir",
    "state_dir",
    env="STATE_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory for the agent's identity token: a restart with the same directory "
    "takes its live session over, so the host's nodes survive the restart.",
)
@_option(
    "--resync-interval",
    "resync_interval_s",
    env="RESYNC_INTERVAL",
    type=DAEMON_SECONDS,
    default=30.0,
    help="Full resync period, seconds.",
)
@_option(
    "--attach-attempts",
    env="ATTACH_ATTEMPTS",
    type=int,
    default=3,
    help="Attach tries per GPU generation before FAILED.",
)
@_option(
    "--backoff-base",
    "backoff_base_s",
    env="BACKOFF_BASE",
    type=DAEMON_SECONDS,
    default=0.2,
    help="First retry delay, seconds (doubles per failure).",
)
@_option(
    "--backoff-max",
    "backoff_max_s",
    env="BACKOFF_MAX",
    type=DAEMON_SECONDS,
    default=10.0,
    help="Longest retry delay, seconds.",
)
@_option(
    "--device-timeout",
    "device_timeout_s",
    env="DEVICE_TIMEOUT",
    type=DAEMON_SECONDS,
    default=30.0,
    help="Wait for a PCI device after a rescan, seconds.",
)
@_option("--workers", env="WORKERS", type=int, default=4, help="Reconcile worker threads.")
@_option(
    "--startup-timeout",
    "startup_timeout_s",
    env="STARTUP_TIMEOUT",
    type=DAEMON_SECONDS,
    default=60.0,
    help="Wait for a broker at startup, seconds.",
)
@_option(
    "--agent-endpoint", env="ENDPOINT", default="", help="Address of this agent (informational)."
)
@_option(
    "--metrics-port",
    env="METRICS_PORT",
    type=click.IntRange(0, 65535),
    default=0,
    help="Serve Prometheus metrics on this port (0: off).",
)
@_option(
    "--metrics-address",
    env="METRICS_ADDRESS",
    default="127.0.0.1",
    help="Address the metrics port binds (0.0.0.0 for every interface).",
)
@_option(
    "--log-level",
    env="LOG_LEVEL",
    default="INFO",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Log level (logs go to stderr).",
)
def agent_command(
    labels: tuple[str, ...],
    linux_ports: tuple[str, ...],
    log_level: str,
    memory_mib: str,
    metrics_port: int,
    metrics_address: str,
    **fields: Any,
) -> None:
    """Run a dxpool host agent: register the host, attach and detach its GPUs."""
    configure_logging(log_level)
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=metrics_address)
    try:
        config = AgentConfig(
            labels=_parse_labels(labels),
            linux_ports=_parse_ports(linux_ports),
            memory_mib=0 if memory_mib.strip() == "0" else parse_host_memory_mib(memory_mib),
            **fields,
        )
    except InvalidArgument as error:
        raise click.UsageError(error.message) from error
    sys.exit(run_agent(config))
