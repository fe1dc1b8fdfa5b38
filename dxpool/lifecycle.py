"""The node and GPU state machines: every legal transition, in one place.

Each function takes a record and returns a *new* record in the next state (records from
the broker's cache are shared and never mutated). Compose, the node controller, the
leader's duties (host loss, fencing, garbage collection) and the client's idea of what a
node can still become all use this module, so the rules are written once.

A function raises :class:`IllegalTransitionError` when asked for a transition the machine does
not have: that is a bug in the caller, never a user error.

GPU (``GpuState``)::

    FREE ──assign──► ATTACHING ──attach_confirmed──► ATTACHED
     ▲                   │                              │
     │                   ├──────── begin_detach ────────┤──► DETACHING ──free──► FREE
     │                   │                              │        │
     │                   └──────── begin_fence ─────────┴────────┴──► FENCING ──free──► FREE
     │                                                           │        │
     └─────────────── (operator clears: fence first) ◄── QUARANTINED ◄────┘

A GPU reaches FREE from DETACHING only once its host's agent has confirmed the detach,
and from FENCING only once the box side has revoked every mapping made for its
generation (and the GPU was scrubbed): no path frees a GPU that a host may still reach.

Node (``NodeState``)::

    QUEUED ─► (admitted) PENDING; QUEUED ─► FAILED (timed out) or RELEASING (cancelled)

    PENDING ─► ATTACHING ─► READY ─► RELEASING ─► RELEASED
       │           │         │ ▲         ▲  ▲
       │           │    grow ▼ │ done    │  │
       │           │       RESIZING ─────┤  │
       ├───────────┴──► FAILED ──────────┤  │
       └───────────┴──────┴──────┴─► LOST ──┘
                          │          ▲   ▲
                          ▼          │   │
                       DEGRADED ─────┴───┘   (and back to READY)

RESIZING (a READY node growing or shrinking) goes back to READY whether new GPUs attach
or not, and once removed GPUs are freed (the agent reported them scrubbed). Only a READY
node is resized: a DEGRADED one is refused until its GPUs are healthy again (or it is
released), so a resize never hides a health problem.

READY -> DEGRADED when one of the node's GPUs is reported UNHEALTHY after the attach;
DEGRADED -> READY when none is any more (the agent reports it healthy again, or an
operator cleared it). A DEGRADED node keeps its GPUs until it is released or lost.

Health (``GpuHealth``) is apart from the scheduling state: an UNHEALTHY GPU is never
handed out (:func:`is_free`), whatever its state, until an operator clears it
(:func:`health_cleared`).

Every node transition also appends an :class:`~dxpool.api.v1.resources_pb2.Event` to the
node's own bounded ``events`` list (at most :data:`MAX_NODE_EVENTS`, oldest dropped):
the history rides on the node writes that the transitions make anyway, so it costs no
etcd write of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeAlias

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.records import copy, timestamp

NodeStateValue: TypeAlias = pb.NodeState.ValueType
GpuStateValue: TypeAlias = pb.GpuState.ValueType

NODE_TRANSITIONS: Mapping[int, frozenset[int]] = {
    # admitted (placed and committed), given up (queue timeout, tenant deleted), cancelled
    pb.NODE_STATE_QUEUED: frozenset(
        {pb.NODE_STATE_PENDING, pb.NODE_STATE_FAILED, pb.NODE_STATE_RELEASING}
    ),
    pb.NODE_STATE_PENDING: frozenset(
        {
            pb.NODE_STATE_ATTACHING,
            pb.NODE_STATE_READY,
            pb.NODE_STATE_FAILED,
            pb.NODE_STATE_RELEASING,
            pb.NODE_STATE_LOST,
        }
    ),
    pb.NODE_STATE_ATTACHING: frozenset(
        {pb.NODE_STATE_READY, pb.NODE_STATE_FAILED, pb.NODE_STATE_RELEASING, pb.NODE_STATE_LOST}
    ),
    pb.NODE_STATE_READY: frozenset(
        {
            pb.NODE_STATE_RESIZING,
            pb.NODE_STATE_RELEASING,
            pb.NODE_STATE_LOST,
            pb.NODE_STATE_DEGRADED,
        }
    ),
    pb.NODE_STATE_RESIZING: frozenset(
        {pb.NODE_STATE_READY, pb.NODE_STATE_RELEASING, pb.NODE_STATE_LOST}
    ),
    pb.NODE_STATE_DEGRADED: frozenset(
        {pb.NODE_STATE_READY, pb.NODE_STATE_RELEASING, pb.NODE_STATE_LOST}
    ),
    pb.NODE_STATE_FAILED: frozenset({pb.NODE_STATE_RELEASING}),
    pb.NODE_STATE_LOST: frozenset({pb.NODE_STATE_RELEASING}),
    pb.NODE_STATE_RELEASING: frozenset({pb.NODE_STATE_RELEASED}),
    pb.NODE_STATE_RELEASED: frozenset(),
}

GPU_TRANSITIONS: Mapping[int, frozenset[int]] = {
    pb.GPU_STATE_FREE: frozenset({pb.GPU_STATE_ATTACHING, pb.GPU_STATE_FAULTED}),
    pb.GPU_STATE_ATTACHING: frozenset(
        {pb.GPU_STATE_ATTACHED, pb.GPU_STATE_DETACHING, pb.GPU_STATE_FENCING}
    ),
    pb.GPU_STATE_ATTACHED: frozenset({pb.GPU_STATE_DETACHING, pb.GPU_STATE_FENCING}),
    pb.GPU_STATE_DETACHING: frozenset(
        {pb.GPU_STATE_FREE, pb.GPU_STATE_FENCING, pb.GPU_STATE_QUARANTINED}
    ),
    pb.GPU_STATE_FENCING: frozenset({pb.GPU_STATE_FREE, pb.GPU_STATE_QUARANTINED}),
    pb.GPU_STATE_QUARANTINED: frozenset({pb.GPU_STATE_FENCING}),
    pb.GPU_STATE_FAULTED: frozenset({pb.GPU_STATE_FREE, pb.GPU_STATE_FENCING}),
}

# How many events a node keeps; the oldest is dropped when a new one arrives.
MAX_NODE_EVENTS = 16
EVENT_NORMAL = "Normal"
EVENT_WARNING = "Warning"
# The reason an event records for a node entering each state.
NODE_STATE_REASONS: Mapping[int, str] = {
    pb.NODE_STATE_PENDING: "Composed",
    pb.NODE_STATE_ATTACHING: "Attaching",
    pb.NODE_STATE_READY: "Ready",
    pb.NODE_STATE_RELEASING: "Releasing",
    pb.NODE_STATE_RELEASED: "Released",
    pb.NODE_STATE_FAILED: "Failed",
    pb.NODE_STATE_LOST: "Lost",
    pb.NODE_STATE_DEGRADED: "Degraded",
    pb.NODE_STATE_RESIZING: "Resizing",
    pb.NODE_STATE_QUEUED: "Queued",
}
_WARNING_STATES = frozenset({pb.NODE_STATE_FAILED, pb.NODE_STATE_LOST, pb.NODE_STATE_DEGRADED})

# Node states in which the host agent may still be asked to attach the node's GPUs.
ATTACHING_NODE_STATES = frozenset(
    {pb.NODE_STATE_PENDING, pb.NODE_STATE_ATTACHING, pb.NODE_STATE_RESIZING}
)
# Node states a host loss turns into LOST (the others already let go of their GPUs).
LOSABLE_NODE_STATES = frozenset(
    {
        pb.NODE_STATE_PENDING,
        pb.NODE_STATE_ATTACHING,
        pb.NODE_STATE_READY,
        pb.NODE_STATE_RESIZING,
        pb.NODE_STATE_DEGRADED,
    }
)
# Node states whose GPUs are attached and in use: the agent's health reports count.
IN_USE_NODE_STATES = frozenset({pb.NODE_STATE_READY, pb.NODE_STATE_DEGRADED})
# GPU states in which a host may hold a mapping of the GPU.
ON_HOST_GPU_STATES = frozenset(
    {
        pb.GPU_STATE_ATTACHING,
        pb.GPU_STATE_ATTACHED,
        pb.GPU_STATE_DETACHING,
        pb.GPU_STATE_FENCING,
        pb.GPU_STATE_QUARANTINED,
    }
)


class IllegalTransitionError(ValueError):
    """A transition the state machine does not have; a bug in the caller."""


def _closure(graph: Mapping[int, frozenset[int]]) -> dict[int, frozenset[int]]:
    reachable: dict[int, frozenset[int]] = {}
    for start in graph:
        seen: set[int] = set()
        frontier = list(graph[start])
        while frontier:
            state = frontier.pop()
            if state not in seen:
                seen.add(state)
                frontier.extend(graph.get(state, ()))
        reachable[start] = frozenset(seen)
    return reachable


# From each node state, every state it can still reach (transitively).
NODE_REACHABLE: Mapping[int, frozenset[int]] = _closure(NODE_TRANSITIONS)


def can_become(current: NodeStateValue, wanted: Iterable[NodeStateValue]) -> bool:
    """True if a node in ``current`` is, or can still become, one of ``wanted``."""
    goals = set(wanted)
    return current in goals or bool(goals & NODE_REACHABLE.get(current, frozenset()))


def is_terminal(state: NodeStateValue) -> bool:
    """True for a node state with no way out but deletion (RELEASED)."""
    return not NODE_TRANSITIONS.get(state)


def _check(kind: str, graph: Mapping[int, frozenset[int]], old: int, new: int, name: str) -> None:
    if new not in graph.get(old, frozenset()):
        names = pb.NodeState if kind == "node" else pb.GpuState
        raise IllegalTransitionError(
            f"{kind} {name}: no transition {names.Name(old)} -> {names.Name(new)}"  # type: ignore[arg-type]
        )


# -- GPUs ----------------------------------------------------------------------------


def _gpu_to(gpu: pb.Gpu, state: GpuStateValue, message: str = "") -> pb.Gpu:
    _check("gpu", GPU_TRANSITIONS, gpu.state, state, gpu.name)
    updated = copy(gpu)
    updated.state = state
    updated.message = message
    return updated


def is_free(gpu: pb.Gpu) -> bool:
    """True when the GPU may be given to a node."""
    return gpu.state == pb.GPU_STATE_FREE and not gpu.node and gpu.health != pb.GPU_HEALTH_UNHEALTHY


def assign(gpu: pb.Gpu, *, node: str, host: str, host_slot: int) -> pb.Gpu:
    """FREE -> ATTACHING for ``node`` on ``host``; a new generation (the fencing token
    every mapping of this assignment carries)."""
    updated = _gpu_to(gpu, pb.GPU_STATE_ATTACHING)
    updated.node = node
    updated.host = host
    updated.host_slot = host_slot
    updated.generation += 1
    return updated


def attach_confirmed(gpu: pb.Gpu, seen: pb.ObservedAttachment) -> pb.Gpu:
    """ATTACHING -> ATTACHED with what the agent learned (UUID, serial, health)."""
    updated = _gpu_to(gpu, pb.GPU_STATE_ATTACHED)
    updated.uuid = seen.uuid or gpu.uuid
    updated.serial = seen.serial or gpu.serial
    if seen.health != pb.GPU_HEALTH_UNSPECIFIED:
        updated.health = seen.health
        updated.health_reason = seen.health_reason
    return updated


def health_observed(gpu: pb.Gpu, seen: pb.ObservedAttachment) -> pb.Gpu | None:
    """The GPU with the health its host's agent reports in ``seen``, or None when that
    changes nothing (same health and reason, or the report says nothing about health).
    The scheduling state is untouched."""
    if seen.health == pb.GPU_HEALTH_UNSPECIFIED:
        return None
    if (gpu.health, gpu.health_reason) == (seen.health, seen.health_reason):
        return None
    updated = copy(gpu)
    updated.health = seen.health
    updated.health_reason = seen.health_reason
    return updated


def health_cleared(gpu: pb.Gpu, message: str) -> pb.Gpu:
    """HEALTHY again by an operator's word, with ``message`` saying why; the scheduling
    state is untouched (a FREE GPU can be handed out again)."""
    updated = copy(gpu)
    updated.health = pb.GPU_HEALTH_HEALTHY
    updated.health_reason = ""
    updated.message = message
    return updated


def begin_detach(gpu: pb.Gpu) -> pb.Gpu:
    """-> DETACHING: the owner let go; the host's agent must detach it."""
    return _gpu_to(gpu, pb.GPU_STATE_DETACHING)


