"""Host registration and the liveness lease, against a real etcd."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.errors import FailedPrecondition
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.identity import AgentIdentity
from dxpool.hostagent.registration import HostHeldError, HostRegistration
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema


@pytest.fixture
def client(etcd_server: EmbeddedEtcd) -> Iterator[Any]:
    etcd = connect(etcd_server.endpoint)
    yield etcd
    etcd.close()


@pytest.fixture
def config(etcd_server: EmbeddedEtcd, key_prefix: str) -> AgentConfig:
    return AgentConfig(
        host_id="h7",
        etcd_endpoints=etcd_server.endpoint,
        key_prefix=key_prefix,
        site="s1",
        pod="p2",
        rack="r3",
        slot_capacity=6,
        labels={"gpu-class": "training"},
        agent_endpoint="10.0.0.7:7070",
        lease_ttl_s=3,
    )


def test_register_writes_the_host_record_and_a_leased_liveness_key(
    client: Any, config: AgentConfig
) -> None:
    keys = KeySchema(config.key_prefix)
    registration = HostRegistration(client, config)

    registration.register()

    value, _ = client.get(keys.host("h7"))
    host = resources_pb2.Host.FromString(value)
    assert host.name == "hosts/h7"
    assert (host.location.site, host.location.pod, host.location.rack) == ("s1", "p2", "r3")
    assert host.slot_capacity == 6
    assert dict(host.labels) == {"gpu-class": "training"}
    assert host.driver == "sim"
    assert host.agent_endpoint == "10.0.0.7:7070"
    assert host.HasField("register_time")
    value, meta = client.get(keys.host_lease("h7"))
    assert value == b""
    assert meta.lease_id == registration.lease_id
    registration.stop()


def test_stop_revokes_the_lease_at_once_and_keeps_the_host_record(
    client: Any, config: AgentConfig
) -> None:
    keys = KeySchema(config.key_prefix)
    registration = HostRegistration(client, config)
    registration.register()
    registration.start_keepalive()

    registration.stop()
    registration.stop()  # idempotent

    assert client.get(keys.host_lease("h7")) == (None, None)
    assert client.get(keys.host("h7"))[0] is not None


def test_keep_alive_renews_a_lease_found_expired(client: Any, config: AgentConfig) -> None:
    keys = KeySchema(config.key_prefix)
    registration = HostRegistration(client, config)
    registration.register()
    assert registration.keep_alive_once() is True
    old_lease = registration.lease_id

    client.revoke_lease(old_lease)  # as if etcd had been unreachable past the TTL
    assert client.get(keys.host_lease("h7")) == (None, None)

    assert registration.keep_alive_once() is False
    _, meta = client.get(keys.host_lease("h7"))
    assert meta is not None
    assert meta.lease_id == registration.lease_id != old_lease
    registration.stop()


def test_a_second_agent_cannot_take_a_held_host(client: Any, config: AgentConfig) -> None:
    first = HostRegistration(client, config)
    first.register()
    second = HostRegistration(client, config)

    with pytest.raises(HostHeldError, match="held by another live agent"):
        second.register()

    _, meta = client.get(KeySchema(config.key_prefix).host_lease("h7"))
    assert meta.lease_id == first.lease_id  # the holder kept its key
    assert second.lease_id is None
    first.stop()
    second.register()  # once released, the host can be taken
    assert second.lease_id is not None
    second.stop()


def test_a_restarted_agent_adopts_its_own_live_lease(client: Any, config: AgentConfig) -> None:
    first = HostRegistration(client, config, token="agent-token")
    first.register()
    lease_id = first.lease_id

    restarted = HostRegistration(client, config, token="agent-token")  # same identity
    restarted.register()

    assert restarted.lease_id == lease_id  # no new lease: the host was never gone
    assert client.get(KeySchema(config.key_prefix).host_lease("h7"))[0] == b"agent-token"
    with pytest.raises(HostHeldError):
        HostRegistration(client, config, token="someone-else").register()
    restarted.stop()


def test_one_state_directory_serves_one_agent_at_a_time(tmp_path: Any) -> None:
    identity = AgentIdentity("h7", tmp_path)
    with pytest.raises(FailedPrecondition, match="another agent for host h7"):
        AgentIdentity("h7", tmp_path)
    token = identity.token
    identity.close()
    again = AgentIdentity("h7", tmp_path)
    assert again.token == token  # the identity survives the restart
    again.close()
