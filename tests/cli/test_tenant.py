"""``dxpool tenant`` against a real broker and etcd: what it prints is what etcd holds."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from click.testing import CliRunner, Result

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.main import cli
from dxpool.store.keys import KeySchema
from tests.conftest import Stubs, add_box, wait_until

if TYPE_CHECKING:
    from collections.abc import Callable

    from dxpool.broker.api.server import BrokerServer

    Run = Callable[..., Result]


@pytest.fixture
def run(broker: BrokerServer, monkeypatch: pytest.MonkeyPatch) -> Run:
    """Runs ``dxpool --endpoint <broker> ARGS...`` in-process."""
    monkeypatch.delenv("DXPOOL_ENDPOINT", raising=False)
    runner = CliRunner()

    def invoke(*args: str) -> Result:
        return runner.invoke(cli, ["--endpoint", broker.endpoint, *args])

    return invoke


@pytest.fixture
def pool(broker: BrokerServer, stubs: Stubs, etcd_client: Any, key_prefix: str) -> None:
    """Host h1 (written into etcd, no agent), box1 of four H100s, box2 of four A100s."""
    keys = KeySchema(key_prefix)
    host = pb.Host(name="hosts/h1", location=pb.Location(site="s1", pod="p1", rack="r1"))
    host.slot_capacity = 16
    etcd_client.put(keys.host("h1"), host.SerializeToString())
    etcd_client.put(keys.host_lease("h1"), b"")
    add_box(stubs, "box1", gpus=4, model="H100")
    add_box(stubs, "box2", gpus=4, model="A100")
    wait_until(lambda: broker.index.snapshot().hosts.get("h1") is not None, message="h1")


def ok(result: Result) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
    return result.stdout


def stored(etcd_client: Any, key_prefix: str, tenant: str) -> pb.Tenant:
    value, _ = etcd_client.get(KeySchema(key_prefix).tenant(tenant))
    assert value is not None
    return pb.Tenant.FromString(value)


def test_set_quota_show_and_list_agree_with_etcd(
    run: Run, pool: None, etcd_client: Any, key_prefix: str
) -> None:
    args = "tenant set-quota team-a --gpus 6 --gpus-model H100=3 --gpus-model A100=4 --nodes 2"
    table = ok(run(*shlex.split(args)))
    assert table.splitlines()[0].split() == ["NAME", "NODES", "GPUS", "BY", "MODEL"]
    assert table.splitlines()[1].split() == ["team-a", "0/2", "0/6", "A100=0/4", "H100=0/3"]
    ok(run(*shlex.split("node create --gpus H100:2 --tenant team-a")))
    ok(run(*shlex.split("node create --gpus A100:1 --tenant team-a")))

    record = stored(etcd_client, key_prefix, "team-a")
    assert record.usage == pb.TenantUsage(gpus=3, nodes=2, gpus_by_model={"H100": 2, "A100": 1})
    assert record.quota == pb.TenantQuota(gpus=6, nodes=2, gpus_by_model={"H100": 3, "A100": 4})
    shown = ok(run("tenant", "show", "team-a"))
    assert shown.splitlines()[1].split() == ["team-a", "2/2", "3/6", "A100=1/4", "H100=2/3"]
    as_json = json.loads(ok(run("tenant", "show", "tenants/team-a", "-o", "json")))
    assert as_json["usage"] == {"gpus": 3, "nodes": 2, "gpusByModel": {"H100": 2, "A100": 1}}
    assert as_json["quota"]["gpus"] == 6 and as_json["quota"]["nodes"] == 2
    as_yaml = yaml.safe_load(ok(run("tenant", "list", "-o", "yaml")))
    assert [t["name"] for t in as_yaml] == ["tenants/team-a"]
    assert as_yaml[0]["usage"]["gpus"] == record.usage.gpus

    refused = run(*shlex.split("node create --gpus A100:1 --tenant team-a"))
    assert refused.exit_code == 1
    assert refused.stderr.startswith("error: RESOURCE_EXHAUSTED: ")
    assert "quota of 2 nodes" in refused.stderr

    # Limits left out are lifted; the usage stays.
    lifted = ok(run("tenant", "set-quota", "team-a", "-o", "json"))
    assert json.loads(lifted)["usage"]["gpus"] == 3
    assert not stored(etcd_client, key_prefix, "team-a").quota.HasField("gpus")
    assert ok(run("tenant", "show", "team-a")).splitlines()[1].split()[:3] == [
        "team-a",
        "2/unlimited",
        "3/unlimited",
    ]


def test_a_tenant_never_seen_shows_no_quota_and_no_usage(run: Run) -> None:
    shown = ok(run("tenant", "show", "team-z"))
    assert shown.splitlines()[1].split() == ["team-z", "0/unlimited", "0/unlimited", "<none>"]
    empty = run("tenant", "list")
    assert ok(empty) == "" and "no tenants found" in empty.stderr


@pytest.mark.parametrize(
    "args",
    [
        "tenant set-quota team-a --gpus -1",
        "tenant set-quota team-a --gpus-model H100",
        "tenant set-quota team-a --gpus-model H100=x",
        "tenant set-quota team-a --gpus-model =3",
        "tenant set-quota team-a --gpus-model H100=1 --gpus-model H100=2",
        "tenant set-quota Team_A --gpus 1",
        "tenant show",
    ],
)
def test_usage_errors_exit_2_and_send_nothing(
    run: Run, args: str, etcd_client: Any, key_prefix: str
) -> None:
    result = run(*shlex.split(args))
    assert result.exit_code == 2, result.output
    assert etcd_client.get(KeySchema(key_prefix).tenant("team-a"))[0] is None


def test_delete_refuses_a_tenant_with_nodes_then_deletes_it_audited(
    run: Run, pool: None, broker: BrokerServer, etcd_client: Any, key_prefix: str
) -> None:
    from dxpool.client import Client

    ok(run(*shlex.split("tenant set-quota team-a --gpus 4")))
    node = json.loads(ok(run(*shlex.split("node create --gpus H100:1 --tenant team-a -o json"))))
    refused = run("tenant", "delete", "team-a")
    assert refused.exit_code == 1
    assert refused.stderr.startswith("error: tenants/team-a: FAILED_PRECONDITION: ")
    assert f"still holds 1 node(s) ({node['name']})" in refused.stderr
    assert stored(etcd_client, key_prefix, "team-a").quota.gpus == 4  # nothing changed

    ok(run("node", "delete", node["name"]))  # the release lets go of the charge
    assert ok(run("tenant", "delete", "team-a")) == "tenants/team-a deleted\n"
    assert etcd_client.get(KeySchema(key_prefix).tenant("team-a"))[0] is None
    assert ok(run("tenant", "list")) == ""
    again = run("tenant", "delete", "team-a")
    assert again.exit_code == 1
    assert "NOT_FOUND: tenant tenants/team-a has no record" in again.stderr

    with Client(broker.endpoint, insecure=True) as client:
        records = [r for r in client.list_audit_records() if r.rpc == "NodeService.DeleteTenant"]
    assert [(r.target, r.code) for r in records] == [
        ("tenants/team-a", "FAILED_PRECONDITION"),
        ("tenants/team-a", "OK"),
        ("tenants/team-a", "NOT_FOUND"),
    ]


def test_delete_needs_a_tenant_name(run: Run) -> None:
    assert run("tenant", "delete").exit_code == 2
    assert run("tenant", "delete", "Team_A").exit_code == 2
