"""Roles and identities: who may call what, and tenants kept to their own nodes.

Brokers here run with mutual TLS (the session PKI's CA), or with server TLS and a token
file. Every denial is checked to leave etcd byte for byte unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from dxpool.api.v1 import audit_pb2, nodes_pb2, resources_pb2
from dxpool.broker.api.auth import GUARDED_PREFIXES, RULES, TokenTable
from dxpool.broker.api.server import BrokerServer
from dxpool.client import Client
from dxpool.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from dxpool.fabric.sim import SimGpuSpec
from dxpool.identity import Identity, Role
from dxpool.tls import ClientTls, ServerTls
from tests.conftest import Pki, SimPool, pool_records, wait_until

TENANT_A_TOKEN = "token-for-team-a-0123456789abcdef"
BAD_TOKEN = "token-nobody-was-given-0123456789"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"{TENANT_A_TOKEN}: tenant/team-a\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def secure_broker(broker_factory: Callable[..., BrokerServer], pki: Pki) -> BrokerServer:
    tls = ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca"))
    return broker_factory(tls=tls)


@pytest.fixture
def token_broker(
    broker_factory: Callable[..., BrokerServer], pki: Pki, token_file: Path
) -> BrokerServer:
    tls = ServerTls(pki.path("server"), pki.path("server", "key"))
    return broker_factory(tls=tls, token_file=token_file)


@pytest.fixture
def connect(secure_broker: BrokerServer, pki: Pki) -> Iterator[Callable[..., Client]]:
    """``connect("tenant", "team-b")`` is a client of the mTLS broker with that
    identity's certificate."""
    opened: list[Client] = []

    def open_client(role: str, name: str) -> Client:
        stem = pki.client_identity(role, name)
        tls = ClientTls(pki.path("ca"), pki.path(stem), pki.path(stem, "key"))
        client = Client(secure_broker.endpoint, tls=tls, max_attempts=1)
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


@pytest.fixture
def pool(connect: Callable[..., Client], sim_pool: SimPool, pki: Pki) -> SimPool:
    """One live host (h1) and one box of four GPUs, registered by an operator."""
    operator = connect("operator", "alice")
    sim_pool.fabric.add_box("box1", [SimGpuSpec("H100", 81920)] * 4)
    operator.create_box("box1", gpus=4, model="H100", memory_mib=81920, location=("s1", "p1", "r1"))
    sim_pool.start_agent("h1", extra=pki.agent_args("h1"))
    wait_until(lambda: any(h.alive for h in operator.list_hosts()), 20, message="h1 alive")
    return sim_pool


