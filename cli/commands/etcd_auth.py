"""``dxpool etcd-auth``: etcd users and roles for a pool, so an agent's certificate can
write only its own host's keys.

With etcd's authentication on and ``--client-cert-auth``, etcd takes the user of a call
from its client certificate's Common Name (``dxpool certs issue`` gives agents
``dxpool-agent-{host}``, ``--etcd-user`` any other). These commands talk to etcd itself,
not to a broker, with ``root``'s certificate once authentication is on::

    dxpool etcd-auth setup --etcd 10.0.0.2:2379 --etcd-ca ca.crt \\
        --etcd-cert etcd-root.crt --etcd-key etcd-root.key --agents h1,h2
    dxpool etcd-auth add-agent h3 ...        # a host that joins later
    dxpool etcd-auth remove-agent h3 ...     # a host that leaves
    dxpool etcd-auth show ...

Every command is idempotent. ``setup`` gives the broker's user and each named agent's
user exactly their grants (taking back any added by hand), makes ``root`` if missing and
turns authentication on. Exit status 1 when etcd refuses or cannot be reached, 2 for bad
options. The grants are :mod:`dxpool.store.etcd_auth`'s table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from dxpool.cli.exits import EXIT_API_ERROR
from dxpool.cli.extras import require_extras
from dxpool.cli.help import SummaryGroup
from dxpool.errors import DxpoolError, InvalidArgument
from dxpool.etcd_users import BROKER_USER, agent_user
from dxpool.store.keys import DEFAULT_PREFIX, KeySchema
from dxpool.tls import ClientTls

if TYPE_CHECKING:
    from dxpool.store.etcd_auth import EtcdAuth

F = TypeVar("F", bound=Callable[..., Any])
_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def _etcd_options(command: F) -> F:
    """The options every subcommand takes: where etcd is and whose certificate to use."""
    for option in reversed(
        [
            click.option(
                "--etcd",
                "endpoints",
                envvar="DXPOOL_ETCD_ENDPOINTS",
                show_envvar=True,
                default="127.0.0.1:2379",
                show_default=True,
                help="etcd endpoints, host:port[,host:port...] (the first one is used).",
            ),
            click.option(
                "--etcd-ca",
                envvar="DXPOOL_ETCD_CA",
                show_envvar=True,
                type=_FILE,
                help="CA (PEM) that signed etcd's certificate: talk to etcd over TLS.",
            ),
            click.option(
                "--etcd-cert",
                envvar="DXPOOL_ETCD_CERT",
                show_envvar=True,
                type=_FILE,
                help="Client certificate (PEM) with CN root (`dxpool certs issue "
                "--etcd-user root`).",
            ),
            click.option(
                "--etcd-key",
                envvar="DXPOOL_ETCD_KEY",
                show_envvar=True,
                type=_FILE,
                help="Key of --etcd-cert (PEM).",
            ),
            click.option(
                "--prefix",
                default=DEFAULT_PREFIX,
                show_default=True,
                help="The pool's etcd key prefix.",
            ),
        ]
    ):
        command = option(command)
    return command


def _hosts(values: tuple[str, ...], param_hint: str) -> list[str]:
    """Host ids from repeated and comma-separated values, validated (exit 2 if bad)."""
    hosts = [part.strip() for value in values for part in value.split(",") if part.strip()]
    for host in hosts:
        try:
            agent_user(host)
        except InvalidArgument as error:
            raise click.BadParameter(error.message, param_hint=param_hint) from None
    return list(dict.fromkeys(hosts))


def _schema(prefix: str) -> KeySchema:
    try:
        return KeySchema(prefix)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--prefix") from None


def _open(
    endpoints: str, etcd_ca: Path | None, etcd_cert: Path | None, etcd_key: Path | None
) -> EtcdAuth:
    require_extras("etcd-auth", "server")
    from dxpool.store.client import parse_endpoints
    from dxpool.store.etcd_auth import EtcdAuth

    tls = None
    if etcd_ca or etcd_cert or etcd_key:
        try:
            tls = ClientTls(ca=etcd_ca, cert=etcd_cert, key=etcd_key)
        except InvalidArgument as error:
            raise click.UsageError(error.message) from None
    try:
        address = parse_endpoints(endpoints, tls)[0]
    except InvalidArgument as error:
        raise click.BadParameter(error.message, param_hint="--etcd") from None
    return EtcdAuth(address)


def _run(action: Callable[[], None]) -> None:
    """Run ``action``; an error from etcd is printed and exits 1."""
    try:
        action()
    except DxpoolError as error:
        click.echo(f"error: {error.code.name}: {error.message}", err=True)
        raise click.exceptions.Exit(EXIT_API_ERROR) from None


def _report(wanted: list[str], changed: list[str]) -> None:
    for user in wanted:
        click.echo(f"etcd user {user}: {'updated' if user in changed else 'unchanged'}")


@click.group("etcd-auth", cls=SummaryGroup)
def etcd_auth() -> None:
    """etcd users and roles: each agent may write only its own host's keys."""


