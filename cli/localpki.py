"""The TLS material of a local pool (``dxpool up``), kept in ``<data-dir>/pki``.

A private CA (``ca.crt``/``ca.key``) signs: the broker's server certificate
(``broker``, for 127.0.0.1, localhost and the listen host; also the broker's client
certificate towards etcd, as etcd user ``dxpool-broker``), etcd's server certificate
(``etcd``, for 127.0.0.1 and localhost), etcd's administrator's client certificate
(``etcd-root``, etcd user ``root``: ``dxpool up`` sets up etcd's users and roles and
probes etcd with it), the operator's client certificate (``operator``, identity
``dxpool://operator/local``) that the CLI uses, and one client certificate per host
agent (``agent-<host>``, ``dxpool://agent/<host>``, etcd user ``dxpool-agent-<host>``),
which it also shows etcd. The etcd user is each certificate's Common Name (see
:mod:`dxpool.etcd_users`).

Keys are 0600. :func:`ensure_local_pki` keeps what a previous run made (the CA above
all, so certificates handed out stay valid) and makes only what is missing, expires
within a week, or names another etcd user than it must (a pool made before etcd users
existed). It also writes ``<data-dir>/config.yaml``, which points the CLI at the broker
with the operator's certificate.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from dxpool.etcd_users import BROKER_USER, ROOT_USER, agent_user
from dxpool.identity import Identity, Role
from dxpool.pki import CertPair, create_ca, issue, load_pair, write_pair
from dxpool.private_files import write_atomic
from dxpool.tls import ClientTls, ServerTls

__all__ = ["LOCAL_OPERATOR", "LocalPki", "ensure_local_pki", "write_client_config"]

LOCAL_OPERATOR = Identity(Role.OPERATOR, "local")
_RENEW_BEFORE = dt.timedelta(days=7)


@dataclass(frozen=True)
class LocalPki:
    """Where a local pool's certificates are."""

    directory: Path

    def cert(self, name: str) -> Path:
        return self.directory / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.directory / f"{name}.key"

    @property
    def ca(self) -> Path:
        return self.cert("ca")

    def broker_tls(self) -> ServerTls:
        """The broker's TLS: its certificate, and client certificates required (mTLS)."""
        return ServerTls(self.cert("broker"), self.key("broker"), client_ca=self.ca)

    def operator_tls(self) -> ClientTls:
        return ClientTls(self.ca, self.cert("operator"), self.key("operator"))

    def etcd_tls(self) -> ServerTls:
        """etcd's TLS: its certificate, and client certificates required
        (``--client-cert-auth``)."""
        return ServerTls(self.cert("etcd"), self.key("etcd"), client_ca=self.ca)

    def broker_etcd_tls(self) -> ClientTls:
        """How the broker (and ``dxpool up``'s own probes) reach etcd."""
        return ClientTls(self.ca, self.cert("broker"), self.key("broker"))

    def root_etcd_tls(self) -> ClientTls:
        """How ``dxpool up`` changes etcd's users and roles, and probes etcd (etcd user
        ``root``, which may read every key)."""
        return ClientTls(self.ca, self.cert("etcd-root"), self.key("etcd-root"))

    def agent_etcd_args(self, host: str) -> list[str]:
        """The agent flags that make host ``host``'s agent reach etcd over TLS."""
        name = f"agent-{host}"
        return [
            "--etcd-ca",
            str(self.ca),
            "--etcd-cert",
            str(self.cert(name)),
            "--etcd-key",
            str(self.key(name)),
        ]


def _fresh(directory: Path, name: str, common_name: str | None = None) -> bool:
    """Whether ``name``'s pair exists, stays valid for more than a week and (if given)
    has ``common_name`` as its Common Name (the etcd user it acts as)."""
    from cryptography.x509.oid import NameOID

    try:
        cert = load_pair(directory, name).cert
        expires = cert.not_valid_after_utc
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except Exception:  # missing, unreadable or not a certificate: make it again
        return False
    if common_name is not None and [n.value for n in names] != [common_name]:
        return False
    return expires - dt.datetime.now(dt.UTC) > _RENEW_BEFORE


