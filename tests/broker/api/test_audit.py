"""The audit log: exactly one record per mutating call, whatever its outcome; filters,
pages and retention."""

from __future__ import annotations

import datetime as dt
import hashlib
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from google.protobuf import timestamp_pb2
from prometheus_client import REGISTRY

from dxpool.api.v1 import (
    audit_pb2,
    audit_pb2_grpc,
    fabric_pb2,
    inventory_pb2,
    nodes_pb2,
    nodes_pb2_grpc,
)
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.audit import MUTATIONS, AuditLog, audit_prefix
from dxpool.broker.api.audit_fields import MAX_RECORD_BYTES
from dxpool.broker.api.server import BrokerServer
from dxpool.cli.main import cli
from dxpool.client import Client
from dxpool.errors import (
    DxpoolError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
)
from dxpool.fabric.sim import SimGpuSpec
from dxpool.store.client import connect
from dxpool.tls import ClientTls, ServerTls
from tests.conftest import Pki, SimPool, pool_records, wait_until
from tests.patience import patient

READS = ("Get", "List", "Watch", "Plan", "Predict")
TENANT_A = "token-for-team-a-0123456789abcdef"
TENANT_B = "token-for-team-b-0123456789abcdef"
OPERATOR = "token-for-operator-0123456789abcd"