@etcd_auth.command("setup")
@click.option(
    "--agents",
    "agents",
    multiple=True,
    metavar="HOST[,HOST...]",
    help="Hosts whose agents get an etcd user (comma-separated or repeated).",
)
@_etcd_options
def setup(
    agents: tuple[str, ...],
    endpoints: str,
    etcd_ca: Path | None,
    etcd_cert: Path | None,
    etcd_key: Path | None,
    prefix: str,
) -> None:
    """Set up the broker's and the agents' etcd users, then turn etcd's auth on."""
    hosts = _hosts(agents, "--agents")
    keys = _schema(prefix)

    def act() -> None:
        from dxpool.store.etcd_auth import setup_pool

        with _open(endpoints, etcd_ca, etcd_cert, etcd_key) as auth:
            changed = setup_pool(auth, keys, agents=hosts)
        _report([BROKER_USER, *(agent_user(h) for h in hosts)], changed)
        click.echo("etcd authentication is on")

    _run(act)


@etcd_auth.command("add-agent")
@click.argument("hosts", nargs=-1, required=True)
@_etcd_options
def add_agent(
    hosts: tuple[str, ...],
    endpoints: str,
    etcd_ca: Path | None,
    etcd_cert: Path | None,
    etcd_key: Path | None,
    prefix: str,
) -> None:
    """Give the agents of HOSTS their etcd users (other users are left as they are)."""
    wanted = _hosts(hosts, "HOSTS")
    keys = _schema(prefix)

    def act() -> None:
        from dxpool.store.etcd_auth import setup_pool

        with _open(endpoints, etcd_ca, etcd_cert, etcd_key) as auth:
            changed = setup_pool(auth, keys, agents=wanted, broker=False, enable=False)
        _report([agent_user(h) for h in wanted], changed)

    _run(act)


@etcd_auth.command("remove-agent")
@click.argument("hosts", nargs=-1, required=True)
@_etcd_options
def remove_agent(
    hosts: tuple[str, ...],
    endpoints: str,
    etcd_ca: Path | None,
    etcd_cert: Path | None,
    etcd_key: Path | None,
    prefix: str,
) -> None:
    """Delete the etcd users of HOSTS' agents: their certificates lose all access."""
    gone = _hosts(hosts, "HOSTS")
    _schema(prefix)

    def act() -> None:
        with _open(endpoints, etcd_ca, etcd_cert, etcd_key) as auth:
            for host in gone:
                user = agent_user(host)
                removed = auth.remove_user(user)
                click.echo(f"etcd user {user}: {'removed' if removed else 'not there'}")

    _run(act)


@etcd_auth.command("show")
@click.option(
    "-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True
)
@_etcd_options
def show(
    output: str,
    endpoints: str,
    etcd_ca: Path | None,
    etcd_cert: Path | None,
    etcd_key: Path | None,
    prefix: str,
) -> None:
    """Print etcd's users, their roles and what each role grants."""
    _schema(prefix)

    def act() -> None:
        with _open(endpoints, etcd_ca, etcd_cert, etcd_key) as auth:
            views = [auth.view(user) for user in auth.users()]
        found = [view for view in views if view is not None]
        if output == "json":
            data = {
                view.user: {
                    role: [grant.describe() for grant in grants]
                    for role, grants in view.roles.items()
                }
                for view in found
            }
            click.echo(json.dumps(data, indent=2, sort_keys=True))
            return
        for view in found:
            click.echo(view.user)
            for role, grants in sorted(view.roles.items()):
                if role == "root":
                    click.echo("  role root: everything")
                    continue
                click.echo(f"  role {role}:")
                for grant in grants:
                    click.echo(f"    {grant.describe()}")

    _run(act)
