"""``describe`` output, kubectl-style: an object's fields as ``Key:  value`` lines, its
parts as indented tables, and its recent events last (``Events:`` with TYPE, REASON,
AGE, OBJECT and MESSAGE; ``<none>`` when there are none).

A node's events are its own (``VirtualNode.events``). A box or host has no events of its
own: its describe shows the events of the nodes that use its GPUs or run on it, merged
oldest first, with the node they belong to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.output import format_table
from dxpool.cli.views import (
    BINDING_VIEW,
    GPU_VIEW,
    NONE,
    age,
    enum_label,
    gpu_request,
    labels,
    latency,
    location,
    node_gpus,
    short,
)

# How many events a box's or host's describe shows (the most recent).
MAX_SHOWN_EVENTS = 20


def _fields(pairs: Sequence[tuple[str, str]]) -> list[str]:
    width = max(len(key) for key, _ in pairs) + 2
    return [f"{key + ':':<{width}}{value}" for key, value in pairs]


def _indent(text: str) -> list[str]:
    return ["  " + line for line in text.splitlines()]


def _section(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    if not rows:
        return [f"{title}:  {NONE}"]
    return [f"{title}:", *_indent(format_table(headers, rows))]


def events_section(events: Iterable[tuple[str, pb.Event]], now: float | None = None) -> list[str]:
    """The ``Events:`` section: ``(object, event)`` pairs, printed oldest first."""
    ordered = sorted(events, key=lambda item: (item[1].time.seconds, item[1].time.nanos))
    rows = [
        [event.type, event.reason, age(event.time, now), source, event.message or NONE]
        for source, event in ordered
    ]
    return _section("Events", ["type", "reason", "age", "object", "message"], rows)


def _stamp(stamp: Timestamp) -> str:
    if not stamp.seconds and not stamp.nanos:
        return NONE
    return f"{stamp.ToJsonString()} ({age(stamp)} ago)"


def _gpus_line(node: pb.VirtualNode) -> str:
    """``H100:6``, and what it was composed with when a resize changed that."""
    now = node_gpus(node)
    composed = gpu_request(node.spec.gpus)
    return now if now == composed else f"{now} (composed as {composed})"


def describe_node(node: pb.VirtualNode, now: float | None = None) -> str:
    """A node: its spec, placement and state, its GPUs, and its own events."""
    spec = node.spec
    lines = _fields(
        [
            ("Name", short(node.name)),
            ("State", enum_label(pb.NodeState.Name(node.state), "NODE_STATE_")),
            ("Message", node.message or NONE),
            ("Host", short(node.host)),
            ("GPUs", _gpus_line(node)),
            ("Max latency", latency(spec.max_latency_ns)),
            ("Max slowdown", f"{spec.max_slowdown:g} ({spec.workload})" if spec.workload else NONE),
            ("VFIO", "yes" if spec.vfio else "no"),
            ("Tenant", spec.tenant or NONE),
            ("Owner", node.owner or NONE),
            ("Labels", labels(spec.labels)),
            ("Request id", node.request_id or NONE),
            ("Created", _stamp(node.create_time)),
            ("Ready", _stamp(node.ready_time)),
            ("Updated", _stamp(node.update_time)),
        ]
    )
    bindings = [
        [
            *BINDING_VIEW.row(binding, False),
            enum_label(pb.AttachmentPhase.Name(binding.phase), "ATTACHMENT_PHASE_"),
            binding.bdf or NONE,
            binding.uuid or NONE,
        ]
        for binding in node.gpus
    ]
    headers = [*BINDING_VIEW.headers(False), "phase", "bdf", "uuid"]
    lines += _section("Bindings", headers, bindings)
    lines += events_section(((f"node/{short(node.name)}", e) for e in node.events), now)
    return "\n".join(lines)


def _node_events(nodes: Iterable[pb.VirtualNode]) -> list[tuple[str, pb.Event]]:
    merged = [(f"node/{short(n.name)}", e) for n in nodes for e in n.events]
    merged.sort(key=lambda item: (item[1].time.seconds, item[1].time.nanos))
    return merged[-MAX_SHOWN_EVENTS:]


def describe_box(
    box: pb.Box, gpus: Sequence[pb.Gpu], nodes: Sequence[pb.VirtualNode], now: float | None = None
) -> str:
    """A box: its fields, its GPUs, and the recent events of the nodes using them."""
    lines = _fields(
        [
            ("Name", short(box.name)),
            ("State", enum_label(pb.BoxState.Name(box.state), "BOX_STATE_")),
            ("Cordon reason", box.cordon_reason or NONE),
            ("Location", location(box.location)),
            ("Fabric endpoint", box.fabric_endpoint or NONE),
            ("GPUs free/total", f"{box.gpus_free}/{box.gpu_count}"),
            ("Labels", labels(box.labels)),
            ("Created", _stamp(box.create_time)),
        ]
    )
    lines += _section("GPUs", GPU_VIEW.headers(False), [GPU_VIEW.row(gpu, False) for gpu in gpus])
    lines += events_section(_node_events(nodes), now)
    return "\n".join(lines)


def describe_host(host: pb.Host, nodes: Sequence[pb.VirtualNode], now: float | None = None) -> str:
    """A host: its fields, the nodes on it, and their recent events."""
    lines = _fields(
        [
            ("Name", short(host.name)),
            ("Alive", "yes" if host.alive else "no"),
            ("Slots used/total", f"{host.slots_used}/{host.slot_capacity}"),
            ("Used slots", ",".join(map(str, host.used_slots)) or NONE),
            ("Location", location(host.location)),
            ("Driver", host.driver or NONE),
            ("Agent", host.agent_endpoint or NONE),
            ("Labels", labels(host.labels)),
            ("Registered", _stamp(host.register_time)),
        ]
    )
    rows = [
        [
            short(n.name),
            enum_label(pb.NodeState.Name(n.state), "NODE_STATE_"),
            node_gpus(n),
            ",".join(str(g.host_slot) for g in n.gpus) or NONE,
        ]
        for n in nodes
    ]
    lines += _section("Nodes", ["name", "state", "gpus", "host-slots"], rows)
    lines += events_section(_node_events(nodes), now)
    return "\n".join(lines)


__all__ = ["MAX_SHOWN_EVENTS", "describe_box", "describe_host", "describe_node", "events_section"]
