"""The root ``dxpool`` command: global options, exit statuses, and the command tree.

Exit statuses: 0 ok; 1 an API error (``error: NOT_FOUND: ...`` on stderr) or a wait that
timed out; 2 a usage error (click's own, and values that do not parse); 130 Ctrl-C.

Every command is imported only when it is used: :data:`COMMANDS` names each one's module
and summary, so ``dxpool --help`` (and the shell's completion of command names) loads
click and nothing else - no gRPC, protobuf or rich. ``dxpool broker`` and ``dxpool
agent`` live in their own packages; without their extra (``dxpool[server]``,
``dxpool[agent]``) they are stand-ins that say what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any, NamedTuple

import click

import dxpool
import dxpool.grpc_env  # before anything imports grpc
from dxpool.cli.exits import EXIT_API_ERROR, EXIT_INTERRUPTED
from dxpool.cli.help import SummaryGroup


class LazyCommand(NamedTuple):
    """Where a command lives, and its summary for the root's ``--help``."""

    module: str
    attribute: str
    summary: str
    extra: str = ""  # the extra whose modules it needs ("" for the base install)


COMMANDS: dict[str, LazyCommand] = {
    "agent": LazyCommand(
        "dxpool.cli.commands.agent",
        "agent_command",
        "Run a dxpool host agent: register the host, attach and detach its GPUs",
        "agent",
    ),
    "audit": LazyCommand(
        "dxpool.cli.commands.audit",
        "audit",
        "Show the audit log: every mutating call, who made it and how it ended",
    ),
    "box": LazyCommand(
        "dxpool.cli.commands.box", "box", "Register, list, cordon, drain and delete GPU boxes"
    ),
    "broker": LazyCommand(
        "dxpool.cli.commands.broker",
        "broker_command",
        "Run a dxpool broker: the gRPC API over the etcd inventory",
        "server",
    ),
    "certs": LazyCommand(
        "dxpool.cli.commands.certs",
        "certs",
        "Create a private CA and issue certificates for dxpool identities",
    ),
    "completion": LazyCommand(
        "dxpool.cli.commands.completion",
        "completion",
        "Print the completion script for SHELL (bash, zsh, fish)",
    ),
    "etcd-auth": LazyCommand(
        "dxpool.cli.commands.etcd_auth",
        "etcd_auth",
        "etcd users and roles: each agent may write only its own host's keys",
    ),
    "fabric": LazyCommand(
        "dxpool.cli.commands.fabric",
        "fabric",
        "Inspect the fabric latency model; set up a simulated fabric",
    ),
    "gang": LazyCommand(
        "dxpool.cli.commands.gang",
        "gang",
        "Compose several nodes all or nothing, inspect and release them together",
    ),
    "gpu": LazyCommand(
        "dxpool.cli.commands.gpu",
        "gpu",
        "List GPUs and their state; reclaim quarantined ones, clear unhealthy ones",
    ),
    "host": LazyCommand(
        "dxpool.cli.commands.host",
        "host",
        "List hosts and their proxy slots; cordon, drain and uncordon them",
    ),
    "node": LazyCommand(
        "dxpool.cli.commands.node", "node", "Compose, inspect and release virtual nodes"
    ),
    "queue": LazyCommand(
        "dxpool.cli.commands.sharing",
        "queue",
        "The requests waiting for capacity, in the order they will be served",
    ),
    "status": LazyCommand(
        "dxpool.cli.commands.status",
        "status",
        "The pool at a glance: GPUs, nodes, hosts and what fits (--picture: every GPU)",
    ),
    "tenant": LazyCommand(
        "dxpool.cli.commands.tenant",
        "tenant",
        "Set and show tenants' quotas (GPUs, GPUs per model, nodes) and usage",
    ),
    "up": LazyCommand(
        "dxpool.cli.commands.up",
        "up",
        "Run a local pool: etcd, a broker, simulated GPU boxes and host agents",
    ),
}
"""Every command of the root, by name. Only the base install's are sure to be there."""

# Long-running commands that own their logging configuration (their --log-level).
DAEMONS = frozenset({"broker", "agent"})


def _module_exists(module: str) -> bool:
    """Whether ``module`` is installed, without importing its package: a command's
    package (``dxpool.hostagent``) may be heavy to import, and the root lists them all."""
    parent, _, leaf = module.rpartition(".")
    try:
        spec = importlib.util.find_spec(parent)  # imports the parent's parents only
    except ModuleNotFoundError:
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(
        (Path(place) / f"{leaf}.py").is_file() or (Path(place) / leaf / "__init__.py").is_file()
        for place in spec.submodule_search_locations
    )


class _Seconds(click.ParamType[float, Any]):
    """``--request-timeout``: a duration, parsed by the request grammar when used (the
    grammar's module brings gRPC, which ``--help`` need not load)."""

    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from dxpool.cli.params import SECONDS

        return SECONDS.convert(value, param, ctx)


class DxpoolGroup(SummaryGroup):
    """The root group: maps errors onto exit statuses and imports commands when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        installed = {name for name, entry in COMMANDS.items() if _module_exists(entry.module)}
        return sorted(installed | set(super().list_commands(ctx)))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        added = super().get_command(ctx, cmd_name)
        entry = COMMANDS.get(cmd_name)
        if added is not None or entry is None or not _module_exists(entry.module):
            return added
        if entry.extra:
            from dxpool.extras import missing_modules

            if missing_modules(entry.extra):
                from dxpool.cli.extras import missing_extra_command

                return missing_extra_command(cmd_name, entry.extra)
        try:
            found = getattr(importlib.import_module(entry.module), entry.attribute, None)
        except ImportError as error:  # a partial install: leave the command out
            logging.getLogger(__name__).debug(
                "command not mounted", extra={"command": cmd_name, "error": str(error)}
            )
            return None
        return found if isinstance(found, click.Command) else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from dxpool.extras import install_hint, missing_modules

        rows = []
        for name in self.list_commands(ctx):
            entry = COMMANDS.get(name)
            if entry is None:
                command = super().get_command(ctx, name)
                rows.append((name, (command.help or "") if command is not None else ""))
            elif entry.extra and missing_modules(entry.extra):
                rows.append((name, f"(not installed: {install_hint(entry.extra)})"))
            else:
                rows.append((name, entry.summary))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        from dxpool.errors import DxpoolError

        try:
            return super().invoke(ctx)
        except DxpoolError as error:
            from dxpool.cli.context import CliContext
            from dxpool.cli.errors import format_error

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
    type=_Seconds(),
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
    from dxpool.cli.context import CliContext, SecurityFlags
    from dxpool.logs import KeyValueFormatter

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


def main() -> None:
    """Console-script entry point. Ctrl-C anywhere, also while a command's modules are
    still loading, ends with exit status 130 and no traceback."""
    try:
        status = cli.main(prog_name="dxpool", standalone_mode=False)
    except click.ClickException as error:  # a usage error: its message, exit 2
        error.show()
        sys.exit(error.exit_code)
    except click.Abort as error:  # click's word for Ctrl-C (or end of input at a prompt)
        click.echo("", err=True)
        sys.exit(EXIT_INTERRUPTED if isinstance(error.__cause__, KeyboardInterrupt) else 1)
    except KeyboardInterrupt:
        click.echo("", err=True)
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(status if isinstance(status, int) else 0)


__all__ = ["COMMANDS", "DxpoolGroup", "LazyCommand", "cli", "main"]
