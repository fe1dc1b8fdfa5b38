"""AgentService over real gRPC: sessions, spec pushes, and who may act for which host.

Brokers run with mutual TLS (the session PKI's CA) where identities matter; every refusal
is checked to leave etcd byte for byte unchanged. The agent side here is a bare stream
(:class:`RawSession`), so the tests see the protocol itself.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import agent_pb2, agent_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.errors import from_rpc_error
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Versioned
from dxpool.tls import ClientTls, ServerTls
from tests.conftest import Pki, pool_records, wait_until

ATTACHED = pb.ATTACHMENT_PHASE_ATTACHED


def hello(host: str = "h1", token: str = "token-1", ttl_ms: int = 60_000, **fields: Any) -> Any:
    return agent_pb2.ConnectRequest(
        hello=agent_pb2.AgentHello(
            host=pb.Host(name=f"hosts/{host}", slot_capacity=8),
            token=token,
            liveness_ttl_ms=ttl_ms,
            **fields,
        )
    )


class RawSession:
    """One Connect stream driven message by message."""

    def __init__(self, channel: grpc.Channel, first: Any) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queue.put(first)
        self.stub = agent_pb2_grpc.AgentServiceStub(channel)
        self.call = self.stub.Connect(self._messages(), timeout=30)
        self._responses = iter(self.call)

    def _messages(self) -> Iterator[Any]:
        while True:
            message = self._queue.get()
            if message is None:
                return
            yield message

    def send(self, message: Any) -> None:
        self._queue.put(message)

    def receive(self) -> agent_pb2.ConnectResponse:
        message: agent_pb2.ConnectResponse = next(self._responses)
        return message

    def close(self) -> None:
        self._queue.put(None)
        self.call.cancel()


@pytest.fixture
def open_sessions() -> Iterator[list[RawSession]]:
    opened: list[RawSession] = []
    yield opened
    for session in opened:
        session.close()


@pytest.fixture
def plain(
    broker: BrokerServer, open_sessions: list[RawSession]
) -> Iterator[Callable[[Any], RawSession]]:
    channel = grpc.insecure_channel(broker.agent_endpoint)

    def start(first: Any) -> RawSession:
        session = RawSession(channel, first)
        open_sessions.append(session)
        return session

    yield start
    channel.close()


@pytest.fixture
def secure_broker(broker_factory: Callable[..., BrokerServer], pki: Pki) -> BrokerServer:
    tls = ServerTls(pki.path("server"), pki.path("server", "key"), client_ca=pki.path("ca"))
    return broker_factory(tls=tls)


@pytest.fixture
def as_identity(
    secure_broker: BrokerServer, pki: Pki, open_sessions: list[RawSession]
) -> Iterator[Callable[[str, str], grpc.Channel]]:
    """``as_identity("agent", "h1")``: a channel to the secure broker's agent port with
    that identity's certificate."""
    channels: list[grpc.Channel] = []

    def open_channel(role: str, name: str) -> grpc.Channel:
        stem = pki.client_identity(role, name)
        tls = ClientTls(pki.path("ca"), pki.path(stem), pki.path(stem, "key"))
        channel = grpc.secure_channel(secure_broker.agent_endpoint, tls.credentials())
        channels.append(channel)
        return channel

    yield open_channel
    for channel in channels:
        channel.close()


def refusal(call: Callable[[], Any]) -> Any:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return from_rpc_error(raised.value)


def test_a_session_is_welcomed_with_its_host_s_status_and_spec(
    plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str
) -> None:
    keys = KeySchema(key_prefix)
    spec = pb.HostAllocation(
        host="hosts/h1", attachments=[pb.DesiredAttachment(gpu="boxes/b1/gpus/0")]
    )
    spec_revision = int(
        etcd_client.put(keys.host_allocation("h1"), spec.SerializeToString()).header.revision
    )
    status = pb.HostStatus(
        host="hosts/h1", attachments=[pb.ObservedAttachment(gpu="boxes/b1/gpus/0")]
    )
    etcd_client.put(keys.host_status("h1"), status.SerializeToString())
    etcd_client.put(keys.host_status("h2"), pb.HostStatus(host="hosts/h2").SerializeToString())

    welcome = plain(hello()).receive().welcome

    assert welcome.session and welcome.broker
    assert welcome.status == status
    assert (welcome.liveness_ttl_ms, welcome.heartbeat_interval_ms) == (60_000, 20_000)
    assert welcome.spec.allocation == spec and welcome.spec.spec_revision == spec_revision


