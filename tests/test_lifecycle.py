"""Node events recorded by the state machine's transitions: every transition appends one
to the node, FAILED and LOST are warnings, and the list stays bounded."""

from __future__ import annotations

import pytest

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb


def composed(now: float = 100.0) -> pb.VirtualNode:
    node = pb.VirtualNode(
        name="nodes/n1",
        host="hosts/h1",
        state=pb.NODE_STATE_PENDING,
        message="waiting for the host agent to attach the GPUs",
        gpus=[pb.GpuBinding(gpu="boxes/b1/gpus/0"), pb.GpuBinding(gpu="boxes/b1/gpus/1")],
    )
    lifecycle.new_node_event(node, now)
    return node


def test_a_composed_node_starts_with_one_normal_event() -> None:
    node = composed()
    assert [(e.type, e.reason, e.message) for e in node.events] == [
        ("Normal", "Composed", "waiting for the host agent to attach the GPUs")
    ]
    assert node.events[0].time.seconds == 100


def test_each_transition_appends_its_reason_and_leaves_the_input_alone() -> None:
    node = composed()
    attaching = lifecycle.node_to(node, pb.NODE_STATE_ATTACHING, "attaching", 101.0)
    failed = lifecycle.node_letting_go(
        attaching,
        pb.NODE_STATE_FAILED,
        "attach failed on hosts/h1: boom",
        102.0,
        reason="AttachFailed",
    )
    releasing = lifecycle.node_letting_go(failed, pb.NODE_STATE_RELEASING, "released", 103.0)
    released = lifecycle.node_to(releasing, pb.NODE_STATE_RELEASED, "all GPUs let go", 104.0)
    assert len(node.events) == 1 and len(attaching.events) == 2  # inputs untouched
    assert [(e.type, e.reason) for e in released.events] == [
        ("Normal", "Composed"),
        ("Normal", "Attaching"),
        ("Warning", "AttachFailed"),
        ("Normal", "Releasing"),
        ("Normal", "Released"),
    ]
    assert released.events[2].message == "attach failed on hosts/h1: boom"
    assert [e.time.seconds for e in released.events] == [100, 101, 102, 103, 104]


def test_lost_is_a_warning() -> None:
    lost = lifecycle.node_letting_go(composed(), pb.NODE_STATE_LOST, "host lost", 101.0)
    assert (lost.events[-1].type, lost.events[-1].reason) == ("Warning", "Lost")


def test_ready_warns_about_gpus_that_came_up_degraded_or_unhealthy() -> None:
    observed = {
        "boxes/b1/gpus/0": pb.ObservedAttachment(
            gpu="boxes/b1/gpus/0",
            phase=pb.ATTACHMENT_PHASE_ATTACHED,
            health=pb.GPU_HEALTH_DEGRADED,
            health_reason="pending row remap",
        ),
        "boxes/b1/gpus/1": pb.ObservedAttachment(
            gpu="boxes/b1/gpus/1",
            phase=pb.ATTACHMENT_PHASE_ATTACHED,
            health=pb.GPU_HEALTH_HEALTHY,
        ),
    }
    ready = lifecycle.node_ready(composed(), observed, 101.0)
    assert [(e.type, e.reason, e.message) for e in ready.events[1:]] == [
        ("Normal", "Ready", "all GPUs attached and verified"),
        ("Warning", "GpuDegraded", "boxes/b1/gpus/0: pending row remap"),
    ]


def test_events_are_bounded_oldest_dropped() -> None:
    node = composed()
    for index in range(lifecycle.MAX_NODE_EVENTS + 5):
        lifecycle.add_event(node, "Note", f"n{index}", 200.0 + index)
    assert len(node.events) == lifecycle.MAX_NODE_EVENTS
    assert node.events[-1].message == f"n{lifecycle.MAX_NODE_EVENTS + 4}"
    assert node.events[0].message == "n5"


def test_an_illegal_transition_records_nothing() -> None:
    node = composed()
    with pytest.raises(lifecycle.IllegalTransitionError):
        lifecycle.node_to(node, pb.NODE_STATE_RELEASED, "no", 101.0)
    assert len(node.events) == 1