def begin_fence(gpu: pb.Gpu, reason: str) -> pb.Gpu:
    """-> FENCING: the broker must revoke the box-side mapping before reuse."""
    if gpu.state == pb.GPU_STATE_FENCING:
        return gpu
    return _gpu_to(gpu, pb.GPU_STATE_FENCING, reason)


def quarantine(gpu: pb.Gpu, reason: str) -> pb.Gpu:
    """-> QUARANTINED: out of service until an operator clears it. It lets go of its
    node (so the node can finish) but keeps its host: it may still be mapped there."""
    updated = _gpu_to(gpu, pb.GPU_STATE_QUARANTINED, reason)
    updated.node = ""
    return updated


def free(gpu: pb.Gpu) -> pb.Gpu:
    """DETACHING/FENCING -> FREE: no owner, no host."""
    updated = _gpu_to(gpu, pb.GPU_STATE_FREE)
    updated.node = ""
    updated.host = ""
    updated.host_slot = 0
    return updated


# -- nodes ---------------------------------------------------------------------------


def add_event(
    node: pb.VirtualNode, reason: str, message: str, now: float, *, warning: bool = False
) -> None:
    """Append an event to ``node`` (a record being built, never one from a cache),
    dropping the oldest beyond :data:`MAX_NODE_EVENTS`."""
    node.events.add(
        time=timestamp(now),
        type=EVENT_WARNING if warning else EVENT_NORMAL,
        reason=reason,
        message=message,
    )
    excess = len(node.events) - MAX_NODE_EVENTS
    if excess > 0:
        del node.events[:excess]


