"""FabricService.Predict over real gRPC against a broker on a real etcd."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
import pytest

from dxpool.api.v1 import fabric_pb2, fabric_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.client import Client
from dxpool.errors import InvalidArgument
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.conftest import Stubs, add_box, wait_until

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer

SAME_RACK_NS = 2_900  # default topology: 2 x (600 + 600 + 250)
SAME_POD_NS = 4_400  # 2 x (600 + 600 + 250 + 500 + 250)


@pytest.fixture
def fabric(broker: BrokerServer, stubs: Stubs, etcd_client: Any, key_prefix: str) -> Any:
    """box1 (4 H100, rack r1), box2 (4 H100, rack r2); host h1 alive on rack r1."""
    add_box(stubs, "box1", gpus=4, rack="r1")
    add_box(stubs, "box2", gpus=4, rack="r2")
    keys = KeySchema(key_prefix)
    host = pb.Host(
        name="hosts/h1", location=pb.Location(site="s1", pod="p1", rack="r1"), slot_capacity=8
    )
    Store(etcd_client, keys).commit(
        Txn().put(keys.host("h1"), host).put(keys.host_lease("h1"), b"")
    )
    with Client(broker.endpoint) as client:
        wait_until(lambda: any(h.alive for h in client.list_hosts()), message="h1 alive")
    return fabric_pb2_grpc.FabricServiceStub(stubs.channel)


def test_predict_for_one_box_gives_every_profile_by_default(fabric: Any) -> None:
    result = fabric.Predict(fabric_pb2.PredictRequest(host="hosts/h1", box="boxes/box2"))
    assert (result.host, result.box, result.round_trip_ns) == (
        "hosts/h1",
        "boxes/box2",
        SAME_POD_NS,
    )
    assert list(result.path) == [
        "proxy:hosts/h1",
        "rack:s1/p1/r1",
        "pod:s1/p1",
        "rack:s1/p1/r2",
        "proxy:boxes/box2",
    ]
    assert result.latency_model == "topology"
    assert [s.workload for s in result.slowdowns] == [
        "compute-bound",
        "inference-batch",
        "inference-online",
        "training",
    ]
    online = {s.workload: s for s in result.slowdowns}["inference-online"]
    assert online.slowdown == pytest.approx(1.088)
    assert online.profile == "100 round trips per 5ms step"
    assert [(link.box, link.round_trip_ns, link.gpus) for link in result.links] == [
        ("boxes/box2", SAME_POD_NS, 1)
    ]


def test_predict_for_a_request_uses_the_boxes_placement_would_take(
    fabric: Any, broker: BrokerServer
) -> None:
    request = fabric_pb2.PredictRequest(
        host="hosts/h1", gpus=pb.GpuRequest(model="H100", count=6), workload="400@5ms"
    )
    result = fabric.Predict(request)
    assert [(link.box, link.round_trip_ns, link.gpus) for link in result.links] == [
        ("boxes/box1", SAME_RACK_NS, 4),
        ("boxes/box2", SAME_POD_NS, 2),
    ]
    assert (result.box, result.round_trip_ns) == ("boxes/box2", SAME_POD_NS)
    (slowdown,) = result.slowdowns
    assert slowdown.workload == "400@5ms"
    assert slowdown.slowdown == pytest.approx(1 + 400 * SAME_POD_NS / 5_000_000)
    with Client(broker.endpoint) as client:
        same = client.predict("h1", gpus="H100:6", workload="400@5ms")
        assert same == result
        assert client.list_nodes() == []  # nothing was composed


@pytest.mark.parametrize(
    ("request_fields", "code", "words"),
    [
        ({"host": "hosts/nope", "box": "boxes/box1"}, grpc.StatusCode.NOT_FOUND, "not registered"),
        ({"host": "hosts/h1", "box": "boxes/nope"}, grpc.StatusCode.NOT_FOUND, "does not exist"),
        (
            {"host": "hosts/h1", "box": "boxes/box1", "workload": "mystery"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "known profiles: compute-bound, inference-batch, inference-online, training",
        ),
        ({"host": "hosts/h1"}, grpc.StatusCode.INVALID_ARGUMENT, "give exactly one of box"),
        (
            {"host": "hosts/h1", "box": "boxes/box1", "gpus": pb.GpuRequest(count=1)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "give exactly one of box (a box to predict for) and gpus",
        ),
        (
            {"host": "hosts/h1", "gpus": pb.GpuRequest(count=0)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid GPU count 0",
        ),
        (
            {"host": "hosts/h1", "gpus": pb.GpuRequest(model="H100", count=9)},
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "ask for fewer GPUs",
        ),
        ({"host": "h1", "box": "boxes/box1"}, grpc.StatusCode.INVALID_ARGUMENT, "hosts/"),
    ],
)
def test_predict_errors_say_what_to_fix(
    fabric: Any, request_fields: dict[str, Any], code: grpc.StatusCode, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        fabric.Predict(fabric_pb2.PredictRequest(**request_fields))
    assert raised.value.code() == code, raised.value.details()
    assert words in raised.value.details()


def test_the_client_checks_box_or_gpus_before_sending(broker: BrokerServer) -> None:
    with Client(broker.endpoint) as client, pytest.raises(InvalidArgument, match="exactly one"):
        client.predict("h1")