def test_every_rpc_is_either_audited_or_a_read() -> None:
    for module in (inventory_pb2, nodes_pb2, fabric_pb2, audit_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                full = f"/{service.full_name}/{method.name}"
                assert (full in MUTATIONS) != method.name.startswith(READS), full


def _records(client: Client, **filters: str) -> list[audit_pb2.AuditRecord]:
    return client.list_audit_records(**filters)  # type: ignore[arg-type]


@pytest.fixture
def pool_client(broker: BrokerServer, sim_pool: SimPool) -> Client:
    client = Client(broker.endpoint, insecure=True, max_attempts=1)
    sim_pool.fabric.add_box("box1", [SimGpuSpec("H100", 81920)] * 4)
    sim_pool.start_agent("h1")
    return client


def test_every_mutating_call_leaves_exactly_one_record(pool_client: Client) -> None:
    client = pool_client
    client.create_box("box1", gpus=4, model="H100", memory_mib=81920, request_id="req-box1",
                      location=("s1", "p1", "r1"))  # fmt: skip
    wait_until(lambda: any(h.alive for h in client.list_hosts()), 20, message="h1 alive")
    client.cordon_box("box1", reason="test")
    client.uncordon_box("box1")
    with pytest.raises(FailedPrecondition):
        client.reclaim_gpu("box1/0")  # a FREE GPU: refused, and still recorded
    node = client.compose_node("H100:1", node_id="n1", request_id="req-n1")
    client.wait_for_node(node.name, timeout_s=20)
    client.release_node("n1")
    with pytest.raises(DxpoolError):
        client.delete_box("box1")  # a GPU may still be detaching; either way one record
    records = _records(client)
    calls = Counter(r.rpc for r in records)
    assert calls == {
        "InventoryService.CreateBox": 1,
        "InventoryService.CordonBox": 1,
        "InventoryService.UncordonBox": 1,
        "InventoryService.ReclaimGpu": 1,
        "NodeService.ComposeNode": 1,
        "NodeService.ReleaseNode": 1,
        "InventoryService.DeleteBox": 1,
    }
    by_rpc = {r.rpc: r for r in records}
    assert by_rpc["InventoryService.CreateBox"].target == "boxes/box1"
    assert by_rpc["InventoryService.CreateBox"].request_id == "req-box1"
    assert by_rpc["InventoryService.ReclaimGpu"].code == "FAILED_PRECONDITION"
    assert by_rpc["NodeService.ComposeNode"].target == "nodes/n1"
    assert by_rpc["NodeService.ComposeNode"].code == "OK"
    assert by_rpc["NodeService.ReleaseNode"].target == "nodes/n1"
    assert all(r.identity == "" and r.peer for r in records)  # authentication is off
    times = [r.time.ToNanoseconds() for r in records]
    assert times == sorted(times)
    # Reads leave nothing.
    client.list_nodes()
    client.get_node("n1")
    assert len(_records(client)) == 7


def test_filters_and_pages(pool_client: Client) -> None:
    client = pool_client
    for index in range(5):
        client.create_box(f"b{index}", gpus=1, model="H100", memory_mib=1)
    client.cordon_box("b3")
    assert [r.target for r in _records(client, target="boxes/b3")] == ["boxes/b3"] * 2
    assert len(_records(client)) == 6  # walked in pages of 500 by the client
    first = client._audit.ListAuditRecords(audit_pb2.ListAuditRecordsRequest(page_size=4))
    assert len(first.records) == 4 and first.next_page_token
    rest = client._audit.ListAuditRecords(
        audit_pb2.ListAuditRecordsRequest(page_size=4, page_token=first.next_page_token)
    )
    assert [r.target for r in [*first.records, *rest.records]] == [
        r.target for r in _records(client)
    ]
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    assert _records(client, since=later) == []  # type: ignore[arg-type]
    assert _records(client, identity="dxpool://tenant/nobody") == []
    with pytest.raises(InvalidArgument, match="expected dxpool://ROLE/NAME"):
        _records(client, identity="team-a")


def _refused(rpc: str, code: str, role: str) -> float:
    labels = {"rpc": rpc, "code": code, "role": role}
    return REGISTRY.get_sample_value("dxpool_audit_refused_calls_total", labels) or 0.0


def test_refused_calls_are_counted_not_recorded(
    broker_factory: Callable[..., BrokerServer],
    pki: Pki,
    etcd_client: object,
    key_prefix: str,
) -> None:
    """A call refused for its role (PERMISSION_DENIED) writes nothing to etcd, neither to
    the pool nor to the audit log: it is counted by RPC, code and role."""
    broker = broker_factory(
        tls=ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca"))
    )

    def as_(role: str, name: str) -> Client:
        stem = pki.client_identity(role, name)
        tls = ClientTls(pki.path("ca"), pki.path(stem), pki.path(stem, "key"))
        return Client(broker.endpoint, tls=tls, max_attempts=1)

    denied_before = _refused("InventoryService.CreateBox", "PERMISSION_DENIED", "tenant")
    before = pool_records(etcd_client, key_prefix)
    with as_("tenant", "team-a") as tenant:
        for _ in range(3):
            with pytest.raises(PermissionDenied):
                tenant.create_box("b1", gpus=1, model="H100", memory_mib=1)
    assert pool_records(etcd_client, key_prefix) == before
    assert _refused("InventoryService.CreateBox", "PERMISSION_DENIED", "tenant") == (
        denied_before + 3
    )
    with as_("operator", "alice") as operator:
        operator.create_box("b2", gpus=1, model="H100", memory_mib=1)
        records = _records(operator)
        assert [(r.identity, r.target, r.code) for r in records] == [
            ("dxpool://operator/alice", "boxes/b2", "OK"),
        ]
    with as_("tenant", "team-a") as tenant, pytest.raises(PermissionDenied):
        tenant.list_audit_records()


def _audit_values(etcd_client: object, key_prefix: str) -> dict[bytes, bytes]:
    return {
        meta.key: value
        for value, meta in etcd_client.get_prefix(audit_prefix(key_prefix))  # type: ignore[attr-defined]
    }


def test_oversized_fields_with_and_without_credentials_cost_a_bounded_record_or_none(
    broker_factory: Callable[..., BrokerServer],
    pki: Pki,
    etcd_client: object,
    key_prefix: str,
    tmp_path: Path,
) -> None:
    """On a bearer-token broker, while another tenant's 60 calls are recorded: callers
    without a token send names of 3.9 KB, 700 KB and 1 MB, a tenant with one sends
    3.9 KB names. The anonymous calls write nothing (counted); the tenant's records hold
    the name's size and digest, never the name; every one of the other tenant's 60
    records is written; the audit log grows by at most the bound per record."""
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        f"{TENANT_A}: tenant/team-a\n{TENANT_B}: tenant/team-b\n{OPERATOR}: operator/o\n"
    )
    tokens.chmod(0o600)
    broker = broker_factory(
        tls=ServerTls(pki.path("server"), pki.path("server", "key")), token_file=tokens
    )

    credentials = grpc.ssl_channel_credentials(pki.path("ca").read_bytes())
    # One connection, shared by every caller's threads; raw stubs, since dxpool.client
    # would refuse the bad names itself before sending them.
    channel = grpc.secure_channel(
        broker.endpoint, credentials, options=[("grpc.max_send_message_length", -1)]
    )
    stub = nodes_pb2_grpc.NodeServiceStub(channel)
    before = _audit_values(etcd_client, key_prefix)
    unauthenticated_before = _refused("NodeService.ReleaseNode", "UNAUTHENTICATED", "none")
    long_name = "nodes/" + "n" * 3900  # within ReleaseNode's 4 KiB, not a node name
    sizes = ("nodes/" + "n" * 700_000, "nodes/" + "n" * 1_000_000, long_name)
    errors: list[str] = []

    def call(token: str | None, name: str, expected: grpc.StatusCode) -> None:
        metadata = [("authorization", f"Bearer {token}")] if token else []
        try:
            stub.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=name), metadata=metadata,
                             timeout=60)  # fmt: skip
            errors.append(f"{name[:20]} went through")
        except grpc.RpcError as error:
            if error.code() != expected:  # type: ignore[attr-defined]
                errors.append(f"{name[:20]}: {error.code()} {error.details()}")  # type: ignore[attr-defined]

    threads = [
        threading.Thread(
            target=call, args=(TENANT_B, f"nodes/missing-{i}", grpc.StatusCode.NOT_FOUND)
        )
        for i in range(60)
    ]
    for _ in range(3):
        for name in sizes:
            expected = (
                grpc.StatusCode.UNAUTHENTICATED if name is long_name
                else grpc.StatusCode.RESOURCE_EXHAUSTED
            )  # fmt: skip
            threads.append(threading.Thread(target=call, args=(None, name, expected)))
        threads.append(
            threading.Thread(
                target=call, args=(TENANT_A, long_name, grpc.StatusCode.INVALID_ARGUMENT)
            )
        )
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        channel.close()
    assert not errors, errors[:3]

    added = {k: v for k, v in _audit_values(etcd_client, key_prefix).items() if k not in before}
    records = [audit_pb2.AuditRecord.FromString(value) for value in added.values()]
    by_identity = Counter(r.identity for r in records)
    assert by_identity == {"dxpool://tenant/team-b": 60, "dxpool://tenant/team-a": 3}
    assert sorted(r.target for r in records if r.identity.endswith("team-b")) == sorted(
        f"nodes/missing-{i}" for i in range(60)
    )
    digest = hashlib.sha256(long_name.encode()).hexdigest()
    for record in (r for r in records if r.identity.endswith("team-a")):
        assert record.code == "INVALID_ARGUMENT" and record.target == ""
        assert [(f.field, f.size, f.sha256) for f in record.rejected_fields] == [
            ("target", len(long_name), digest)
        ]
        assert "n" * 100 not in record.message  # the broker echoes an excerpt at most
    assert all(len(value) <= MAX_RECORD_BYTES for value in added.values())
    assert sum(len(value) for value in added.values()) <= 63 * MAX_RECORD_BYTES
    # the 3.9 KB ones; larger ones are refused before any interceptor but the size guard
    assert _refused("NodeService.ReleaseNode", "UNAUTHENTICATED", "none") == (
        unauthenticated_before + 3
    )