def new_node_event(node: pb.VirtualNode, now: float) -> None:
    """Record the event of a node just composed (PENDING) on ``node`` itself."""
    add_event(node, NODE_STATE_REASONS[node.state], node.message, now)


def node_to(
    node: pb.VirtualNode,
    state: NodeStateValue,
    message: str,
    now: float,
    *,
    reason: str = "",
) -> pb.VirtualNode:
    """``node`` in ``state`` with ``message``, its update time set to ``now``, and an
    event recording the change (``reason``, or the state's own reason word; FAILED and
    LOST are warnings)."""
    _check("node", NODE_TRANSITIONS, node.state, state, node.name)
    updated = copy(node)
    updated.state = state
    updated.message = message
    updated.update_time.CopyFrom(timestamp(now))
    add_event(
        updated,
        reason or NODE_STATE_REASONS[state],
        message,
        now,
        warning=state in _WARNING_STATES,
    )
    return updated


def node_attaching(
    node: pb.VirtualNode, observed: Mapping[str, pb.ObservedAttachment], now: float
) -> pb.VirtualNode:
    """PENDING -> ATTACHING, bindings showing the phases the agent reported."""
    updated = node_to(node, pb.NODE_STATE_ATTACHING, "the host agent is attaching GPUs", now)
    for binding in updated.gpus:
        seen = observed.get(binding.gpu)
        if seen is not None:
            binding.phase = seen.phase
    return updated


