"""Compose latency against its floor, measured in one run against one etcd.

Starts a private etcd (fsync on), a broker process and four host agent processes on the
simulated fabric, then measures from this process:

1. the floor: a bare etcd transaction of the same shape as a one-GPU compose (5 compares,
   4 writes of records of similar size, same client library) and a no-op gRPC call to
   the broker (health Check);
2. ComposeNode and ReleaseNode end to end (p50/p99);
3. compose+release pairs per second with 1 and with 8 client threads.

The latencies that make the ratio are measured **paired**: one loop takes, in turn, a
no-op RPC, a bare transaction, a ComposeNode and (once the node is READY) a
ReleaseNode, each after the same idle pause on a settled system (no attach or detach
in flight). All three then meet the same conditions: a call that follows a pause pays
thread and connection wake-ups that back-to-back calls do not (on these machines a bare
transaction takes ~1.1 ms back to back and ~1.8 ms after a 10 ms pause). Back-to-back
baselines and back-to-back compose/release are printed too, for reference.

Everything (etcd, broker, agents, this client) shares the machine, so the back-to-back
and throughput figures include the agents' work, which in a real pool runs on the hosts.
Prints the ratio  compose p50 / (bare txn p50 + no-op RPC p50)  from the paired loop
(target: at most 1.3). Compare ratios, not absolute times: these machines are noisy.

Usage: python bench/compose_latency.py [--samples 1000] [--seconds 5] [--pause-ms 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
from etcd3 import transactions
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from bench.broker_metrics import broker_samples
from dxpool.api.v1 import inventory_pb2, inventory_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.fabric.sim import SimFabric, SimGpuSpec
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, free_ports

BOXES = 16
GPUS_PER_BOX = 8
HOSTS = 4
SLOTS = 64


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(call: Callable[[], object], samples: int) -> list[float]:
    for _ in range(min(100, samples)):
        call()
    out = []
    for _ in range(samples):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1000)
    return out


def report(name: str, samples: list[float]) -> float:
    p50 = statistics.median(samples)
    print(
        f"{name:<34} p50 {p50:7.3f} ms   p99 {percentile(samples, 0.99):7.3f} ms   n={len(samples)}"
    )
    return p50


class BareTxn:
    """Transactions shaped like a one-GPU compose: 5 compares, 4 puts of similar records."""

    def __init__(self, etcd_endpoint: str) -> None:
        self._client = connect(etcd_endpoint)
        self._prefix = f"/bench-{uuid.uuid4().hex[:8]}/"
        gpu = pb.Gpu(
            name="boxes/b/gpus/0",
            box="boxes/b",
            model="H100",
            memory_mib=81920,
            state=pb.GPU_STATE_ATTACHING,
            node="nodes/node-12345678",
            host="hosts/h1",
        )
        node = pb.VirtualNode(
            name="nodes/node-12345678",
            host="hosts/h1",
            spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)),
        )
        node.gpus.add(gpu="boxes/b/gpus/0", model="H100", host_slot=3, latency_ns=3000)
        alloc = pb.HostAllocation(host="hosts/h1")
        alloc.attachments.add(gpu="boxes/b/gpus/0", host_slot=3, node=node.name, generation=1)
        self._values = [
            gpu.SerializeToString(),
            alloc.SerializeToString(),
            node.SerializeToString(),
            b"x",
        ]
        self._client.put(self._prefix + "lease", b"")
        self._counter = 0

    def one(self) -> None:
        self._counter += 1
        keys = [f"{self._prefix}{kind}/{self._counter}" for kind in ("gpu", "alloc", "node", "req")]
        self._client.transaction(
            compare=[transactions.Create(key) == 0 for key in keys]
            + [transactions.Version(self._prefix + "lease") > 0],
            success=[
                transactions.Put(key, value) for key, value in zip(keys, self._values, strict=True)
            ],
            failure=[],
        )

    def close(self) -> None:
        self._client.delete_prefix(self._prefix)
        self._client.close()


def start_stack(work: Path) -> tuple[EmbeddedEtcd, list[subprocess.Popen[bytes]], str, int]:
    etcd = EmbeddedEtcd(work / "etcd").start()
    port, agent_port, metrics_port = free_ports(3)
    endpoint = f"127.0.0.1:{port}"
    agent_endpoint = f"127.0.0.1:{agent_port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(work / "processes.log", "ab")  # noqa: SIM115 - shared by the children
    fabric_dir = work / "fabric"
    SimFabric.create(
        fabric_dir,
        boxes={f"box{i}": [SimGpuSpec("H100", 81920)] * GPUS_PER_BOX for i in range(BOXES)},
        hosts={f"h{i}": SLOTS for i in range(HOSTS)},
    )
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dxpool.broker",
                "--etcd",
                etcd.endpoint,
                "--listen",
                endpoint,
                "--agent-listen",
                agent_endpoint,
                "--log-level",
                "WARNING",
                "--metrics-port",
                str(metrics_port),
                "--insecure",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    ]
    for index in range(HOSTS):
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dxpool.hostagent",
                    "--host",
                    f"h{index}",
                    "--broker",
                    agent_endpoint,
                    "--driver",
                    "sim",
                    "--sim-state",
                    str(fabric_dir),
                    "--slots",
                    str(SLOTS),
                    "--site",
                    "s1",
                    "--pod",
                    "p1",
                    "--rack",
                    f"r{index % 2}",
                    "--log-level",
                    "WARNING",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
    channel = grpc.insecure_channel(endpoint)
    grpc.channel_ready_future(channel).result(timeout=30)
    inventory = inventory_pb2_grpc.InventoryServiceStub(channel)
    for index in range(BOXES):
        inventory.CreateBox(
            inventory_pb2.CreateBoxRequest(
                box_id=f"box{index}",
                gpu_model="H100",
                gpu_memory_mib=81920,
                box=pb.Box(
                    gpu_count=GPUS_PER_BOX,
                    location=pb.Location(site="s1", pod="p1", rack=f"r{index % 2}"),
                ),
            )
        )
    deadline = time.monotonic() + 30
    while sum(h.alive for h in inventory.ListHosts(inventory_pb2.ListHostsRequest()).hosts) < HOSTS:
        if time.monotonic() > deadline:
            raise RuntimeError("host agents did not register; see processes.log")
        time.sleep(0.1)
    channel.close()
    return etcd, processes, endpoint, metrics_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput run")
    parser.add_argument("--pause-ms", type=float, default=5.0, help="quiet before each paired call")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dxpool-bench-") as raw:
        etcd, processes, endpoint, metrics_port = start_stack(Path(raw))
        try:
            run(etcd, endpoint, metrics_port, args.samples, args.seconds, args.pause_ms / 1000)
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(10)
            etcd.stop()


def run(
    etcd: EmbeddedEtcd,
    endpoint: str,
    metrics_port: int,
    samples: int,
    seconds: float,
    pause_s: float,
) -> None:
    channel = grpc.insecure_channel(endpoint)
    health = health_pb2_grpc.HealthStub(channel)
    nodes = nodes_pb2_grpc.NodeServiceStub(channel)
    bare = BareTxn(etcd.endpoint)
    request = nodes_pb2.ComposeNodeRequest(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1))
    )

    def noop() -> None:
        health.Check(health_pb2.HealthCheckRequest())

    print(
        f"pool: {BOXES} boxes x {GPUS_PER_BOX} GPUs, {HOSTS} hosts; {samples} samples per "
        f"figure; pause before each paired call {pause_s * 1000:.0f} ms"
    )
    print("paired (the ratio's figures): each call after the same pause, nothing in flight")
    paired = paired_latencies(nodes, noop, bare.one, request, samples, pause_s)
    rpc_p50 = report("  no-op gRPC (health Check)", paired["noop"])
    txn_p50 = report("  etcd txn (5 compares, 4 puts)", paired["txn"])
    compose_p50 = report("  ComposeNode (1 GPU)", paired["compose"])
    report("  ReleaseNode", paired["release"])
    for stage, mean_ms in compose_stages(metrics_port).items():
        print(f"  broker-side compose stage {stage:<10} mean {mean_ms:7.3f} ms")

    print("back-to-back, for reference: each call right after the previous one")
    warm_rpc = report("  no-op gRPC (health Check)", timed(noop, samples))
    warm_txn = report("  etcd txn (5 compares, 4 puts)", timed(bare.one, samples))
    busy_compose: list[float] = []
    busy_release: list[float] = []
    for _ in range(samples):
        start = time.perf_counter()
        node = nodes.ComposeNode(request)
        middle = time.perf_counter()
        nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
        busy_compose.append((middle - start) * 1000)
        busy_release.append((time.perf_counter() - middle) * 1000)
        if len(busy_compose) % 32 == 0:
            wait_for_free_pool(nodes)
    busy_p50 = report("  ComposeNode (1 GPU), agents busy", busy_compose)
    report("  ReleaseNode, agents busy", busy_release)
    for clients in (1, 8):
        wait_for_free_pool(nodes)
        pairs = throughput(endpoint, request, clients, seconds)
        print(f"compose+release pairs/s, {clients} client(s): {pairs:8.1f}")
    print(
        f"ratio compose p50 / (etcd txn p50 + no-op RPC p50), paired = "
        f"{compose_p50 / (txn_p50 + rpc_p50):.2f} (target <= 1.3)"
    )
    print(
        f"ratio back-to-back compose p50 / back-to-back floor = "
        f"{busy_p50 / (warm_txn + warm_rpc):.2f} (includes the agents' work on this machine)"
    )
    bare.close()
    channel.close()


def compose_stages(metrics_port: int) -> dict[str, float]:
    """Mean time per compose stage so far, from the broker's own Prometheus metrics."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for sample in broker_samples(metrics_port, timeout_s=5):
        stage = sample.labels.get("stage", "")
        if sample.name == "dxpool_compose_stage_duration_seconds_sum":
            sums[stage] = sample.value
        elif sample.name == "dxpool_compose_stage_duration_seconds_count":
            counts[stage] = sample.value
    return {stage: 1000 * sums[stage] / counts[stage] for stage in sums if counts.get(stage)}