def test_records_older_than_the_retention_are_pruned(etcd_server: object, key_prefix: str) -> None:
    now = [1_000 * 10**9]
    client = connect(etcd_server.endpoint)  # type: ignore[attr-defined]
    try:
        audit = AuditLog(client, key_prefix, retention_s=60, clock_ns=lambda: now[0])
        audit.write(audit_pb2.AuditRecord(rpc="NodeService.ComposeNode", target="nodes/old"))
        now[0] += 61 * 10**9
        audit.write(audit_pb2.AuditRecord(rpc="NodeService.ComposeNode", target="nodes/new"))
        audit.prune()
        kept = audit.list(audit_pb2.ListAuditRecordsRequest())
        assert [r.target for r in kept.records] == ["nodes/new"]
        assert all(
            meta.key.decode().startswith(audit_prefix(key_prefix))
            for _, meta in client.get_prefix(audit_prefix(key_prefix))
        )
    finally:
        client.close()


def test_cli_audit_filters_by_node(broker: BrokerServer, pool_client: Client) -> None:
    pool_client.create_box("box1", gpus=4, model="H100", memory_mib=81920,
                           location=("s1", "p1", "r1"))  # fmt: skip
    wait_until(lambda: any(h.alive for h in pool_client.list_hosts()), 20, message="h1 alive")
    pool_client.compose_node("H100:1", node_id="n1")
    result = CliRunner().invoke(cli, ["--endpoint", broker.endpoint, "audit", "--node", "n1",
                                      "--since", "10m", "-o", "name"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "NodeService.ComposeNode nodes/n1"


def test_cli_audit_shows_a_rejected_name_by_size_and_digest(broker: BrokerServer) -> None:
    name = "nodes/" + "N" * 3000
    channel = grpc.insecure_channel(broker.endpoint)
    try:
        with pytest.raises(grpc.RpcError):
            nodes_pb2_grpc.NodeServiceStub(channel).ReleaseNode(
                nodes_pb2.ReleaseNodeRequest(name=name), timeout=30
            )
    finally:
        channel.close()
    digest = hashlib.sha256(name.encode()).hexdigest()
    result = CliRunner().invoke(cli, ["--endpoint", broker.endpoint, "audit", "-o", "wide"])
    assert result.exit_code == 0, result.output
    assert f"(3006 bytes, sha256 {digest[:12]})" in result.output
    assert f"target:3006B:{digest[:12]}" in result.output
    assert "NNNNNNNNNN" * 10 not in result.output


class _HeldEtcd:
    """An etcd client whose first put waits for ``release``; counts puts and txns."""

    def __init__(self, client: object) -> None:
        self._client = client
        self.entered = threading.Event()
        self.release = threading.Event()
        self.puts = 0
        self.txns: list[int] = []

    def put(self, key: str, value: bytes) -> object:
        self.puts += 1
        if self.puts == 1:
            self.entered.set()
            assert self.release.wait(patient(10))
        return self._client.put(key, value)  # type: ignore[attr-defined]

    def transaction(
        self, compare: list[object], success: list[object], failure: list[object]
    ) -> object:
        self.txns.append(len(success))
        return self._client.transaction(compare=compare, success=success, failure=failure)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)


def test_records_written_during_a_write_go_to_etcd_together(
    etcd_server: object, key_prefix: str
) -> None:
    """While one write is held inside etcd, three more callers wait; once it returns,
    their records go in one transaction, and every call returns with its record stored."""
    import threading

    client = connect(etcd_server.endpoint)  # type: ignore[attr-defined]
    held = _HeldEtcd(client)
    audit = AuditLog(held, key_prefix)  # type: ignore[arg-type]
    try:
        first = threading.Thread(
            target=audit.write, args=(audit_pb2.AuditRecord(target="nodes/first"),)
        )
        first.start()
        assert held.entered.wait(patient(10))
        later = [
            threading.Thread(
                target=audit.write, args=(audit_pb2.AuditRecord(target=f"nodes/later-{i}"),)
            )
            for i in range(3)
        ]
        for thread in later:
            thread.start()
        wait_until(lambda: len(audit._open.records) == 3, message="three callers waiting")
        assert all(thread.is_alive() for thread in later)  # not stored yet: not returned
        held.release.set()
        for thread in [first, *later]:
            thread.join(10)
            assert not thread.is_alive()
        assert held.puts == 1 and held.txns == [3]
        stored = audit.list(audit_pb2.ListAuditRecordsRequest())
        assert sorted(r.target for r in stored.records) == [
            "nodes/first",
            "nodes/later-0",
            "nodes/later-1",
            "nodes/later-2",
        ]
    finally:
        held.release.set()
        client.close()


def test_a_failed_group_write_fails_every_caller_in_it(
    etcd_server: object, key_prefix: str
) -> None:
    client = connect(etcd_server.endpoint)  # type: ignore[attr-defined]

    class Failing:
        def put(self, key: str, value: bytes) -> None:
            raise ConnectionError("etcd away")

    audit = AuditLog(Failing(), key_prefix)  # type: ignore[arg-type]
    try:
        with pytest.raises(ConnectionError):
            audit.write(audit_pb2.AuditRecord(target="nodes/lost"))
        assert not audit._writing  # the next write is not left waiting
    finally:
        client.close()


class _OneBadRecord:
    """An etcd client whose writes attach the record of ``bad_target`` to a lease that
    does not exist, so etcd itself refuses any request carrying it (NOT_FOUND,
    "requested lease not found"), as it would a record it cannot take."""

    def __init__(self, client: object, bad_target: str) -> None:
        self._client = client
        self._bad = bad_target.encode()

    def _lease(self, value: bytes) -> int:
        return 0x7FFF_FFFF if self._bad in value else 0

    def put(self, key: str, value: bytes) -> object:
        return self._client.put(key, value, lease=self._lease(value) or None)  # type: ignore[attr-defined]

    def transaction(
        self, compare: list[object], success: list[object], failure: list[object]
    ) -> object:
        put = self._client.transactions.put  # type: ignore[attr-defined]
        ops = [put(op.key, op.value, lease=self._lease(op.value) or None) for op in success]  # type: ignore[attr-defined]
        return self._client.transaction(compare=compare, success=ops, failure=failure)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)


