"""What etcd failures cost the broker: write gaps, status codes, health, cache staleness.

Starts etcd (one member, or three on loopback), one host agent process on the simulated
fabric and a broker in this process (so the member its cache watches is known), then
drives compose + release pairs (each a write) from one client thread at a steady pace
while it injects one fault:

* ``leader``: SIGKILL the etcd leader of three members (it stays down);
* ``watched``: SIGKILL the member the broker's cache watches (it stays down); leadership
  is first moved to another member, so this measures the watch alone;
* ``kill``: SIGKILL the only member, restart it on the same data directory and port
  after ``--outage`` seconds;
* ``stop``: SIGSTOP the only member, SIGCONT it after ``--outage`` seconds.

A failed write is retried at once with the same request id (as ``dxpool.client`` does),
so the figures show when the broker can write again, not a client's backoff. Reports:

* ``write_gap_s``: the longest time between two successful writes from the fault on;
* ``resumed_after_fault_s`` / ``resumed_after_restore_s``: fault (or restore) to the
  first successful write after it;
* the status codes of failed writes (INTERNAL should be 0), the health transitions, and
  the longest cache lag the broker reported.

Usage: python bench/etcd_faults.py {leader,watched,kill,stop} [--outage 15] [--after 8]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dxpool.api.v1 import inventory_pb2, inventory_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerConfig, BrokerServer
from dxpool.fabric.sim import SimFabric, SimGpuSpec
from dxpool.store.embedded import EmbeddedEtcd, EtcdCluster

GPUS = 16
PACE_S = 0.05


@dataclass
class Record:
    """What the load and health threads saw, with times relative to ``t0``."""

    t0: float = field(default_factory=time.monotonic)
    successes: list[float] = field(default_factory=list)
    failures: list[tuple[float, str, str]] = field(default_factory=list)
    health: list[tuple[float, str]] = field(default_factory=list)
    max_lag_s: float = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0


def write(stub: nodes_pb2_grpc.NodeServiceStub, record: Record, call: object) -> object:
    """Retry one write until it succeeds (same request, as a retrying client would)."""
    while True:
        try:
            result = call()  # type: ignore[operator]
            record.successes.append(record.now())
            return result
        except grpc.RpcError as error:
            record.failures.append((record.now(), error.code().name, error.details() or ""))
            time.sleep(0.01)


def load(endpoint: str, record: Record, stop: threading.Event) -> None:
    channel = grpc.insecure_channel(endpoint)
    nodes = nodes_pb2_grpc.NodeServiceStub(channel)
    spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1))
    while not stop.is_set():
        request_id = uuid.uuid4().hex
        node = write(
            nodes,
            record,
            lambda request_id=request_id: nodes.ComposeNode(
                nodes_pb2.ComposeNodeRequest(spec=spec, request_id=request_id), timeout=5
            ),
        )
        name = node.name  # type: ignore[attr-defined]
        write(
            nodes,
            record,
            lambda name=name: nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=name), timeout=5),
        )
        time.sleep(PACE_S)
    channel.close()


def watch_health(
    endpoint: str, broker: BrokerServer, record: Record, stop: threading.Event
) -> None:
    channel = grpc.insecure_channel(endpoint)
    stub = health_pb2_grpc.HealthStub(channel)
    last = ""
    while not stop.is_set():
        try:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            )
        except grpc.RpcError as error:
            status = error.code().name
        if status != last:
            record.health.append((round(record.now(), 3), status))
            last = status
        record.max_lag_s = max(record.max_lag_s, broker.cache.lag_s())
        time.sleep(0.02)
    channel.close()


def start_agent(work: Path, broker: str) -> subprocess.Popen[bytes]:
    log = open(work / "agent.log", "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dxpool.hostagent",
            "--host",
            "h1",
            "--broker",
            broker,
            "--driver",
            "sim",
            "--sim-state",
            str(work / "fabric"),
            "--slots",
            str(GPUS),
            "--site",
            "s1",
            "--pod",
            "p1",
            "--rack",
            "r1",
            "--log-level",
            "WARNING",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def prepare(endpoint: str) -> None:
    channel = grpc.insecure_channel(endpoint)
    inventory = inventory_pb2_grpc.InventoryServiceStub(channel)
    for index in range(GPUS // 8):
        inventory.CreateBox(
            inventory_pb2.CreateBoxRequest(
                box_id=f"box{index}",
                gpu_model="H100",
                gpu_memory_mib=81920,
                box=pb.Box(gpu_count=8, location=pb.Location(site="s1", pod="p1", rack="r1")),
            )
        )
    deadline = time.monotonic() + 30
    while not any(h.alive for h in inventory.ListHosts(inventory_pb2.ListHostsRequest()).hosts):
        if time.monotonic() > deadline:
            raise RuntimeError("the host agent did not register; see agent.log")
        time.sleep(0.1)
    channel.close()


def report(scenario: str, record: Record, fault_at: float, restore_at: float | None) -> dict:
    after = [t for t in record.successes if t >= fault_at]
    window = [fault_at, *after]
    gaps = [b - a for a, b in itertools.pairwise(window)]
    codes = collections.Counter(code for t, code, _ in record.failures if t >= fault_at)
    details = collections.Counter(
        f"{code}: {re.sub(r'[0-9.]+s', 'Ns', detail)[:100]}"
        for t, code, detail in record.failures
        if t >= fault_at
    )
    result: dict[str, object] = {
        "scenario": scenario,
        "writes_ok_before_fault": sum(1 for t in record.successes if t < fault_at),
        "writes_ok_after_fault": len(after),
        "write_gap_s": round(max(gaps), 3) if gaps else None,
        "resumed_after_fault_s": round(after[0] - fault_at, 3) if after else None,
        "failed_writes_by_code": dict(codes),
        "internal": codes.get("INTERNAL", 0),
        "failure_details": dict(details.most_common(6)),
        "health": [(round(t - fault_at, 3), s) for t, s in record.health],
        "max_cache_lag_s": round(record.max_lag_s, 3),
    }
    if restore_at is not None:
        later = [t for t in record.successes if t >= restore_at]
        result["resumed_after_restore_s"] = round(later[0] - restore_at, 3) if later else None
    return result


def inject(
    scenario: str,
    etcd: EtcdCluster | EmbeddedEtcd,
    broker: BrokerServer,
    record: Record,
    outage_s: float,
    after_s: float,
) -> dict[str, object]:
    """Inject the fault, wait it out, and report."""
    if isinstance(etcd, EtcdCluster):
        watched = etcd.member(str(broker.cache.watch_endpoint))
        if scenario == "watched":
            etcd.move_leader(next(m for m in etcd.members if m is not watched))
            time.sleep(1)
        leader = etcd.leader()
        victim = leader if scenario == "leader" else watched
        fault_at = record.now()
        victim.kill()
        time.sleep(after_s)
        result = report(scenario, record, fault_at, None)
        result["killed"] = f"{victim.name} (leader: {leader.name}, cache watched: {watched.name})"
        return result
    fault_at = record.now()
    if scenario == "kill":
        etcd.kill()
    else:
        etcd.pause()
    time.sleep(outage_s)
    if scenario == "kill":
        etcd.start()  # same data directory and port; returns once etcd answers
    else:
        etcd.resume()
    restore_at = record.now()
    time.sleep(after_s)
    result = report(scenario, record, fault_at, restore_at)
    result["outage_s"] = round(restore_at - fault_at, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=["leader", "watched", "kill", "stop"])
    parser.add_argument("--outage", type=float, default=15.0, help="seconds etcd stays down")
    parser.add_argument("--after", type=float, default=8.0, help="seconds measured after")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dxpool-faults-") as raw:
        work = Path(raw)
        etcd: EtcdCluster | EmbeddedEtcd = (
            EtcdCluster(3, work / "etcd")
            if args.scenario in ("leader", "watched")
            else EmbeddedEtcd(work / "etcd")
        )
        etcd.start()
        endpoints = etcd.endpoints if isinstance(etcd, EtcdCluster) else etcd.endpoint
        prefix = "/dxpool-faults/"
        SimFabric.create(
            work / "fabric",
            boxes={f"box{i}": [SimGpuSpec("H100", 81920)] * 8 for i in range(GPUS // 8)},
            hosts={"h1": GPUS},
        )
        broker = BrokerServer(
            BrokerConfig(
                etcd_endpoints=endpoints,
                key_prefix=prefix,
                listen="127.0.0.1:0",
                agent_listen="127.0.0.1:0",
            )
        ).start()
        agent = start_agent(work, broker.agent_endpoint)
        stop = threading.Event()
        try:
            prepare(broker.endpoint)
            record = Record()
            threads = [
                threading.Thread(target=load, args=(broker.endpoint, record, stop)),
                threading.Thread(target=watch_health, args=(broker.endpoint, broker, record, stop)),
            ]
            for thread in threads:
                thread.start()
            time.sleep(3)
            result = inject(args.scenario, etcd, broker, record, args.outage, args.after)
            stop.set()
            for thread in threads:
                thread.join(30)
            print(json.dumps(result, indent=2))
        finally:
            stop.set()
            broker.stop(grace_s=0)
            agent.terminate()
            agent.wait(10)
            etcd.stop()


if __name__ == "__main__":
    main()
