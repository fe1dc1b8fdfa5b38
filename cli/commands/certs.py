"""``dxpool certs``: a private CA for a deployment, without openssl recipes.

``init`` makes the CA (``ca.crt``, ``ca.key``), ``issue`` signs a certificate for an
identity (a client: ``operator/alice``, ``tenant/team-a``, ``agent/h7``) and/or for
server names (the broker's, etcd's: ``--dns``, ``--ip``), ``show`` says what a
certificate holds. Keys are written 0600. No broker is needed.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import click
from cryptography import x509

from dxpool.cli.help import SummaryGroup
from dxpool.errors import InvalidArgument
from dxpool.identity import SCHEME, Identity
from dxpool.names import check_id
from dxpool.pki import (
    DEFAULT_CA_DAYS,
    DEFAULT_CERT_DAYS,
    create_ca,
    identities_in,
    issue,
    load_pair,
    write_pair,
)
from dxpool.tls import read_pem

_DIR = click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("pki"),
    show_default=True,
    help="Directory of the CA and the certificates.",
)


def _fail(message: str) -> click.exceptions.Exit:
    click.echo(f"error: {message}", err=True)
    return click.exceptions.Exit(1)


@click.group("certs", cls=SummaryGroup)
def certs() -> None:
    """Create a private CA and issue certificates for dxpool identities."""


@certs.command("init")
@_DIR
@click.option("--name", default="dxpool CA", show_default=True, help="The CA's common name.")
@click.option("--days", type=click.IntRange(1), default=DEFAULT_CA_DAYS, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing CA (its certificates die).")
def init(directory: Path, name: str, days: int, force: bool) -> None:
    """Create a CA in DIR (ca.crt, ca.key)."""
    if (directory / "ca.key").exists() and not force:
        raise _fail(
            f"{directory / 'ca.key'} exists: keep it, or replace it with --force "
            "(every certificate it signed stops being trusted)"
        )
    cert_path, key_path = write_pair(directory, "ca", create_ca(name, valid_days=days))
    click.echo(f"CA written: {cert_path} (key {key_path})")


def _identity(value: str | None) -> Identity | None:
    if value is None:
        return None
    uri = value if value.startswith(f"{SCHEME}://") else f"{SCHEME}://{value}"
    try:
        return Identity.parse(uri)
    except InvalidArgument as error:
        raise click.BadParameter(
            f"{error.message} (give ROLE/NAME, e.g. tenant/team-a)", param_hint="IDENTITY"
        ) from None


@certs.command("issue")
@click.argument("identity", required=False, metavar="[IDENTITY]")
@_DIR
@click.option("--dns", multiple=True, help="Server DNS name (repeatable).")
@click.option("--ip", multiple=True, help="Server IP address (repeatable).")
@click.option(
    "--etcd-user",
    metavar="NAME",
    help="The etcd user the certificate acts as (its Common Name), and good for client "
    "authentication: dxpool-broker for a broker, root for `dxpool etcd-auth`. An agent's "
    "certificate names dxpool-agent-HOST without it.",
)
@click.option(
    "--client-auth",
    is_flag=True,
    help="Good for client authentication too: etcd's own certificate needs it (etcd "
    "connects to itself with it); --etcd-user implies it.",
)
@click.option(
    "--out",
    help="File name stem (default: ROLE-NAME, else etcd-USER, else the first server name).",
)
@click.option("--days", type=click.IntRange(1), default=DEFAULT_CERT_DAYS, show_default=True)
def issue_command(
    identity: str | None,
    directory: Path,
    dns: tuple[str, ...],
    ip: tuple[str, ...],
    etcd_user: str | None,
    client_auth: bool,
    out: str | None,
    days: int,
) -> None:
    """Issue a certificate signed by the CA in DIR.

    IDENTITY is ROLE/NAME (operator, tenant or agent; e.g. tenant/team-a) for a client
    certificate; --dns/--ip make a server certificate (both may be combined); --etcd-user
    names the etcd user a certificate acts as towards etcd.

    \b
      dxpool certs issue operator/alice
      dxpool certs issue agent/h7                  # etcd user dxpool-agent-h7
      dxpool certs issue --dns broker.example --ip 10.0.0.5 --etcd-user dxpool-broker \\
          --out broker
      dxpool certs issue --etcd-user root          # for `dxpool etcd-auth`
      dxpool certs issue --dns etcd.example --ip 10.0.0.5 --client-auth --out etcd
    """
    who = _identity(identity)
    if etcd_user is not None:
        try:
            check_id(etcd_user, "etcd user")
        except InvalidArgument as error:
            raise click.BadParameter(error.message, param_hint="--etcd-user") from None
    if who is None and not dns and not ip and etcd_user is None:
        raise click.UsageError(
            "give an IDENTITY (ROLE/NAME), --etcd-user, or --dns/--ip for a server"
        )
    for address in ip:
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise click.BadParameter(
                f"{address!r} is not an IP address", param_hint="--ip"
            ) from None
    stem = out or (
        f"{who.role.value}-{who.name}"
        if who
        else f"etcd-{etcd_user}"
        if etcd_user
        else (dns or ip)[0]
    )
    if "/" in stem or stem.startswith("."):
        raise click.BadParameter(f"{stem!r} is not a plain file name", param_hint="--out")
    try:
        ca = load_pair(directory, "ca")
    except InvalidArgument as error:
        hint = f"create a CA with `dxpool certs init --dir {directory}`"
        raise _fail(f"{error.message}; {hint}") from None
    pair = issue(
        ca,
        identity=who,
        common_name=etcd_user,
        dns_names=dns,
        ip_addresses=ip,
        client_auth=client_auth or etcd_user is not None,
        valid_days=days,
    )
    cert_path, key_path = write_pair(directory, stem, pair)
    click.echo(f"certificate written: {cert_path} (key {key_path})")


@certs.command("show")
@click.argument("certificate", type=click.Path(dir_okay=False, path_type=Path))
def show(certificate: Path) -> None:
    """Print what a certificate holds: identity, names, issuer, validity."""
    try:
        cert = x509.load_pem_x509_certificate(read_pem(certificate, "certificate"))
        identities = identities_in(cert)
    except (InvalidArgument, ValueError) as error:
        raise _fail(str(getattr(error, "message", error))) from None
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [*sans.get_values_for_type(x509.DNSName)]
        names += [str(a) for a in sans.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        names = []
    click.echo(f"subject:   {cert.subject.rfc4514_string()}")
    click.echo(f"issuer:    {cert.issuer.rfc4514_string()}")
    click.echo(f"identity:  {', '.join(i.uri for i in identities) or '-'}")
    click.echo(f"names:     {', '.join(names) or '-'}")
    click.echo(f"valid:     {cert.not_valid_before_utc:%Y-%m-%dT%H:%M:%SZ} to ", nl=False)
    click.echo(f"{cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}")
