"""The host side of the trust boundary, tried as an attacker holding one host's
certificate would: it cannot keep another host alive, and it reads no other host's
records, through any API it can reach.

A real mTLS broker (the session PKI's CA), real agent processes with their own
certificates, the session's etcd. That a host's certificate cannot reach etcd at all is
proven against `dxpool up`'s own etcd, with its separate CA (``tests/cli/test_up.py``).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from dxpool.api.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    audit_pb2,
    fabric_pb2,
    inventory_pb2,
    nodes_pb2,
)
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.control.agent_sessions import parse_liveness
from dxpool.client import Client
from dxpool.errors import from_rpc_error
from dxpool.fabric.sim import SimGpuSpec
from dxpool.store.keys import KeySchema
from dxpool.tls import ClientTls, ServerTls
from tests.conftest import Pki, SimPool, wait_until

TTL_S = 2.0


@pytest.fixture
def secure_broker(broker_factory: Callable[..., BrokerServer], pki: Pki, sim_pool: SimPool) -> Any:
    tls = ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca"))
    return broker_factory(tls=tls, fabric=f"sim:{sim_pool.state_dir / 'fabric'}")


def tls_of(pki: Pki, role: str, name: str) -> ClientTls:
    stem = pki.client_identity(role, name)
    return ClientTls(pki.path("ca"), pki.path(stem), pki.path(stem, "key"))


@pytest.fixture
def operator(secure_broker: BrokerServer, pki: Pki) -> Iterator[Client]:
    with Client(secure_broker.endpoint, tls=tls_of(pki, "operator", "alice")) as client:
        yield client


@pytest.fixture
def two_hosts(operator: Client, sim_pool: SimPool, pki: Pki) -> SimPool:
    """Hosts h1 and h2 with their own agents and certificates, a box of four GPUs."""
    sim_pool.fabric.add_box("box1", [SimGpuSpec("H100", 81920)] * 4)
    operator.create_box("box1", gpus=4, model="H100", memory_mib=81920, location=("s1", "p1", "r1"))
    for host in ("h1", "h2"):
        sim_pool.start_agent(host, lease_ttl_s=TTL_S, extra=pki.agent_args(host))
    wait_until(
        lambda: sum(h.alive for h in operator.list_hosts()) == 2, 30, message="both hosts alive"
    )
    return sim_pool


def h1_channel(endpoint: str, pki: Pki) -> grpc.Channel:
    """A channel with h1's agent certificate: what an attacker on host h1 holds."""
    return grpc.secure_channel(endpoint, tls_of(pki, "agent", "h1").credentials())


def forge_forever(
    channel: grpc.Channel, h2_session: str, stop: threading.Event
) -> dict[str, set[str]]:
    """Keep trying, from h1's certificate, every way to say "h2 is alive"; returns, by
    attempt, the status codes the broker answered with."""
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    codes: dict[str, set[str]] = {"hello": set(), "heartbeat": set(), "status": set()}
    hello = agent_pb2.ConnectRequest(
        hello=agent_pb2.AgentHello(
            host=pb.Host(name="hosts/h2", slot_capacity=8), token="guessed", liveness_ttl_ms=60_000
        )
    )
    beat = agent_pb2.ConnectRequest(heartbeat=agent_pb2.AgentHeartbeat(sequence=1))
    status = agent_pb2.ReportStatusRequest(
        host="hosts/h2", session=h2_session, status=pb.HostStatus()
    )
    attempts: dict[str, Callable[[], object]] = {
        "hello": lambda: list(stub.Connect(iter([hello, beat]), timeout=5)),
        "heartbeat": lambda: list(stub.Connect(iter([beat]), timeout=5)),  # no session at all
        "status": lambda: stub.ReportStatus(status, timeout=5),
    }
    while not stop.is_set():
        for kind, attempt in attempts.items():
            try:
                attempt()
                codes[kind].add("OK")
            except grpc.RpcError as error:
                codes[kind].add(error.code().name)
        stop.wait(0.2)
    return codes


