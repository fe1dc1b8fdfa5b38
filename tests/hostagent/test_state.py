"""DesiredState (the spec as read) and StatusStore (the status as written, through a
real broker's session)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dxpool.api.v1 import agent_pb2, resources_pb2
from dxpool.broker.api.server import BrokerServer
from dxpool.hostagent.desired import DesiredState
from dxpool.hostagent.link import BrokerLink
from dxpool.hostagent.status import NotRegisteredError, StaleSpecError, StatusStore
from dxpool.limits import MAX_STATUS_TEXT
from dxpool.names import GpuRef
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema

GPU = GpuRef("b1", 0)
OTHER_GPU = GpuRef("b2", 3)


def allocation(*attachments: tuple[str, int, int]) -> resources_pb2.HostAllocation:
    return resources_pb2.HostAllocation(
        host="hosts/h1",
        attachments=[
            resources_pb2.DesiredAttachment(gpu=gpu, host_slot=slot, generation=generation)
            for gpu, slot, generation in attachments
        ],
    )


def test_replace_reports_the_gpus_whose_attachment_changed() -> None:
    desired = DesiredState("h1")

    assert desired.replace(allocation((GPU.name, 0, 1), (OTHER_GPU.name, 1, 1)), 5) == {
        GPU,
        OTHER_GPU,
    }
    assert desired.replace(allocation((GPU.name, 0, 1), (OTHER_GPU.name, 2, 1)), 6) == {OTHER_GPU}
    assert desired.replace(None, 7) == {GPU, OTHER_GPU}
    assert desired.gpus() == set()
    assert desired.revision == 7


def test_an_older_revision_never_replaces_a_newer_one() -> None:
    desired = DesiredState("h1")
    desired.replace(allocation((GPU.name, 0, 2)), 10)

    assert desired.replace(allocation((GPU.name, 0, 1)), 9) == set()

    attachment = desired.get(GPU)
    assert attachment is not None
    assert attachment.generation == 2


def test_malformed_entries_are_skipped_and_the_rest_kept() -> None:
    desired = DesiredState("h1")

    desired.replace(allocation(("gpus/b1/0", 0, 1), (GPU.name, 1, 1)), 1)

    assert desired.gpus() == {GPU}


def test_get_returns_a_copy() -> None:
    desired = DesiredState("h1")
    desired.replace(allocation((GPU.name, 0, 1)), 1)

    attachment = desired.get(GPU)
    assert attachment is not None
    attachment.host_slot = 9

    again = desired.get(GPU)
    assert again is not None
    assert again.host_slot == 0


@pytest.fixture
def client(etcd_server: EmbeddedEtcd) -> Iterator[Any]:
    etcd = connect(etcd_server.endpoint)
    yield etcd
    etcd.close()


def entry(
    gpu: GpuRef, phase: resources_pb2.AttachmentPhase.ValueType, message: str = ""
) -> resources_pb2.ObservedAttachment:
    return resources_pb2.ObservedAttachment(
        gpu=gpu.name, generation=1, phase=phase, message=message
    )


def stored(client: Any, keys: KeySchema) -> resources_pb2.HostStatus:
    value, _ = client.get(keys.host_status("h1"))
    return resources_pb2.HostStatus.FromString(value)


def test_status_store_writes_the_whole_record_and_loads_it_back(
    client: Any, key_prefix: str, open_link: Callable[..., BrokerLink]
) -> None:
    keys = KeySchema(key_prefix)
    link = open_link()
    status = StatusStore(link, "h1")
    status.put(entry(GPU, resources_pb2.ATTACHMENT_PHASE_ATTACHED))
    status.put(entry(OTHER_GPU, resources_pb2.ATTACHMENT_PHASE_ATTACHING))
    status.remove(GPU)

    record = stored(client, keys)
    assert record.host == "hosts/h1"
    assert [e.gpu for e in record.attachments] == [OTHER_GPU.name]

    reloaded = StatusStore(link, "h1")
    reloaded.adopt(record)
    assert reloaded.gpus() == {OTHER_GPU}
    loaded = reloaded.get(OTHER_GPU)
    assert loaded is not None
    assert loaded.phase == resources_pb2.ATTACHMENT_PHASE_ATTACHING


def test_status_store_skips_writes_that_change_nothing(
    client: Any, key_prefix: str, open_link: Callable[..., BrokerLink]
) -> None:
    keys = KeySchema(key_prefix)
    status = StatusStore(open_link(), "h1")
    status.put(entry(GPU, resources_pb2.ATTACHMENT_PHASE_ATTACHED))
    _, first = client.get(keys.host_status("h1"))

    status.put(entry(GPU, resources_pb2.ATTACHMENT_PHASE_ATTACHED))
    status.remove(OTHER_GPU)
    _, unchanged = client.get(keys.host_status("h1"))
    status.put(entry(GPU, resources_pb2.ATTACHMENT_PHASE_ATTACHED, message="x"))
    _, changed = client.get(keys.host_status("h1"))

    assert unchanged.mod_revision == first.mod_revision
    assert changed.mod_revision > first.mod_revision


def test_a_claim_on_a_stale_spec_writes_nothing(
    client: Any, key_prefix: str, open_link: Callable[..., BrokerLink]
) -> None:
    keys = KeySchema(key_prefix)
    read = client.put(keys.host_allocation("h1"), b"")
    spec_revision = int(read.header.revision)
    status = StatusStore(open_link(), "h1")
    status.put(entry(OTHER_GPU, resources_pb2.ATTACHMENT_PHASE_ATTACHED))
    _, before = client.get(keys.host_status("h1"))

    changed = resources_pb2.HostAllocation(host="hosts/h1")
    client.put(keys.host_allocation("h1"), changed.SerializeToString())  # broker changed it
    with pytest.raises(StaleSpecError):
        status.put(
            entry(GPU, resources_pb2.ATTACHMENT_PHASE_ATTACHING), spec_revision=spec_revision
        )

    _, after = client.get(keys.host_status("h1"))
    assert after.mod_revision == before.mod_revision
    assert status.get(GPU) is None  # nothing kept in memory to leak into a later write
    status.remove(OTHER_GPU)
    assert list(stored(client, keys).attachments) == []


def test_only_the_session_holder_writes_status(
    client: Any, key_prefix: str, broker: BrokerServer, open_link: Callable[..., BrokerLink]
) -> None:
    keys = KeySchema(key_prefix)
    holder = open_link(token="the-holder")
    intruder = BrokerLink(  # another identity for the same host: refused a session
        [broker.agent_endpoint],
        "hosts/h1",
        lambda: agent_pb2.AgentHello(
            host=resources_pb2.Host(name="hosts/h1", slot_capacity=4), token="an-intruder"
        ),
        lambda welcome: None,
        lambda spec: None,
    )
    intruder.start()
    try:
        assert not intruder.wait_connected(2)
        assert intruder.last_error is not None and intruder.last_error.reason == "HOST_HELD"
        with pytest.raises(NotRegisteredError):
            StatusStore(intruder, "h1").put(entry(GPU, resources_pb2.ATTACHMENT_PHASE_ATTACHED))
    finally:
        intruder.stop(release=True)
    assert client.get(keys.host_status("h1"))[0] is None
    holder.stop(release=False)  # the holder's own session gone: it writes nothing either
    with pytest.raises(NotRegisteredError):
        StatusStore(holder, "h1").remove(GPU)
    assert client.get(keys.host_status("h1"))[0] is None


def test_text_from_drivers_is_cleaned_not_refused(
    client: Any, key_prefix: str, open_link: Callable[..., BrokerLink]
) -> None:
    status = StatusStore(open_link(), "h1")
    message = "hook failed:\n" + "x" * 5000
    status.put(entry(GPU, resources_pb2.ATTACHMENT_PHASE_FAILED, message=message))

    written = stored(client, KeySchema(key_prefix)).attachments[0].message
    assert written.startswith("hook failed: x") and written.endswith("...")
    assert len(written) == MAX_STATUS_TEXT and written.isprintable()
