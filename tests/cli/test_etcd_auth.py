"""``dxpool etcd-auth`` and ``dxpool certs issue --etcd-user`` against a real etcd serving
TLS with client-certificate auth: an operator's whole round, from certificates to an
agent that etcd holds to its own host."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner, Result

from dxpool.cli.main import cli
from dxpool.store.client import EtcdAddress, connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from dxpool.tls import ClientTls, ServerTls

KEYS = KeySchema()


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def pki_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "pki"
    for args in (
        ["certs", "init"],
        ["certs", "issue", "--dns", "localhost", "--ip", "127.0.0.1", "--out", "etcd"],
        ["certs", "issue", "--etcd-user", "root"],
        ["certs", "issue", "agent/h1"],
        ["certs", "issue", "agent/h2"],
        ["certs", "issue", "--dns", "localhost", "--etcd-user", "dxpool-broker", "--out", "broker"],
    ):
        result = run(*args, "--dir", str(directory))
        assert result.exit_code == 0, result.output
    return directory


@pytest.fixture
def etcd(pki_dir: Path, tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd(
        tmp_path / "etcd",
        unsafe_no_fsync=True,
        tls=ServerTls(pki_dir / "etcd.crt", pki_dir / "etcd.key", client_ca=pki_dir / "ca.crt"),
        client_tls=_tls(pki_dir, "etcd-root"),
    ) as server:
        yield server


def _tls(pki_dir: Path, name: str) -> ClientTls:
    return ClientTls(pki_dir / "ca.crt", pki_dir / f"{name}.crt", pki_dir / f"{name}.key")


def _etcd_args(etcd: EmbeddedEtcd, pki_dir: Path, name: str = "etcd-root") -> list[str]:
    return [
        "--etcd", etcd.endpoint,
        "--etcd-ca", str(pki_dir / "ca.crt"),
        "--etcd-cert", str(pki_dir / f"{name}.crt"),
        "--etcd-key", str(pki_dir / f"{name}.key"),
    ]  # fmt: skip


def test_setup_add_show_and_remove_agents(etcd: EmbeddedEtcd, pki_dir: Path) -> None:
    args = _etcd_args(etcd, pki_dir)
    first = run("etcd-auth", "setup", "--agents", "h1", *args)
    assert first.exit_code == 0, first.output
    assert first.output.splitlines() == [
        "etcd user dxpool-broker: updated",
        "etcd user dxpool-agent-h1: updated",
        "etcd authentication is on",
    ]
    again = run("etcd-auth", "setup", "--agents", "h1", *args)
    assert again.exit_code == 0, again.output
    assert "etcd user dxpool-agent-h1: unchanged" in again.output

    # The agent's certificate, as `dxpool certs issue agent/h1` made it, is held to h1.
    h1 = connect([EtcdAddress(etcd.host, etcd.client_port, _tls(pki_dir, "agent-h1"))])
    try:
        h1.put(KEYS.host_status("h1"), b"mine")
        with pytest.raises(grpc.RpcError) as refused:
            h1.put(KEYS.host_status("h2"), b"forged")
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        h1.close()

    added = run("etcd-auth", "add-agent", "h2", *args)
    assert added.exit_code == 0, added.output
    assert added.output.splitlines() == ["etcd user dxpool-agent-h2: updated"]
    shown = run("etcd-auth", "show", "-o", "json", *args)
    assert shown.exit_code == 0, shown.output
    users = json.loads(shown.output)
    assert set(users) == {"root", "dxpool-broker", "dxpool-agent-h1", "dxpool-agent-h2"}
    assert users["dxpool-agent-h2"]["dxpool-agent-h2"] == [
        "read /dxpool/v1/",
        "read /dxpool/v1/hostalloc/h2",
        "read/write /dxpool/v1/hostleases/h2",
        "write /dxpool/v1/hosts/h2",
        "read/write /dxpool/v1/hoststatus/h2",
    ]
    assert users["dxpool-broker"]["dxpool-broker"] == [
        "read/write /dxpool/v1-audit/*",
        "read/write /dxpool/v1/*",
    ]
    table = run("etcd-auth", "show", *args)
    assert "  role root: everything" in table.output

    removed = run("etcd-auth", "remove-agent", "h2", *args)
    assert removed.output.splitlines() == ["etcd user dxpool-agent-h2: removed"]
    removed = run("etcd-auth", "remove-agent", "h2", *args)
    assert removed.output.splitlines() == ["etcd user dxpool-agent-h2: not there"]


def test_only_roots_certificate_may_change_users(etcd: EmbeddedEtcd, pki_dir: Path) -> None:
    assert run("etcd-auth", "setup", *_etcd_args(etcd, pki_dir)).exit_code == 0
    refused = run("etcd-auth", "add-agent", "h2", *_etcd_args(etcd, pki_dir, "agent-h1"))
    assert refused.exit_code == 1
    assert "error: PERMISSION_DENIED:" in refused.output
    assert "CN is 'root'" in refused.output


def test_unreachable_etcd_is_an_error_that_names_it(pki_dir: Path) -> None:
    result = run("etcd-auth", "show", "--etcd", "127.0.0.1:1", "--etcd-ca", str(pki_dir / "ca.crt"))
    assert result.exit_code == 1
    assert "error: UNAVAILABLE: etcd at 127.0.0.1:1 did not answer" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["etcd-auth", "setup", "--agents", "h1,bad id"],
        ["etcd-auth", "add-agent", "-h1-"],
        ["etcd-auth", "setup", "--etcd", "nowhere"],
        ["etcd-auth", "setup", "--prefix", "no-slash"],
        ["certs", "issue", "--etcd-user", "bad user"],
    ],
)
def test_bad_input_is_a_usage_error(args: list[str], tmp_path: Path) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.output


def test_setup_refuses_to_turn_auth_on_without_roots_certificate(
    etcd: EmbeddedEtcd, pki_dir: Path
) -> None:
    refused = run("etcd-auth", "setup", "--agents", "h1", *_etcd_args(etcd, pki_dir, "agent-h1"))
    assert refused.exit_code == 1
    assert refused.output.startswith(
        "error: FAILED_PRECONDITION: not turning etcd's authentication on with a "
        "certificate with CN dxpool-agent-h1"
    )
    shown = run("etcd-auth", "show", "-o", "json", *_etcd_args(etcd, pki_dir))
    assert json.loads(shown.output) == {}  # nothing was made
