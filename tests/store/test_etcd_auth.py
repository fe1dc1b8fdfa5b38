"""etcd users and roles for a pool, against a real etcd serving TLS with client-certificate
auth and authentication on: the broker's grants, a host's certificate holding no etcd
user, idempotent setup that removes the agent users of older versions, and a broker
working through its user for an agent that has none.

etcd's users stop a certificate from reading and writing keys, not from renewing leases
or compacting (etcd checks no permission for those): that is why etcd should trust a CA
of its own that signs no host's certificate (``dxpool up`` does; see
``tests/cli/test_up.py``), so a host never gets past the TLS handshake."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from etcd3 import etcdrpc

from dxpool.api.v1 import resources_pb2
from dxpool.errors import FailedPrecondition, PermissionDenied
from dxpool.etcd_users import BROKER_USER, ROOT_USER, agent_user
from dxpool.identity import Identity, Role
from dxpool.pki import issue, load_pair, write_pair
from dxpool.store.client import EtcdAddress, channel, connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.etcd_auth import (
    Access,
    EtcdAuth,
    Grant,
    PoolUsers,
    broker_grants,
    setup_pool,
)
from dxpool.store.keys import KeySchema
from dxpool.tls import ClientTls, ServerTls
from tests.conftest import Pki, SimPool, wait_until

PREFIX = "/dxpool/v1/"
KEYS = KeySchema(PREFIX)


@pytest.fixture(scope="module")
def certs(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Certificates of the module's etcd users, signed by the suite's CA: root, the
    broker, agents h1, h2 and h10 (issued as ``dxpool certs`` does), and an operator."""
    root = tmp_path_factory.mktemp("etcd-users")
    ca = load_pair(pki.root, "ca")
    write_pair(root, "ca", ca)
    write_pair(root, "root", issue(ca, common_name=ROOT_USER, client_auth=True))
    write_pair(
        root,
        "broker",
        issue(ca, common_name=BROKER_USER, dns_names=["localhost"], client_auth=True),
    )
    for host in ("h1", "h2", "h10"):
        write_pair(root, f"agent-{host}", issue(ca, identity=Identity(Role.AGENT, host)))
    write_pair(root, "operator", issue(ca, identity=Identity(Role.OPERATOR, "alice")))
    return root


def tls(certs: Path, name: str) -> ClientTls:
    return ClientTls(certs / "ca.crt", certs / f"{name}.crt", certs / f"{name}.key")


@pytest.fixture(scope="module")
def auth_etcd(
    pki: Pki, certs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedEtcd]:
    """etcd with TLS, client-certificate auth and authentication on, the broker set up."""
    server = EmbeddedEtcd(
        tmp_path_factory.mktemp("auth-etcd"),
        unsafe_no_fsync=True,
        tls=ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca")),
        client_tls=tls(certs, "root"),
    )
    with server:
        with EtcdAuth(server.address) as auth:
            assert setup_pool(auth, KEYS) == PoolUsers([BROKER_USER], [])
        yield server


def address(etcd: EmbeddedEtcd, certs: Path, name: str) -> EtcdAddress:
    return EtcdAddress(etcd.host, etcd.client_port, tls(certs, name))


@pytest.fixture
def agent_h1(auth_etcd: EmbeddedEtcd, certs: Path) -> Iterator[object]:
    client = connect([address(auth_etcd, certs, "agent-h1")], timeout_s=3)
    yield client
    client.close()


def denied(call: object) -> None:
    """``call()`` is refused by etcd itself with PERMISSION_DENIED."""
    with pytest.raises(grpc.RpcError) as refused:
        call()  # type: ignore[operator]
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value


def test_the_certificates_name_their_etcd_users(certs: Path) -> None:
    from cryptography.x509.oid import NameOID

    def common_name(name: str) -> str:
        cert = load_pair(certs, name).cert
        return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)

    assert common_name("agent-h1") == "dxpool://agent/h1"  # no etcd user
    assert common_name("broker") == "dxpool-broker"
    assert common_name("root") == "root"


