"""How the CLI shows the queue, loaning, preemption notices and drains: the lines
``describe`` adds, the queue table, the plan's preemptions, the status's queue."""

from __future__ import annotations

import time

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.output import format_table
from dxpool.cli.views import NONE, age, enum_label, short


def _seconds(stamp: object) -> float:
    return stamp.seconds + stamp.nanos / 1e9  # type: ignore[attr-defined, no-any-return]


def waited(queue: pb.QueueStatus, now: float | None = None) -> str:
    """How long a request has waited, e.g. ``3m``."""
    return age(queue.enqueue_time, now)


def node_fields(node: pb.VirtualNode, now: float | None = None) -> list[tuple[str, str]]:
    """``describe`` lines for a node's priority, loaning, queue place and notice."""
    spec = node.spec
    fields = [("Priority", str(spec.priority))]
    if spec.min_gpus:
        fields.append(("Elastic", f"down to {spec.min_gpus} GPUs"))
    if node.charged or node.preemptible:
        fields.append(("Capacity", "borrowed (preemptible)" if node.preemptible else "guaranteed"))
    if spec.HasField("preemption_grace_s"):
        fields.append(("Preemption grace", f"{spec.preemption_grace_s}s"))
    if node.state == pb.NODE_STATE_QUEUED:
        queue = node.queue
        place = f"{queue.position}" if queue.position else "?"
        fields.append(("Queue", f"position {place}, waiting {waited(queue, now)}"))
        fields.append(("Waiting for", queue.reason or NONE))
        if queue.HasField("deadline"):
            left = _seconds(queue.deadline) - (now if now is not None else time.time())
            fields.append(("Queue timeout", f"in {max(left, 0):.0f}s"))
        if queue.preempting:
            fields.append(("Preempting", ", ".join(short(n) for n in queue.preempting)))
    if node.HasField("preemption") and node.state in (
        pb.NODE_STATE_PENDING,
        pb.NODE_STATE_ATTACHING,
        pb.NODE_STATE_READY,
        pb.NODE_STATE_RESIZING,
        pb.NODE_STATE_DEGRADED,
    ):
        notice = node.preemption
        left = _seconds(notice.deadline) - (now if now is not None else time.time())
        what = f"{len(notice.gpus)} GPUs" if notice.gpus else "all GPUs"
        fields.append(("Preemption", f"{what} taken in {max(left, 0):.0f}s for {short(notice.by)}"))
        fields.append(("Preemption reason", notice.reason or NONE))
    return fields


def drain_fields(drain: pb.DrainStatus) -> list[tuple[str, str]]:
    """``describe`` lines for a host's or box's drain (none when it is not drained)."""
    if not drain.HasField("start_time"):
        return []
    state = enum_label(pb.DrainState.Name(drain.state), "DRAIN_STATE_")
    policy = enum_label(pb.DrainPolicy.Name(drain.policy), "DRAIN_POLICY_")
    fields = [
        ("Drain", f"{state} ({policy}), started {age(drain.start_time)} ago"),
        ("Drain left", f"{drain.nodes_left} nodes, {drain.gpus_left} GPUs"),
    ]
    for line in drain.blocked:
        fields.append(("Drain blocked", line))
    return fields


def drain_progress(name: str, drain: pb.DrainStatus) -> str:
    """One line of a drain's progress, for ``--wait``."""
    state = enum_label(pb.DrainState.Name(drain.state), "DRAIN_STATE_")
    line = f"{name}: {state}, {drain.nodes_left} nodes and {drain.gpus_left} GPUs left"
    if drain.blocked:
        line += f"; blocked: {drain.blocked[0]}"
    return line


QUEUE_HEADERS = ["position", "name", "tenant", "priority", "gpus", "waiting", "reason"]


def queue_rows(entries: list[nodes_pb2.QueueEntry]) -> list[list[str]]:
    return [
        [
            str(entry.queue.position),
            short(entry.name) if entry.name.startswith("nodes/") else entry.name,
            entry.tenant or NONE,
            str(entry.priority),
            str(entry.gpus),
            waited(entry.queue),
            entry.queue.reason or NONE,
        ]
        for entry in entries
    ]


def queue_table(entries: list[nodes_pb2.QueueEntry]) -> str:
    if not entries:
        return "the queue is empty"
    return format_table(QUEUE_HEADERS, queue_rows(entries))


def plan_preemptions(plan: nodes_pb2.NodePlan) -> str:
    """The plan's preemptions as a section ("" when it preempts nothing)."""
    lines = []
    if plan.preemptible:
        lines.append("capacity: borrowed (the node would be preemptible)")
    if plan.preemptions:
        rows = [
            [
                short(p.node),
                p.tenant or NONE,
                str(p.priority),
                "whole node" if not p.gpus else f"{len(p.gpus)} GPUs (shrink)",
                f"{p.gpu_hours:.1f}",
                p.reason,
            ]
            for p in plan.preemptions
        ]
        lines.append("would preempt (after each node's notice):")
        lines.append(
            format_table(["node", "tenant", "priority", "takes", "gpu-hours", "why"], rows)
        )
    return "\n".join(lines)


def status_lines(pool: inventory_pb2.PoolStatus) -> list[str]:
    """The status's queue, notices and cordons."""
    if not pool.queue and not pool.preemptions_pending and not pool.hosts_cordoned:
        return ["Queue:  empty"]
    lines = []
    waiting = sum(q.waiting for q in pool.queue)
    lines.append(
        f"Queue:  {waiting} waiting, {pool.preemptions_pending} preemption notices pending, "
        f"{pool.hosts_cordoned} hosts cordoned"
    )
    for q in pool.queue:
        lines.append(
            f"  {q.tenant or '(no tenant)'}: {q.waiting} waiting for {q.gpus} GPUs, "
            f"oldest {q.oldest_wait_s:.0f}s; first: {q.head_reason or NONE}"
        )
    return lines


__all__ = [
    "drain_fields",
    "drain_progress",
    "node_fields",
    "plan_preemptions",
    "queue_table",
    "status_lines",
]
