"""etcd over TLS with client-certificate authentication: who gets in, and a broker working
through it for an agent that reaches the broker only."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.broker.api.server import BrokerConfig, BrokerServer
from dxpool.client import Client
from dxpool.fabric.sim import SimFabric, SimGpuSpec
from dxpool.store.client import EtcdAddress, addresses_of, connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from dxpool.tls import ClientTls, ServerTls
from tests.conftest import Pki, SimPool, wait_until


def _client_tls(pki: Pki) -> ClientTls:
    return ClientTls(pki.path("ca"), pki.path("operator-alice"), pki.path("operator-alice", "key"))


@pytest.fixture(scope="module")
def tls_etcd(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd(
        tmp_path_factory.mktemp("tls-etcd"),
        unsafe_no_fsync=True,
        tls=ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca")),
        client_tls=_client_tls(pki),
    )
    with server:
        yield server


@pytest.mark.parametrize(
    "tls",
    [
        pytest.param(lambda pki: None, id="plaintext"),
        pytest.param(lambda pki: ClientTls(ca=pki.path("ca")), id="no-client-certificate"),
        pytest.param(
            lambda pki: ClientTls(pki.path("ca"), pki.path("rogue"), pki.path("rogue", "key")),
            id="certificate-of-another-ca",
        ),
    ],
)
def test_etcd_refuses_a_client_without_a_certificate_of_its_ca(
    tls_etcd: EmbeddedEtcd, pki: Pki, tls: object
) -> None:
    client = connect(tls_etcd.endpoint, timeout_s=2, tls=tls(pki))  # type: ignore[operator]
    try:
        with pytest.raises(Exception):  # noqa: B017 - refused at the handshake, or reset
            client.put("/tls-test/denied", "x")
    finally:
        client.close()
    good = connect([tls_etcd.address], timeout_s=2)
    try:
        assert good.get("/tls-test/denied")[0] is None  # nothing was written
    finally:
        good.close()


def test_a_client_with_a_certificate_reads_and_writes(tls_etcd: EmbeddedEtcd, pki: Pki) -> None:
    client = connect(tls_etcd.endpoint, timeout_s=2, tls=_client_tls(pki))
    try:
        client.put("/tls-test/ok", "yes")
        assert client.get("/tls-test/ok")[0] == b"yes"
        # Watches and other channels built from the client's addresses keep its TLS.
        assert addresses_of(client)[0].tls == _client_tls(pki)
        assert addresses_of(client) == [EtcdAddress(tls_etcd.host, tls_etcd.client_port)]
    finally:
        client.close()


def test_a_broker_on_etcd_with_tls_serves_an_agent_over_mutual_tls(
    tls_etcd: EmbeddedEtcd, pki: Pki, tmp_path: Path
) -> None:
    prefix = "/dxpool-tls-test/"
    broker = BrokerServer(
        BrokerConfig(
            etcd_endpoints=tls_etcd.endpoint,
            key_prefix=prefix,
            listen="127.0.0.1:0",
            agent_listen="127.0.0.1:0",
            tls=ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca")),
            etcd_tls=_client_tls(pki),
            controller_sweep_s=0.2,
        )
    ).start()
    fabric = SimFabric.create(tmp_path / "fabric", boxes={}, hosts={})
    pool = SimPool(tmp_path, fabric, lambda: [broker.agent_endpoint])
    try:
        fabric.add_box("box1", [SimGpuSpec("H100", 81920)] * 2)
        pool.start_agent("h1", extra=pki.agent_args("h1"))
        with Client(broker.endpoint, tls=_client_tls(pki)) as client:
            client.create_box(
                "box1", gpus=2, model="H100", memory_mib=81920, location=("s1", "p1", "r1")
            )
            wait_until(lambda: any(h.alive for h in client.list_hosts()), 30, message="h1")
            node = client.wait_for_node(client.compose_node("H100:2").name, timeout_s=30)
            assert node.state == resources_pb2.NODE_STATE_READY
        # What the broker wrote is in etcd, read over TLS.
        reader = connect([tls_etcd.address], timeout_s=2)
        try:
            stored = reader.get(KeySchema(prefix).node(node.name.removeprefix("nodes/")))[0]
        finally:
            reader.close()
        assert stored is not None
    finally:
        for agent in pool.agents:
            agent.kill()
        broker.stop(grace_s=0)


def test_an_agent_the_broker_does_not_accept_fails_to_start(
    tls_etcd: EmbeddedEtcd, pki: Pki, tmp_path: Path
) -> None:
    import subprocess

    broker = BrokerServer(
        BrokerConfig(
            etcd_endpoints=tls_etcd.endpoint,
            key_prefix="/dxpool-tls-refused/",
            listen="127.0.0.1:0",
            agent_listen="127.0.0.1:0",
            tls=ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca")),
            etcd_tls=_client_tls(pki),
        )
    ).start()
    SimFabric.create(tmp_path / "fabric", boxes={}, hosts={"h9": 2})
    try:
        result = subprocess.run(
            [sys.executable, "-m", "dxpool.hostagent", "--host", "h9",
             "--broker", broker.agent_endpoint, "--tls-ca", str(pki.path("ca")),
             "--driver", "sim", "--sim-state", str(tmp_path / "fabric"), "--slots", "2",
             "--startup-timeout", "2"],
            check=False, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        broker.stop(grace_s=0)
    assert result.returncode == 1, result.stderr
    assert f"no broker at {broker.agent_endpoint} opened a session" in result.stderr