def test_a_reconnecting_agent_that_knows_its_status_is_not_sent_it(
    plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str
) -> None:
    keys = KeySchema(key_prefix)
    status = pb.HostStatus(
        host="hosts/h1", attachments=[pb.ObservedAttachment(gpu="boxes/b1/gpus/0")]
    )
    etcd_client.put(keys.host_status("h1"), status.SerializeToString())

    welcome = plain(hello(status_known=True)).receive().welcome

    assert welcome.session and not welcome.HasField("status")


def test_a_broker_busy_opening_sessions_refuses_more_at_once(
    plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str, monkeypatch: Any
) -> None:
    from dxpool.broker.api import agent_service

    before = pool_records(etcd_client, key_prefix)
    monkeypatch.setattr(agent_service, "MAX_OPENING", 0)

    refused = refusal(plain(hello()).receive)

    assert (refused.code, refused.reason) == (grpc.StatusCode.UNAVAILABLE, "BROKER_BUSY")
    assert pool_records(etcd_client, key_prefix) == before


def test_a_storm_of_hellos_waits_its_turn_and_leaves_workers_for_status_writes(
    broker: BrokerServer,
    plain: Callable[[Any], RawSession],
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: Any,
) -> None:
    """More hellos than the worker pool has threads, every one held inside its open (as
    a slow etcd would): the connected agent's status write still goes through at once,
    and the waiting hellos are welcomed, not refused, once the opens move again."""
    from dxpool.broker.api import agent_server, agent_service

    keys = KeySchema(key_prefix)
    connected = plain(hello("h0"))
    welcome = connected.receive().welcome
    release = threading.Event()
    held: list[str] = []
    lock = threading.Lock()
    real_open = broker.agent_sessions.open

    def held_open(host_id: str, *args: Any, **kwargs: Any) -> Any:
        with lock:
            held.append(host_id)
        assert release.wait(30)
        return real_open(host_id, *args, **kwargs)

    monkeypatch.setattr(broker.agent_sessions, "open", held_open)
    storm = [
        plain(hello(f"s{index}", token=f"t{index}"))
        for index in range(agent_server.ETCD_WORKERS + 4)
    ]
    deadline = time.monotonic() + 15
    while len(held) < agent_service.OPEN_WORKERS and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # any hello beyond its turn would be held by now too

    record = pb.HostStatus(
        attachments=[pb.ObservedAttachment(gpu="boxes/b1/gpus/0", phase=ATTACHED)]
    )
    written = connected.stub.ReportStatus(
        agent_pb2.ReportStatusRequest(host="hosts/h0", session=welcome.session, status=record),
        timeout=10,
    )
    assert etcd_client.get(keys.host_status("h0"))[1].mod_revision == written.revision
    assert len(held) == agent_service.OPEN_WORKERS  # the rest wait their turn, not refused

    release.set()
    assert all(session.receive().welcome.session for session in storm)
    assert len(held) == len(storm)


def test_heartbeats_are_acknowledged_and_spec_changes_pushed(
    plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str
) -> None:
    keys = KeySchema(key_prefix)
    session = plain(hello())
    assert session.receive().welcome.spec.spec_revision == 0
    session.send(agent_pb2.ConnectRequest(heartbeat=agent_pb2.AgentHeartbeat(sequence=7)))
    assert session.receive().heartbeat_ack.sequence == 7

    spec = pb.HostAllocation(
        host="hosts/h1", attachments=[pb.DesiredAttachment(gpu="boxes/b1/gpus/3")]
    )
    etcd_client.put(keys.host_allocation("h2"), spec.SerializeToString())  # not h1's: not sent
    revision = int(
        etcd_client.put(keys.host_allocation("h1"), spec.SerializeToString()).header.revision
    )

    pushed = session.receive().spec
    assert pushed.allocation == spec
    assert pushed.spec_revision == revision


def test_a_welcome_never_carries_a_spec_older_than_the_agent_s(
    plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str
) -> None:
    keys = KeySchema(key_prefix)
    spec = pb.HostAllocation(host="hosts/h1")
    revision = int(
        etcd_client.put(keys.host_allocation("h1"), spec.SerializeToString()).header.revision
    )

    ahead = plain(hello(spec_revision=revision + 5, revision=revision + 5)).receive().welcome
    assert not ahead.HasField("spec")  # this broker's view is behind the agent's: keep yours
    same = plain(hello(token="token-1", spec_revision=revision, revision=revision)).receive()
    assert same.welcome.spec.spec_revision == revision


def test_a_session_must_start_with_a_readable_hello(
    broker: BrokerServer, plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str
) -> None:
    before = pool_records(etcd_client, key_prefix)
    heartbeat = agent_pb2.ConnectRequest(heartbeat=agent_pb2.AgentHeartbeat(sequence=1))
    assert refusal(plain(heartbeat).receive).reason == "NO_HELLO"

    channel = grpc.insecure_channel(broker.agent_endpoint)
    garbage = channel.stream_stream("/dxpool.v1.AgentService/Connect")(
        iter([b"\xff\xff\xff"]), timeout=10
    )
    assert refusal(lambda: next(garbage)).reason == "UNDECODABLE_REQUEST"
    channel.close()
    assert pool_records(etcd_client, key_prefix) == before


