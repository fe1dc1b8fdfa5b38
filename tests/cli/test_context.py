"""The CLI's connection: TLS flags reach the client; unreadable TLS files are usage errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from dxpool.broker.api.server import BrokerServer
from dxpool.cli.main import cli
from dxpool.tls import ServerTls
from tests.conftest import Pki


@pytest.fixture(autouse=True)
def no_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for name in ("DXPOOL_CONFIG", "DXPOOL_CA", "DXPOOL_CERT", "DXPOOL_KEY", "DXPOOL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def mtls_broker(broker_factory: Callable[..., BrokerServer], pki: Pki) -> BrokerServer:
    return broker_factory(
        tls=ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca"))
    )


def test_tls_flags_connect_with_mutual_tls(mtls_broker: BrokerServer, pki: Pki) -> None:
    result = CliRunner().invoke(
        cli,
        ["--endpoint", mtls_broker.endpoint, "--tls-ca", str(pki.path("ca")),
         "--tls-cert", str(pki.path("operator-alice")),
         "--tls-key", str(pki.path("operator-alice", "key")), "box", "list", "-o", "name"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output


def test_config_file_tls_settings_are_used(
    mtls_broker: BrokerServer, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        f"endpoint: {mtls_broker.endpoint}\nca: {pki.path('ca')}\n"
        f"cert: {pki.path('operator-alice')}\nkey: {pki.path('operator-alice', 'key')}\n"
    )
    monkeypatch.setenv("DXPOOL_CONFIG", str(config))
    result = CliRunner().invoke(cli, ["box", "list"])
    assert result.exit_code == 0, result.output


def test_plaintext_cli_against_a_tls_broker_is_an_api_error(mtls_broker: BrokerServer) -> None:
    result = CliRunner().invoke(
        cli, ["--endpoint", mtls_broker.endpoint, "--request-timeout", "2s", "box", "list"]
    )
    assert result.exit_code == 1
    assert "error: UNAVAILABLE" in result.output
    assert "if it serves TLS" in result.output  # not "is the broker running?": it is


def test_unreadable_tls_file_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--tls-ca", str(tmp_path / "missing.crt"), "box", "list"])
    assert result.exit_code == 2
    assert "missing.crt does not exist" in result.output


def test_unauthenticated_call_hints_at_credentials(
    broker_factory: Callable[..., BrokerServer], pki: Pki, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("token-for-team-a-0123456789abcdef: tenant/team-a\n")
    tokens.chmod(0o600)
    broker = broker_factory(
        tls=ServerTls(pki.path("server"), pki.path("server", "key")), token_file=tokens
    )
    result = CliRunner().invoke(
        cli, ["--endpoint", broker.endpoint, "--tls-ca", str(pki.path("ca")), "node", "list"]
    )
    assert result.exit_code == 1
    assert "error: UNAUTHENTICATED: this broker requires authentication" in result.output
    assert "hint: connect with a client certificate" in result.output


def test_permission_denied_names_the_role(mtls_broker: BrokerServer, pki: Pki) -> None:
    stem = pki.client_identity("tenant", "team-a")
    result = CliRunner().invoke(
        cli,
        ["--endpoint", mtls_broker.endpoint, "--tls-ca", str(pki.path("ca")),
         "--tls-cert", str(pki.path(stem)), "--tls-key", str(pki.path(stem, "key")),
         "box", "list"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert "error: PERMISSION_DENIED: ListBoxes needs the role operator" in result.output
