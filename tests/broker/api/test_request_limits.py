"""Per-method request limits: the largest valid request of each method fits its limit; a
larger one is refused RESOURCE_EXHAUSTED before it is decoded, and leaves nothing in etcd
(neither the pool nor the audit log)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client import REGISTRY

from dxpool.api.v1 import agent_pb2, audit_pb2, fabric_pb2, inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.audit import audit_prefix
from dxpool.broker.api.decoding import Oversized, guard_deserializer
from dxpool.broker.api.request_limits import (
    AGENT_SERVER_MAX_RECEIVE_BYTES,
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_REQUEST_BYTES,
    SERVER_MAX_RECEIVE_BYTES,
    limit_for,
)
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.nodes.gang import gang_ops
from dxpool.broker.nodes.validation import check_box, check_node_spec
from dxpool.broker.state.metrics import method_label
from dxpool.limits import (
    MAX_EXCLUDED_HOSTS,
    MAX_GANG_MEMBERS,
    MAX_GPU_MEMORY_MIB,
    MAX_GPUS_PER_BOX,
    MAX_HOST_CPUS,
    MAX_HOST_MEMORY_MIB,
    MAX_HOST_SLOTS,
    MAX_LABEL_KEY,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_LOCATION_PART,
    MAX_PAGE_TOKEN,
    MAX_QUOTA_MODELS,
    MAX_ROUND_TRIPS,
    MAX_STATUS_ENTRIES,
    MAX_STATUS_TEXT,
    MAX_TENANT,
    MAX_TEXT,
    MAX_TXN_OPS,
)
from dxpool.request import MAX_MODEL_LENGTH, MAX_MODELS_IN_SET
from dxpool.selector import MAX_SELECTOR_LENGTH
from tests.conftest import pool_records

SERVICES = {
    "InventoryService": inventory_pb2,
    "NodeService": nodes_pb2,
    "FabricService": fabric_pb2,
    "AuditService": audit_pb2,
    "AgentService": agent_pb2,
}
ID = "a" * 63  # the longest id
REQUEST_ID = "r" * 128
TOKEN = "t" * MAX_PAGE_TOKEN


def _labels(tag: str) -> dict[str, str]:
    return {
        f"{tag}{i:02d}".ljust(MAX_LABEL_KEY, "k"): "v" * MAX_LABEL_VALUE for i in range(MAX_LABELS)
    }


def largest_spec() -> pb.NodeSpec:
    """A NodeSpec with every field at its limit (ASCII text)."""
    models = "|".join(f"m{i}".ljust(MAX_MODEL_LENGTH, "x") for i in range(MAX_MODELS_IN_SET))
    spec = pb.NodeSpec(
        gpus=pb.GpuRequest(
            model=models, count=1, min_memory_mib=MAX_GPU_MEMORY_MIB, mixed_models=True
        ),
        host=f"hosts/{ID}",
        max_latency_ns=10**9,
        vfio=True,
        tenant="t" * MAX_TENANT,
        labels=_labels("l"),
        workload="inference-online",  # a profile name or ROUND_TRIPS@STEP_TIME
        max_gpus_per_box=64,
        host_selector=_labels("s"),
        cpu_cores=MAX_HOST_CPUS,
        host_memory_mib=MAX_HOST_MEMORY_MIB,
        exclude_hosts=[f"hosts/{ID[:-4]}{i:04d}" for i in range(MAX_EXCLUDED_HOSTS)],
    )
    return spec


def _latest(stamp: Any) -> None:
    stamp.seconds, stamp.nanos = 253402300799, 999999999  # the largest a Timestamp takes


def largest_status() -> pb.HostStatus:
    """A host's status with every entry and text at its limit (ASCII)."""
    attachment = pb.ObservedAttachment(
        gpu=f"boxes/{ID}/gpus/4095",
        generation=2**62,
        phase=pb.ATTACHMENT_PHASE_FAILED,
        host_slot=MAX_HOST_SLOTS - 1,
        bdf="b" * MAX_TEXT,
        uuid="u" * MAX_TEXT,
        serial="s" * MAX_TEXT,
        health=pb.GPU_HEALTH_UNHEALTHY,
        message="m" * MAX_STATUS_TEXT,
        health_reason="h" * MAX_STATUS_TEXT,
        scrubbed=True,
        identity_mismatch=True,
    )
    _latest(attachment.update_time)
    trip = pb.RoundTripSample(box=f"boxes/{ID}", round_trip_ns=2**62)
    _latest(trip.measure_time)
    status = pb.HostStatus(
        host=f"hosts/{ID}",
        attachments=[attachment] * MAX_STATUS_ENTRIES,
        round_trips=[trip] * MAX_ROUND_TRIPS,
    )
    _latest(status.update_time)
    return status


