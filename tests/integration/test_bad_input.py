"""Bad requests get the right status code, a message that says what to fix, and change
nothing in etcd."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import fabric_pb2, fabric_pb2_grpc, inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from tests.conftest import Stubs, add_box, pool_records

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def spec(model: str = "H100", count: int = 1, **fields: object) -> pb.NodeSpec:
    return pb.NodeSpec(gpus=pb.GpuRequest(model=model, count=count), **fields)


def compose_request(**fields: object) -> nodes_pb2.ComposeNodeRequest:
    return nodes_pb2.ComposeNodeRequest(**fields)  # type: ignore[arg-type]


COMPOSE_CASES = {
    "unknown model": (compose_request(spec=spec("B300", 1)), grpc.StatusCode.FAILED_PRECONDITION),
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
    "slowdown without workload": (compose_request(spec=spec(max_slowdown=1.05)), INVALID),
    "slowdown of one": (compose_request(spec=spec(max_slowdown=1.0, workload="training")), INVALID),
    "nan slowdown": (
        compose_request(spec=spec(max_slowdown=float("nan"), workload="training")),
        INVALID,
    ),
    "unknown workload": (compose_request(spec=spec(max_slowdown=1.05, workload="x")), INVALID),
    "control character in workload": (compose_request(spec=spec(workload="a\x00")), INVALID),
    "malformed node id": (compose_request(spec=spec(), node_id="Bad_Name"), INVALID),
    "oversized node id": (compose_request(spec=spec(), node_id="n" * 300), INVALID),
    "malformed request id": (compose_request(spec=spec(), request_id="a b"), INVALID),
    "oversized request id": (compose_request(spec=spec(), request_id="r" * 129), INVALID),
    "negative memory": (
        compose_request(spec=pb.NodeSpec(gpus=pb.GpuRequest(count=1, min_memory_mib=-1))),
        INVALID,
    ),
}


def dump(etcd_client: Any, prefix: str) -> dict[bytes, bytes]:
    return pool_records(etcd_client, prefix)


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


# -- defects found by review: each case once answered wrongly ----------------------------

C1 = "\u0085"  # NEXT LINE, a C1 control character
CSI = "\u009b"  # C1 control sequence introducer: "\u009b31m" turns a terminal red
RLO = "\u202e"  # RIGHT-TO-LEFT OVERRIDE, a format character that reverses shown text


@pytest.mark.parametrize(
    "name",
    [
        "boxes/box1/gpus/\u00b3",
        "boxes/box1/gpus/\u00b2",
        "boxes/box1/gpus/" + "9" * 4000,  # as long as GetGpu's 4 KiB allows
        "boxes/box1/gpus/\u0663",
    ],
)
def test_gpu_slots_that_are_not_ascii_digits_are_invalid(
    name: str, stubs: Stubs, etcd_client, key_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    """str.isdigit() accepted these and int() then raised: the call ended INTERNAL."""
    add_box(stubs, "box1")
    before = dump(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as error:
        stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=name))
    assert error.value.code() == INVALID, error.value.details()
    assert "0-4095" in error.value.details()
    assert len(error.value.details()) < 400
    assert dump(etcd_client, key_prefix) == before


def test_a_name_longer_than_its_request_may_be_is_refused_undecoded(
    stubs: Stubs, etcd_client, key_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    """A slot of 5000 digits (int() refuses over 4300) no longer reaches a parser at all:
    the request is over GetGpu's size limit."""
    add_box(stubs, "box1")
    before = dump(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as error:
        stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name="boxes/box1/gpus/" + "9" * 5000))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.value.details()
    assert "GetGpu takes at most 4096 bytes" in error.value.details()
    assert dump(etcd_client, key_prefix) == before


