"""The private CA: identities in certificates, key file modes, what a CA may sign."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509

from dxpool.errors import InvalidArgument
from dxpool.identity import Identity, Role
from dxpool.pki import create_ca, identities_in, issue, load_pair, write_pair


def test_client_certificate_carries_its_identity_as_a_san_uri() -> None:
    ca = create_ca()
    pair = issue(ca, identity=Identity.make("tenant", "team-a"))
    assert identities_in(pair.cert) == [Identity(Role.TENANT, "team-a")]
    usage = pair.cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH in usage
    assert pair.cert.issuer == ca.cert.subject


def test_server_certificate_names_its_hosts() -> None:
    pair = issue(create_ca(), dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    sans = pair.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert identities_in(pair.cert) == []


def test_ca_signs_end_entities_only() -> None:
    constraints = create_ca().cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.value.ca and constraints.value.path_length == 0
    assert constraints.critical


def test_keys_are_written_0600_and_certificates_0644(tmp_path: Path) -> None:
    ca = create_ca()
    cert_path, key_path = write_pair(tmp_path / "pki", "ca", ca)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(cert_path.stat().st_mode) == 0o644
    assert load_pair(tmp_path / "pki", "ca") == ca
    # Written again (a re-issue), the key keeps its mode.
    write_pair(tmp_path / "pki", "ca", create_ca())
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("dxpool://operator", "expected dxpool://ROLE/NAME"),
        ("https://operator/alice", "expected dxpool://ROLE/NAME"),
        ("dxpool://root/alice", "unknown role 'root'"),
        ("dxpool://tenant/a b", "invalid tenant name id"),
    ],
)
def test_bad_identities_say_what_is_expected(uri: str, expected: str) -> None:
    with pytest.raises(InvalidArgument, match=expected):
        Identity.parse(uri)


def test_a_certificate_needs_an_identity_or_a_name() -> None:
    with pytest.raises(InvalidArgument, match="needs an identity"):
        issue(create_ca())
