"""``python -m dxpool.broker`` (what ``dxpool broker`` runs) as a process."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc

from dxpool.api.v1 import fabric_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.client import Client
from dxpool.errors import NotFound
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, free_port
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.conftest import wait_until


def test_metrics_are_served_on_the_address_and_port_given(
    etcd_server: EmbeddedEtcd, key_prefix: str, tmp_path: Path
) -> None:
    port, metrics_port = free_port(), free_port()
    log = (tmp_path / "broker.log").open("wb")
    broker = subprocess.Popen(
        [sys.executable, "-m", "dxpool.broker", "--etcd", etcd_server.endpoint,
         "--prefix", key_prefix, "--listen", f"127.0.0.1:{port}",
         "--metrics-port", str(metrics_port), "--metrics-address", "127.0.0.1",
         "--log-level", "WARNING"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_until(lambda: _get(url) is not None, timeout_s=10, message="metrics served")
        body = _get(url) or ""
        assert "dxpool_release_total 0.0" in body
    finally:
        broker.terminate()
        broker.wait(30)
        log.close()


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None


def test_a_latency_matrix_flag_is_used_and_a_bad_one_is_a_usage_error(
    etcd_server: EmbeddedEtcd, key_prefix: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("round_trips: [{hosts: s1/p1/r1, boxes: s1/p1/r2, round_trip: soon}]\n")
    refused = subprocess.run(
        [sys.executable, "-m", "dxpool.broker", "--etcd", etcd_server.endpoint,
         "--prefix", key_prefix, "--listen", "127.0.0.1:0", "--latency-matrix", str(bad)],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert f"{bad}: round_trips[0].round_trip: cannot parse duration 'soon'" in refused.stderr
    assert "Traceback" not in refused.stderr

    good = tmp_path / "rtt.csv"
    good.write_text("hosts,boxes,round_trip\ns1/p1/r1,s1/p1/r2,3.3us\n")
    port = free_port()
    log = (tmp_path / "broker.log").open("wb")
    broker = subprocess.Popen(
        [sys.executable, "-m", "dxpool.broker", "--etcd", etcd_server.endpoint,
         "--prefix", key_prefix, "--listen", f"127.0.0.1:{port}",
         "--latency-matrix", str(good), "--log-level", "WARNING"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    keys = KeySchema(key_prefix)
    host = pb.Host(
        name="hosts/h1", location=pb.Location(site="s1", pod="p1", rack="r1"), slot_capacity=8
    )
    etcd = connect(etcd_server.endpoint)
    Store(etcd, keys).commit(Txn().put(keys.host("h1"), host))
    etcd.close()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        with Client(f"127.0.0.1:{port}") as client:
            client.create_box(
                "box2",
                gpus=1,
                model="H100",
                memory_mib=81920,
                location=("s1", "p1", "r2"),
            )
            latency = wait_until(
                lambda: _latency_or_none(client), message="the broker sees h1 and box2"
            )
        assert latency.round_trip_ns == 3_300
        assert list(latency.path) == [
            "proxy:hosts/h1",
            "matrix:s1/p1/r1->s1/p1/r2",
            "proxy:boxes/box2",
        ]
    finally:
        broker.terminate()
        broker.wait(30)
        log.close()


def _latency_or_none(client: Client) -> fabric_pb2.Latency | None:
    try:
        return client.get_latency("h1", "box2")
    except NotFound:
        return None