def _good_for_clients(directory: Path, name: str) -> bool:
    """Whether ``name``'s certificate may authenticate a client (extended key usage);
    one made before etcd's certificate had to be is made again."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        usage = load_pair(directory, name).cert.extensions.get_extension_for_class(
            x509.ExtendedKeyUsage
        )
    except Exception:
        return False
    return ExtendedKeyUsageOID.CLIENT_AUTH in usage.value


def _server_names(listen_host: str) -> tuple[list[str], list[str]]:
    dns, ips = ["localhost"], ["127.0.0.1", "::1"]
    host = listen_host.strip("[]")
    if host and host not in ("0.0.0.0", "::", "localhost"):
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            dns.append(host)
        else:
            if str(address) not in ips:
                ips.append(str(address))
    return dns, ips


def ensure_local_pki(directory: Path, *, listen: str, hosts: Sequence[str]) -> LocalPki:
    """Make (or keep) the CA and every certificate the pool needs; see the module doc."""
    pki = LocalPki(directory)
    ca: CertPair
    if _fresh(directory, "ca"):
        ca = load_pair(directory, "ca")
    else:
        ca = create_ca("dxpool local pool CA")
        write_pair(directory, "ca", ca)
        for stale in directory.glob("*.crt"):  # signed by a CA that is gone
            if stale.name != "ca.crt":
                stale.unlink()
    dns, ips = _server_names(listen.rpartition(":")[0])
    if not _fresh(directory, "broker", BROKER_USER) or not _names_cover(directory, dns, ips):
        pair = issue(ca, common_name=BROKER_USER, dns_names=dns, ip_addresses=ips, client_auth=True)
        write_pair(directory, "broker", pair)
    if not _fresh(directory, "etcd-root", ROOT_USER):
        write_pair(directory, "etcd-root", issue(ca, common_name=ROOT_USER, client_auth=True))
    if not _fresh(directory, "etcd") or not _good_for_clients(directory, "etcd"):
        # etcd also connects to itself with its certificate (its gRPC gateway), so it
        # must be good for client authentication too, or etcd logs "incompatible key
        # usage" for every such connection.
        pair = issue(ca, dns_names=["localhost"], ip_addresses=["127.0.0.1"], client_auth=True)
        write_pair(directory, "etcd", pair)
    if not _fresh(directory, "operator"):
        write_pair(directory, "operator", issue(ca, identity=LOCAL_OPERATOR))
    for host in hosts:
        if not _fresh(directory, f"agent-{host}", agent_user(host)):
            pair = issue(ca, identity=Identity(Role.AGENT, host))
            write_pair(directory, f"agent-{host}", pair)
    return pki


def _names_cover(directory: Path, dns: list[str], ips: list[str]) -> bool:
    """Whether the broker certificate names every host it must (the listen host may have
    changed since the last run)."""
    from cryptography import x509

    cert = load_pair(directory, "broker").cert
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    have_dns = set(sans.get_values_for_type(x509.DNSName))
    have_ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    return set(dns) <= have_dns and set(ips) <= have_ips


def write_client_config(path: Path, endpoint: str, pki: LocalPki | None) -> None:
    """Write the CLI config for the pool: its endpoint and, with TLS, the operator's
    certificate (paths relative to the file, so the directory can move); mode 0600, as
    it leads to the operator's key."""
    config: dict[str, str] = {"endpoint": endpoint}
    if pki is not None:
        base = path.parent.resolve()
        for key, value in (
            ("ca", pki.ca),
            ("cert", pki.cert("operator")),
            ("key", pki.key("operator")),
        ):
            config[key] = str(value.resolve().relative_to(base))
    header = "# Written by `dxpool up`: how the dxpool CLI reaches this pool.\n"
    write_atomic(path, header + yaml.safe_dump(config, sort_keys=False))  # mode 0600
