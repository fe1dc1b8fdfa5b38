"""``dxpool certs``: a CA and certificates that a broker and the CLI accept."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from dxpool.broker.api.server import BrokerServer
from dxpool.cli.main import cli
from dxpool.client import Client
from dxpool.identity import Identity, Role
from dxpool.pki import identities_in, load_pair
from dxpool.tls import ClientTls, ServerTls


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, ["certs", *args])


def test_init_issue_and_serve_with_mutual_tls(
    tmp_path: Path, broker_factory: Callable[..., BrokerServer]
) -> None:
    pki = tmp_path / "pki"
    assert run("init", "--dir", str(pki)).exit_code == 0
    issued = run("issue", "--dir", str(pki), "--dns", "localhost", "--ip", "127.0.0.1",
                 "--out", "broker")  # fmt: skip
    assert issued.exit_code == 0, issued.output
    assert run("issue", "tenant/team-a", "--dir", str(pki)).exit_code == 0
    assert stat.S_IMODE((pki / "tenant-team-a.key").stat().st_mode) == 0o600
    assert identities_in(load_pair(pki, "tenant-team-a").cert) == [Identity(Role.TENANT, "team-a")]
    broker = broker_factory(
        tls=ServerTls(pki / "broker.crt", pki / "broker.key", client_ca=pki / "ca.crt")
    )
    tls = ClientTls(pki / "ca.crt", pki / "tenant-team-a.crt", pki / "tenant-team-a.key")
    with Client(broker.endpoint, tls=tls, max_attempts=1) as client:
        assert client.list_nodes() == []
    shown = run("show", str(pki / "tenant-team-a.crt"))
    assert shown.exit_code == 0
    assert "identity:  dxpool://tenant/team-a" in shown.output


def test_init_keeps_an_existing_ca_unless_forced(tmp_path: Path) -> None:
    assert run("init", "--dir", str(tmp_path)).exit_code == 0
    before = (tmp_path / "ca.crt").read_bytes()
    again = run("init", "--dir", str(tmp_path))
    assert again.exit_code == 1
    assert "exists: keep it, or replace it with --force" in again.output
    assert (tmp_path / "ca.crt").read_bytes() == before
    assert run("init", "--dir", str(tmp_path), "--force").exit_code == 0
    assert (tmp_path / "ca.crt").read_bytes() != before


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        (["issue"], 2, "give an IDENTITY (ROLE/NAME), --etcd-user, or --dns/--ip"),
        (["issue", "root/alice"], 2, "unknown role 'root'"),
        (["issue", "--ip", "not-an-ip"], 2, "'not-an-ip' is not an IP address"),
        (["issue", "operator/alice"], 1, "create a CA with `dxpool certs init"),
    ],
)
def test_bad_issue_requests_say_what_to_fix(
    tmp_path: Path, args: list[str], code: int, expected: str
) -> None:
    result = run(*args, "--dir", str(tmp_path / "empty"))
    assert result.exit_code == code
    assert expected in result.output


def test_issued_certificates_name_the_etcd_user_they_act_as(tmp_path: Path) -> None:
    directory = str(tmp_path / "pki")
    assert run("init", "--dir", directory).exit_code == 0
    for args in (
        ["issue", "agent/h7"],
        ["issue", "--etcd-user", "root"],
        ["issue", "--dns", "broker.example", "--etcd-user", "dxpool-broker", "--out", "broker"],
        ["issue", "operator/alice"],
    ):
        assert run(*args, "--dir", directory).exit_code == 0
    subjects = {
        name: run("show", str(tmp_path / "pki" / f"{name}.crt")).output.splitlines()[0]
        for name in ("agent-h7", "etcd-root", "broker", "operator-alice")
    }
    assert subjects == {  # an agent's names no etcd user: agents never reach etcd
        "agent-h7": "subject:   CN=dxpool://agent/h7",
        "etcd-root": "subject:   CN=root",
        "broker": "subject:   CN=dxpool-broker",
        "operator-alice": "subject:   CN=dxpool://operator/alice",
    }
    # The agent keeps its dxpool identity, which the broker's roles go by.
    assert (
        "identity:  dxpool://agent/h7" in run("show", str(tmp_path / "pki" / "agent-h7.crt")).output
    )