def test_every_rpc_of_every_service_has_exactly_one_rule() -> None:
    from dxpool.api.v1 import fabric_pb2 as fabric
    from dxpool.api.v1 import inventory_pb2 as inventory
    from dxpool.api.v1 import nodes_pb2 as nodes

    methods = {
        f"/{service.full_name}/{method.name}"
        for module in (inventory, nodes, fabric, audit_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert set(RULES) == methods
    assert all(method.startswith(GUARDED_PREFIXES) for method in methods)


def test_operator_may_manage_the_inventory(connect: Callable[..., Client]) -> None:
    operator = connect("operator", "alice")
    operator.create_box("box9", gpus=2, model="H100", memory_mib=1024)
    operator.cordon_box("box9", reason="maintenance")
    assert [b.name for b in operator.list_boxes()] == ["boxes/box9"]


@pytest.mark.parametrize(
    ("role", "call", "needed"),
    [
        ("tenant", lambda c: c.create_box("b2", gpus=1, model="H100", memory_mib=1), "operator"),
        ("tenant", lambda c: c.cordon_box("box1"), "operator"),
        ("tenant", lambda c: c.reclaim_gpu("box1/0"), "operator"),
        ("tenant", lambda c: c.list_boxes(), "operator"),
        ("agent", lambda c: c.compose_node("H100:1"), "operator or tenant"),
        ("agent", lambda c: c.release_node("n1"), "operator or tenant"),
        ("agent", lambda c: c.delete_box("box1"), "operator"),
        ("tenant", lambda c: c.set_tenant_quota("team-a", gpus=100), "operator"),
        ("tenant", lambda c: c.list_tenants(), "operator"),
        ("agent", lambda c: c.set_tenant_quota("team-a", gpus=1), "operator"),
        ("agent", lambda c: c.get_tenant("team-a"), "operator or tenant"),
        ("tenant", lambda c: c.delete_tenant("team-a"), "operator"),
        ("agent", lambda c: c.delete_tenant("team-a"), "operator"),
    ],
)
def test_wrong_role_is_permission_denied_and_changes_nothing(
    connect: Callable[..., Client],
    pool: SimPool,
    etcd_client: object,
    key_prefix: str,
    role: str,
    call: Callable[[Client], object],
    needed: str,
) -> None:
    caller = connect(role, "h1" if role == "agent" else "team-a")
    before = pool_records(etcd_client, key_prefix)
    with pytest.raises(PermissionDenied) as denied:
        call(caller)
    assert f"needs the role {needed}" in denied.value.message
    assert f"has the role {role}" in denied.value.message
    assert denied.value.reason == "ROLE_NOT_ALLOWED"
    assert pool_records(etcd_client, key_prefix) == before


def test_an_agent_may_read_its_own_host_only(connect: Callable[..., Client], pool: SimPool) -> None:
    assert connect("agent", "h1").get_host("h1").name == "hosts/h1"
    with pytest.raises(PermissionDenied, match="only name its own host hosts/h2"):
        connect("agent", "h2").get_host("h1")
    assert connect("agent", "h1").get_latency("h1", "box1").round_trip_ns > 0
    with pytest.raises(PermissionDenied, match="its own host"):
        connect("agent", "h2").get_latency("h1", "box1")


def test_tenants_see_and_release_only_their_own_nodes(
    connect: Callable[..., Client], pool: SimPool, etcd_client: object, key_prefix: str
) -> None:
    team_a, team_b = connect("tenant", "team-a"), connect("tenant", "team-b")
    operator = connect("operator", "alice")
    node = team_a.compose_node("H100:1", node_id="a1")
    assert node.owner == "dxpool://tenant/team-a"
    assert [n.name for n in team_a.list_nodes()] == ["nodes/a1"]
    assert team_b.list_nodes() == []
    assert [n.name for n in operator.list_nodes()] == ["nodes/a1"]
    team_a.wait_for_node("a1", timeout_s=20)  # the agent is done writing
    before = pool_records(etcd_client, key_prefix)
    with pytest.raises(NotFound, match="node nodes/a1 does not exist"):
        team_b.get_node("a1")
    with pytest.raises(NotFound):
        team_b.release_node("a1")
    with pytest.raises(NotFound):
        next(iter(team_b.watch_nodes("a1", timeout_s=5)))
    assert pool_records(etcd_client, key_prefix) == before
    # B's watch of everything shows B's own node, never A's.
    b_node = team_b.compose_node("H100:1", node_id="b1")
    events = team_b.watch_nodes(timeout_s=5)
    names = {e.node.name for e in itertools.islice(events, 1)}
    assert names == {b_node.name}
    assert team_a.release_node("a1").state in (
        resources_pb2.NODE_STATE_RELEASING,
        resources_pb2.NODE_STATE_RELEASED,
    )


def test_watch_of_everything_skips_other_tenants_events() -> None:
    from dxpool.broker.api.node_service import _owned_events

    def event(kind: int, name: str, owner: str = "") -> nodes_pb2.NodeEvent:
        return nodes_pb2.NodeEvent(
            type=kind, node=resources_pb2.VirtualNode(name=name, owner=owner)
        )

    event_type = nodes_pb2.NodeEvent
    mine, theirs = "dxpool://tenant/a", "dxpool://tenant/b"
    stream = [
        event(event_type.TYPE_EXISTING, "nodes/1", mine),
        event(event_type.TYPE_CHANGED, "nodes/2", theirs),
        event(event_type.TYPE_SYNCED, ""),
        event(event_type.TYPE_DELETED, "nodes/2"),
        event(event_type.TYPE_DELETED, "nodes/1"),
    ]
    kept = [(e.type, e.node.name) for e in _owned_events(iter(stream), mine)]
    assert kept == [
        (event_type.TYPE_EXISTING, "nodes/1"),
        (event_type.TYPE_SYNCED, ""),
        (event_type.TYPE_DELETED, "nodes/1"),
    ]


def test_a_tenant_may_not_force_release(
    connect: Callable[..., Client], pool: SimPool, etcd_client: object, key_prefix: str
) -> None:
    team_a = connect("tenant", "team-a")
    team_a.compose_node("H100:1", node_id="a1")
    team_a.wait_for_node("a1", timeout_s=20)  # the agent is done writing
    before = pool_records(etcd_client, key_prefix)
    with pytest.raises(PermissionDenied, match="force release needs the role operator"):
        team_a.release_node("a1", force=True)
    assert pool_records(etcd_client, key_prefix) == before
    assert connect("operator", "alice").release_node("a1", force=True).name == "nodes/a1"


def test_a_request_id_is_its_owners_own(connect: Callable[..., Client], pool: SimPool) -> None:
    connect("tenant", "team-a").compose_node("H100:1", request_id="req-1")
    with pytest.raises(Exception) as reused:
        connect("tenant", "team-b").compose_node("H100:1", request_id="req-1")
    assert "already used by another caller" in str(reused.value)
    assert "nodes/" not in str(reused.value)


def _token_client(broker: BrokerServer, pki: Pki, token: str | None) -> Client:
    return Client(broker.endpoint, tls=ClientTls(ca=pki.path("ca")), token=token, max_attempts=1)


def test_bearer_token_authenticates_as_its_identity(
    token_broker: BrokerServer, pki: Pki, sim_pool: SimPool
) -> None:
    with _token_client(token_broker, pki, TENANT_A_TOKEN) as orchestrator:
        assert orchestrator.list_nodes() == []
        with pytest.raises(PermissionDenied, match="ListBoxes needs the role operator"):
            orchestrator.list_boxes()


def test_unknown_token_is_unauthenticated(
    token_broker: BrokerServer, pki: Pki, etcd_client: object, key_prefix: str
) -> None:
    before = pool_records(etcd_client, key_prefix)
    with (
        _token_client(token_broker, pki, BAD_TOKEN) as client,
        pytest.raises(Unauthenticated, match="bearer token is not known"),
    ):
        client.compose_node("H100:1")
    assert pool_records(etcd_client, key_prefix) == before


def test_no_token_is_unauthenticated(token_broker: BrokerServer, pki: Pki) -> None:
    with (
        _token_client(token_broker, pki, None) as client,
        pytest.raises(Unauthenticated, match="connect with a bearer token"),
    ):
        client.list_nodes()


def test_health_needs_no_identity(token_broker: BrokerServer, pki: Pki) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    credentials = grpc.ssl_channel_credentials(pki.path("ca").read_bytes())
    with grpc.secure_channel(token_broker.endpoint, credentials) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tokens_with_a_client_ca_are_refused(
    broker_factory: Callable[..., BrokerServer], pki: Pki, token_file: Path
) -> None:
    tls = ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca"))
    with pytest.raises(InvalidArgument, match="not both"):
        broker_factory(tls=tls, token_file=token_file)


def test_tokens_without_tls_are_refused(
    broker_factory: Callable[..., BrokerServer], token_file: Path
) -> None:
    with pytest.raises(InvalidArgument, match="bearer tokens need TLS"):
        broker_factory(token_file=token_file)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("short: tenant/a\n", "16 characters or more"),
        (f"{TENANT_A_TOKEN}: root/a\n", "unknown role 'root'"),
        ("- a list\n", "must map tokens to identities"),
    ],
)
def test_bad_token_files_say_what_to_fix(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(InvalidArgument, match=expected):
        TokenTable.load(path)


def test_a_token_file_others_may_read_is_refused(token_file: Path) -> None:
    token_file.chmod(0o640)
    with pytest.raises(InvalidArgument, match=r"mode 0640.*chmod 600") as refused:
        TokenTable.load(token_file)
    assert refused.value.reason == "INVALID_TOKEN_FILE"


def test_token_lookup_finds_the_identity_of_an_exact_match_only(token_file: Path) -> None:
    table = TokenTable.load(token_file)
    assert table.lookup(TENANT_A_TOKEN) == Identity(Role.TENANT, "team-a")
    assert table.lookup(TENANT_A_TOKEN[:-1]) is None
    assert table.lookup(TENANT_A_TOKEN + "x") is None


def test_a_certificate_without_exactly_one_dxpool_identity_is_refused(pki: Pki) -> None:
    from dxpool.broker.api.auth import _certificate_identity

    # gRPC refuses a server-only certificate as a client's at the handshake; what the
    # authenticator says of a certificate with no identity is checked on its own.
    found = _certificate_identity(pki.path("server").read_bytes())
    assert isinstance(found, str)
    assert "carries 0 dxpool identities" in found
    assert _certificate_identity(pki.path("operator-alice").read_bytes()) == Identity(
        Role.OPERATOR, "alice"
    )


def _race(callers: dict[str, Client], request_id: str) -> dict[str, object]:
    """Both callers compose at once with ``request_id``; each one's node or error."""
    import threading

    barrier = threading.Barrier(len(callers))
    outcomes: dict[str, object] = {}

    def compose(team: str) -> None:
        barrier.wait()
        try:
            outcomes[team] = callers[team].compose_node("H100:1", request_id=request_id)
        except Exception as error:
            outcomes[team] = error

    threads = [threading.Thread(target=compose, args=(team,)) for team in callers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcomes


def test_two_tenants_racing_on_one_request_id_never_share_a_node(
    connect: Callable[..., Client], pool: SimPool
) -> None:
    """Both composes start together with the same request id: one makes the node; the
    other learns the id is taken (from the cache, or from the compose transaction's
    compare on the request key) and never gets the winner's node."""
    callers = {"team-a": connect("tenant", "team-a"), "team-b": connect("tenant", "team-b")}
    for round_ in range(4):
        outcomes = _race(callers, f"race-{round_}")
        winners = {t: o for t, o in outcomes.items() if isinstance(o, resources_pb2.VirtualNode)}
        losers = {t: o for t, o in outcomes.items() if t not in winners}
        assert len(winners) == 1 and len(losers) == 1, outcomes
        ((winner, node),) = winners.items()
        assert isinstance(node, resources_pb2.VirtualNode)
        assert node.owner == f"dxpool://tenant/{winner}"
        ((_, error),) = losers.items()
        assert "already used by another caller" in str(error)
        callers[winner].release_node(node.name)
        # Its GPU returns to the pool once the agent reports it scrubbed: wait, so the
        # next round's loser meets the taken request id, not an empty pool.
        callers[winner].wait_for_node(node.name, until=["RELEASED"], timeout_s=30)


def test_a_tenant_is_charged_for_its_own_nodes_only(
    connect: Callable[..., Client], pool: SimPool, etcd_client: object, key_prefix: str
) -> None:
    team_a, team_b = connect("tenant", "team-a"), connect("tenant", "team-b")
    operator = connect("operator", "alice")
    operator.set_tenant_quota("team-a", gpus=1)
    # A tenant's node is charged to it whatever the request leaves out...
    node = team_a.compose_node("H100:1", node_id="a1")
    assert node.spec.tenant == "team-a" and node.charged
    assert team_a.get_tenant("team-a").usage.gpus == 1
    team_a.wait_for_node("a1", timeout_s=20)  # the agent is done writing
    before = pool_records(etcd_client, key_prefix)
    # ... so its quota holds, and naming another tenant is refused.
    with pytest.raises(ResourceExhausted) as over:
        team_a.compose_node("H100:1")
    assert over.value.reason == "QUOTA_EXCEEDED"
    for call in (
        lambda: team_a.compose_node("H100:1", tenant="team-b"),
        lambda: team_a.plan_node("H100:1", tenant="team-b"),
        lambda: team_a.get_tenant("team-b"),
        lambda: team_b.get_tenant("team-a"),
    ):
        with pytest.raises(PermissionDenied) as denied:
            call()
        assert denied.value.reason == "NOT_OWN_TENANT"
        assert "may only name its own tenant" in denied.value.message
    assert pool_records(etcd_client, key_prefix) == before
    # An operator may charge a node to a tenant, and sees every tenant.
    on_behalf = operator.compose_node("H100:1", tenant="team-b")
    assert on_behalf.spec.tenant == "team-b" and on_behalf.charged
    assert team_b.get_tenant("team-b").usage.nodes == 1
    assert [t.name for t in operator.list_tenants()] == ["tenants/team-a", "tenants/team-b"]
    # Releasing the node gives the quota back.
    team_a.release_node("a1")
    assert team_a.get_tenant("team-a").usage == resources_pb2.TenantUsage()


def test_tenants_compose_and_resize_their_own_gangs_and_nodes_only(
    connect: Callable[..., Client], pool: SimPool, etcd_client: object, key_prefix: str
) -> None:
    team_a, team_b = connect("tenant", "team-a"), connect("tenant", "team-b")
    gang = team_a.compose_gang("H100:1", 2, gang_id="ga")
    assert {n.owner for n in gang.nodes} == {"dxpool://tenant/team-a"}
    # Its members are charged to it whatever the request leaves out, and naming another
    # tenant is refused.
    assert all(n.spec.tenant == "team-a" and n.charged for n in gang.nodes)
    assert team_a.get_tenant("team-a").usage.nodes == 2
    with pytest.raises(PermissionDenied) as other_tenant:
        team_a.compose_gang("H100:1", 1, tenant="team-b")
    assert other_tenant.value.reason == "NOT_OWN_TENANT"
    team_a.wait_for_gang("ga", timeout_s=20)
    grown = team_a.resize_node("ga-0", 2)
    assert grown.state == resources_pb2.NODE_STATE_RESIZING
    team_a.wait_for_node("ga-0", timeout_s=20)
    before = pool_records(etcd_client, key_prefix)
    with pytest.raises(NotFound):
        team_b.get_gang("ga")
    with pytest.raises(NotFound):
        team_b.release_gang("ga")
    with pytest.raises(NotFound):
        team_b.resize_node("ga-0", 1)
    with pytest.raises(PermissionDenied, match="force release needs the role operator"):
        team_a.release_gang("ga", force=True)
    assert pool_records(etcd_client, key_prefix) == before
    released = team_a.release_gang("ga")
    assert [n.state for n in released.nodes] == [resources_pb2.NODE_STATE_RELEASING] * 2