def largest_hello() -> agent_pb2.ConnectRequest:
    """An agent's hello with its registration at every limit (ASCII)."""
    host = pb.Host(
        name=f"hosts/{ID}",
        location=pb.Location(
            site="s" * MAX_LOCATION_PART, pod="p" * MAX_LOCATION_PART, rack="r" * MAX_LOCATION_PART
        ),
        agent_endpoint="e" * MAX_TEXT,
        slot_capacity=MAX_HOST_SLOTS,
        labels=_labels("h"),
        driver="d" * MAX_TEXT,
        cpu_cores=MAX_HOST_CPUS,
        memory_mib=MAX_HOST_MEMORY_MIB,
    )
    _latest(host.register_time)
    hello = agent_pb2.AgentHello(
        host=host,
        token="t" * MAX_TEXT,
        liveness_ttl_ms=2**62,
        spec_revision=2**62,
        revision=2**62,
        status_known=True,
    )
    return agent_pb2.ConnectRequest(hello=hello)


def largest_requests() -> dict[str, Message]:
    """The largest valid request (or one at least as large) of every method that needs
    more than a name or two."""
    spec = largest_spec()
    members = (MAX_TXN_OPS - 2) // 4  # 1-GPU members: GPU + 3 ops each, + tenant + 1
    assert gang_ops([spec] * members) <= MAX_TXN_OPS < gang_ops([spec] * (members + 1))
    box = pb.Box(
        location=pb.Location(
            site="s" * MAX_LOCATION_PART, pod="p" * MAX_LOCATION_PART, rack="r" * MAX_LOCATION_PART
        ),
        fabric_endpoint="e" * MAX_TEXT,
        gpu_count=MAX_GPUS_PER_BOX,
        labels=_labels("b"),
    )
    slots = [
        inventory_pb2.GpuSlotSpec(
            slot=i, model="M" * MAX_MODEL_LENGTH, memory_mib=MAX_GPU_MEMORY_MIB, pci_id="10de:2330"
        )
        for i in range(MAX_GPUS_PER_BOX)
    ]
    selector = ("k=" + "v" * MAX_SELECTOR_LENGTH)[:MAX_SELECTOR_LENGTH]
    reason = "x" * MAX_TEXT
    return {
        "NodeService.ComposeGang": nodes_pb2.ComposeGangRequest(
            members=[spec] * members, gang_id=ID, request_id=REQUEST_ID
        ),
        "NodeService.ComposeNode": nodes_pb2.ComposeNodeRequest(
            spec=spec, node_id=ID, request_id=REQUEST_ID
        ),
        "NodeService.PlanNode": nodes_pb2.ComposeNodeRequest(spec=spec, node_id=ID),
        "InventoryService.CreateBox": inventory_pb2.CreateBoxRequest(
            box_id=ID,
            box=box,
            gpus=slots,
            gpu_model="M" * MAX_MODEL_LENGTH,
            gpu_memory_mib=MAX_GPU_MEMORY_MIB,
            request_id=REQUEST_ID,
        ),
        "NodeService.ListNodes": nodes_pb2.ListNodesRequest(
            page_size=1000, page_token=TOKEN, host=f"hosts/{ID}", label_selector=selector
        ),
        "InventoryService.ListBoxes": inventory_pb2.ListBoxesRequest(
            page_size=1000, page_token=TOKEN, label_selector=selector
        ),
        "InventoryService.ListHosts": inventory_pb2.ListHostsRequest(
            page_size=1000, page_token=TOKEN, label_selector=selector
        ),
        "NodeService.ResizeNode": nodes_pb2.ResizeNodeRequest(
            name=f"nodes/{ID}",
            gpu_count=64,
            remove=[f"boxes/{ID}/gpus/{i}" for i in range(64)],
            request_id=REQUEST_ID,
        ),
        "NodeService.SetTenantQuota": nodes_pb2.SetTenantQuotaRequest(
            name=f"tenants/{'t' * MAX_TENANT}",
            quota=pb.TenantQuota(
                gpus=10**6,
                nodes=10**6,
                gpus_by_model={
                    f"m{i}".ljust(MAX_MODEL_LENGTH, "x"): 10**6 for i in range(MAX_QUOTA_MODELS)
                },
            ),
        ),
        "InventoryService.CordonBox": inventory_pb2.CordonBoxRequest(
            name=f"boxes/{ID}", reason=reason
        ),
        "InventoryService.CordonHost": inventory_pb2.CordonHostRequest(
            name=f"hosts/{ID}", reason=reason
        ),
        "InventoryService.DrainHost": inventory_pb2.DrainHostRequest(
            name=f"hosts/{ID}", reason=reason, policy=pb.DRAIN_POLICY_RELEASE
        ),
        "InventoryService.DrainBox": inventory_pb2.DrainBoxRequest(
            name=f"boxes/{ID}", reason=reason, policy=pb.DRAIN_POLICY_RELEASE
        ),
        "NodeService.ListQueue": nodes_pb2.ListQueueRequest(
            page_size=1000, page_token=TOKEN, tenant="t" * MAX_TENANT
        ),
        "InventoryService.ReclaimGpu": inventory_pb2.ReclaimGpuRequest(
            name=f"boxes/{ID}/gpus/4095", reason=reason
        ),
        "InventoryService.ClearGpuHealth": inventory_pb2.ClearGpuHealthRequest(
            name=f"boxes/{ID}/gpus/4095", reason=reason
        ),
        "InventoryService.ListGpus": inventory_pb2.ListGpusRequest(
            parent=f"boxes/{ID}", page_size=1000, page_token=TOKEN, model="M" * 520
        ),
        "AuditService.ListAuditRecords": audit_pb2.ListAuditRecordsRequest(
            page_size=1000,
            page_token=TOKEN,
            identity=f"dxpool://tenant/{ID}",
            target=f"boxes/{ID}/gpus/4095",
        ),
        "FabricService.Predict": fabric_pb2.PredictRequest(
            host=f"hosts/{ID}", gpus=spec.gpus, workload="w" * MAX_TEXT
        ),
        "AgentService.Connect": largest_hello(),
        "AgentService.ReportStatus": agent_pb2.ReportStatusRequest(
            host=f"hosts/{ID}", session="x" * MAX_TEXT, status=largest_status(), spec_revision=2**62
        ),
    }


