"""``describe`` text: fields, parts and events, with no broker (the commands' tests cover
the same against a real one)."""

from __future__ import annotations

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.describe import MAX_SHOWN_EVENTS, describe_host, describe_node


def event(seconds: int, reason: str, kind: str = "Normal", message: str = "m") -> pb.Event:
    found = pb.Event(type=kind, reason=reason, message=message)
    found.time.seconds = seconds
    return found


def test_a_node_lists_its_bindings_and_events_oldest_first() -> None:
    node = pb.VirtualNode(
        name="nodes/n1",
        host="hosts/h1",
        state=pb.NODE_STATE_FAILED,
        message="attach failed",
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)),
        gpus=[pb.GpuBinding(gpu="boxes/b1/gpus/3", model="H100", host_slot=2)],
        events=[event(1_000, "Composed"), event(1_060, "AttachFailed", "Warning", "proxy: busy")],
    )
    lines = describe_node(node, now=1_120).splitlines()
    assert lines[1].split() == ["State:", "Failed"]
    bindings = lines[lines.index("Bindings:") + 2].split()
    assert bindings[:3] == ["b1/3", "H100", "2"]
    events = lines[lines.index("Events:") + 1 :]
    assert [line.split() for line in events[1:]] == [
        ["Normal", "Composed", "2m", "node/n1", "m"],
        ["Warning", "AttachFailed", "1m", "node/n1", "proxy:", "busy"],
    ]


def test_no_events_and_no_nodes_say_none() -> None:
    text = describe_host(pb.Host(name="hosts/h1", slot_capacity=4), [])
    assert "Nodes:  <none>" in text and "Events:  <none>" in text


def test_a_host_shows_only_the_most_recent_events_of_its_nodes() -> None:
    nodes = [
        pb.VirtualNode(
            name=f"nodes/n{index}",
            state=pb.NODE_STATE_READY,
            events=[event(index * 100 + step, f"R{index}x{step}") for step in range(8)],
        )
        for index in range(4)
    ]
    lines = describe_host(pb.Host(name="hosts/h1"), nodes, now=1_000).splitlines()
    events = lines[lines.index("Events:") + 2 :]
    assert len(events) == MAX_SHOWN_EVENTS
    assert events[-1].split()[1] == "R3x7" and events[0].split()[1] == "R1x4"
    assert events[-1].split()[3] == "node/n3"
