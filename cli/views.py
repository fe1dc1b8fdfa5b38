"""Table columns for each kind of API object, and the cell formatters they share."""

from __future__ import annotations

import time
from collections.abc import Mapping

from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import fabric_pb2, nodes_pb2, resources_pb2
from dxpool.cli.output import Column, View
from dxpool.request import format_duration_ns

NONE = "<none>"


def short(name: str) -> str:
    """``hosts/h1`` -> ``h1``; ``boxes/box1/gpus/3`` -> ``box1/3``; empty -> ``<none>``."""
    if not name:
        return NONE
    parts = name.split("/")
    if len(parts) == 4 and parts[0] == "boxes" and parts[2] == "gpus":
        return f"{parts[1]}/{parts[3]}"
    return parts[-1]


def enum_label(name: str, prefix: str) -> str:
    """``NODE_STATE_READY`` -> ``Ready``; the UNSPECIFIED value -> ``Unknown``."""
    label = name.removeprefix(prefix)
    return "Unknown" if label == "UNSPECIFIED" else label.replace("_", " ").title()


def age(stamp: Timestamp, now: float | None = None) -> str:
    """Time since ``stamp`` the way kubectl prints it: ``42s``, ``5m``, ``3h``, ``2d``."""
    if not stamp.seconds and not stamp.nanos:
        return NONE
    seconds = max(0, int((time.time() if now is None else now) - stamp.seconds))
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= 2 * size or (unit == "m" and seconds >= size):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def memory(mib: int) -> str:
    """81920 -> ``80GiB``; 1536 -> ``1536MiB``; 0 -> ``<none>``."""
    if not mib:
        return NONE
    return f"{mib // 1024}GiB" if mib % 1024 == 0 else f"{mib}MiB"


def latency(ns: int) -> str:
    return format_duration_ns(ns) if ns else NONE


def location(where: resources_pb2.Location) -> str:
    """``site/pod/rack``, leaving out trailing parts that are not set."""
    parts = [where.site, where.pod, where.rack]
    while parts and not parts[-1]:
        parts.pop()
    return "/".join(p or "-" for p in parts) or NONE


def labels(values: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(values.items())) or NONE


def gpu_request(request: resources_pb2.GpuRequest) -> str:
    """``H100:4`` (``*:4`` for any model), with ``>=80GiB`` when a minimum memory is set."""
    text = f"{request.model or '*'}:{request.count}"
    return f"{text}(>={memory(request.min_memory_mib)})" if request.min_memory_mib else text


def _box_state(box: resources_pb2.Box) -> str:
    return enum_label(resources_pb2.BoxState.Name(box.state), "BOX_STATE_")


def _gpu_state(gpu: resources_pb2.Gpu) -> str:
    return enum_label(resources_pb2.GpuState.Name(gpu.state), "GPU_STATE_")


def _gpu_health(gpu: resources_pb2.Gpu) -> str:
    return enum_label(resources_pb2.GpuHealth.Name(gpu.health), "GPU_HEALTH_")


def _node_state(node: resources_pb2.VirtualNode) -> str:
    return enum_label(resources_pb2.NodeState.Name(node.state), "NODE_STATE_")


def node_gpu_count(node: resources_pb2.VirtualNode) -> int:
    """How many GPUs the node has, or is on its way to (a resize changes that from what
    it was composed with): its bindings, less those a shrink is taking away."""
    leaving = resources_pb2.ATTACHMENT_PHASE_DETACHING
    return sum(1 for binding in node.gpus if binding.phase != leaving)


def node_gpus(node: resources_pb2.VirtualNode) -> str:
    """The node's GPUs as a request reads (``H100:6``): the model asked for, with the
    count :func:`node_gpu_count` gives (the composed count until it has bindings)."""
    request = resources_pb2.GpuRequest()
    request.CopyFrom(node.spec.gpus)
    if node.gpus:
        request.count = node_gpu_count(node)
        # The pool's spelling of the model (h100 asked for, H100 bound): one model, one row.
        bound = {binding.model for binding in node.gpus}
        if len(bound) == 1 and request.model.casefold() == next(iter(bound)).casefold():
            request.model = next(iter(bound))
    return gpu_request(request)


def _node_latency(node: resources_pb2.VirtualNode) -> str:
    return latency(max((g.latency_ns for g in node.gpus), default=0))


BOX_VIEW: View[resources_pb2.Box] = View(
    "boxes",
    [
        Column("name", lambda b: short(b.name)),
        Column("state", _box_state),
        Column("gpus free/total", lambda b: f"{b.gpus_free}/{b.gpu_count}"),
        Column("location", lambda b: location(b.location)),
        Column("age", lambda b: age(b.create_time)),
        Column("fabric-endpoint", lambda b: b.fabric_endpoint or NONE, wide_only=True),
        Column("labels", lambda b: labels(b.labels), wide_only=True),
        Column("cordon-reason", lambda b: b.cordon_reason or NONE, wide_only=True),
    ],
)

