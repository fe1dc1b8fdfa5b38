"""The root ``dxpool`` command: global options, exit statuses, and the command tree.

Exit statuses: 0 ok; 1 an API error (``error: NOT_FOUND: ...`` on stderr) or a wait that
timed out; 2 a usage error (click's own, and values that do not parse); 130 Ctrl-C.

``dxpool broker`` and ``dxpool agent`` are mounted from their own packages and imported
only when used; without their extra (``dxpool[server]``, ``dxpool[agent]``) they are
stand-ins that say what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

import click

import dxpool
import dxpool.grpc_env  # before anything imports grpc
from dxpool.cli.commands import (
    audit,
    box,
    certs,
    completion,
    etcd_auth,
    fabric,
    gang,
    gpu,
    host,
    node,
    sharing,
    status,
    tenant,
    up,
)
from dxpool.cli.context import CliContext, SecurityFlags
from dxpool.cli.errors import EXIT_API_ERROR, EXIT_INTERRUPTED, format_error
from dxpool.cli.extras import missing_extra_command
from dxpool.cli.params import SECONDS
from dxpool.errors import DxpoolError
from dxpool.extras import missing_modules
from dxpool.logs import KeyValueFormatter

# Commands that live in other packages: name -> (module, attribute, extra it needs).
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "broker": ("dxpool.broker.command", "broker_command", "server"),
    "agent": ("dxpool.hostagent.__main__", "agent_command", "agent"),
}


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


class DxpoolGroup(click.Group):
    """A group that maps errors onto exit statuses and mounts commands lazily."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [name for name in LAZY_COMMANDS if self.get_command(ctx, name) is not None]
        return sorted({*super().list_commands(ctx), *lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None or cmd_name not in LAZY_COMMANDS:
            return command
        module_name, attribute, extra = LAZY_COMMANDS[cmd_name]
        if not _module_exists(module_name):
            return None
        if missing_modules(extra):
            return missing_extra_command(cmd_name, extra)
        try:
            found = getattr(importlib.import_module(module_name), attribute, None)
        except ImportError as error:  # a partial install: leave the command out
            logging.getLogger(__name__).debug(
                "command not mounted", extra={"command": cmd_name, "error": str(error)}
            )
            return None
        return found if isinstance(found, click.Command) else None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DxpoolError as error:
            cli = ctx.find_object(CliContext)
            endpoint = cli.endpoint.value if cli is not None else "the configured endpoint"
            verbose = logging.getLogger("dxpool").getEffectiveLevel() <= logging.DEBUG
            click.echo(format_error(error, endpoint, verbose=verbose), err=True)
            raise click.exceptions.Exit(EXIT_API_ERROR) from None
        except TimeoutError as error:
            click.echo(f"error: DEADLINE_EXCEEDED: {error}", err=True)
            click.echo(
                "hint: wait longer with --timeout, or look at it with `dxpool node get`",
                err=True,
            )
            raise click.exceptions.Exit(EXIT_API_ERROR) from None
        except KeyboardInterrupt:
            click.echo("", err=True)  # end the line the terminal's ^C is on
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


@click.group("dxpool", cls=DxpoolGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--endpoint",
    metavar="HOST:PORT",
    help="Broker address (a leading http:// or grpc:// is dropped). Default: "
    "$DXPOOL_ENDPOINT, else 'endpoint' in $DXPOOL_CONFIG or ~/.config/dxpool/config.yaml, "
    "else 127.0.0.1:8470 (where `dxpool up` listens).",
)
@click.option(
    "--request-timeout",
    type=SECONDS,
    default="10s",
    show_default=True,
    help="Deadline of each call to the broker.",
)
@click.option(
    "--tls-ca",
    metavar="PATH",
    help="CA (PEM) that signed the broker's certificate; connects with TLS. Default: "
    "$DXPOOL_CA, else 'ca' in the config file; none of the TLS settings: plaintext.",
)
@click.option(
    "--tls-cert", metavar="PATH", help="Client certificate (PEM) for mutual TLS ($DXPOOL_CERT)."
)
@click.option("--tls-key", metavar="PATH", help="Key of --tls-cert (PEM) ($DXPOOL_KEY).")
@click.option(
    "--token-file",
    metavar="PATH",
    help="File holding a bearer token to authenticate with ($DXPOOL_TOKEN_FILE); needs TLS.",
)
@click.option("-v", "--verbose", count=True, help="Log more to stderr (-v info, -vv debug).")
@click.version_option(dxpool.__version__, prog_name="dxpool")
@click.pass_context
def cli(
    ctx: click.Context,
    endpoint: str | None,
    request_timeout: float,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    token_file: str | None,
    verbose: int,
) -> None:
    """Compose GPU nodes from a disaggregated GPU pool.

    \b
    Start a local pool and compose a node:
      dxpool up
      dxpool node create --gpus H100:2 --wait
    """
    if request_timeout <= 0:
        raise click.BadParameter("must be positive", param_hint="--request-timeout")
    if ctx.invoked_subcommand not in DAEMONS:  # daemons set up logging from --log-level
        level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
        # Like basicConfig, a no-op where logging is already set up (an embedding program).
        stderr = logging.StreamHandler()
        stderr.setFormatter(KeyValueFormatter())
        logging.basicConfig(level=level, handlers=[stderr])
        logging.getLogger("dxpool").setLevel(level)
    ctx.obj = CliContext(
        endpoint_flag=endpoint,
        request_timeout_s=request_timeout,
        security_flags=SecurityFlags(tls_ca, tls_cert, tls_key, token_file),
    )


# Long-running commands that own their logging configuration (their --log-level).
DAEMONS = frozenset({"broker", "agent"})

for _command in (
    audit.audit,
    box.box,
    certs.certs,
    etcd_auth.etcd_auth,
    gpu.gpu,
    host.host,
    node.node,
    gang.gang,
    fabric.fabric,
    status.status,
    sharing.queue,
    tenant.tenant,
    completion.completion,
    up.up,
):
    cli.add_command(_command)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="dxpool")


__all__ = ["DxpoolGroup", "cli", "main"]
