"""The broker serves gRPC health checking and reflection, so load balancers and grpcurl
work, and it keeps GPU models apart."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from tests.conftest import SimPool, Stubs, add_box, register_sim_box, wait_hosts_alive

SERVICES = {
    "dxpool.v1.InventoryService",
    "dxpool.v1.NodeService",
    "dxpool.v1.FabricService",
    "grpc.health.v1.Health",
}


def test_health_reports_serving(stubs: Stubs) -> None:
    health = health_pb2_grpc.HealthStub(stubs.channel)
    for service in ("", *sorted(SERVICES - {"grpc.health.v1.Health"})):
        response = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service


def test_reflection_lists_and_describes_services(stubs: Stubs) -> None:
    reflection = reflection_pb2_grpc.ServerReflectionStub(stubs.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="dxpool.v1.NodeService"),
    ]
    listed, described = list(reflection.ServerReflectionInfo(iter(requests)))
    names = {service.name for service in listed.list_services_response.service}
    assert names >= SERVICES
    assert described.file_descriptor_response.file_descriptor_proto


def test_models_are_kept_apart(stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "hbox", gpus=4, model="H100")
    register_sim_box(sim_pool, stubs, "abox", gpus=4, model="A100")
    sim_pool.start_agent("h1", slots=16)
    wait_hosts_alive(stubs)

    def compose(model: str, count: int) -> pb.VirtualNode:
        return stubs.nodes.ComposeNode(
            nodes_pb2.ComposeNodeRequest(
                spec=pb.NodeSpec(gpus=pb.GpuRequest(model=model, count=count))
            )
        )

    a100 = compose("a100", 3)  # models compare case-insensitively
    assert {b.model for b in a100.gpus} == {"A100"}
    assert all(b.gpu.startswith("boxes/abox/") for b in a100.gpus)
    h100 = compose("H100", 4)
    assert {b.model for b in h100.gpus} == {"H100"}
    try:
        compose("A100", 2)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "A100" in (error.details() or "")
    else:
        raise AssertionError("only one A100 was left")
    listed = stubs.inventory.ListGpus(inventory_pb2.ListGpusRequest(model="A100"))
    assert len(listed.gpus) == 4


def test_list_pages_cover_every_box(stubs: Stubs) -> None:
    for index in range(7):
        add_box(stubs, f"box{index}", gpus=1)
    seen: list[str] = []
    token = ""
    while True:
        page = stubs.inventory.ListBoxes(
            inventory_pb2.ListBoxesRequest(page_size=3, page_token=token)
        )
        seen.extend(box.name for box in page.boxes)
        token = page.next_page_token
        if not token:
            break
    assert seen == [f"boxes/box{index}" for index in range(7)]
