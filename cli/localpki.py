"""The TLS material of a local pool (``dxpool up``), kept in ``<data-dir>/pki``.

Two private CAs, so that no host's certificate can even shake hands with etcd:

* ``ca`` (``ca.crt``/``ca.key``) signs what the broker's clients and the broker show each
  other: the broker's server certificate (``broker``, for 127.0.0.1, localhost and the
  listen host; served on the public and the agent port), the operator's client
  certificate (``operator``, identity ``dxpool://operator/local``) that the CLI uses, and
  one client certificate per host agent (``agent-<host>``, ``dxpool://agent/<host>``),
  which the agent shows the broker's agent port.
* ``etcd-ca`` signs only etcd's side: etcd's server certificate (``etcd``, for 127.0.0.1
  and localhost; also its peer certificate), the broker's client certificate towards
  etcd (``broker-etcd``, etcd user ``dxpool-broker``) and etcd's administrator's
  (``etcd-root``, etcd user ``root``: ``dxpool up`` sets up etcd's users and roles and
  probes etcd with it). etcd trusts this CA alone, on its client port and its peer port,
  so an agent's certificate is refused at the TLS handshake.

The etcd user is each etcd certificate's Common Name (see :mod:`dxpool.etcd_users`).

Keys are 0600. :func:`ensure_local_pki` keeps what a previous run made (the CAs above
all, so certificates handed out stay valid) and makes only what is missing, expires
within a week, names another etcd user than it must, or is signed by the other CA (a
pool made before etcd had a CA of its own). It also writes ``<data-dir>/config.yaml``,
which points the CLI at the broker with the operator's certificate.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from dxpool.etcd_users import BROKER_USER, ROOT_USER
from dxpool.identity import Identity, Role
from dxpool.pki import CertPair, create_ca, issue, load_pair, write_pair
from dxpool.private_files import write_atomic
from dxpool.tls import ClientTls, ServerTls

__all__ = ["LOCAL_OPERATOR", "LocalPki", "ensure_local_pki", "write_client_config"]

LOCAL_OPERATOR = Identity(Role.OPERATOR, "local")
ETCD_CA = "etcd-ca"
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
        """The CA of the broker's clients (operator, agents) and of the broker."""
        return self.cert("ca")

    @property
    def etcd_ca(self) -> Path:
        """The CA etcd trusts: etcd's own certificate, the broker's and root's towards it."""
        return self.cert(ETCD_CA)

    def broker_tls(self) -> ServerTls:
        """The broker's TLS: its certificate, and client certificates required (mTLS)."""
        return ServerTls(self.cert("broker"), self.key("broker"), client_ca=self.ca)

    def operator_tls(self) -> ClientTls:
        return ClientTls(self.ca, self.cert("operator"), self.key("operator"))

    def etcd_tls(self) -> ServerTls:
        """etcd's TLS on its client port: its certificate, and client certificates of the
        etcd CA required (``--client-cert-auth``)."""
        return ServerTls(self.cert("etcd"), self.key("etcd"), client_ca=self.etcd_ca)

    def etcd_peer_tls(self) -> ServerTls:
        """etcd's TLS on its peer port: the same certificate, and peers must show one of
        the etcd CA (``--peer-client-cert-auth``)."""
        return ServerTls(self.cert("etcd"), self.key("etcd"), client_ca=self.etcd_ca)

    def broker_etcd_tls(self) -> ClientTls:
        """How the broker reaches etcd (etcd user ``dxpool-broker``)."""
        return ClientTls(self.etcd_ca, self.cert("broker-etcd"), self.key("broker-etcd"))

    def root_etcd_tls(self) -> ClientTls:
        """How ``dxpool up`` changes etcd's users and roles, and probes etcd (etcd user
        ``root``, which may read every key)."""
        return ClientTls(self.etcd_ca, self.cert("etcd-root"), self.key("etcd-root"))

    def agent_args(self, host: str) -> list[str]:
        """The agent flags that make host ``host``'s agent reach the broker with its own
        certificate (mutual TLS)."""
        name = f"agent-{host}"
        return [
            "--tls-ca",
            str(self.ca),
            "--tls-cert",
            str(self.cert(name)),
            "--tls-key",
            str(self.key(name)),
        ]


def _fresh(
    directory: Path, name: str, common_name: str | None = None, signer: CertPair | None = None
) -> bool:
    """Whether ``name``'s pair exists, stays valid for more than a week, (if given) has
    ``common_name`` as its Common Name (the etcd user it acts as) and was signed by
    ``signer``."""
    from cryptography.x509.oid import NameOID

    try:
        cert = load_pair(directory, name).cert
        expires = cert.not_valid_after_utc
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if signer is not None:
            cert.verify_directly_issued_by(signer.cert)
    except Exception:  # missing, unreadable, not a certificate, another CA's: make it again
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


def _ca(directory: Path, name: str, common_name: str) -> CertPair:
    """The CA ``name``, made now when missing or expiring."""
    if _fresh(directory, name):
        return load_pair(directory, name)
    ca = create_ca(common_name)
    write_pair(directory, name, ca)
    return ca


def ensure_local_pki(directory: Path, *, listen: str, hosts: Sequence[str]) -> LocalPki:
    """Make (or keep) both CAs and every certificate the pool needs; see the module doc."""
    pki = LocalPki(directory)
    ca = _ca(directory, "ca", "dxpool local pool CA")
    etcd_ca = _ca(directory, ETCD_CA, "dxpool local pool etcd CA")
    dns, ips = _server_names(listen.rpartition(":")[0])
    if not _fresh(directory, "broker", signer=ca) or not _names_cover(directory, dns, ips):
        write_pair(directory, "broker", issue(ca, dns_names=dns, ip_addresses=ips))
    if not _fresh(directory, "broker-etcd", BROKER_USER, etcd_ca):
        pair = issue(etcd_ca, common_name=BROKER_USER, client_auth=True)
        write_pair(directory, "broker-etcd", pair)
    if not _fresh(directory, "etcd-root", ROOT_USER, etcd_ca):
        write_pair(directory, "etcd-root", issue(etcd_ca, common_name=ROOT_USER, client_auth=True))
    if not _fresh(directory, "etcd", signer=etcd_ca) or not _good_for_clients(directory, "etcd"):
        # client_auth: the same certificate is what this member shows its peers, and etcd
        # also connects to itself with it (its gRPC gateway), or etcd logs "incompatible
        # key usage" for every such connection.
        pair = issue(etcd_ca, dns_names=["localhost"], ip_addresses=["127.0.0.1"], client_auth=True)
        write_pair(directory, "etcd", pair)
    if not _fresh(directory, "operator", signer=ca):
        write_pair(directory, "operator", issue(ca, identity=LOCAL_OPERATOR))
    for host in hosts:
        agent = Identity(Role.AGENT, host)
        if not _fresh(directory, f"agent-{host}", agent.uri, ca):
            write_pair(directory, f"agent-{host}", issue(ca, identity=agent))
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
