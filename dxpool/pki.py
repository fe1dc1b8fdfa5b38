"""A small private CA for dxpool: create it, issue certificates for identities.

Keys are ECDSA P-256 (fast to make, accepted by gRPC and etcd); certificates are X.509
v3 signed with SHA-256. A certificate for an identity carries it as its one
``dxpool://ROLE/NAME`` URI in the subject alternative names (see :mod:`dxpool.identity`)
and is good for client authentication; ``dns_names``/``ip_addresses`` make it good for
server authentication under those names too (the broker's, etcd's).

Files: :func:`write_pair` writes ``NAME.crt`` (0644) and ``NAME.key`` (0600, created with
that mode so the key is never readable by others, even for a moment).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dxpool.errors import InvalidArgument
from dxpool.etcd_users import agent_user
from dxpool.identity import SCHEME, Identity, Role
from dxpool.private_files import write_atomic
from dxpool.tls import read_pem

__all__ = [
    "DEFAULT_CA_DAYS",
    "DEFAULT_CERT_DAYS",
    "CertPair",
    "create_ca",
    "identities_in",
    "issue",
    "load_pair",
    "write_pair",
]

DEFAULT_CA_DAYS = 3650
DEFAULT_CERT_DAYS = 365
# Tolerate clocks a little behind the issuer's.
_BACKDATE = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class CertPair:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    @property
    def key(self) -> ec.EllipticCurvePrivateKey:
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise InvalidArgument("the CA key must be an EC key made by `dxpool certs init`")
        return key


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _validity(valid_days: int, not_before: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    if valid_days < 1:
        raise InvalidArgument(f"validity must be 1 day or more, got {valid_days}")
    start = not_before or dt.datetime.now(dt.UTC) - _BACKDATE
    return start, start + dt.timedelta(days=valid_days)


def create_ca(common_name: str = "dxpool CA", *, valid_days: int = DEFAULT_CA_DAYS) -> CertPair:
    """A new self-signed CA that may sign end-entity certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start, end = _validity(valid_days, None)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(
    ca: CertPair,
    *,
    identity: Identity | None = None,
    common_name: str | None = None,
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
    valid_days: int = DEFAULT_CERT_DAYS,
    not_before: dt.datetime | None = None,
    client_auth: bool = False,
) -> CertPair:
    """A certificate signed by ``ca``.

    ``identity`` makes it a client certificate for that identity; ``dns_names`` and
    ``ip_addresses`` make it a server certificate for those names; ``client_auth`` makes
    it good as a client's too (a broker's, towards etcd), and with ``common_name`` alone
    it is a plain client certificate (an etcd user's, such as ``root``). At least one of
    them must be given.

    ``common_name`` is the name etcd, with authentication on, takes as the user (see
    :mod:`dxpool.etcd_users`). By default an agent's certificate names its etcd user
    (``dxpool-agent-{host}``), another identity's its URI, a server's its first name.
    ``not_before`` (default: now) lets tests make expired certificates.
    """
    plain_client = client_auth and bool(common_name)
    if identity is None and not dns_names and not ip_addresses and not plain_client:
        raise InvalidArgument(
            "a certificate needs an identity (client), an etcd user (a common name, for a "
            "client), or DNS names or IP addresses (server)"
        )
    try:
        ips = [ipaddress.ip_address(value) for value in ip_addresses]
    except ValueError as error:
        raise InvalidArgument(f"invalid IP address: {error}") from None
    key = ec.generate_private_key(ec.SECP256R1())
    cn = common_name or _default_common_name(identity, dns_names, ip_addresses)
    sans: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
    sans += [x509.IPAddress(ip) for ip in ips]
    usages = []
    if identity is not None:
        sans.append(x509.UniformResourceIdentifier(identity.uri))
    if identity is not None or client_auth:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    if dns_names or ips:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    ca_cert = ca.cert
    start, end = _validity(valid_days, not_before)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
        .sign(ca.key, hashes.SHA256())
    )
    return CertPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _default_common_name(
    identity: Identity | None, dns_names: Sequence[str], ip_addresses: Sequence[str]
) -> str:
    if identity is not None:
        return agent_user(identity.name) if identity.role is Role.AGENT else identity.uri
    return (list(dns_names) or list(ip_addresses))[0]


def identities_in(cert: x509.Certificate) -> list[Identity]:
    """The ``dxpool://`` identities in a certificate's subject alternative names (the
    broker accepts a certificate with exactly one). Malformed ones raise InvalidArgument."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    return [Identity.parse(uri) for uri in uris if uri.startswith(f"{SCHEME}://")]


def write_pair(directory: Path, name: str, pair: CertPair) -> tuple[Path, Path]:
    """Write ``NAME.crt`` and ``NAME.key`` (mode 0600 from creation) into ``directory``;
    replaces files that exist. Returns (cert path, key path)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    _write(key_path, pair.key_pem, 0o600)
    _write(cert_path, pair.cert_pem, 0o644)
    return cert_path, key_path


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a temporary file made with ``mode``, then rename it into place."""
    write_atomic(path, data, mode)


def load_pair(directory: Path, name: str) -> CertPair:
    """Read ``NAME.crt`` and ``NAME.key`` from ``directory``."""
    return CertPair(
        read_pem(directory / f"{name}.crt", f"{name} certificate"),
        read_pem(directory / f"{name}.key", f"{name} key"),
    )