def node_ready(
    node: pb.VirtualNode, observed: Mapping[str, pb.ObservedAttachment], now: float
) -> pb.VirtualNode:
    """-> READY with every binding ATTACHED and its BDF and UUID filled in."""
    updated = node_to(node, pb.NODE_STATE_READY, "all GPUs attached and verified", now)
    updated.ready_time.CopyFrom(timestamp(now))
    for binding in updated.gpus:
        seen = observed[binding.gpu]
        binding.phase = pb.ATTACHMENT_PHASE_ATTACHED
        binding.bdf = seen.bdf
        binding.uuid = seen.uuid
        if seen.health in (pb.GPU_HEALTH_DEGRADED, pb.GPU_HEALTH_UNHEALTHY):
            unhealthy = seen.health == pb.GPU_HEALTH_UNHEALTHY
            add_event(
                updated,
                "GpuUnhealthy" if unhealthy else "GpuDegraded",
                f"{binding.gpu}: {seen.health_reason or 'no reason reported'}",
                now,
                warning=True,
            )
    return updated


def node_letting_go(
    node: pb.VirtualNode, state: NodeStateValue, message: str, now: float, *, reason: str = ""
) -> pb.VirtualNode:
    """-> ``state`` (FAILED, RELEASING or LOST), every binding not FAILED now DETACHING;
    ``reason`` as for :func:`node_to`."""
    updated = node_to(node, state, message, now, reason=reason)
    for binding in updated.gpus:
        if binding.phase != pb.ATTACHMENT_PHASE_FAILED:
            binding.phase = pb.ATTACHMENT_PHASE_DETACHING
    return updated


__all__ = [
    "ATTACHING_NODE_STATES",
    "EVENT_NORMAL",
    "EVENT_WARNING",
    "GPU_TRANSITIONS",
    "IN_USE_NODE_STATES",
    "LOSABLE_NODE_STATES",
    "MAX_NODE_EVENTS",
    "NODE_REACHABLE",
    "NODE_STATE_REASONS",
    "NODE_TRANSITIONS",
    "ON_HOST_GPU_STATES",
    "IllegalTransitionError",
    "add_event",
    "assign",
    "attach_confirmed",
    "begin_detach",
    "begin_fence",
    "can_become",
    "free",
    "health_cleared",
    "health_observed",
    "is_free",
    "is_terminal",
    "new_node_event",
    "node_attaching",
    "node_letting_go",
    "node_ready",
    "node_to",
    "quarantine",
]