def test_a_record_etcd_refuses_costs_no_other_call_its_record(
    etcd_server: object, key_prefix: str
) -> None:
    """Records of concurrent calls go to etcd in one transaction; when etcd refuses that
    transaction because of one record, every other record is still written and only the
    call of the refused one sees the error."""
    client = connect(etcd_server.endpoint)  # type: ignore[attr-defined]
    held = _HeldEtcd(_OneBadRecord(client, "nodes/bad"))
    audit = AuditLog(held, key_prefix)  # type: ignore[arg-type]
    outcomes: dict[str, str] = {}

    def write(target: str) -> None:
        try:
            audit.write(audit_pb2.AuditRecord(rpc="NodeService.ReleaseNode", target=target))
            outcomes[target] = "stored"
        except Exception as error:
            outcomes[target] = type(error).__name__

    try:
        first = threading.Thread(target=write, args=("nodes/first",))
        first.start()
        assert held.entered.wait(10)
        targets = ["nodes/bad", *(f"nodes/n{i}" for i in range(20))]
        later = [threading.Thread(target=write, args=(t,)) for t in targets]
        for thread in later:
            thread.start()
        wait_until(lambda: len(audit._open.records) == len(targets), message="all waiting")
        held.release.set()
        for thread in [first, *later]:
            thread.join(20)
        assert held.txns == [len(targets)]  # they went together, and etcd refused that
        assert outcomes.pop("nodes/bad") != "stored"
        assert set(outcomes.values()) == {"stored"} and len(outcomes) == 21
        stored = audit.list(audit_pb2.ListAuditRecordsRequest(page_size=100))
        assert sorted(r.target for r in stored.records) == sorted(outcomes)
    finally:
        held.release.set()
        client.close()


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [(2**62, 0), (-(2**62), 0), (253_402_300_800, 0), (0, -1), (0, 1_000_000_000), (-1, 0)],
)
def test_an_out_of_range_since_is_invalid_argument(
    broker: BrokerServer, seconds: int, nanos: int
) -> None:
    channel = grpc.insecure_channel(broker.endpoint)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            audit_pb2_grpc.AuditServiceStub(channel).ListAuditRecords(
                audit_pb2.ListAuditRecordsRequest(
                    since=timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
                ),
                timeout=30,
            )
    finally:
        channel.close()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "give a time" in refused.value.details()  # type: ignore[attr-defined]