def test_messages_over_their_method_s_limit_are_refused_undecoded(
    broker: BrokerServer, plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str
) -> None:
    """A hello over Connect's 16 KiB ends REQUEST_TOO_LARGE, undecoded; a status over
    ReportStatus's 2 MiB (the port's limit) RESOURCE_EXHAUSTED; neither writes anything.
    A 1.2 MB status, larger than the API port takes, is decoded and judged on its merits:
    the agent port's receive limit is ReportStatus's own."""
    before = pool_records(etcd_client, key_prefix)
    big = hello(token="t" * 20_000)
    assert refusal(plain(big).receive).reason == "REQUEST_TOO_LARGE"
    assert pool_records(etcd_client, key_prefix) == before
    session = plain(hello())
    welcome = session.receive().welcome
    written = pool_records(etcd_client, key_prefix)

    def status_of(size: int) -> agent_pb2.ReportStatusRequest:
        entry = pb.ObservedAttachment(gpu="boxes/b1/gpus/0", message="m" * 1000)
        count = size // entry.ByteSize()
        record = pb.HostStatus(attachments=[entry] * count)
        return agent_pb2.ReportStatusRequest(
            host="hosts/h1", session=welcome.session, status=record
        )

    over = status_of(2 * 1024 * 1024 + 10_000)  # the port's limit: gRPC core refuses it
    with pytest.raises(grpc.RpcError) as raised:
        session.stub.ReportStatus(over, timeout=30)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    under = status_of(1024 * 1024 + 200_000)
    assert refusal(lambda: session.stub.ReportStatus(under, timeout=30)).reason == (
        "STATUS_TOO_LARGE"
    )
    assert pool_records(etcd_client, key_prefix) == written


def test_a_status_write_names_its_session(
    plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str
) -> None:
    keys = KeySchema(key_prefix)
    session = plain(hello())
    welcome = session.receive().welcome
    record = pb.HostStatus(
        attachments=[pb.ObservedAttachment(gpu="boxes/b1/gpus/0", phase=ATTACHED)]
    )

    written = session.stub.ReportStatus(
        agent_pb2.ReportStatusRequest(host="hosts/h1", session=welcome.session, status=record)
    )
    value, meta = etcd_client.get(keys.host_status("h1"))
    assert meta.mod_revision == written.revision
    assert pb.HostStatus.FromString(value).host == "hosts/h1"

    stale = refusal(
        lambda: session.stub.ReportStatus(
            agent_pb2.ReportStatusRequest(host="hosts/h1", session="not-the-session", status=record)
        )
    )
    assert (stale.code, stale.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "SESSION_NOT_LIVE")
    assert etcd_client.get(keys.host_status("h1"))[1].mod_revision == written.revision


def test_a_goodbye_with_release_ends_the_host_at_once(
    plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str
) -> None:
    keys = KeySchema(key_prefix)
    session = plain(hello())
    session.receive()
    assert etcd_client.get(keys.host_lease("h1"))[0] is not None

    session.send(agent_pb2.ConnectRequest(goodbye=agent_pb2.AgentGoodbye(release=True)))
    with pytest.raises(StopIteration):
        session.receive()  # the broker ends the stream with OK
    assert etcd_client.get(keys.host_lease("h1")) == (None, None)


def test_a_second_identity_is_refused_while_the_first_is_live(
    plain: Callable[[Any], RawSession], etcd_client: Any, key_prefix: str
) -> None:
    first = plain(hello(token="token-1"))
    first.receive()
    before = pool_records(etcd_client, key_prefix)

    refused = refusal(plain(hello(token="token-2", host="h1")).receive)

    assert (refused.code, refused.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "HOST_HELD")
    assert pool_records(etcd_client, key_prefix) == before
    first.send(agent_pb2.ConnectRequest(heartbeat=agent_pb2.AgentHeartbeat(sequence=1)))
    assert first.receive().heartbeat_ack.sequence == 1  # the holder is undisturbed


# -- who may act for which host ----------------------------------------------------------


