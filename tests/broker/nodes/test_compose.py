"""Concurrent composes in one broker place one at a time (a real broker, etcd and agent).

The interleaving is forced: the first compose is held inside its placement while a second
one is sent. The second must not place until the first holds its choice, so it places on
a snapshot that shows that hold, chooses other GPUs at once and is never refused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.nodes import compose
from dxpool.broker.state.placement_index import PlacementIndex
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive
from tests.patience import patient

NOT_BEFORE_S = 1.0  # how long the second compose is given to (wrongly) start placing


def conflicts() -> float:
    return REGISTRY.get_sample_value("dxpool_compose_conflicts_total") or 0.0


class HeldFirstPlacement:
    """Wraps compose.place and PlacementIndex.hold: the first placement waits for
    ``release``; every placement and hold is recorded in order as (event, thread)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.first_placing = threading.Event()
        self.second_placing = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()

    def place(self, real: Any, *args: Any) -> Any:
        with self._lock:
            self.events.append(("place", threading.current_thread().name))
            calls = sum(1 for event, _ in self.events if event == "place")
        if calls == 1:
            self.first_placing.set()
            assert self.release.wait(patient(30))
        elif calls == 2:
            self.second_placing.set()
        return real(*args)

    def hold(self, real: Any, index: PlacementIndex, placement: Any) -> bool:
        held: bool = real(index, placement)
        with self._lock:
            self.events.append(("hold" if held else "refused", threading.current_thread().name))
        return held


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldFirstPlacement]:
    gate = HeldFirstPlacement()
    real_place, real_hold = compose.place, PlacementIndex.hold
    monkeypatch.setattr(compose, "place", lambda *args: gate.place(real_place, *args))
    monkeypatch.setattr(
        PlacementIndex, "hold", lambda index, placement: gate.hold(real_hold, index, placement)
    )
    yield gate
    gate.release.set()


def test_a_compose_places_only_once_the_one_placing_before_it_holds_its_choice(
    broker: BrokerServer, sim_pool: SimPool, held: HeldFirstPlacement
) -> None:
    channel = grpc.insecure_channel(broker.endpoint)
    stubs = Stubs(channel)
    register_sim_box(sim_pool, stubs, "box0", gpus=4)
    sim_pool.start_agent("h0", slots=4)
    wait_hosts_alive(stubs)
    conflicts_before = conflicts()
    nodes: dict[str, pb.VirtualNode] = {}

    def compose_one(name: str) -> None:
        request = nodes_pb2.ComposeNodeRequest(
            spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)), node_id=name
        )
        nodes[name] = stubs.nodes.ComposeNode(request, timeout=30)

    first = threading.Thread(target=compose_one, args=("first",))
    first.start()
    assert held.first_placing.wait(patient(30))
    second = threading.Thread(target=compose_one, args=("second",))
    second.start()
    # The second compose waits for the first's placement and hold, not beside it.
    assert not held.second_placing.wait(NOT_BEFORE_S)
    held.release.set()
    first.join(30)
    second.join(30)
    channel.close()

    assert set(nodes) == {"first", "second"}
    places = [index for index, (event, _) in enumerate(held.events) if event == "place"]
    holds = [index for index, (event, _) in enumerate(held.events) if event == "hold"]
    assert len(places) == 2, held.events  # no compose placed again
    assert "refused" not in {event for event, _ in held.events}
    assert places[1] > holds[0]  # the second placed on a snapshot showing the first's hold
    assert nodes["first"].gpus[0].gpu != nodes["second"].gpus[0].gpu
    assert nodes["first"].gpus[0].host_slot != nodes["second"].gpus[0].host_slot
    assert conflicts() == conflicts_before
