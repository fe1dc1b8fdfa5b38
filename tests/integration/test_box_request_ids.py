"""CreateBox's request_id: a retry gets its box, a reuse is refused, a delete frees it.

The request key (``requests/{id}`` -> box name) lives exactly as long as its box: it is
written in the box's create transaction and removed in its delete transaction, so the
same request registers the box again after a delete (``dxpool up`` does that on every
start). Interleavings are forced by holding a call between its read of the request key
and its commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.inventory_service import InventoryService
from dxpool.store.keys import KeySchema
from tests.conftest import Stubs, add_box, pool_records
from tests.patience import patient

ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS


def create(box_id: str = "box1", *, request_id: str = "r1", rack: str = "r1", gpus: int = 2):
    return inventory_pb2.CreateBoxRequest(
        box_id=box_id,
        box=pb.Box(gpu_count=gpus, location=pb.Location(site="s1", pod="p1", rack=rack)),
        gpu_model="H100",
        gpu_memory_mib=81920,
        request_id=request_id,
    )


def dump(etcd_client: Any, prefix: str) -> dict[bytes, bytes]:
    return pool_records(etcd_client, prefix)


def reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    return info.reason


def test_a_retry_returns_the_same_box_and_writes_nothing(
    stubs: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    first = stubs.inventory.CreateBox(create())
    before = dump(etcd_client, key_prefix)
    again = stubs.inventory.CreateBox(create())
    assert again == first
    assert again.request_id == "r1"
    assert dump(etcd_client, key_prefix) == before


def test_a_retry_after_a_cordon_still_returns_the_box(stubs: Stubs) -> None:
    stubs.inventory.CreateBox(create())
    stubs.inventory.CordonBox(inventory_pb2.CordonBoxRequest(name="boxes/box1", reason="fan"))
    again = stubs.inventory.CreateBox(create())
    assert again.state == pb.BOX_STATE_CORDONED


@pytest.mark.parametrize(
    "other",
    [
        create(rack="r2"),  # the same box id, another location
        create(gpus=3),  # another size
        create("box2"),  # another box
    ],
)
def test_a_reused_request_id_is_already_exists(
    other: inventory_pb2.CreateBoxRequest, stubs: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    """It used to return the first box silently, whatever the second request asked."""
    stubs.inventory.CreateBox(create())
    before = dump(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as error:
        stubs.inventory.CreateBox(other)
    assert error.value.code() == ALREADY_EXISTS
    assert reason(error.value) == "REQUEST_ID_REUSED"
    assert "boxes/box1" in error.value.details() and "new request_id" in error.value.details()
    assert dump(etcd_client, key_prefix) == before


def test_a_request_id_of_a_node_is_not_taken_by_a_box(stubs: Stubs, sim_pool: Any) -> None:
    from tests.conftest import wait_hosts_alive

    add_box(stubs, "box9")
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    stubs.nodes.ComposeNode(
        nodes_pb2.ComposeNodeRequest(
            spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)), request_id="r1"
        )
    )
    with pytest.raises(grpc.RpcError) as error:
        stubs.inventory.CreateBox(create())
    assert error.value.code() == ALREADY_EXISTS
    assert reason(error.value) == "REQUEST_ID_REUSED"
    assert "nodes/" in error.value.details()


def test_a_request_id_of_a_box_is_not_taken_by_a_node(
    stubs: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    """It used to be INVALID_ARGUMENT about a node name the caller never gave."""
    stubs.inventory.CreateBox(create())
    before = dump(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as error:
        stubs.nodes.ComposeNode(
            nodes_pb2.ComposeNodeRequest(
                spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)), request_id="r1"
            )
        )
    assert error.value.code() == ALREADY_EXISTS
    assert reason(error.value) == "REQUEST_ID_REUSED"
    assert "boxes/box1" in error.value.details() and "new request_id" in error.value.details()
    assert dump(etcd_client, key_prefix) == before


def test_delete_removes_the_request_key_in_the_same_transaction(
    stubs: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    keys = KeySchema(key_prefix)
    stubs.inventory.CreateBox(create())
    start = etcd_client.get_prefix_response(key_prefix).header.revision + 1
    stubs.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/box1"))
    assert dump(etcd_client, key_prefix) == {}
    events, cancel = etcd_client.watch_prefix(key_prefix, start_revision=start)
    deleted: dict[str, int] = {}
    for event in events:
        deleted[event.key.decode()] = event.mod_revision
        if keys.box("box1") in deleted and keys.request("r1") in deleted:
            break
    cancel()
    assert deleted[keys.request("r1")] == deleted[keys.box("box1")]


def test_the_same_request_registers_the_box_again_after_a_delete(stubs: Stubs) -> None:
    """`dxpool up` registers its boxes with fixed request ids on every start."""
    stubs.inventory.CreateBox(create())
    stubs.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/box1"))
    again = stubs.inventory.CreateBox(create())
    assert again.name == "boxes/box1" and again.request_id == "r1"
    # and another request may take the id once the box is gone
    stubs.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/box1"))
    assert stubs.inventory.CreateBox(create("box2")).name == "boxes/box2"


def test_a_request_key_left_behind_by_a_deleted_box_is_taken_over(
    stubs: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    """Deletes before this change left request keys behind; the same request still works."""
    keys = KeySchema(key_prefix)
    etcd_client.put(keys.request("r1"), b"boxes/box1")  # box1 itself is long gone
    box = stubs.inventory.CreateBox(create())
    assert box.request_id == "r1"
    stubs.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/box1"))
    assert dump(etcd_client, key_prefix) == {}


# -- forced interleavings ----------------------------------------------------------------


class HoldFirstCreate:
    """Holds the first CreateBox between its read of the request key and its commit."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read = threading.Event()
        self.release = threading.Event()
        self.reads = 0
        original = InventoryService._earlier_create
        lock = threading.Lock()

        def held(service: InventoryService, *args: Any) -> Any:
            result = original(service, *args)
            with lock:
                self.reads += 1
                first = self.reads == 1
            if first:
                self.read.set()
                assert self.release.wait(patient(10)), "the held call was never released"
            return result

        monkeypatch.setattr(InventoryService, "_earlier_create", held)


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[HoldFirstCreate]:
    holder = HoldFirstCreate(monkeypatch)
    yield holder
    holder.release.set()