def test_a_forged_keep_alive_for_another_host_does_not_save_it(
    secure_broker: BrokerServer,
    operator: Client,
    two_hosts: SimPool,
    pki: Pki,
    etcd_client: Any,
    key_prefix: str,
) -> None:
    """h2's agent freezes; from h1's certificate an attacker keeps sending h2's hello,
    heartbeats and status, naming even h2's real session. h2 is still declared lost and
    fenced on time, and every forged call is refused."""
    node = operator.wait_for_node(operator.compose_node("H100:2", host="h2").name, timeout_s=30)
    gpus = [b.gpu for b in node.gpus]
    value, _ = etcd_client.get(KeySchema(key_prefix).host_lease("h2"))
    h2_session = parse_liveness(value).session  # as much as an insider could know
    h2 = next(agent for agent in two_hosts.agents if agent.host == "h2")
    stop = threading.Event()
    found: queue.Queue[dict[str, set[str]]] = queue.Queue()
    channel = h1_channel(secure_broker.agent_endpoint, pki)
    attacker = threading.Thread(target=lambda: found.put(forge_forever(channel, h2_session, stop)))
    os.kill(h2.process.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    attacker.start()
    try:
        wait_until(
            lambda: operator.get_node(node.name).state == pb.NODE_STATE_LOST,
            timeout_s=TTL_S + 20,
            message="h2's node to be LOST despite the forged keep-alives",
        )
        lost_s = time.monotonic() - frozen_at
        wait_until(
            lambda: all(operator.get_gpu(g).state == pb.GPU_STATE_FREE for g in gpus),
            timeout_s=20,
            message="h2's GPUs fenced, scrubbed and freed",
        )
    finally:
        stop.set()
        attacker.join(30)
        channel.close()
        os.kill(h2.process.pid, signal.SIGCONT)
    codes = found.get(timeout=5)
    assert codes == {
        "hello": {"PERMISSION_DENIED"},
        "heartbeat": {"INVALID_ARGUMENT"},  # a stream must open with a hello
        "status": {"PERMISSION_DENIED"},
    }
    assert lost_s >= TTL_S * 0.5  # lost by its own silence, not at once
    for gpu in gpus:
        box, slot = gpu.removeprefix("boxes/").split("/gpus/")
        assert two_hosts.fabric.mapping(box, int(slot)) is None  # revoked at the box side


# Requests naming host h2, for the RPCs that name a host; every RPC also gets an empty one.
NAMING_H2: dict[str, Message] = {
    "GetHost": inventory_pb2.GetHostRequest(name="hosts/h2"),
    "GetLatency": fabric_pb2.GetLatencyRequest(host="hosts/h2", box="boxes/box1"),
    "Predict": fabric_pb2.PredictRequest(host="hosts/h2", box="boxes/box1"),
}


def ask(channel: grpc.Channel, path: str, request: Message, answer: Any, stream: bool) -> Any:
    """One call of ``path`` (its first message, for a stream)."""
    serializer = type(request).SerializeToString
    if stream:
        call = channel.unary_stream(path, serializer, answer.FromString)
        return next(iter(call(request, timeout=10)))
    return channel.unary_unary(path, serializer, answer.FromString)(request, timeout=10)


def test_another_hosts_records_are_unreadable_through_every_api_of_an_agent_certificate(
    secure_broker: BrokerServer,
    operator: Client,
    two_hosts: SimPool,
    pki: Pki,
    etcd_client: Any,
    key_prefix: str,
) -> None:
    """An agent certificate for h1 tries every RPC of every service of both ports. Those
    its role may not call are PERMISSION_DENIED; those it may, naming h2, are too; what it
    may read (its own host, its own session) carries nothing of h2, of nodes or of GPUs."""
    on_h2 = operator.wait_for_node(operator.compose_node("H100:1", host="h2").name, timeout_s=30)
    from google.protobuf import symbol_database

    database = symbol_database.Default()
    channel = h1_channel(secure_broker.endpoint, pki)
    allowed: list[str] = []
    try:
        for module in (inventory_pb2, nodes_pb2, fabric_pb2, audit_pb2):
            for service in module.DESCRIPTOR.services_by_name.values():
                for method in service.methods:
                    path = f"/{service.full_name}/{method.name}"
                    empty = database.GetSymbol(method.input_type.full_name)()
                    answer_type = database.GetSymbol(method.output_type.full_name)
                    requests = [
                        empty,
                        *([NAMING_H2[method.name]] if method.name in NAMING_H2 else []),
                    ]
                    for request in requests:
                        try:
                            answer = ask(
                                channel, path, request, answer_type, method.server_streaming
                            )
                        except grpc.RpcError as error:
                            code = from_rpc_error(error).code
                            assert code in (
                                grpc.StatusCode.PERMISSION_DENIED,
                                grpc.StatusCode.INVALID_ARGUMENT,  # an empty name: nothing read
                            ), (path, code)
                            continue
                        allowed.append(path)
                        text = str(answer)
                        assert "h2" not in text and on_h2.name not in text, (path, text)
    finally:
        channel.close()
    # Nothing answered but the calls about h1 itself.
    assert set(allowed) <= {
        "/dxpool.v1.FabricService/GetLatency",
        "/dxpool.v1.FabricService/Predict",
        "/dxpool.v1.InventoryService/GetHost",
    }, allowed

    # The agent port: h1's welcome and pushes carry h1's status and spec only.
    agent_channel = h1_channel(secure_broker.agent_endpoint, pki)
    try:
        stub = agent_pb2_grpc.AgentServiceStub(agent_channel)
        replies = stub.Connect(
            iter([agent_pb2.ConnectRequest(hello=agent_pb2.AgentHello(
                host=pb.Host(name="hosts/h1", slot_capacity=8), token="attacker",
            ))]),
            timeout=10,
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as held:
            next(iter(replies))
        assert from_rpc_error(held.value).reason == "HOST_HELD"  # its own host's agent runs
    finally:
        agent_channel.close()
