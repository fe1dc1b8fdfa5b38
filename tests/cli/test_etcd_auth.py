"""``dxpool etcd-auth`` and ``dxpool certs issue --etcd-user`` against a real etcd serving
TLS with client-certificate auth: an operator's whole round, from certificates to an etcd
that only the broker and root may touch, and the agent users of older versions removed."""

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


def test_setup_show_and_an_agent_certificate_refused(etcd: EmbeddedEtcd, pki_dir: Path) -> None:
    args = _etcd_args(etcd, pki_dir)
    first = run("etcd-auth", "setup", *args)
    assert first.exit_code == 0, first.output
    assert first.output.splitlines() == [
        "etcd user dxpool-broker: updated",
        "etcd authentication is on",
    ]
    again = run("etcd-auth", "setup", *args)
    assert again.exit_code == 0, again.output
    assert "etcd user dxpool-broker: unchanged" in again.output

    shown = run("etcd-auth", "show", "-o", "json", *args)
    assert shown.exit_code == 0, shown.output
    users = json.loads(shown.output)
    assert set(users) == {"root", "dxpool-broker"}  # no agent has an etcd user
    assert users["dxpool-broker"]["dxpool-broker"] == [
        "read/write /dxpool/v1-audit/*",
        "read/write /dxpool/v1/*",
    ]
    table = run("etcd-auth", "show", *args)
    assert "  role root: everything" in table.output

    # An agent's certificate, as `dxpool certs issue agent/h1` makes it, names no etcd
    # user: etcd refuses it even its own host's keys (were it let through TLS at all).
    h1 = connect([EtcdAddress(etcd.host, etcd.client_port, _tls(pki_dir, "agent-h1"))])
    try:
        for call in (
            lambda: h1.put(KEYS.host_status("h1"), b"mine"),
            lambda: h1.get(KEYS.host_allocation("h1")),
            lambda: h1.get_prefix(KEYS.prefix),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        h1.close()


def test_setup_removes_the_agent_users_of_older_versions(etcd: EmbeddedEtcd, pki_dir: Path) -> None:
    from dxpool.store.etcd_auth import Access, EtcdAuth, Grant

    with EtcdAuth(etcd.address) as auth:  # what an older `etcd-auth setup --agents h1` made
        auth.ensure_user("dxpool-agent-h1", [Grant.one_key("/dxpool/v1/hosts/h1", Access.WRITE)])
    args = _etcd_args(etcd, pki_dir)

    done = run("etcd-auth", "setup", *args)

    assert done.exit_code == 0, done.output
    assert "etcd user dxpool-agent-h1: removed (host agents no longer use etcd" in done.output
    assert set(json.loads(run("etcd-auth", "show", "-o", "json", *args).output)) == {
        "root",
        "dxpool-broker",
    }
    removed = run("etcd-auth", "remove-agent", "h1", *args)
    assert removed.exit_code == 0
    assert removed.stdout.splitlines() == ["etcd user dxpool-agent-h1: not there"]
    assert "host agents no longer use etcd" in removed.stderr


def test_agents_need_no_etcd_user_any_more(etcd: EmbeddedEtcd, pki_dir: Path) -> None:
    for args in (["add-agent", "h2"], ["setup", "--agents", "h1"]):
        result = run("etcd-auth", *args, *_etcd_args(etcd, pki_dir))
        assert result.exit_code == 2, result.output
        assert "host agents no longer use etcd" in result.output
        assert "--broker" in result.output


def test_only_roots_certificate_may_change_users(etcd: EmbeddedEtcd, pki_dir: Path) -> None:
    assert run("etcd-auth", "setup", *_etcd_args(etcd, pki_dir)).exit_code == 0
    refused = run("etcd-auth", "remove-agent", "h2", *_etcd_args(etcd, pki_dir, "broker"))
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
        ["etcd-auth", "remove-agent", "bad id"],
        ["etcd-auth", "remove-agent", "-h1-"],
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
    refused = run("etcd-auth", "setup", *_etcd_args(etcd, pki_dir, "broker"))
    assert refused.exit_code == 1
    assert refused.output.startswith(
        "error: FAILED_PRECONDITION: not turning etcd's authentication on with a "
        "certificate with CN dxpool-broker"
    )
    shown = run("etcd-auth", "show", "-o", "json", *_etcd_args(etcd, pki_dir))
    assert json.loads(shown.output) == {}  # nothing was made