def _path(name: str) -> str:
    service, method = name.split(".")
    return f"/{SERVICES[service].DESCRIPTOR.services_by_name[service].full_name}/{method}"


def test_the_largest_spec_is_valid() -> None:
    check_node_spec(largest_spec())
    box = largest_requests()["InventoryService.CreateBox"]
    assert isinstance(box, inventory_pb2.CreateBoxRequest)
    check_box(box.box_id, box.box, len(box.gpus))


@pytest.mark.parametrize("name", sorted(largest_requests()))
def test_the_largest_request_of_each_method_fits_its_limit(name: str) -> None:
    size = len(largest_requests()[name].SerializeToString())
    limit = limit_for(_path(name))
    assert size <= limit, f"{name}: {size} bytes, limit {limit}"
    # and the limit is what the method needs, not much more: within a factor of 2
    assert limit <= max(2 * size, DEFAULT_MAX_REQUEST_BYTES), f"{name}: {size} of {limit}"


def test_a_gang_of_the_most_members_with_ordinary_specs_fits_its_limit() -> None:
    """Gangs are chunked over transactions, so a gang may have MAX_GANG_MEMBERS members;
    with specs of an ordinary size (a model and count, a tenant, two labels, a priority,
    a grace) the largest such request still fits ComposeGang's limit."""
    spec = pb.NodeSpec(
        gpus=pb.GpuRequest(model="H100", count=8),
        tenant="t" * 32,
        labels={"job": "j" * 40, "team": "t" * 24},
        priority=1000,
        preemption_grace_s=3600,
    )
    request = nodes_pb2.ComposeGangRequest(
        members=[spec] * MAX_GANG_MEMBERS, gang_id=ID, request_id=REQUEST_ID
    )
    assert len(request.SerializeToString()) <= limit_for(_path("NodeService.ComposeGang"))


