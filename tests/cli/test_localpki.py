"""The local pool's certificates: made once, kept across runs, keys private."""

from __future__ import annotations

import stat
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from dxpool.cli.localpki import LOCAL_OPERATOR, ensure_local_pki, write_client_config
from dxpool.config import resolve_connection, resolve_endpoint
from dxpool.identity import Identity, Role
from dxpool.pki import identities_in, issue, load_pair, write_pair


def test_every_certificate_is_made_with_private_keys(tmp_path: Path) -> None:
    pki = ensure_local_pki(tmp_path / "pki", listen="127.0.0.1:8470", hosts=["h1", "h2"])
    for name in ("ca", "broker", "etcd", "operator", "agent-h1", "agent-h2"):
        assert stat.S_IMODE(pki.key(name).stat().st_mode) == 0o600, name
    assert identities_in(load_pair(pki.directory, "operator").cert) == [LOCAL_OPERATOR]
    assert identities_in(load_pair(pki.directory, "agent-h2").cert) == [Identity(Role.AGENT, "h2")]


def test_a_second_run_keeps_the_ca_and_names_a_new_listen_host(tmp_path: Path) -> None:
    first = ensure_local_pki(tmp_path / "pki", listen="127.0.0.1:8470", hosts=["h1"])
    ca, operator = first.ca.read_bytes(), first.cert("operator").read_bytes()
    second = ensure_local_pki(tmp_path / "pki", listen="10.1.2.3:8470", hosts=["h1"])
    assert second.ca.read_bytes() == ca
    assert second.cert("operator").read_bytes() == operator
    broker = load_pair(second.directory, "broker").cert
    sans = broker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "10.1.2.3" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert "localhost" in sans.get_values_for_type(x509.DNSName)


def test_client_config_points_the_cli_at_the_pool(tmp_path: Path) -> None:
    pki = ensure_local_pki(tmp_path / "pool" / "pki", listen="127.0.0.1:8470", hosts=[])
    config = tmp_path / "pool" / "config.yaml"
    write_client_config(config, "127.0.0.1:9999", pki)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600  # it leads to the operator's key
    assert yaml.safe_load(config.read_text())["cert"] == "pki/operator.crt"
    env = {"DXPOOL_CONFIG": str(config)}
    assert resolve_endpoint(env=env) == "127.0.0.1:9999"
    assert resolve_connection(env=env).tls == pki.operator_tls()


def test_insecure_pool_config_has_only_the_endpoint(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    write_client_config(config, "127.0.0.1:9999", None)
    assert yaml.safe_load(config.read_text()) == {"endpoint": "127.0.0.1:9999"}


def _common_name(pki_dir: Path, name: str) -> str:
    cert = load_pair(pki_dir, name).cert
    return str(cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value)


def test_certificates_name_their_etcd_users(tmp_path: Path) -> None:
    pki = ensure_local_pki(tmp_path / "pki", listen="127.0.0.1:8470", hosts=["h1"])
    assert _common_name(pki.directory, "broker") == "dxpool-broker"
    assert _common_name(pki.directory, "etcd-root") == "root"
    assert _common_name(pki.directory, "agent-h1") == "dxpool-agent-h1"
    assert stat.S_IMODE(pki.key("etcd-root").stat().st_mode) == 0o600


def test_an_agent_certificate_of_an_older_pool_is_issued_again_for_its_etcd_user(
    tmp_path: Path,
) -> None:
    from dxpool.pki import issue, write_pair

    pki = ensure_local_pki(tmp_path / "pki", listen="127.0.0.1:8470", hosts=["h1"])
    ca = load_pair(pki.directory, "ca")
    old = issue(ca, identity=Identity(Role.AGENT, "h1"), common_name="dxpool://agent/h1")
    write_pair(pki.directory, "agent-h1", old)
    ensure_local_pki(tmp_path / "pki", listen="127.0.0.1:8470", hosts=["h1"])
    assert _common_name(pki.directory, "agent-h1") == "dxpool-agent-h1"
    assert identities_in(load_pair(pki.directory, "agent-h1").cert) == [Identity(Role.AGENT, "h1")]


def _usages(directory: Path, name: str) -> set[x509.ObjectIdentifier]:
    extension = load_pair(directory, name).cert.extensions.get_extension_for_class(
        x509.ExtendedKeyUsage
    )
    return set(extension.value)


def test_etcds_certificate_serves_and_authenticates_as_a_client(tmp_path: Path) -> None:
    """etcd dials itself with its own certificate; without client usage it logs an
    "incompatible key usage" error for every such connection."""
    pki = ensure_local_pki(tmp_path / "pki", listen="127.0.0.1:8470", hosts=["h1"])
    assert _usages(pki.directory, "etcd") == {
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    }


def test_an_etcd_certificate_of_an_older_pool_is_issued_again_with_client_usage(
    tmp_path: Path,
) -> None:
    pki = ensure_local_pki(tmp_path / "pki", listen="127.0.0.1:8470", hosts=["h1"])
    older = issue(load_pair(pki.directory, "ca"), dns_names=["localhost"])
    write_pair(pki.directory, "etcd", older)
    again = ensure_local_pki(tmp_path / "pki", listen="127.0.0.1:8470", hosts=["h1"])
    assert ExtendedKeyUsageOID.CLIENT_AUTH in _usages(again.directory, "etcd")