@pytest.mark.parametrize(
    "key",
    [
        KEYS.host("h1"),
        KEYS.host_lease("h1"),
        KEYS.host_status("h1"),
        KEYS.host_status("h2"),
        KEYS.gpu("box1", 0),
        KEYS.node("n1"),
        KEYS.election("duties"),
        KEYS.audit_prefix + "x",
        "/elsewhere",
    ],
)
def test_a_hosts_certificate_writes_nothing_not_even_its_own_keys(
    agent_h1: object, key: str
) -> None:
    denied(lambda: agent_h1.put(key, b"forged"))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "key", [KEYS.host_allocation("h1"), KEYS.host_allocation("h2"), KEYS.node("n1"), PREFIX]
)
def test_a_hosts_certificate_reads_nothing(agent_h1: object, key: str) -> None:
    denied(lambda: agent_h1.get(key))  # type: ignore[attr-defined]
    denied(lambda: agent_h1.get_prefix(KEYS.collection("hostalloc")))  # type: ignore[attr-defined]


def test_a_hosts_certificate_cannot_watch_the_pool(auth_etcd: EmbeddedEtcd, certs: Path) -> None:
    """A watch from the pool's prefix to the end of the key space (the range a wildcard
    grant would have let through) is refused."""
    everything = etcdrpc.WatchCreateRequest(key=PREFIX.encode(), range_end=b"\0")
    ch = channel(address(auth_etcd, certs, "agent-h1"))
    try:
        call = etcdrpc.WatchStub(ch).Watch(iter([etcdrpc.WatchRequest(create_request=everything)]))
        first = next(call)
        assert first.canceled and "permission denied" in first.cancel_reason
        call.cancel()
    finally:
        ch.close()


def test_the_broker_reads_and_writes_the_whole_pool_and_its_audit_log(
    auth_etcd: EmbeddedEtcd, certs: Path
) -> None:
    broker = connect([address(auth_etcd, certs, "broker")], timeout_s=3)
    try:
        for key in (
            KEYS.gpu("box1", 0),
            KEYS.node("n1"),
            KEYS.host_allocation("h1"),
            KEYS.host_status("h2"),
            KEYS.election("duties"),
            KEYS.audit_prefix + "0001",
        ):
            broker.put(key, b"x")
            assert broker.get(key)[0] == b"x"
        assert len(list(broker.get_prefix(PREFIX))) >= 5
        denied(lambda: broker.put("/elsewhere", b"x"))
    finally:
        broker.close()


def test_a_certificate_without_an_etcd_user_is_refused(
    auth_etcd: EmbeddedEtcd, certs: Path
) -> None:
    operator = connect([address(auth_etcd, certs, "operator")], timeout_s=3)
    try:
        denied(lambda: operator.get(KEYS.node("n1")))
    finally:
        operator.close()


def test_only_root_changes_users_and_roles(auth_etcd: EmbeddedEtcd, certs: Path) -> None:
    for name in ("agent-h1", "broker"):
        with (
            EtcdAuth(address(auth_etcd, certs, name)) as auth,
            pytest.raises(PermissionDenied, match="CN is 'root'"),
        ):
            setup_pool(auth, KEYS, enable=False)  # etcd itself refuses


def test_setup_is_idempotent_and_repairs_a_role_changed_by_hand(auth_etcd: EmbeddedEtcd) -> None:
    with EtcdAuth(auth_etcd.address) as auth:
        assert setup_pool(auth, KEYS) == PoolUsers([], [])
        # Someone widened the broker's role by hand: the next setup takes it back.
        auth.ensure_user(BROKER_USER, [*broker_grants(KEYS), Grant.prefix("/x/", Access.READ)])
        assert setup_pool(auth, KEYS) == PoolUsers([BROKER_USER], [])
        assert auth.role_grants(BROKER_USER) == tuple(sorted(broker_grants(KEYS)))
        assert auth.user_roles(BROKER_USER) == [BROKER_USER]
        assert auth.user_roles(ROOT_USER) == ["root"]


def test_users_have_no_password(auth_etcd: EmbeddedEtcd) -> None:
    ch = channel(auth_etcd.address)
    try:
        with pytest.raises(grpc.RpcError, match="no password user"):
            etcdrpc.AuthStub(ch).Authenticate(
                etcdrpc.AuthenticateRequest(name=BROKER_USER, password="")
            )
    finally:
        ch.close()