def _in_background(call: Callable[[], Any]) -> tuple[ThreadPoolExecutor, Future[Any]]:
    executor = ThreadPoolExecutor(1)
    return executor, executor.submit(call)


def test_two_calls_with_one_request_make_one_box(
    stubs: Stubs, hold: HoldFirstCreate, etcd_client: Any, key_prefix: str
) -> None:
    executor, held = _in_background(lambda: stubs.inventory.CreateBox(create(), timeout=20))
    assert hold.read.wait(patient(10))  # the first call saw no request key, and waits
    second = stubs.inventory.CreateBox(create(), timeout=20)
    hold.release.set()
    first = held.result(20)  # its commit fails; it looks again and finds the same request
    executor.shutdown()
    assert first == second
    boxes = [k for k in dump(etcd_client, key_prefix) if b"/boxes/" in k]
    assert len(boxes) == 1 and hold.reads >= 3


def test_a_held_call_with_another_request_loses_the_request_id(
    stubs: Stubs, hold: HoldFirstCreate
) -> None:
    executor, held = _in_background(lambda: stubs.inventory.CreateBox(create(rack="r2")))
    assert hold.read.wait(patient(10))
    winner = stubs.inventory.CreateBox(create(), timeout=20)
    hold.release.set()
    with pytest.raises(grpc.RpcError) as error:
        held.result(20)
    executor.shutdown()
    assert error.value.code() == ALREADY_EXISTS
    assert reason(error.value) == "REQUEST_ID_REUSED"
    box = stubs.inventory.GetBox(inventory_pb2.GetBoxRequest(name="boxes/box1"))
    assert box == winner and box.location.rack == "r1"


def test_a_held_call_after_a_create_and_delete_creates_the_box(
    stubs: Stubs, hold: HoldFirstCreate, etcd_client: Any, key_prefix: str
) -> None:
    """Create, delete, then the held call: it commits last, so its box is what remains."""
    keys = KeySchema(key_prefix)
    executor, held = _in_background(lambda: stubs.inventory.CreateBox(create(), timeout=20))
    assert hold.read.wait(patient(10))
    stubs.inventory.CreateBox(create(), timeout=20)
    stubs.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/box1"))
    hold.release.set()
    box = held.result(20)
    executor.shutdown()
    assert box.name == "boxes/box1"
    stored = dump(etcd_client, key_prefix)
    assert stored[keys.request("r1").encode()] == b"boxes/box1"
    assert keys.box("box1").encode() in stored
