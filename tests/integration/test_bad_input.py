"""Bad requests get the right status code, a message that says what to fix, and change
nothing in etcd."""

from __future__ import annotations

import grpc
import pytest

from dxpool.api.v1 import fabric_pb2, fabric_pb2_grpc, inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from tests.conftest import Stubs, add_box

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def spec(model: str = "H100", count: int = 1, **fields: object) -> pb.NodeSpec:
    return pb.NodeSpec(gpus=pb.GpuRequest(model=model, count=count), **fields)


def compose_request(**fields: object) -> nodes_pb2.ComposeNodeRequest:
    return nodes_pb2.ComposeNodeRequest(**fields)  # type: ignore[arg-type]


COMPOSE_CASES = {
    "unknown model": (compose_request(spec=spec("B300", 1)), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "zero count": (compose_request(spec=spec(count=0)), INVALID),
    "negative count": (compose_request(spec=spec(count=-3)), INVALID),
    "more than a node takes": (compose_request(spec=spec(count=65)), INVALID),
    "more than exist": (compose_request(spec=spec(count=9)), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "unknown host": (compose_request(spec=spec(host="hosts/nope")), NOT_FOUND),
    "malformed host": (compose_request(spec=spec(host="host/x")), INVALID),
    "malformed model": (compose_request(spec=spec(model="H100;rm -rf")), INVALID),
    "oversized model": (compose_request(spec=spec(model="H" * 5000)), INVALID),
    "oversized tenant": (compose_request(spec=spec(tenant="t" * 5000)), INVALID),
    "too many labels": (
        compose_request(spec=spec(labels={f"k{i}": "v" for i in range(100)})),
        INVALID,
    ),
    "negative latency": (compose_request(spec=spec(max_latency_ns=-1)), INVALID),
    "malformed node id": (compose_request(spec=spec(), node_id="Bad_Name"), INVALID),
    "oversized node id": (compose_request(spec=spec(), node_id="n" * 300), INVALID),
    "malformed request id": (compose_request(spec=spec(), request_id="a b"), INVALID),
    "oversized request id": (compose_request(spec=spec(), request_id="r" * 129), INVALID),
    "negative memory": (
        compose_request(spec=pb.NodeSpec(gpus=pb.GpuRequest(count=1, min_memory_mib=-1))),
        INVALID,
    ),
}


def dump(etcd_client, prefix: str) -> dict[bytes, bytes]:  # type: ignore[no-untyped-def]
    return {meta.key: value for value, meta in etcd_client.get_prefix(prefix)}


@pytest.mark.parametrize("case", sorted(COMPOSE_CASES))
def test_bad_compose_changes_nothing(case: str, stubs: Stubs, etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    add_box(stubs, "box1")
    request, code = COMPOSE_CASES[case]
    before = dump(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as error:
        stubs.nodes.ComposeNode(request)
    assert error.value.code() == code, error.value.details()
    assert len(error.value.details()) > 20
    assert dump(etcd_client, key_prefix) == before


BOX_CASES = {
    "missing id": inventory_pb2.CreateBoxRequest(box=pb.Box(gpu_count=1), gpu_model="H100"),
    "malformed id": inventory_pb2.CreateBoxRequest(
        box_id="Box_1", box=pb.Box(gpu_count=1), gpu_model="H100"
    ),
    "oversized id": inventory_pb2.CreateBoxRequest(
        box_id="b" * 100, box=pb.Box(gpu_count=1), gpu_model="H100"
    ),
    "zero gpus": inventory_pb2.CreateBoxRequest(box_id="b1", gpu_model="H100"),
    "too many gpus": inventory_pb2.CreateBoxRequest(
        box_id="b1", box=pb.Box(gpu_count=65), gpu_model="H100"
    ),
    "missing model": inventory_pb2.CreateBoxRequest(box_id="b1", box=pb.Box(gpu_count=2)),
    "duplicate slot": inventory_pb2.CreateBoxRequest(
        box_id="b1",
        gpus=[
            inventory_pb2.GpuSlotSpec(slot=0, model="H100"),
            inventory_pb2.GpuSlotSpec(slot=0, model="H100"),
        ],
    ),
    "oversized location": inventory_pb2.CreateBoxRequest(
        box_id="b1", box=pb.Box(gpu_count=1, location=pb.Location(site="s" * 500)), gpu_model="H100"
    ),
}


@pytest.mark.parametrize("case", sorted(BOX_CASES))
def test_bad_create_box_changes_nothing(
    case: str, stubs: Stubs, etcd_client, key_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    before = dump(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as error:
        stubs.inventory.CreateBox(BOX_CASES[case])
    assert error.value.code() == INVALID, error.value.details()
    assert dump(etcd_client, key_prefix) == before


def test_duplicate_box_is_already_exists(stubs: Stubs) -> None:
    add_box(stubs, "box1")
    with pytest.raises(grpc.RpcError) as error:
        add_box(stubs, "box1")
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda s: s.inventory.GetBox(inventory_pb2.GetBoxRequest(name="boxes/nope")), NOT_FOUND),
        (lambda s: s.inventory.GetBox(inventory_pb2.GetBoxRequest(name="nope")), INVALID),
        (lambda s: s.inventory.GetGpu(inventory_pb2.GetGpuRequest(name="boxes/b/gpus/x")), INVALID),
        (lambda s: s.inventory.GetHost(inventory_pb2.GetHostRequest(name="hosts/zz")), NOT_FOUND),
        (lambda s: s.nodes.GetNode(nodes_pb2.GetNodeRequest(name="nodes/zz")), NOT_FOUND),
        (lambda s: s.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name="nodes/zz")), NOT_FOUND),
        (lambda s: s.nodes.ListNodes(nodes_pb2.ListNodesRequest(page_token="garbage")), INVALID),
        (lambda s: s.inventory.ListBoxes(inventory_pb2.ListBoxesRequest(page_size=-1)), INVALID),
        (
            lambda s: s.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/zz")),
            NOT_FOUND,
        ),
    ],
)
def test_lookups(call, code, stubs: Stubs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as error:
        call(stubs)
    assert error.value.code() == code


def test_error_details_carry_reason(stubs: Stubs) -> None:
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    with pytest.raises(grpc.RpcError) as error:
        stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name="nodes/zz"))
    status = rpc_status.from_call(error.value)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    assert info.reason == "NODE_NOT_FOUND"
    assert info.domain == "dxpool.io"


def test_unknown_host_latency(stubs: Stubs) -> None:
    add_box(stubs, "box1")
    fabric = fabric_pb2_grpc.FabricServiceStub(stubs.channel)
    with pytest.raises(grpc.RpcError) as error:
        fabric.GetLatency(fabric_pb2.GetLatencyRequest(host="hosts/nope", box="boxes/box1"))
    assert error.value.code() == NOT_FOUND
