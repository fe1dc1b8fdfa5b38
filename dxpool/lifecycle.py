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

    PENDING ─► ATTACHING ─► READY ─► RELEASING ─► RELEASED
       │           │         │ ▲         ▲  ▲
       │           │    grow ▼ │ done    │  │
       │           │       RESIZING ─────┤  │
       ├───────────┴──► FAILED ──────────┘  │
       └───────────┴──────┴──────┴─► LOST ──┘

RESIZING (a READY node growing or shrinking) goes back to READY whether new GPUs attach
or not, and once removed GPUs are freed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeAlias

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.records import copy, timestamp

NodeStateValue: TypeAlias = pb.NodeState.ValueType
GpuStateValue: TypeAlias = pb.GpuState.ValueType

NODE_TRANSITIONS: Mapping[int, frozenset[int]] = {
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
        {pb.NODE_STATE_RESIZING, pb.NODE_STATE_RELEASING, pb.NODE_STATE_LOST}
    ),
    pb.NODE_STATE_RESIZING: frozenset(
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

# Node states in which the host agent may still be asked to attach the node's GPUs.
ATTACHING_NODE_STATES = frozenset(
    {pb.NODE_STATE_PENDING, pb.NODE_STATE_ATTACHING, pb.NODE_STATE_RESIZING}
)
# Node states a host loss turns into LOST (the others already let go of their GPUs).
LOSABLE_NODE_STATES = frozenset(
    {pb.NODE_STATE_PENDING, pb.NODE_STATE_ATTACHING, pb.NODE_STATE_READY, pb.NODE_STATE_RESIZING}
)
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


def node_to(
    node: pb.VirtualNode, state: NodeStateValue, message: str, now: float
) -> pb.VirtualNode:
    """``node`` in ``state`` with ``message``, its update time set to ``now``."""
    _check("node", NODE_TRANSITIONS, node.state, state, node.name)
    updated = copy(node)
    updated.state = state
    updated.message = message
    updated.update_time.CopyFrom(timestamp(now))
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
    return updated


def node_letting_go(
    node: pb.VirtualNode, state: NodeStateValue, message: str, now: float
) -> pb.VirtualNode:
    """-> ``state`` (FAILED, RELEASING or LOST), every binding not FAILED now DETACHING."""
    updated = node_to(node, state, message, now)
    for binding in updated.gpus:
        if binding.phase != pb.ATTACHMENT_PHASE_FAILED:
            binding.phase = pb.ATTACHMENT_PHASE_DETACHING
    return updated


__all__ = [
    "ATTACHING_NODE_STATES",
    "GPU_TRANSITIONS",
    "LOSABLE_NODE_STATES",
    "NODE_REACHABLE",
    "NODE_TRANSITIONS",
    "ON_HOST_GPU_STATES",
    "IllegalTransitionError",
    "assign",
    "attach_confirmed",
    "begin_detach",
    "begin_fence",
    "can_become",
    "free",
    "is_free",
    "is_terminal",
    "node_attaching",
    "node_letting_go",
    "node_ready",
    "node_to",
    "quarantine",
]
