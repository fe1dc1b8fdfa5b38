"""InventoryService's list views against a real broker and etcd: label selectors on boxes
and hosts, free GPUs per box, and the slot numbers a host's allocation uses."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.state.stm import COMMIT_ATTEMPTS
from dxpool.store.keys import KeySchema
from tests.broker.commit_races import meddle_before_commits, writing
from tests.broker.nodes.test_gang import reason
from tests.conftest import Stubs, add_box
from tests.streaming import rpc_error, settle


def labelled_box(stubs: Stubs, box_id: str, labels: dict[str, str]) -> pb.Box:
    return stubs.inventory.CreateBox(
        inventory_pb2.CreateBoxRequest(
            box_id=box_id,
            box=pb.Box(gpu_count=2, labels=labels),
            gpu_model="H100",
            gpu_memory_mib=81920,
        )
    )


def box_names(stubs: Stubs, selector: str) -> list[str]:
    found, token = [], ""
    while True:
        page = stubs.inventory.ListBoxes(
            inventory_pb2.ListBoxesRequest(label_selector=selector, page_size=1, page_token=token)
        )
        found += [b.name.removeprefix("boxes/") for b in page.boxes]
        token = page.next_page_token
        if not token:
            return found


def test_list_boxes_filters_by_label_selector_across_pages(stubs: Stubs) -> None:
    labelled_box(stubs, "a1", {"row": "1", "vendor": "x"})
    labelled_box(stubs, "a2", {"row": "2"})
    labelled_box(stubs, "a3", {"row": "1"})
    labelled_box(stubs, "a4", {})
    assert box_names(stubs, "row=1") == ["a1", "a3"]
    assert box_names(stubs, "row!=1") == ["a2", "a4"]
    assert box_names(stubs, "row,!vendor") == ["a2", "a3"]
    assert box_names(stubs, "") == ["a1", "a2", "a3", "a4"]


@pytest.mark.parametrize("method", ["ListBoxes", "ListHosts"])
def test_a_bad_selector_is_invalid_argument(stubs: Stubs, method: str) -> None:
    request_type = getattr(inventory_pb2, f"{method}Request")
    call = getattr(stubs.inventory, method)
    error = rpc_error(lambda: call(request_type(label_selector="team=,=x")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid label selector" in (error.details() or "")


def test_boxes_say_how_many_gpus_a_compose_may_take(  # type: ignore[no-untyped-def]
    broker: BrokerServer, stubs: Stubs, etcd_client, key_prefix: str
) -> None:
    created = add_box(stubs, "b1", gpus=4)
    assert created.gpus_free == 4  # the answer says it; the stored record does not hold it
    schema = KeySchema(key_prefix)
    stored = pb.Box.FromString(etcd_client.get(schema.box("b1"))[0])
    assert stored.gpus_free == 0
    add_box(stubs, "b10", gpus=3)  # sorts right after "b1": must not be counted in it

    taken = pb.Gpu.FromString(etcd_client.get(schema.gpu("b1", 1))[0])
    taken.state, taken.node = pb.GPU_STATE_ATTACHED, "nodes/n1"
    sick = pb.Gpu.FromString(etcd_client.get(schema.gpu("b1", 2))[0])
    sick.health = pb.GPU_HEALTH_UNHEALTHY
    etcd_client.put(schema.gpu("b1", 1), taken.SerializeToString())
    etcd_client.put(schema.gpu("b1", 2), sick.SerializeToString())
    revision = etcd_client.get(schema.gpu("b1", 2))[1].mod_revision
    settle(broker, revision)

    listed = {
        b.name: b.gpus_free
        for b in stubs.inventory.ListBoxes(inventory_pb2.ListBoxesRequest()).boxes
    }
    assert listed == {"boxes/b1": 2, "boxes/b10": 3}
    cordoned = stubs.inventory.CordonBox(inventory_pb2.CordonBoxRequest(name="boxes/b1"))
    assert cordoned.gpus_free == 0  # a cordoned box gives nothing to a compose
    assert stubs.inventory.GetBox(inventory_pb2.GetBoxRequest(name="boxes/b10")).gpus_free == 3


def test_hosts_name_the_slots_in_use(  # type: ignore[no-untyped-def]
    broker: BrokerServer, stubs: Stubs, etcd_client, key_prefix: str
) -> None:
    schema = KeySchema(key_prefix)
    host = pb.Host(name="hosts/h1", slot_capacity=8, labels={"rack": "r1"})
    etcd_client.put(schema.host("h1"), host.SerializeToString())
    etcd_client.put(schema.host("h2"), pb.Host(name="hosts/h2").SerializeToString())
    allocation = pb.HostAllocation(
        host="hosts/h1",
        attachments=[
            pb.DesiredAttachment(gpu="boxes/b1/gpus/0", host_slot=5),
            pb.DesiredAttachment(gpu="boxes/b1/gpus/1", host_slot=2),
        ],
    )
    etcd_client.put(schema.host_allocation("h1"), allocation.SerializeToString())
    settle(broker, etcd_client.get(schema.host_allocation("h1"))[1].mod_revision)

    got = stubs.inventory.GetHost(inventory_pb2.GetHostRequest(name="hosts/h1"))
    assert (got.slots_used, list(got.used_slots)) == (2, [2, 5])
    listed = stubs.inventory.ListHosts(inventory_pb2.ListHostsRequest(label_selector="rack=r1"))
    assert [h.name for h in listed.hosts] == ["hosts/h1"]
    assert list(listed.hosts[0].used_slots) == [2, 5]


# -- commits racing another writer (see tests/broker/commit_races.py) -------------------


def stored_box(etcd_client: Any, schema: KeySchema, box_id: str) -> pb.Box | None:
    data, _ = etcd_client.get(schema.box(box_id))
    return pb.Box.FromString(data) if data is not None else None


def test_a_cordon_racing_another_writer_is_made_again_on_what_it_wrote(
    broker: BrokerServer,
    stubs: Stubs,
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    schema = KeySchema(key_prefix)
    add_box(stubs, "b1", gpus=2)

    def relabel() -> None:
        box = stored_box(etcd_client, schema, "b1")
        assert box is not None
        box.labels["row"] = "7"
        etcd_client.put(schema.box("b1"), box.SerializeToString())

    commits = meddle_before_commits(
        broker.store, monkeypatch, writing(schema.box("b1")), relabel, times=1
    )
    cordoned = stubs.inventory.CordonBox(
        inventory_pb2.CordonBoxRequest(name="boxes/b1", reason="swap fans")
    )
    assert len(commits) == 2  # the first lost its compare to the relabel
    assert (cordoned.state, cordoned.cordon_reason) == (pb.BOX_STATE_CORDONED, "swap fans")
    assert dict(cordoned.labels) == {"row": "7"}  # made again on the relabelled record
    stored = stored_box(etcd_client, schema, "b1")
    assert stored is not None
    assert (stored.state, dict(stored.labels)) == (pb.BOX_STATE_CORDONED, {"row": "7"})


def test_a_cordon_that_loses_every_compare_is_aborted_and_writes_nothing(
    broker: BrokerServer,
    stubs: Stubs,
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    schema = KeySchema(key_prefix)
    add_box(stubs, "b1", gpus=2)
    original = stored_box(etcd_client, schema, "b1")
    assert original is not None

    def rewrite() -> None:
        etcd_client.put(schema.box("b1"), original.SerializeToString())

    commits = meddle_before_commits(
        broker.store, monkeypatch, writing(schema.box("b1")), rewrite, times=1000
    )
    error = rpc_error(
        lambda: stubs.inventory.CordonBox(inventory_pb2.CordonBoxRequest(name="boxes/b1"))
    )
    assert error.code() == grpc.StatusCode.ABORTED
    assert reason(error) == "COMMIT_CONFLICT"
    assert "updating boxes/b1 kept conflicting" in (error.details() or "")
    assert len(commits) == COMMIT_ATTEMPTS
    assert stored_box(etcd_client, schema, "b1") == original


def test_a_create_racing_the_same_box_from_another_broker_is_already_exists(
    broker: BrokerServer,
    stubs: Stubs,
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    schema = KeySchema(key_prefix)
    theirs = pb.Box(name="boxes/b1", gpu_count=3, labels={"by": "other"})

    def create_first() -> None:
        etcd_client.put(schema.box("b1"), theirs.SerializeToString())

    commits = meddle_before_commits(
        broker.store, monkeypatch, writing(schema.box("b1")), create_first, times=1
    )
    error = rpc_error(lambda: add_box(stubs, "b1", gpus=2))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert reason(error) == "BOX_EXISTS"
    assert len(commits) == 1  # the retry read the box the compare returned: no second commit
    assert stored_box(etcd_client, schema, "b1") == theirs
    assert etcd_client.get(schema.gpu("b1", 0))[0] is None  # none of ours was written


def test_a_create_whose_request_id_keeps_moving_is_aborted_and_writes_nothing(
    broker: BrokerServer,
    stubs: Stubs,
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request key naming a box that no longer holds it is taken over, compared on its
    revision; another writer rewriting it before every commit exhausts the attempts."""
    schema = KeySchema(key_prefix)
    request_key = schema.request("r1")
    etcd_client.put(request_key, b"boxes/gone")

    def rewrite() -> None:
        etcd_client.put(request_key, b"boxes/gone")

    commits = meddle_before_commits(
        broker.store, monkeypatch, writing(schema.box("b1")), rewrite, times=1000
    )
    request = inventory_pb2.CreateBoxRequest(
        box_id="b1", box=pb.Box(gpu_count=2), gpu_model="H100", gpu_memory_mib=81920
    )
    request.request_id = "r1"
    error = rpc_error(lambda: stubs.inventory.CreateBox(request))
    assert error.code() == grpc.StatusCode.ABORTED
    assert reason(error) == "COMMIT_CONFLICT"
    assert "creating boxes/b1 kept conflicting" in (error.details() or "")
    assert len(commits) == COMMIT_ATTEMPTS
    assert stored_box(etcd_client, schema, "b1") is None
    assert etcd_client.get(request_key)[0] == b"boxes/gone"


