"""InventoryService's list views against a real broker and etcd: label selectors on boxes
and hosts, free GPUs per box, and the slot numbers a host's allocation uses."""

from __future__ import annotations

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.server import BrokerServer
from dxpool.store.keys import KeySchema
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