def test_the_latest_since_a_timestamp_holds_finds_nothing(pool_client: Client) -> None:
    pool_client.create_box("box1", gpus=1, model="H100", memory_mib=1)
    latest = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)
    assert _records(pool_client, since=latest) == []  # type: ignore[arg-type]
    assert len(_records(pool_client)) == 1


def test_a_composes_record_commits_in_the_nodes_own_transaction(
    pool_client: Client,
    etcd_client,  # type: ignore[no-untyped-def]
    key_prefix: str,
) -> None:
    """A successful ComposeNode's record is stored by the transaction that creates the
    node (same etcd revision), and only once; a refused compose is recorded after it; a
    release's record commits with the release, a repeated release is recorded after."""
    from dxpool.errors import ResourceExhausted
    from dxpool.store.keys import KeySchema

    client = pool_client
    client.create_box("box1", gpus=4, model="H100", memory_mib=81920,
                      location=("s1", "p1", "r1"))  # fmt: skip
    wait_until(lambda: any(h.alive for h in client.list_hosts()), 20, message="h1 alive")
    client.compose_node("H100:1", node_id="n1")
    with pytest.raises(ResourceExhausted):
        client.compose_node("H100:64", node_id="big")
    client.compose_node("H100:1", node_id="n2")
    released = client.release_node("n2")
    client.release_node("n2")  # already releasing: nothing committed, recorded after
    stored = {}
    for value, meta in etcd_client.get_prefix(audit_prefix(key_prefix)):
        record = audit_pb2.AuditRecord.FromString(value)
        stored.setdefault(record.target, []).append((record, meta.mod_revision))
    (composed,) = stored["nodes/n1"]
    _, node_meta = etcd_client.get(KeySchema(key_prefix).node("n1"))
    assert composed[0].code == "OK" and composed[1] == node_meta.create_revision
    (refused,) = stored["nodes/big"]
    assert refused[0].code == "RESOURCE_EXHAUSTED"
    composed_n2, release, again = sorted(stored["nodes/n2"], key=lambda item: item[1])
    assert [r.rpc for r, _ in (composed_n2, release, again)] == [
        "NodeService.ComposeNode",
        "NodeService.ReleaseNode",
        "NodeService.ReleaseNode",
    ]
    # the node as the release's own revision wrote it: RELEASING, written right then
    (kv,) = etcd_client.get_response(KeySchema(key_prefix).node("n2"), revision=release[1]).kvs
    assert kv.mod_revision == release[1]
    assert pb.VirtualNode.FromString(kv.value).state == pb.NODE_STATE_RELEASING
    assert released.name == "nodes/n2" and again[0].code == "OK"


def test_a_transaction_outside_an_audited_call_gets_no_record() -> None:
    from dxpool.broker.state.audit_commit import CURRENT, PendingRecord, record_in
    from dxpool.store.typed import Txn

    txn = Txn()
    assert record_in(txn, None) is None and txn.writes == []
    pending = PendingRecord(lambda answer: ("/audit/k", b"r"))
    opened = CURRENT.set(pending)
    try:
        stored = record_in(txn, None)
        assert stored is not None and txn.writes == [("/audit/k", b"r")]
        assert not pending.committed  # not until the transaction committed
        stored()
        assert pending.committed
        assert record_in(Txn(), None) is None  # once stored, never again
    finally:
        CURRENT.reset(opened)