def test_a_delete_racing_a_compose_that_takes_a_gpu_is_refused(
    broker: BrokerServer,
    stubs: Stubs,
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    schema = KeySchema(key_prefix)
    add_box(stubs, "b1", gpus=2)

    def take_gpu() -> None:
        gpu = pb.Gpu.FromString(etcd_client.get(schema.gpu("b1", 1))[0])
        gpu.state, gpu.node = pb.GPU_STATE_ATTACHING, "nodes/n1"
        etcd_client.put(schema.gpu("b1", 1), gpu.SerializeToString())

    commits = meddle_before_commits(
        broker.store, monkeypatch, writing(schema.box("b1")), take_gpu, times=1
    )
    error = rpc_error(
        lambda: stubs.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/b1"))
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(error) == "BOX_IN_USE"
    assert "boxes/b1/gpus/1 (nodes/n1)" in (error.details() or "")
    assert len(commits) == 1  # the retry saw the GPU taken and wrote nothing
    assert stored_box(etcd_client, schema, "b1") is not None
    assert etcd_client.get(schema.gpu("b1", 0))[0] is not None


@pytest.mark.parametrize("races", [1, 1000])
def test_a_delete_racing_another_writer_deletes_the_box_as_it_then_is_or_aborts(
    broker: BrokerServer,
    stubs: Stubs,
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    races: int,
) -> None:
    """A GPU of the box rewritten before the first commit: the delete runs again on it
    and deletes; rewritten before every commit: ABORTED after the last attempt, with
    nothing deleted."""
    schema = KeySchema(key_prefix)
    add_box(stubs, "b1", gpus=2)
    gpu = etcd_client.get(schema.gpu("b1", 0))[0]

    def rewrite_gpu() -> None:
        etcd_client.put(schema.gpu("b1", 0), gpu)

    commits = meddle_before_commits(
        broker.store, monkeypatch, writing(schema.box("b1")), rewrite_gpu, times=races
    )
    delete = inventory_pb2.DeleteBoxRequest(name="boxes/b1")
    if races == 1:
        stubs.inventory.DeleteBox(delete)
        assert len(commits) == 2
        assert stored_box(etcd_client, schema, "b1") is None
        assert list(etcd_client.get_prefix(schema.box_gpus("b1"))) == []
        return
    error = rpc_error(lambda: stubs.inventory.DeleteBox(delete))
    assert error.code() == grpc.StatusCode.ABORTED
    assert reason(error) == "COMMIT_CONFLICT"
    assert len(commits) == COMMIT_ATTEMPTS
    assert stored_box(etcd_client, schema, "b1") is not None
    assert etcd_client.get(schema.gpu("b1", 1))[0] is not None
