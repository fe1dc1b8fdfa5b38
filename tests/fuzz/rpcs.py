"""Every RPC the broker serves, what each may answer, and how to call one generically.

The methods come from the service descriptors, so a new RPC is fuzzed as soon as it is
added, and :data:`EXPECTED` must say what it may answer (a test checks that it does).
The agent port's methods (:data:`AGENT_METHODS`, served apart from the API) have their
own table, :data:`AGENT_EXPECTED`, and baselines, :data:`AGENT_BASELINES`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dxpool.api.v1 import agent_pb2, audit_pb2, fabric_pb2, inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.request_limits import (
    AGENT_SERVER_MAX_RECEIVE_BYTES,
    SERVER_MAX_RECEIVE_BYTES,
    limit_for,
)
from tests.fuzz.strategies import message_class

C = grpc.StatusCode
CALL_TIMEOUT_S = 10.0
# A watch that has not ended this long after it started is taken as accepted (it streams
# until cancelled); a rejected one ends at once.
WATCH_SETTLE_S = 0.2

SERVICES = (
    inventory_pb2.DESCRIPTOR.services_by_name["InventoryService"],
    nodes_pb2.DESCRIPTOR.services_by_name["NodeService"],
    fabric_pb2.DESCRIPTOR.services_by_name["FabricService"],
    audit_pb2.DESCRIPTOR.services_by_name["AuditService"],
)
METHODS: dict[str, MethodDescriptor] = {
    f"{service.name}.{method.name}": method for service in SERVICES for method in service.methods
}

AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
AGENT_METHODS: dict[str, MethodDescriptor] = {
    f"{AGENT_SERVICE.name}.{method.name}": method for method in AGENT_SERVICE.methods
}

_LOOKUP = frozenset({C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND})
_LIST = frozenset({C.OK, C.INVALID_ARGUMENT})
EXPECTED: dict[str, frozenset[grpc.StatusCode]] = {
    "InventoryService.CreateBox": frozenset({C.OK, C.INVALID_ARGUMENT, C.ALREADY_EXISTS}),
    "InventoryService.GetBox": _LOOKUP,
    "InventoryService.ListBoxes": _LIST,
    "InventoryService.CordonBox": _LOOKUP,
    "InventoryService.UncordonBox": _LOOKUP,
    "InventoryService.DeleteBox": _LOOKUP | {C.FAILED_PRECONDITION},
    "InventoryService.GetGpu": _LOOKUP,
    "InventoryService.ListGpus": _LOOKUP,
    "InventoryService.ReclaimGpu": _LOOKUP | {C.FAILED_PRECONDITION},
    "InventoryService.ClearGpuHealth": _LOOKUP | {C.FAILED_PRECONDITION},
    "InventoryService.GetHost": _LOOKUP,
    "InventoryService.GetPoolStatus": _LIST,
    "InventoryService.ListHosts": _LIST,
    "InventoryService.CordonHost": _LOOKUP,
    "InventoryService.UncordonHost": _LOOKUP,
    "InventoryService.DrainHost": _LOOKUP,
    "InventoryService.DrainBox": _LOOKUP,
    "NodeService.ComposeNode": _LOOKUP
    | {C.ALREADY_EXISTS, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION},
    "NodeService.PlanNode": _LOOKUP | {C.FAILED_PRECONDITION},  # UNKNOWN_MODEL
    "NodeService.GetNode": _LOOKUP,
    "NodeService.GetNodeHostdev": _LOOKUP | {C.FAILED_PRECONDITION},
    "NodeService.ListNodes": _LIST,
    "NodeService.ReleaseNode": _LOOKUP,
    "NodeService.WatchNodes": _LOOKUP,
    "NodeService.ComposeGang": _LOOKUP
    | {C.ALREADY_EXISTS, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION},
    "NodeService.GetGang": _LOOKUP,
    "NodeService.ResizeNode": _LOOKUP
    | {C.ALREADY_EXISTS, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION},
    "NodeService.ReleaseGang": _LOOKUP,
    "NodeService.SetTenantQuota": _LIST,
    "NodeService.GetTenant": _LIST,  # a tenant never seen has no quota and no usage
    "NodeService.ListTenants": _LIST,
    "NodeService.DeleteTenant": _LOOKUP | {C.FAILED_PRECONDITION},
    "NodeService.ListQueue": _LIST,
    "FabricService.GetLatency": _LOOKUP,
    "FabricService.Predict": _LOOKUP | {C.RESOURCE_EXHAUSTED},
    "AuditService.ListAuditRecords": _LIST,
}
# The agent port, from a caller that holds no session (a plaintext broker: any host).
AGENT_EXPECTED: dict[str, frozenset[grpc.StatusCode]] = {
    # a welcome; a bad hello; another identity holds the host; the broker is busy
    "AgentService.Connect": frozenset(
        {C.OK, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION, C.UNAVAILABLE}
    ),
    # no session is ever live for the fuzzer, so a write is never OK
    "AgentService.ReportStatus": frozenset({C.INVALID_ARGUMENT, C.FAILED_PRECONDITION}),
}
AGENT_BASELINES: dict[str, Message] = {
    "AgentService.Connect": agent_pb2.ConnectRequest(
        hello=agent_pb2.AgentHello(
            host=pb.Host(
                name="hosts/fz1",
                location=pb.Location(site="s1", pod="p1", rack="r1"),
                slot_capacity=4,
                driver="sim",
                labels={"env": "fuzz"},
            ),
            token="fuzz-token",
            liveness_ttl_ms=60_000,
        )
    ),
    "AgentService.ReportStatus": agent_pb2.ReportStatusRequest(
        host="hosts/fz2",
        session="no-such-session",
        status=pb.HostStatus(
            attachments=[
                pb.ObservedAttachment(
                    gpu="boxes/box1/gpus/0", phase=pb.ATTACHMENT_PHASE_ATTACHED, host_slot=0
                )
            ]
        ),
        spec_revision=1,
    ),
}

# Calls that may change etcd when they succeed; every other call never does.
MUTATIONS = frozenset(
    {
        "InventoryService.CreateBox",
        "InventoryService.CordonBox",
        "InventoryService.UncordonBox",
        "InventoryService.DeleteBox",
        "InventoryService.ReclaimGpu",
        "InventoryService.ClearGpuHealth",
        "InventoryService.CordonHost",
        "InventoryService.UncordonHost",
        "InventoryService.DrainHost",
        "InventoryService.DrainBox",
        "NodeService.ComposeNode",
        "NodeService.ReleaseNode",
        "NodeService.ComposeGang",
        "NodeService.ReleaseGang",
        "NodeService.ResizeNode",
        "NodeService.SetTenantQuota",
        "NodeService.DeleteTenant",
    }
)
# Successful calls the node controller follows up on with writes of its own.
FOLLOWED_UP = frozenset(
    {
        "NodeService.ComposeNode",
        "NodeService.ReleaseNode",
        "NodeService.ComposeGang",
        "NodeService.ReleaseGang",
        "NodeService.ResizeNode",
        "InventoryService.ReclaimGpu",
        "InventoryService.ClearGpuHealth",
        "InventoryService.DrainHost",
        "InventoryService.DrainBox",
        "InventoryService.UncordonHost",
        "InventoryService.UncordonBox",
    }
)

_SPEC = pb.NodeSpec(
    gpus=pb.GpuRequest(model="H100", count=1, min_memory_mib=1024),
    max_latency_ns=1_000_000,
    max_slowdown=1.5,
    workload="training",
    tenant="ml",
    labels={"team": "ml"},
)
# One valid request per RPC (against the pool in conftest.py); fuzzing replaces one field.
BASELINES: dict[str, Message] = {
    "InventoryService.CreateBox": inventory_pb2.CreateBoxRequest(
        box_id="box3",
        box=pb.Box(
            gpu_count=2,
            location=pb.Location(site="s1", pod="p1", rack="r1"),
            labels={"row": "3"},
            fabric_endpoint="127.0.0.1:9000",
        ),
        gpu_model="H100",
        gpu_memory_mib=81920,
        request_id="r-box3",
    ),
    "InventoryService.GetBox": inventory_pb2.GetBoxRequest(name="boxes/box1"),
    "InventoryService.ListBoxes": inventory_pb2.ListBoxesRequest(page_size=1),
    "InventoryService.CordonBox": inventory_pb2.CordonBoxRequest(
        name="boxes/box2", reason="maintenance"
    ),
    "InventoryService.UncordonBox": inventory_pb2.UncordonBoxRequest(name="boxes/box2"),
    "InventoryService.DeleteBox": inventory_pb2.DeleteBoxRequest(name="boxes/box2"),
    "InventoryService.GetGpu": inventory_pb2.GetGpuRequest(name="boxes/box1/gpus/0"),
    "InventoryService.ListGpus": inventory_pb2.ListGpusRequest(
        parent="boxes/box1", page_size=2, state=pb.GPU_STATE_FREE, model="H100"
    ),
    "InventoryService.ReclaimGpu": inventory_pb2.ReclaimGpuRequest(
        name="boxes/box1/gpus/7", reason="proxy replaced"
    ),
    "InventoryService.ClearGpuHealth": inventory_pb2.ClearGpuHealthRequest(
        name="boxes/box1/gpus/7", reason="checked"
    ),
    "InventoryService.GetHost": inventory_pb2.GetHostRequest(name="hosts/h1"),
    "InventoryService.GetPoolStatus": inventory_pb2.GetPoolStatusRequest(),
    "InventoryService.ListHosts": inventory_pb2.ListHostsRequest(page_size=5),
    "InventoryService.CordonHost": inventory_pb2.CordonHostRequest(
        name="hosts/h1", reason="maintenance"
    ),
    "InventoryService.UncordonHost": inventory_pb2.UncordonHostRequest(name="hosts/h1"),
    "InventoryService.DrainHost": inventory_pb2.DrainHostRequest(
        name="hosts/h1", reason="kernel upgrade", policy=pb.DRAIN_POLICY_RELEASE
    ),
    "InventoryService.DrainBox": inventory_pb2.DrainBoxRequest(
        name="boxes/box2", reason="firmware", policy=pb.DRAIN_POLICY_MOVE
    ),
    "NodeService.ComposeNode": nodes_pb2.ComposeNodeRequest(spec=_SPEC, request_id="r-node"),
    "NodeService.PlanNode": nodes_pb2.PlanNodeRequest(spec=_SPEC),
    "NodeService.GetNode": nodes_pb2.GetNodeRequest(name="nodes/n1"),
    "NodeService.GetNodeHostdev": nodes_pb2.GetNodeHostdevRequest(name="nodes/vm1"),
    "NodeService.ListNodes": nodes_pb2.ListNodesRequest(host="hosts/h1", page_size=3),
    "NodeService.ReleaseNode": nodes_pb2.ReleaseNodeRequest(name="nodes/n1"),
    "NodeService.WatchNodes": nodes_pb2.WatchNodesRequest(name="nodes/n1"),
    "NodeService.ComposeGang": nodes_pb2.ComposeGangRequest(
        members=[_SPEC, _SPEC], gang_id="g2", request_id="r-gang"
    ),
    "NodeService.GetGang": nodes_pb2.GetGangRequest(name="gangs/g1"),
    "NodeService.ResizeNode": nodes_pb2.ResizeNodeRequest(
        name="nodes/vm1", gpu_count=1, request_id="r-resize"
    ),
    "NodeService.ReleaseGang": nodes_pb2.ReleaseGangRequest(name="gangs/g1"),
    "NodeService.SetTenantQuota": nodes_pb2.SetTenantQuotaRequest(
        name="tenants/ml", quota=pb.TenantQuota(gpus=8, nodes=2, gpus_by_model={"H100": 4})
    ),
    "NodeService.GetTenant": nodes_pb2.GetTenantRequest(name="tenants/ml"),
    "NodeService.DeleteTenant": nodes_pb2.DeleteTenantRequest(name="tenants/idle"),
    "NodeService.ListTenants": nodes_pb2.ListTenantsRequest(page_size=2),
    "NodeService.ListQueue": nodes_pb2.ListQueueRequest(page_size=2, tenant="ml"),
    "FabricService.GetLatency": fabric_pb2.GetLatencyRequest(host="hosts/h1", box="boxes/box1"),
    "FabricService.Predict": fabric_pb2.PredictRequest(
        host="hosts/h1", gpus=pb.GpuRequest(model="H100", count=2), workload="400@5ms"
    ),
    "AuditService.ListAuditRecords": audit_pb2.ListAuditRecordsRequest(
        page_size=5, identity="dxpool://operator/alice", target="nodes/n1"
    ),
}

# A rejection says what to do about it; each message carries one of these.
GUIDANCE = (
    "use ",
    "give",
    "expected",
    "remove",
    "pick",
    "list ",
    "delete",
    "retry",
    "send ",
    "set ",
    "relax",
    "release",
    "leave",
    "omit",
    "register",
    "see `",
    "ask for",
    "pass ",
    "repeat",
    "connect again",
)


# The broker's server-wide limit on a received message: larger requests end
# RESOURCE_EXHAUSTED in gRPC's transport, before any dxpool code runs, with grpc's message.
# Up to it, each method's own limit is checked before decoding (REQUEST_TOO_LARGE).
MAX_MESSAGE_BYTES = SERVER_MAX_RECEIVE_BYTES
AGENT_MAX_MESSAGE_BYTES = AGENT_SERVER_MAX_RECEIVE_BYTES


def path(method: MethodDescriptor) -> str:
    """``/dxpool.v1.InventoryService/CreateBox``."""
    return f"/{method.containing_service.full_name}/{method.name}"


@dataclass(frozen=True)
class Outcome:
    """How a call ended: its code and, when it failed, the status it failed with."""

    code: grpc.StatusCode
    details: str = ""
    reason: str = ""
    domain: str = ""


def call(channel: grpc.Channel, method: MethodDescriptor, payload: bytes) -> Outcome:
    """Send ``payload`` (serialized or not) to ``method`` and see how the call ends. A
    bidirectional stream gets ``payload`` as its one message: it is OK when its first
    answer arrives (the agent port's welcome), and ends as the server ends it otherwise."""
    response_type = message_class(method.output_type)
    if method.client_streaming and method.server_streaming:
        stream = channel.stream_stream(
            path(method), request_serializer=None, response_deserializer=response_type.FromString
        )(iter([payload]), timeout=CALL_TIMEOUT_S)
        try:
            next(stream, None)
        except grpc.RpcError as error:
            return _failure(error)
        finally:
            stream.cancel()
        return Outcome(C.OK)
    if method.server_streaming:
        watch = channel.unary_stream(
            path(method), request_serializer=None, response_deserializer=response_type.FromString
        )(payload, timeout=CALL_TIMEOUT_S)
        ended = threading.Event()
        watch.add_done_callback(lambda _call: ended.set())
        if not ended.wait(WATCH_SETTLE_S):
            watch.cancel()
            return Outcome(C.OK)
        try:
            for _event in watch:
                pass
        except grpc.RpcError as error:
            return _failure(error)
        return Outcome(C.OK)
    unary = channel.unary_unary(
        path(method), request_serializer=None, response_deserializer=response_type.FromString
    )
    try:
        unary(payload, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        return _failure(error)
    return Outcome(C.OK)


def _failure(error: grpc.RpcError) -> Outcome:
    failed: Any = error  # every RpcError grpc raises is also a grpc.Call
    code, details = failed.code(), failed.details() or ""
    reason = domain = ""
    try:
        status = rpc_status.from_call(failed)
    except ValueError:
        status = None
    if status is not None:
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reason, domain = info.reason, info.domain
    return Outcome(code, details, reason, domain)


def problems(name: str, outcome: Outcome, size: int = 0) -> list[str]:
    """What is wrong with how ``name`` answered a request of ``size`` bytes (empty when
    nothing is)."""
    agent = name in AGENT_METHODS
    if size > (AGENT_MAX_MESSAGE_BYTES if agent else MAX_MESSAGE_BYTES):
        if outcome.code == C.RESOURCE_EXHAUSTED:
            return []
        return [f"{name}: a {size}-byte request answered {outcome.code.name}"]
    found = []
    expected = AGENT_EXPECTED[name] if agent else EXPECTED[name]
    if size > limit_for(path(AGENT_METHODS[name] if agent else METHODS[name])):
        if outcome.code != C.RESOURCE_EXHAUSTED or outcome.reason != "REQUEST_TOO_LARGE":
            found.append(f"{name}: a {size}-byte request answered {outcome}")
    elif outcome.reason == "REQUEST_TOO_LARGE":
        found.append(f"{name}: a {size}-byte request, within its limit, was refused as too large")
    if outcome.code not in expected and outcome.reason != "REQUEST_TOO_LARGE":
        found.append(f"{name} answered {outcome.code.name}: {outcome.details!r}")
    if outcome.code == C.OK or outcome.code in (C.CANCELLED, C.DEADLINE_EXCEEDED):
        return found
    text = outcome.details
    if len(text) < 20 or len(text) > 4096:
        found.append(f"{name}: message of {len(text)} characters: {text[:200]!r}")
    if not text.isprintable():
        found.append(f"{name}: message echoes non-printable characters: {text[:200]!r}")
    if not any(word in text.lower() for word in GUIDANCE):
        found.append(f"{name}: message does not say what to do: {text!r}")
    if outcome.domain != "dxpool.io" or not outcome.reason.replace("_", "").isupper():
        found.append(f"{name}: no dxpool ErrorInfo (reason {outcome.reason!r}): {text!r}")
    return found