GPU_VIEW: View[resources_pb2.Gpu] = View(
    "gpus",
    [
        Column("name", lambda g: short(g.name)),
        Column("model", lambda g: g.model or NONE),
        Column("memory", lambda g: memory(g.memory_mib)),
        Column("state", _gpu_state),
        Column("health", _gpu_health),
        Column("node", lambda g: short(g.node)),
        Column("host", lambda g: short(g.host)),
        Column("host-slot", lambda g: str(g.host_slot) if g.host else NONE, wide_only=True),
        Column("pci-id", lambda g: g.pci_id or NONE, wide_only=True),
        Column("uuid", lambda g: g.uuid or NONE, wide_only=True),
        Column("generation", lambda g: str(g.generation), wide_only=True),
        Column("message", lambda g: g.message or NONE, wide_only=True),
    ],
)

HOST_VIEW: View[resources_pb2.Host] = View(
    "hosts",
    [
        Column("name", lambda h: short(h.name)),
        Column("alive", lambda h: "yes" if h.alive else "no"),
        Column("slots used/total", lambda h: f"{h.slots_used}/{h.slot_capacity}"),
        Column("location", lambda h: location(h.location)),
        Column("driver", lambda h: h.driver or NONE),
        Column("age", lambda h: age(h.register_time)),
        Column("used-slots", lambda h: ",".join(map(str, h.used_slots)) or NONE, True),
        Column("agent", lambda h: h.agent_endpoint or NONE, wide_only=True),
        Column("labels", lambda h: labels(h.labels), wide_only=True),
    ],
)

NODE_VIEW: View[resources_pb2.VirtualNode] = View(
    "nodes",
    [
        Column("name", lambda n: short(n.name)),
        Column("state", _node_state),
        Column("host", lambda n: short(n.host)),
        Column("gpus", node_gpus),
        Column("latency", _node_latency),
        Column("age", lambda n: age(n.create_time)),
        Column("tenant", lambda n: n.spec.tenant or NONE, wide_only=True),
        Column("owner", lambda n: n.owner or NONE, wide_only=True),
        Column("vfio", lambda n: "yes" if n.spec.vfio else "no", wide_only=True),
        Column("bindings", lambda n: ",".join(short(g.gpu) for g in n.gpus) or NONE, True),
        Column("message", lambda n: n.message or NONE, wide_only=True),
    ],
)

# Widths for streaming node rows (``dxpool node watch``), one per NODE_VIEW column.
NODE_STREAM_WIDTHS = (28, 11, 14, 14, 10, 6, 12, 24, 6, 40)

LATENCY_VIEW: View[fabric_pb2.Latency] = View(
    "latencies",
    [
        Column("host", lambda lat: short(lat.host)),
        Column("box", lambda lat: short(lat.box)),
        Column("round-trip", lambda lat: latency(lat.round_trip_ns)),
        Column("path", lambda lat: " > ".join(lat.path) or NONE),
    ],
    name=lambda lat: f"{lat.host} {lat.box}",
)

BINDING_VIEW: View[resources_pb2.GpuBinding] = View(
    "gpus",
    [
        Column("gpu", lambda g: short(g.gpu)),
        Column("model", lambda g: g.model or NONE),
        Column("host-slot", lambda g: str(g.host_slot)),
        Column("latency", lambda g: latency(g.latency_ns)),
    ],
    name=lambda g: g.gpu,
)

CANDIDATE_VIEW: View[nodes_pb2.PlanCandidate] = View(
    "candidates",
    [
        Column("host", lambda c: short(c.name)),
        Column("feasible", lambda c: "yes" if c.feasible else "no"),
        Column("score", lambda c: f"{c.score:.1f}" if c.feasible else NONE),
        Column("reasons", lambda c: "; ".join(c.reasons) or NONE),
    ],
)


def _limited(used: int, limit: int | None) -> str:
    """``3/16``; ``3/unlimited`` without a limit."""
    return f"{used}/{'unlimited' if limit is None else limit}"


def tenant_gpus(tenant: resources_pb2.Tenant) -> str:
    quota = tenant.quota if tenant.HasField("quota") else None
    limit = quota.gpus if quota is not None and quota.HasField("gpus") else None
    return _limited(tenant.usage.gpus, limit)


def tenant_nodes(tenant: resources_pb2.Tenant) -> str:
    quota = tenant.quota if tenant.HasField("quota") else None
    limit = quota.nodes if quota is not None and quota.HasField("nodes") else None
    return _limited(tenant.usage.nodes, limit)


def tenant_models(tenant: resources_pb2.Tenant) -> str:
    """``A100=1 H100=2/8``: GPUs held per model, with the model's limit where it has one."""
    limits = dict(tenant.quota.gpus_by_model) if tenant.HasField("quota") else {}
    used = dict(tenant.usage.gpus_by_model)
    cells = []
    for model in sorted({*limits, *used}):
        count = used.get(model, 0)
        cells.append(f"{model}={count}/{limits[model]}" if model in limits else f"{model}={count}")
    return " ".join(cells) or NONE


TENANT_VIEW: View[resources_pb2.Tenant] = View(
    "tenants",
    [
        Column("name", lambda t: short(t.name)),
        Column("nodes", tenant_nodes),
        Column("gpus", tenant_gpus),
        Column("by model", tenant_models),
        Column("quota set", lambda t: age(t.quota_update_time), wide_only=True),
    ],
)