def _api_methods() -> dict[str, str]:
    """``Service.Method`` -> method path, for every service of every ``dxpool.v1`` proto
    module (a service added later is found here without an edit)."""
    import dxpool.api.v1 as api

    found = {}
    for info in pkgutil.iter_modules(api.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"{api.__name__}.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                found[f"{service.name}.{method.name}"] = f"/{service.full_name}/{method.name}"
    return found


# Methods whose requests are a name or two, ids, a page size and token: the default limit.
SMALL = {
    "InventoryService.GetBox", "InventoryService.UncordonBox", "InventoryService.DeleteBox",
    "InventoryService.UncordonHost",
    "InventoryService.GetGpu", "InventoryService.GetHost", "InventoryService.GetPoolStatus",
    "NodeService.GetNode", "NodeService.GetNodeHostdev", "NodeService.ReleaseNode",
    "NodeService.WatchNodes", "NodeService.GetGang", "NodeService.ReleaseGang",
    "NodeService.GetTenant", "NodeService.ListTenants", "NodeService.DeleteTenant",
    "FabricService.GetLatency",
}  # fmt: skip


def test_every_method_is_sized() -> None:
    """A new RPC says how large its requests get: its largest request is built above, or
    it is one of the small ones (and so takes the default limit)."""
    methods = _api_methods()
    unsized = set(methods) - set(largest_requests()) - SMALL
    assert not unsized, f"add these to largest_requests() or SMALL: {sorted(unsized)}"
    assert not {name for name in SMALL if methods[name] in MAX_REQUEST_BYTES}


def test_the_table_names_only_methods_the_broker_serves() -> None:
    """Each port's receive limit is the largest of its own methods': a host's status
    raises the agent port's, never the API port's."""
    assert set(MAX_REQUEST_BYTES) <= set(_api_methods().values())
    agent = {m: size for m, size in MAX_REQUEST_BYTES.items() if "/dxpool.v1.AgentService/" in m}
    api = {m: size for m, size in MAX_REQUEST_BYTES.items() if m not in agent}
    assert max(api.values()) == SERVER_MAX_RECEIVE_BYTES
    assert max(agent.values()) == AGENT_SERVER_MAX_RECEIVE_BYTES
    assert SERVER_MAX_RECEIVE_BYTES < AGENT_SERVER_MAX_RECEIVE_BYTES


def test_a_guarded_deserializer_does_not_decode_an_oversized_payload() -> None:
    decoded: list[bytes] = []

    def decode(payload: bytes) -> Any:
        decoded.append(payload)
        return nodes_pb2.GetNodeRequest.FromString(payload)

    guarded = guard_deserializer(decode, max_bytes=16)
    assert isinstance(guarded(b"\x0a\x07nodes/a"), nodes_pb2.GetNodeRequest)
    refused = guarded(b"\x0a\x11" + b"n" * 17)
    assert isinstance(refused, Oversized) and (refused.size, refused.limit) == (19, 16)
    assert decoded == [b"\x0a\x07nodes/a"]


def _oversized(method: str) -> float:
    label = method_label(method)
    return REGISTRY.get_sample_value("dxpool_rpc_oversized_total", {"method": label}) or 0.0


def _call(channel: grpc.Channel, name: str, payload: bytes) -> grpc.RpcError:
    call: Callable[..., Any] = channel.unary_unary(
        _path(name), request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as refused:
        call(payload, timeout=60)
    return refused.value


def _reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, error
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def test_huge_requests_are_refused_and_write_nothing(
    broker: BrokerServer, etcd_client: Any, key_prefix: str
) -> None:
    """A 3.9 MB ComposeNode ends in gRPC's transport; a 33 KiB ComposeNode and a 100 KiB
    GetBox end at their method's limit with REQUEST_TOO_LARGE; none of them reaches the
    servicer or the audit log, and etcd holds what it held."""
    channel = grpc.insecure_channel(broker.endpoint, options=[("grpc.max_send_message_length", -1)])
    before = pool_records(etcd_client, key_prefix)
    audit_before = dict(etcd_client.get_prefix(audit_prefix(key_prefix)))
    compose = "/dxpool.v1.NodeService/ComposeNode"
    counted = _oversized(compose)

    def compose_request(node_id_bytes: int) -> bytes:
        return nodes_pb2.ComposeNodeRequest(
            spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)),
            node_id="n" * node_id_bytes,
        ).SerializeToString()

    try:
        huge = _call(channel, "NodeService.ComposeNode", compose_request(3_900_000))
        assert huge.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        just_over = compose_request(32 * 1024)
        refused = _call(channel, "NodeService.ComposeNode", just_over)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert _reason(refused) == "REQUEST_TOO_LARGE"
        assert f"the request is {len(just_over)} bytes; ComposeNode takes at most 32768" in (
            refused.details()  # type: ignore[attr-defined]
        )
        getbox = inventory_pb2.GetBoxRequest(name="boxes/" + "b" * 100_000).SerializeToString()
        refused = _call(channel, "InventoryService.GetBox", getbox)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert _reason(refused) == "REQUEST_TOO_LARGE"
    finally:
        channel.close()
    assert _oversized(compose) == counted + 1  # the 3.9 MB one never reached Python
    assert pool_records(etcd_client, key_prefix) == before
    assert dict(etcd_client.get_prefix(audit_prefix(key_prefix))) == audit_before


def test_the_largest_compose_requests_pass_the_size_check(broker: BrokerServer) -> None:
    """The largest valid ComposeNode and ComposeGang are judged on their content (here:
    nothing fits, the pool is empty), not refused for their size."""
    channel = grpc.insecure_channel(broker.endpoint)
    try:
        for name in ("NodeService.ComposeNode", "NodeService.ComposeGang"):
            payload = largest_requests()[name].SerializeToString()
            error = _call(channel, name, payload)
            assert _reason(error) != "REQUEST_TOO_LARGE", (name, error)
    finally:
        channel.close()