def node_state(nodes: nodes_pb2_grpc.NodeServiceStub, name: str) -> int:
    return int(nodes.GetNode(nodes_pb2.GetNodeRequest(name=name)).state)


def wait_state(nodes: nodes_pb2_grpc.NodeServiceStub, name: str, state: int) -> None:
    deadline = time.monotonic() + 30
    while node_state(nodes, name) != state:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not reach {pb.NodeState.Name(state)}")
        time.sleep(0.002)


def wait_for_free_pool(nodes: nodes_pb2_grpc.NodeServiceStub) -> None:
    """Wait until no node is still releasing, so a run starts from a full pool."""
    deadline = time.monotonic() + 60
    while any(
        n.state == pb.NODE_STATE_RELEASING
        for n in nodes.ListNodes(nodes_pb2.ListNodesRequest(page_size=1000)).nodes
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("released nodes did not finish detaching")
        time.sleep(0.05)


def paired_latencies(
    nodes: nodes_pb2_grpc.NodeServiceStub,
    noop: Callable[[], None],
    bare_txn: Callable[[], None],
    request: nodes_pb2.ComposeNodeRequest,
    samples: int,
    pause_s: float,
) -> dict[str, list[float]]:
    """No-op RPC, bare txn, compose and release, each after ``pause_s`` of quiet."""
    figures: dict[str, list[float]] = {"noop": [], "txn": [], "compose": [], "release": []}

    def measure(name: str, call: Callable[[], object]) -> object:
        time.sleep(pause_s)
        start = time.perf_counter()
        result = call()
        figures[name].append((time.perf_counter() - start) * 1000)
        return result

    for _ in range(samples):
        measure("noop", noop)
        measure("txn", bare_txn)
        node = measure("compose", lambda: nodes.ComposeNode(request))
        assert isinstance(node, pb.VirtualNode)
        wait_state(nodes, node.name, pb.NODE_STATE_READY)
        release = nodes_pb2.ReleaseNodeRequest(name=node.name)
        measure("release", lambda: nodes.ReleaseNode(release))  # noqa: B023 - called at once
        wait_state(nodes, node.name, pb.NODE_STATE_RELEASED)
    return figures


def throughput(
    endpoint: str, request: nodes_pb2.ComposeNodeRequest, clients: int, seconds: float
) -> float:
    done = [0] * clients
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def worker(index: int) -> None:
        channel = grpc.insecure_channel(endpoint)
        nodes = nodes_pb2_grpc.NodeServiceStub(channel)
        while time.monotonic() < stop:
            try:
                node = nodes.ComposeNode(request)
                nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
                done[index] += 1
            except grpc.RpcError as error:
                errors.append(error.code().name)
                time.sleep(0.01)
        channel.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        print(f"  ({len(errors)} calls failed: {sorted(set(errors))})")
    return sum(done) / (time.monotonic() - started)


if __name__ == "__main__":
    main()