def test_an_agent_certificate_acts_for_its_own_host_only(
    as_identity: Callable[[str, str], grpc.Channel],
    open_sessions: list[RawSession],
    etcd_client: Any,
    key_prefix: str,
) -> None:
    own = RawSession(as_identity("agent", "h1"), hello("h1"))
    open_sessions.append(own)
    assert own.receive().welcome.session
    h2 = RawSession(as_identity("agent", "h2"), hello("h2", token="token-h2"))
    open_sessions.append(h2)
    h2_session = h2.receive().welcome.session
    before = pool_records(etcd_client, key_prefix)

    foreign = RawSession(as_identity("agent", "h1"), hello("h2", token="token-h2"))
    open_sessions.append(foreign)
    denied = refusal(foreign.receive)
    assert (denied.code, denied.reason) == (grpc.StatusCode.PERMISSION_DENIED, "NOT_OWN_HOST")
    forged = refusal(
        lambda: own.stub.ReportStatus(
            agent_pb2.ReportStatusRequest(
                host="hosts/h2", session=h2_session, status=pb.HostStatus()
            )
        )
    )
    assert forged.code == grpc.StatusCode.PERMISSION_DENIED
    assert pool_records(etcd_client, key_prefix) == before


@pytest.mark.parametrize(("role", "name"), [("operator", "alice"), ("tenant", "h1")])
def test_only_agents_may_open_sessions(
    as_identity: Callable[[str, str], grpc.Channel],
    open_sessions: list[RawSession],
    etcd_client: Any,
    key_prefix: str,
    role: str,
    name: str,
) -> None:
    before = pool_records(etcd_client, key_prefix)
    session = RawSession(as_identity(role, name), hello("h1"))
    open_sessions.append(session)
    assert refusal(session.receive).code == grpc.StatusCode.PERMISSION_DENIED
    assert pool_records(etcd_client, key_prefix) == before


def test_a_caller_without_a_certificate_never_reaches_the_agent_port(
    secure_broker: BrokerServer, pki: Pki, etcd_client: Any, key_prefix: str, tmp_path: Path
) -> None:
    before = pool_records(etcd_client, key_prefix)
    channel = grpc.secure_channel(
        secure_broker.agent_endpoint, ClientTls(pki.path("ca")).credentials()
    )
    session = RawSession(channel, hello("h1"))
    assert refusal(session.receive).code == grpc.StatusCode.UNAVAILABLE  # the handshake
    session.close()
    channel.close()
    assert pool_records(etcd_client, key_prefix) == before


def test_agent_tokens_on_a_token_broker_act_for_their_own_host_only(
    broker_factory: Callable[..., BrokerServer], pki: Pki, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("agent-h1-token-0123456789abcdef: agent/h1\n")
    tokens.chmod(0o600)
    tls = ServerTls(pki.path("server"), pki.path("server", "key"))
    server = broker_factory(tls=tls, token_file=tokens)
    credentials = grpc.composite_channel_credentials(
        ClientTls(pki.path("ca")).credentials(),
        grpc.access_token_call_credentials("agent-h1-token-0123456789abcdef"),
    )
    channel = grpc.secure_channel(server.agent_endpoint, credentials)
    own = RawSession(channel, hello("h1"))
    foreign = RawSession(channel, hello("h2"))
    try:
        assert own.receive().welcome.session
        assert refusal(foreign.receive).code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        own.close()
        foreign.close()
        channel.close()


def test_a_spec_changed_while_the_welcome_is_on_its_way_is_pushed_after_it(
    broker: BrokerServer,
    plain: Callable[[Any], RawSession],
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: Any,
) -> None:
    """The spec changes after the welcome read it and before the stream takes changes
    (held there): the change reaches no stream, so the stream sends it once it does,
    rather than leave the agent on the welcome's spec until the next change."""
    keys = KeySchema(key_prefix)
    assert broker.agent_server is not None
    service = broker.agent_server.service
    real_welcome = service._welcome
    spec = pb.HostAllocation(
        host="hosts/h1", attachments=[pb.DesiredAttachment(gpu="boxes/b1/gpus/3")]
    )
    changed: list[int] = []

    def welcome_then_change(*args: Any) -> Any:
        welcome = real_welcome(*args)  # (welcome, the spec revision it read)
        put = etcd_client.put(keys.host_allocation("h1"), spec.SerializeToString())
        changed.append(int(put.header.revision))
        record = wait_until(
            lambda: broker.cache.host_allocations.get("h1"), message="the change in the cache"
        )
        assert isinstance(record, Versioned) and record.mod_revision == changed[0]
        return welcome

    monkeypatch.setattr(service, "_welcome", welcome_then_change)
    session = plain(hello())
    assert session.receive().welcome.spec.spec_revision == 0
    session.send(agent_pb2.ConnectRequest(heartbeat=agent_pb2.AgentHeartbeat(sequence=1)))

    pushed = session.receive()
    assert pushed.WhichOneof("kind") == "spec", pushed
    assert pushed.spec.allocation == spec
    assert pushed.spec.spec_revision == changed[0]
    assert session.receive().heartbeat_ack.sequence == 1