def test_setup_removes_the_agent_users_of_older_versions(auth_etcd: EmbeddedEtcd) -> None:
    with EtcdAuth(auth_etcd.address) as auth:
        stale = [Grant.one_key(KEYS.host_status("h2"), Access.READWRITE)]
        auth.ensure_user(agent_user("h2"), stale)  # as an older version made it
        assert setup_pool(auth, KEYS) == PoolUsers([], [agent_user("h2")])
        assert auth.view(agent_user("h2")) is None
        assert auth.role_grants(agent_user("h2")) is None
        assert setup_pool(auth, KEYS) == PoolUsers([], [])


def test_a_broker_composes_through_its_etcd_user_for_an_agent_without_one(
    auth_etcd: EmbeddedEtcd, certs: Path, tmp_path: Path
) -> None:
    from dxpool.broker.api.server import BrokerConfig, BrokerServer
    from dxpool.client import Client
    from dxpool.fabric.sim import SimFabric, SimGpuSpec

    root = connect([auth_etcd.address], timeout_s=3)
    root.delete_prefix(PREFIX)  # what other tests of the module wrote
    broker = BrokerServer(
        BrokerConfig(
            etcd_endpoints=auth_etcd.endpoint,
            key_prefix=PREFIX,
            listen="127.0.0.1:0",
            agent_listen="127.0.0.1:0",
            etcd_tls=tls(certs, "broker"),
            controller_sweep_s=0.2,
        )
    ).start()
    fabric = SimFabric.create(tmp_path / "fabric", boxes={}, hosts={})
    pool = SimPool(tmp_path, fabric, lambda: [broker.agent_endpoint])
    try:
        fabric.add_box("box1", [SimGpuSpec("H100", 81920)] * 2)
        agent = pool.start_agent("h1")
        with Client(broker.endpoint, insecure=True) as client:
            client.create_box(
                "box1", gpus=2, model="H100", memory_mib=81920, location=("s1", "p1", "r1")
            )
            wait_until(lambda: any(h.alive for h in client.list_hosts()), 30, message="h1")
            node = client.wait_for_node(client.compose_node("H100:2").name, timeout_s=30)
            assert node.state == resources_pb2.NODE_STATE_READY
            status = resources_pb2.HostStatus.FromString(root.get(KEYS.host_status("h1"))[0])
            assert {a.gpu for a in status.attachments} == {"boxes/box1/gpus/0", "boxes/box1/gpus/1"}
            client.release_node(node.name)
            wait_until(
                lambda: all(g.state == resources_pb2.GPU_STATE_FREE for g in client.list_gpus()),
                30,
                message="GPUs free after release",
            )
        assert agent.terminate() == 0
        assert "permission denied" not in agent.log().lower(), agent.log()
    finally:
        for agent in pool.agents:
            agent.kill()
        broker.stop(grace_s=0)
        root.close()


def test_auth_is_not_turned_on_without_roots_certificate(
    private_etcd: EmbeddedEtcd, pki: Pki, certs: Path, tmp_path: Path
) -> None:
    """Plaintext, or another user's certificate, could never manage users again once
    authentication were on: setup refuses before it changes anything."""
    with EtcdAuth(private_etcd.address) as auth:
        with pytest.raises(FailedPrecondition, match="no client certificate") as refused:
            setup_pool(auth, KEYS)
        assert refused.value.reason == "ETCD_AUTH_LOCKOUT"
        assert auth.users() == []  # nothing was made
    tls_etcd = EmbeddedEtcd(
        tmp_path / "tls-etcd",
        unsafe_no_fsync=True,
        tls=ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca")),
        client_tls=tls(certs, "root"),
    )
    with tls_etcd, EtcdAuth(address(tls_etcd, certs, "broker")) as auth:
        with pytest.raises(FailedPrecondition, match="CN dxpool-broker"):
            setup_pool(auth, KEYS)
        assert auth.users() == []
        # Without turning authentication on, any certificate may prepare the users.
        assert setup_pool(auth, KEYS, enable=False) == PoolUsers([BROKER_USER], [])
        operator = connect([address(tls_etcd, certs, "operator")], timeout_s=3)
        try:
            operator.put(KEYS.node("n1"), b"still open")  # authentication stays off
        finally:
            operator.close()
