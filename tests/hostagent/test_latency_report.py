"""Round-trip reports: the status record carries them, the reporter writes only news, and
an agent's probes reach a broker's measured model through its session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.client import Client
from dxpool.fabric.latency import Place
from dxpool.fabric.measured import RoundTripSmoother
from dxpool.hostagent.agent import Agent
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.drivers.sim import make_sim_driver
from dxpool.hostagent.latency_report import LatencyReporter
from dxpool.hostagent.link import BrokerLink
from dxpool.hostagent.status import NotRegisteredError, StatusStore
from dxpool.names import GpuRef
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from tests.conftest import SimPool, Stubs, register_sim_box, wait_until
from tests.patience import patient

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer


class FakeProber:
    """Stands in for the hardware probe: a table of round trips per box."""

    def __init__(self, table: dict[str, int]) -> None:
        self.table = table
        self.calls: list[str] = []

    def probe(self, box: str) -> int | None:
        self.calls.append(box)
        value = self.table.get(box)
        if value == -1:
            raise OSError("proxy busy")
        return value


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def client(etcd_server: EmbeddedEtcd) -> Iterator[Any]:
    client = connect(etcd_server.endpoint)
    yield client
    client.close()


@pytest.fixture
def status(open_link: Callable[..., BrokerLink]) -> StatusStore:
    return StatusStore(open_link(), "h1")


def stored(client: Any, key_prefix: str) -> tuple[resources_pb2.HostStatus, int]:
    value, meta = client.get(KeySchema(key_prefix).host_status("h1"))
    return resources_pb2.HostStatus.FromString(value), meta.mod_revision


def sample(box: str, ns: int) -> resources_pb2.RoundTripSample:
    return resources_pb2.RoundTripSample(box=box, round_trip_ns=ns)


def test_round_trips_survive_attachment_writes_and_reloads(
    status: StatusStore, client: Any, key_prefix: str
) -> None:
    status.set_round_trips([sample("boxes/b1", 4_000)])
    entry = resources_pb2.ObservedAttachment(
        gpu="boxes/b1/gpus/0", phase=resources_pb2.ATTACHMENT_PHASE_ATTACHED
    )
    status.put(entry)
    record, revision = stored(client, key_prefix)
    assert [(s.box, s.round_trip_ns) for s in record.round_trips] == [("boxes/b1", 4_000)]
    assert [e.gpu for e in record.attachments] == ["boxes/b1/gpus/0"]
    status.set_round_trips([sample("boxes/b1", 4_000)])  # nothing new: no write
    assert stored(client, key_prefix)[1] == revision
    reloaded = StatusStore(status._writer, "h1")
    reloaded.adopt(stored(client, key_prefix)[0])
    assert [s.round_trip_ns for s in reloaded.round_trips()] == [4_000]


def test_a_report_without_a_session_writes_nothing(
    open_link: Callable[..., BrokerLink], client: Any, key_prefix: str
) -> None:
    keys = KeySchema(key_prefix)
    link = open_link()
    link.stop(release=False)  # the agent's session is gone
    status = StatusStore(link, "h1")
    with pytest.raises(NotRegisteredError):
        status.set_round_trips([sample("boxes/b1", 4_000)])
    assert client.get(keys.host_status("h1"))[0] is None
    assert status.round_trips() == []


def test_the_reporter_smooths_and_writes_only_news(
    status: StatusStore, client: Any, key_prefix: str
) -> None:
    prober = FakeProber({"b1": 4_000, "b2": 8_000})
    boxes = {"b1", "b2"}
    clock = Clock()
    reporter = LatencyReporter(
        prober, status, lambda: boxes, smoother=RoundTripSmoother(0.5), clock=clock
    )
    assert reporter.probe_once()  # first report
    record, _ = stored(client, key_prefix)
    assert [(s.box, s.round_trip_ns) for s in record.round_trips] == [
        ("boxes/b1", 4_000),
        ("boxes/b2", 8_000),
    ]
    assert record.round_trips[0].measure_time.seconds == 1_000
    clock.now += 1
    prober.table["b1"] = 4_100  # smoothed 4050: a 1.25% move is not news
    assert not reporter.probe_once()
    prober.table["b1"] = 6_000  # smoothed 5025: news
    clock.now += 1
    assert reporter.probe_once()
    assert stored(client, key_prefix)[0].round_trips[0].round_trip_ns == 5_025
    clock.now += 61  # a quiet report is written again once refresh_s passed
    prober.table["b1"] = 5_025
    assert reporter.probe_once()
    assert stored(client, key_prefix)[0].round_trips[0].measure_time.seconds == 1_063
    boxes.discard("b2")  # the host let go of b2's GPUs: b2 leaves the report
    prober.table["b1"] = -1  # and b1's probe fails this round: its figure stays
    assert reporter.probe_once()
    assert [(s.box, s.round_trip_ns) for s in stored(client, key_prefix)[0].round_trips] == [
        ("boxes/b1", 5_025)
    ]


def test_an_agents_probes_reach_the_brokers_measured_model(
    broker_factory: Callable[..., BrokerServer],
    sim_pool: SimPool,
    etcd_server: EmbeddedEtcd,
    key_prefix: str,
    tmp_path: Path,
) -> None:
    broker = broker_factory(latency_model="measured")
    channel = grpc.insecure_channel(broker.endpoint)
    register_sim_box(sim_pool, Stubs(channel), "box2", gpus=2, rack="r2")
    channel.close()
    sim_pool.fabric.add_host("h1", 8)
    config = AgentConfig(
        host_id="h1",
        brokers=broker.agent_endpoint,
        site="s1",
        pod="p1",
        rack="r1",
        sim_state_dir=sim_pool.state_dir,
        state_dir=tmp_path / "agent",
        probe_interval_s=0.1,
    )
    prober = FakeProber({"box2": 33_000})
    agent = Agent(config, make_sim_driver(sim_pool.fabric, "h1"), prober=prober)
    agent.start()
    host, box = Place("hosts/h1", "s1", "p1", "r1"), Place("boxes/box2", "s1", "p1", "r2")
    try:
        before = broker.latency.current().round_trip(host, box).round_trip_ns
        assert before == 4_400  # nothing measured: the topology model
        with Client(broker.endpoint) as pool:
            wait_until(lambda: any(h.alive for h in pool.list_hosts()), message="h1 alive")
            node = pool.compose_node("H100:1")
            pool.wait_for_node(node.name, timeout_s=20)
        wait_until(
            lambda: broker.latency.current().round_trip(host, box).round_trip_ns == 33_000,
            message="the agent's probe in the broker's model",
        )
        assert GpuRef("box2", 0) in agent._status.gpus()
        assert "box2" in prober.calls
    finally:
        agent.stop()


def test_a_report_and_an_attachment_write_at_once_lose_neither(
    status: StatusStore, client: Any, key_prefix: str
) -> None:
    """The report's write is held inside the broker call while a reconcile worker writes
    an attachment: the worker waits for it, then writes both, so neither is lost (and the
    attachment entry, the one a release compares, is never written without the session)."""
    import threading

    link = status._writer
    in_commit, release = threading.Event(), threading.Event()

    class HeldWriter:
        def write_status(self, record: resources_pb2.HostStatus, spec_revision: int) -> None:
            if not in_commit.is_set():
                in_commit.set()
                assert release.wait(patient(10))
            link.write_status(record, spec_revision)

    status._writer = HeldWriter()
    reporter = threading.Thread(target=status.set_round_trips, args=([sample("boxes/b1", 4_000)],))
    reporter.start()
    assert in_commit.wait(patient(10))
    entry = resources_pb2.ObservedAttachment(
        gpu="boxes/b1/gpus/0", phase=resources_pb2.ATTACHMENT_PHASE_ATTACHING
    )
    worker = threading.Thread(target=status.put, args=(entry,))
    worker.start()
    worker.join(0.3)
    assert worker.is_alive()  # it waits for the report's write to finish
    release.set()
    reporter.join(10)
    worker.join(10)
    record, _ = stored(client, key_prefix)
    assert [e.gpu for e in record.attachments] == ["boxes/b1/gpus/0"]
    assert [(s.box, s.round_trip_ns) for s in record.round_trips] == [("boxes/b1", 4_000)]
