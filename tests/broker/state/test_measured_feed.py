"""Agents' round-trip reports reach a broker's measured model through etcd and the cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.state.measured_feed import measurements
from dxpool.fabric.latency import Place, TopologyLatencyModel
from dxpool.fabric.measured import MeasuredLatency, Measurement
from dxpool.fabric.topology import Topology
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.conftest import Stubs, add_box, wait_until

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer

TREE = TopologyLatencyModel(Topology.default())
HOST = Place("hosts/h1", "s1", "p1", "r1")
BOX = Place("boxes/box2", "s1", "p1", "r2")


def stamp(seconds: float) -> Timestamp:
    value = Timestamp()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def sample(box: str, ns: int, at: float) -> pb.RoundTripSample:
    return pb.RoundTripSample(box=box, round_trip_ns=ns, measure_time=stamp(at))


def test_measurements_keep_one_valid_entry_per_box() -> None:
    status = pb.HostStatus(
        round_trips=[
            sample("boxes/b1", 5_000, 10.0),
            sample("boxes/b1", 6_000, 11.0),  # the last one listed wins
            sample("boxes/b2", 0, 11.0),  # not a round trip
            sample("", 4_000, 11.0),  # no box
            sample("boxes/b3/x", 4_000, 11.0),  # not a box name
            sample("b4", 3_000, 12.5),
        ]
    )
    assert measurements(status) == [Measurement("b1", 6_000, 11.0), Measurement("b4", 3_000, 12.5)]


def test_a_status_report_moves_the_brokers_model_and_deleting_it_falls_back(
    broker_factory: Callable[..., BrokerServer],
    etcd_client: Any,
    key_prefix: str,
) -> None:
    broker = broker_factory(latency_model="measured")
    assert isinstance(broker.latency, MeasuredLatency)
    channel = grpc.insecure_channel(broker.endpoint)
    add_box(Stubs(channel), "box2", gpus=1, rack="r2")
    channel.close()
    keys = KeySchema(key_prefix)
    store = Store(etcd_client, keys)
    host = pb.Host(
        name="hosts/h1", location=pb.Location(site="s1", pod="p1", rack="r1"), slot_capacity=8
    )
    status = pb.HostStatus(host="hosts/h1", round_trips=[sample("boxes/box2", 12_345, time.time())])
    store.commit(Txn().put(keys.host("h1"), host).put(keys.host_status("h1"), status))

    def measured() -> int:
        return broker.latency.current().round_trip(HOST, BOX).round_trip_ns

    wait_until(lambda: measured() == 12_345, message="the report reached the model")
    assert broker.latency.current().round_trip(HOST, BOX).path[1] == ("measured:s1/p1/r1->s1/p1/r2")
    store.commit(Txn().delete(keys.host_status("h1")))
    wait_until(
        lambda: measured() == TREE.round_trip(HOST, BOX).round_trip_ns,
        message="the model fell back to the topology",
    )
