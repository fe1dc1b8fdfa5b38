"""The agent's link to the brokers, against real brokers and etcd: registration, the
liveness record a broker keeps for it, takeovers, and failing over between brokers."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dxpool.api.v1 import agent_pb2, resources_pb2
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.control.agent_sessions import parse_liveness, token_digest
from dxpool.errors import FailedPrecondition
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.identity import AgentIdentity
from dxpool.hostagent.link import BrokerLink, broker_order
from dxpool.hostagent.registration import host_record
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from tests.conftest import wait_until


@pytest.fixture
def client(etcd_server: EmbeddedEtcd) -> Iterator[Any]:
    etcd = connect(etcd_server.endpoint)
    yield etcd
    etcd.close()


@pytest.fixture
def config() -> AgentConfig:
    return AgentConfig(
        host_id="h7",
        site="s1",
        pod="p2",
        rack="r3",
        slot_capacity=6,
        labels={"gpu-class": "training"},
        agent_endpoint="10.0.0.7:7070",
        lease_ttl_s=3,
    )


@pytest.fixture
def links() -> Iterator[Callable[..., BrokerLink]]:
    """``links(brokers, config, token)``: a started link of ``config``'s host to the
    agent ports of ``brokers``; stopped (releasing the host) at teardown."""
    made: list[BrokerLink] = []

    def make(brokers: list[BrokerServer], config: AgentConfig, token: str) -> BrokerLink:
        def hello() -> agent_pb2.AgentHello:
            return agent_pb2.AgentHello(
                host=host_record(config),
                token=token,
                liveness_ttl_ms=round(config.lease_ttl_s * 1000),
            )

        link = BrokerLink(
            [b.agent_endpoint for b in brokers],
            f"hosts/{config.host_id}",
            hello,
            lambda welcome: None,
            lambda spec: None,
            backoff_max_s=0.5,
        )
        link.start()
        made.append(link)
        return link

    yield make
    for link in made:
        link.stop(release=True)


def liveness(client: Any, keys: KeySchema) -> tuple[resources_pb2.HostLiveness, Any] | None:
    value, meta = client.get(keys.host_lease("h7"))
    return None if value is None else (parse_liveness(value), meta)


def test_a_session_registers_the_host_and_its_broker_keeps_it_alive(
    broker: BrokerServer,
    client: Any,
    key_prefix: str,
    config: AgentConfig,
    links: Callable[..., BrokerLink],
) -> None:
    keys = KeySchema(key_prefix)
    link = links([broker], config, "agent-token")
    assert link.wait_connected(20)

    value, _ = client.get(keys.host("h7"))
    host = resources_pb2.Host.FromString(value)
    assert host.name == "hosts/h7"
    assert (host.location.site, host.location.pod, host.location.rack) == ("s1", "p2", "r3")
    assert host.slot_capacity == 6
    assert dict(host.labels) == {"gpu-class": "training"}
    assert host.driver == "sim"
    assert host.agent_endpoint == "10.0.0.7:7070"
    assert host.HasField("register_time")
    found = liveness(client, keys)
    assert found is not None
    record, meta = found
    session = link.session
    assert session is not None
    assert (record.session, record.broker) == (session.id, broker.election.identity)
    assert record.agent_digest == token_digest("agent-token")
    assert meta.lease_id == broker.agent_sessions.lease.lease_id  # the broker's lease
    time.sleep(config.lease_ttl_s + 1)  # past the TTL: heartbeats keep the host alive
    found = liveness(client, keys)
    assert found is not None and found[0].session == session.id


def test_a_goodbye_with_release_ends_the_host_at_once_and_keeps_its_record(
    broker: BrokerServer,
    client: Any,
    key_prefix: str,
    config: AgentConfig,
    links: Callable[..., BrokerLink],
) -> None:
    keys = KeySchema(key_prefix)
    link = links([broker], config, "agent-token")
    assert link.wait_connected(20)

    link.stop(release=True)
    link.stop(release=True)  # idempotent

    assert client.get(keys.host_lease("h7")) == (None, None)
    assert client.get(keys.host("h7"))[0] is not None


def test_a_second_agent_cannot_take_a_held_host(
    broker: BrokerServer,
    client: Any,
    key_prefix: str,
    config: AgentConfig,
    links: Callable[..., BrokerLink],
) -> None:
    keys = KeySchema(key_prefix)
    first = links([broker], config, "first-token")
    assert first.wait_connected(20)
    second = links([broker], config, "second-token")

    assert not second.wait_connected(2)
    assert isinstance(second.last_error, FailedPrecondition)
    assert second.last_error.reason == "HOST_HELD"
    found = liveness(client, keys)
    assert found is not None and found[0].agent_digest == token_digest("first-token")

    first.stop(release=True)  # once released, the host can be taken
    assert second.wait_connected(20)
    found = liveness(client, keys)
    assert found is not None and found[0].agent_digest == token_digest("second-token")


def test_a_restarted_agent_takes_its_own_live_session_over(
    broker: BrokerServer,
    client: Any,
    key_prefix: str,
    config: AgentConfig,
    links: Callable[..., BrokerLink],
) -> None:
    keys = KeySchema(key_prefix)
    first = links([broker], config, "agent-token")
    assert first.wait_connected(20)
    first.stop(release=False)  # a restart: the host stays alive for the TTL
    found = liveness(client, keys)
    assert found is not None
    old_session = found[0].session

    restarted = links([broker], config, "agent-token")  # the same identity
    assert restarted.wait_connected(20)

    found = liveness(client, keys)
    assert found is not None
    assert found[0].session not in ("", old_session)  # taken over, never absent


def test_the_link_fails_over_when_its_broker_goes_and_the_host_stays_alive(
    broker_factory: Callable[..., BrokerServer],
    client: Any,
    key_prefix: str,
    config: AgentConfig,
    links: Callable[..., BrokerLink],
) -> None:
    keys = KeySchema(key_prefix)
    brokers = [broker_factory(), broker_factory()]
    link = links(brokers, config, "agent-token")
    assert link.wait_connected(20)
    session = link.session
    assert session is not None
    first = next(b for b in brokers if b.agent_endpoint == session.endpoint)
    second = next(b for b in brokers if b is not first)
    absent: list[float] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            if client.get(keys.host_lease("h7"))[0] is None:
                absent.append(time.monotonic())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        first.stop(grace_s=0)
        wait_until(
            lambda: link.session is not None and link.session.endpoint == second.agent_endpoint,
            timeout_s=20,
            message="the link to reach the second broker",
        )
    finally:
        watching.set()
        watcher.join()
    found = liveness(client, keys)
    assert found is not None
    assert found[0].broker == second.election.identity
    assert found[1].lease_id == second.agent_sessions.lease.lease_id
    assert absent == []  # the host never looked gone


def test_hosts_spread_over_the_brokers_and_a_broker_s_hosts_over_the_others() -> None:
    """Every host is given the same list: each broker is the first choice of a third of
    them, and the hosts of one broker have the other two as next choice half and half,
    so a broker that goes does not send all its hosts to the same broker."""
    brokers = ["b0:8471", "b1:8471", "b2:8471"]
    orders = [broker_order(f"hosts/h{index}", brokers) for index in range(3000)]

    assert all(sorted(order) == brokers for order in orders)
    assert broker_order("hosts/h1", brokers) == orders[1]  # the same on every start
    firsts = Counter(order[0] for order in orders)
    assert all(900 <= firsts[broker] <= 1100 for broker in brokers), firsts
    nexts = Counter(order[1] for order in orders if order[0] == "b0:8471")
    assert all(0.4 <= nexts[b] / firsts["b0:8471"] <= 0.6 for b in brokers[1:]), nexts
    assert broker_order("hosts/h1", ["only:8471"]) == ("only:8471",)


def test_one_state_directory_serves_one_agent_at_a_time(tmp_path: Path) -> None:
    identity = AgentIdentity("h7", tmp_path)
    with pytest.raises(FailedPrecondition, match="another agent for host h7"):
        AgentIdentity("h7", tmp_path)
    token = identity.token
    identity.close()
    again = AgentIdentity("h7", tmp_path)
    assert again.token == token  # the identity survives the restart
    again.close()
