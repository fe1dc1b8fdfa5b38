"""The broker over TLS and mutual TLS: which handshakes succeed, which fail, and why."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from click.testing import CliRunner

from dxpool.broker.api.server import BrokerServer
from dxpool.cli.commands.broker import broker_command
from dxpool.client import Client
from dxpool.errors import InvalidArgument, Unavailable
from dxpool.store.embedded import free_port
from dxpool.tls import ClientTls, ServerTls, is_loopback_listen
from tests.conftest import Pki

BrokerFactory = Callable[..., BrokerServer]


def _mtls(pki: Pki) -> ServerTls:
    return ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca"))


def _client(broker: BrokerServer, tls: ClientTls | None, **kwargs: object) -> Client:
    return Client(
        broker.endpoint, tls=tls, insecure=tls is None, timeout_s=3, max_attempts=1, **kwargs
    )  # type: ignore[arg-type]


def _as(pki: Pki, stem: str, **kwargs: str) -> ClientTls:
    return ClientTls(pki.path("ca"), pki.path(stem), pki.path(stem, "key"), **kwargs)


def test_server_tls_serves_a_client_that_trusts_its_ca(
    broker_factory: BrokerFactory, pki: Pki
) -> None:
    broker = broker_factory(tls=ServerTls(pki.path("server"), pki.path("server", "key")))
    with _client(broker, ClientTls(ca=pki.path("ca"))) as client:
        assert client.list_boxes() == []


def test_mutual_tls_serves_a_client_with_a_certificate_of_its_ca(
    broker_factory: BrokerFactory, pki: Pki
) -> None:
    broker = broker_factory(tls=_mtls(pki))
    with _client(broker, _as(pki, "operator-alice")) as client:
        assert client.list_boxes() == []


@pytest.mark.parametrize(
    "client_tls",
    [
        pytest.param(lambda pki: None, id="plaintext-client"),
        pytest.param(lambda pki: ClientTls(ca=pki.path("ca")), id="no-client-certificate"),
        pytest.param(lambda pki: _as(pki, "rogue"), id="certificate-of-another-ca"),
        pytest.param(lambda pki: _as(pki, "expired"), id="expired-certificate"),
        pytest.param(
            lambda pki: _as(pki, "operator-alice", server_name="broker.elsewhere.example"),
            id="wrong-server-name",
        ),
        pytest.param(
            lambda pki: ClientTls(
                pki.path("rogue-ca"), pki.path("operator-alice"), pki.path("operator-alice", "key")
            ),
            id="server-from-an-untrusted-ca",
        ),
    ],
)
def test_mutual_tls_refuses_the_handshake(
    broker_factory: BrokerFactory,
    pki: Pki,
    client_tls: Callable[[Pki], ClientTls | None],
) -> None:
    broker = broker_factory(tls=_mtls(pki))
    with _client(broker, client_tls(pki)) as client, pytest.raises(Unavailable) as refused:
        client.list_boxes()
    # the Python client says what to check, as the CLI does
    assert refused.value.hint is not None
    assert any(word in refused.value.hint for word in ("TLS", "ClientTls")), str(refused.value)
    assert refused.value.hint in str(refused.value)


def test_a_broker_that_is_not_running_gets_a_hint() -> None:
    client = Client(f"127.0.0.1:{free_port()}", insecure=True, max_attempts=1)
    with client, pytest.raises(Unavailable) as refused:
        client.list_boxes()
    assert refused.value.hint is not None and "is the broker running" in refused.value.hint


def test_missing_tls_file_fails_the_start_naming_it(
    broker_factory: BrokerFactory, pki: Pki
) -> None:
    missing = pki.root / "nope.crt"
    with pytest.raises(InvalidArgument, match=r"server certificate file .*nope\.crt"):
        broker_factory(tls=ServerTls(missing, pki.path("server", "key")))


def test_client_certificate_without_key_is_refused(pki: Pki) -> None:
    with pytest.raises(InvalidArgument, match="give both"):
        ClientTls(ca=pki.path("ca"), cert=pki.path("operator-alice"))


def test_plaintext_on_a_non_loopback_address_is_logged_as_a_warning(
    broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="dxpool.broker.api.server"):
        broker_factory(listen="0.0.0.0:0")
    assert any("without TLS" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dxpool.broker.api.server"):
        broker_factory(listen="127.0.0.1:0")
    assert not any("without TLS" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [("127.0.0.1:1", True), ("localhost:1", True), ("[::1]:1", True), ("0.0.0.0:1", False),
     ("[::]:1", False), ("10.0.0.5:1", False), ("broker.example:1", False)],
)  # fmt: skip
def test_loopback_listen_addresses(listen: str, loopback: bool) -> None:
    assert is_loopback_listen(listen) is loopback


def test_broker_command_needs_tls_or_an_explicit_insecure(pki: Pki) -> None:
    runner = CliRunner()
    result = runner.invoke(broker_command, ["--etcd", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "--tls-cert and --tls-key" in result.output and "--insecure" in result.output
    result = runner.invoke(
        broker_command, ["--etcd", "127.0.0.1:1", "--insecure", "--tls-cert", str(pki.path("ca"))]
    )
    assert result.exit_code == 2
    assert "--insecure serves plaintext" in result.output