def _box(box_id: str, **fields: object) -> inventory_pb2.CreateBoxRequest:
    request = inventory_pb2.CreateBoxRequest(
        box_id=box_id, box=pb.Box(gpu_count=2), gpu_model="H100", gpu_memory_mib=81920
    )
    for field, value in fields.items():
        if field.startswith("box_"):
            setattr(request.box, field.removeprefix("box_"), value)
        else:
            setattr(request, field, value)
    return request


INVALID_BOXES = {
    "id with a trailing newline": _box("a\n"),
    "name with a trailing newline": inventory_pb2.CreateBoxRequest(
        box=pb.Box(name="boxes/a\n", gpu_count=1), gpu_model="H100"
    ),
    "box_id and box.name apart": inventory_pb2.CreateBoxRequest(
        box_id="box1", box=pb.Box(name="boxes/box2", gpu_count=1), gpu_model="H100"
    ),
    "request id with a trailing newline": _box("box1", request_id="r1\n"),
    "memory of 2^63-1 MiB": _box("box1", gpu_memory_mib=2**63 - 1),
    "memory over 16 TiB": _box("box1", gpu_memory_mib=16 * 1024 * 1024 + 1),
    "negative memory": _box("box1", gpu_memory_mib=-1),
    "model with a trailing newline": _box("box1", gpu_model="H100\n"),
    "C1 control in a label": inventory_pb2.CreateBoxRequest(
        box_id="box1", box=pb.Box(gpu_count=1, labels={"team": "ml" + C1}), gpu_model="H100"
    ),
    "terminal escape in a label key": inventory_pb2.CreateBoxRequest(
        box_id="box1", box=pb.Box(gpu_count=1, labels={CSI + "31m": "x"}), gpu_model="H100"
    ),
    "bidi override in the endpoint": _box("box1", box_fabric_endpoint="127.0.0.1" + RLO),
    "newline in the rack": inventory_pb2.CreateBoxRequest(
        box_id="box1",
        box=pb.Box(gpu_count=1, location=pb.Location(site="s1", pod="p1", rack="r1\n")),
        gpu_model="H100",
    ),
    "slot out of range": inventory_pb2.CreateBoxRequest(
        box_id="box1", gpus=[inventory_pb2.GpuSlotSpec(slot=2**31 - 1, model="H100")]
    ),
    "slot memory of 2^63-1 MiB": inventory_pb2.CreateBoxRequest(
        box_id="box1", gpus=[inventory_pb2.GpuSlotSpec(slot=0, model="H100", memory_mib=2**63 - 1)]
    ),
    "malformed pci id": inventory_pb2.CreateBoxRequest(
        box_id="box1", gpus=[inventory_pb2.GpuSlotSpec(slot=0, model="H100", pci_id="10de\n")]
    ),
    "more slots than a box holds": inventory_pb2.CreateBoxRequest(
        box_id="box1",
        gpus=[inventory_pb2.GpuSlotSpec(slot=i, model="H100") for i in range(65)],
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID_BOXES))
def test_invalid_boxes_change_nothing(
    case: str, stubs: Stubs, etcd_client, key_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    before = dump(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as error:
        stubs.inventory.CreateBox(INVALID_BOXES[case])
    assert error.value.code() == INVALID, error.value.details()
    assert error.value.details().isprintable(), error.value.details()
    assert dump(etcd_client, key_prefix) == before


INVALID_NODES = {
    "node id with a trailing newline": compose_request(spec=spec(), node_id="a\n"),
    "host with a trailing newline": compose_request(spec=spec(host="hosts/h1\n")),
    "request id with a trailing newline": compose_request(spec=spec(), request_id="r1\n"),
    "minimum memory of 2^63-1 MiB": compose_request(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(count=1, min_memory_mib=2**63 - 1))
    ),
    "latency bound of 2^63-1 ns": compose_request(spec=spec(max_latency_ns=2**63 - 1)),
    "C1 control in the tenant": compose_request(spec=spec(tenant="ml" + C1)),
    "bidi override in a label": compose_request(spec=spec(labels={"team": RLO + "lm"})),
    "line separator in a label": compose_request(spec=spec(labels={"team": "a\u2028b"})),
}


@pytest.mark.parametrize("case", sorted(INVALID_NODES))
@pytest.mark.parametrize("rpc", ["ComposeNode", "PlanNode"])
def test_invalid_nodes_change_nothing(
    case: str, rpc: str, stubs: Stubs, etcd_client, key_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    request: Any = INVALID_NODES[case]
    if rpc == "PlanNode":
        if request.node_id or request.request_id:
            pytest.skip("a plan takes no node id or request id")
        request = nodes_pb2.PlanNodeRequest(spec=request.spec)
    add_box(stubs, "box1")
    before = dump(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as error:
        getattr(stubs.nodes, rpc)(request)
    assert error.value.code() == INVALID, error.value.details()
    assert dump(etcd_client, key_prefix) == before


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.inventory.CordonBox(
            inventory_pb2.CordonBoxRequest(name="boxes/box1", reason="disk" + C1)
        ),
        lambda s: s.inventory.CordonBox(
            inventory_pb2.CordonBoxRequest(name="boxes/box1", reason="\x1b[2Jgone")
        ),
        lambda s: s.inventory.GetBox(inventory_pb2.GetBoxRequest(name="boxes/box1\n")),
        lambda s: s.inventory.DeleteBox(inventory_pb2.DeleteBoxRequest(name="boxes/box1\n")),
        lambda s: s.inventory.ListGpus(inventory_pb2.ListGpusRequest(state=99)),
        lambda s: s.inventory.ListGpus(inventory_pb2.ListGpusRequest(model="H100\n")),
        lambda s: s.inventory.ListBoxes(inventory_pb2.ListBoxesRequest(page_token="x" * 5000)),
        lambda s: s.nodes.GetNode(nodes_pb2.GetNodeRequest(name="nodes/n1\n")),
        lambda s: s.nodes.ListNodes(nodes_pb2.ListNodesRequest(host="hosts/h1\n")),
    ],
)
def test_other_invalid_calls_change_nothing(
    call, stubs: Stubs, etcd_client, key_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    add_box(stubs, "box1")
    before = dump(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as error:
        call(stubs)
    assert error.value.code() == INVALID, error.value.details()
    assert dump(etcd_client, key_prefix) == before


def test_box_slots_accept_their_whole_range(stubs: Stubs) -> None:
    """The bounds are limits, not typos: the largest valid values are accepted."""
    box = stubs.inventory.CreateBox(
        inventory_pb2.CreateBoxRequest(
            box_id="big",
            gpus=[
                inventory_pb2.GpuSlotSpec(
                    slot=63, model="H100", memory_mib=16 * 1024 * 1024, pci_id="10de:2330"
                )
            ],
            box=pb.Box(labels={"note": "caf\u00e9 \u6771\u4eac"}),
        )
    )
    assert box.gpu_count == 1
    gpu = stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name="boxes/big/gpus/63"))
    assert gpu.memory_mib == 16 * 1024 * 1024


def test_an_undecodable_payload_is_invalid_argument_without_a_traceback(
    stubs: Stubs, etcd_client, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """grpc answered INTERNAL and logged a full traceback for every such call."""
    caplog.set_level("DEBUG")
    before = dump(etcd_client, key_prefix)
    call = stubs.channel.unary_unary(
        "/dxpool.v1.InventoryService/CreateBox",
        request_serializer=None,
        response_deserializer=None,
    )
    for _ in range(20):
        with pytest.raises(grpc.RpcError) as error:
            call(b"\x0a\x05ab", timeout=10)
        assert error.value.code() == INVALID, error.value.details()
        assert "dxpool.v1.CreateBoxRequest" in error.value.details()
    assert not [r for r in caplog.records if r.exc_info]
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 1
    assert dump(etcd_client, key_prefix) == before
