"""How the broker scales with the pool: start, memory, placement and compose throughput.

For each pool size (GPUs; 8 GPUs per box, one host per box, racks of 16 hosts + 16
boxes, pods of 16 racks) this starts a private etcd, registers the boxes through the
broker's API (``CreateBox``, 8 clients) and the hosts through the store layer (the Host
record the agent writes, plus a liveness key on one shared lease kept alive here, so
every host is alive without running thousands of agents), then measures:

* **start**: a broker process (``python -m dxpool.broker``) from spawn until it has
  answered a ComposeNode; its RSS then, its idle CPU over ``--idle-s`` seconds, and the
  median of 20 ``GetPoolStatus`` calls (``dxpool status``) on the idle broker;
* **placement**: ``place()`` on the placement index, in this process over the same
  code the broker runs (Cache + PlacementIndex fed from etcd), for 1- and 8-GPU
  requests at 0%, 50% and 90% fill. Fill marks a random fraction of boxes wholly
  ATTACHED to their rack's hosts (GPU records and host allocations written through the
  store), so an 8-GPU request still fits at 90%. p50/p99 over ``--placements`` calls on
  a settled index (the snapshot is shared, as between two composes with no change);
  ``snapshot after a change`` is the median time of the first snapshot after one GPU
  changed, over 20 changes; **placement after a commit** times the first 1-GPU
  ``place()`` on each new snapshot while the placements are committed one after another
  (each chosen GPU written ATTACHED with its host slot, as a compose would), which is
  what a compose pays: the preparation brought forward by the change, then the decision;
* **composes/s**: 8 client threads composing 1-GPU nodes for ``--compose-s`` seconds
  against the started broker (with ``--compose-windows N``, N such windows back to
  back, each on the pool the previous ones filled; the table shows the first). No
  agent runs during these windows, so the nodes stay ATTACHING;
* **compose+release pairs/s**: then ``bench/pool_agents.py`` starts, one process that
  stands in for every host's agent (the agent's own reconciler and status writes over an
  in-memory driver; see its docstring). The benchmark waits until the nodes composed so
  far are READY (``backlog settled``), then 8 client threads each compose a 1-GPU node
  and release it, again and again, for ``--pairs-s`` seconds; a pair counts when both
  calls returned. ``released in`` is how long after the window the last node took to
  reach RELEASED (its GPUs scrubbed, detached and freed); the window's ComposeNode and
  ReleaseNode p50/p99, the first refusal's message, and the CPU of the broker, the
  stand-in agents, etcd and the clients over it are shown, all on this one machine,
  with the broker's own counters over it read from its metrics port: lost compares by
  operation, full garbage collections, and composes per group commit;

Prints one block per size and a summary table, and with ``--png PATH`` draws the
scaling curves (start, RSS, composes/s, placement p50/p99 against pool size, log-log)
into PATH; that needs matplotlib (the ``bench`` extra). Nothing is asserted; compare
sizes within one run (these machines are shared and noisy). etcd runs with --unsafe-no-fsync
to load large pools quickly; the broker's own work is what is measured.

Usage: python bench/scale.py [--sizes 1000,10000,100000] [--placements 200]
       [--compose-windows N] [--pairs-s SECONDS] [--png PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from bench.broker_metrics import broker_samples
from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerConfig, BrokerServer
from dxpool.broker.placement import PlacementRequest, place
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.placement_index import PlacementIndex
from dxpool.client import Client
from dxpool.fabric.latency import TopologyLatencyModel
from dxpool.fabric.topology import Topology
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.registration import host_record
from dxpool.store import keys as k
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, free_port
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn

PREFIX = "/dxpool-scale/"
GPUS_PER_BOX = 8
RACK_SIZE = 16  # hosts (and boxes) per rack
RACKS_PER_POD = 16
LOADERS = 8
TXN_RECORDS = 60  # records per loading transaction (etcd allows 128 operations)
SEED = 7
START_POLL_S = 0.05  # how often the start probe retries a refused ComposeNode
SNAPSHOT_SAMPLES = 20  # changes after each of which the first snapshot is timed


@dataclass
class Pairs:
    per_s: float
    exhausted: int
    first_refusal: str  # the first RESOURCE_EXHAUSTED's message, if any
    compose_ms: tuple[float, float]  # p50, p99 of the ComposeNode calls
    release_ms: tuple[float, float]  # p50, p99 of the ReleaseNode calls


@dataclass
class Figures:
    gpus: int
    load_s: float = 0.0
    start_s: float = 0.0
    rss_mib: float = 0.0
    idle_cpu: float = 0.0
    placement: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    snapshot_ms: float = 0.0
    chained: tuple[float, float] = (0.0, 0.0)  # placement after a commit, p50/p99 ms
    chained_gc: int = 0  # of those placements, how many a full collection ran within
    composes_per_s: float = 0.0
    exhausted: int = 0
    # composes/s of each further --compose-windows window, back to back, as the pool fills
    later_windows: list[float] = field(default_factory=list)
    settle_s: float = 0.0  # until the nodes composed without agents were READY
    settled_nodes: int = 0
    pairs: Pairs | None = None
    pairs_released_s: float = 0.0  # after the pairs window, until every node was RELEASED
    # cores used over the pairs window: broker, stand-in agents, etcd, this process (clients)
    pairs_cpu: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    pool_status_ms: float = 0.0  # GetPoolStatus, median of POOL_STATUS_CALLS
    # the broker's counters over the pairs window (see broker_counters)
    pairs_counters: dict[str, float] = field(default_factory=dict)


def location(index: int) -> tuple[str, str, str]:
    rack = index // RACK_SIZE
    pod, rack_in_pod = divmod(rack, RACKS_PER_POD)
    return "dc0", f"p{pod}", f"r{rack_in_pod}"


def batches(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# -- loading ------------------------------------------------------------------------------


def load_boxes(endpoint: str, boxes: int) -> None:
    """CreateBox for every box through the API, LOADERS clients at once."""

    def create(indexes: list[int]) -> None:
        with Client(endpoint, timeout_s=60) as client:
            for index in indexes:
                site, pod, rack = location(index)
                client.create_box(
                    f"b{index:05d}",
                    gpus=GPUS_PER_BOX,
                    model="H100",
                    memory_mib=81920,
                    location=pb.Location(site=site, pod=pod, rack=rack),
                )

    shares = [list(range(i, boxes, LOADERS)) for i in range(LOADERS)]
    with concurrent.futures.ThreadPoolExecutor(LOADERS) as pool:
        for done in [pool.submit(create, share) for share in shares]:
            done.result()


def load_hosts(store: Store, hosts: int, lease: object) -> None:
    """The Host record an agent registers, and its liveness key on ``lease``."""
    keys = store.keys
    for chunk in batches(list(range(hosts)), TXN_RECORDS // 2):
        txn = Txn()
        for index in chunk:
            site, pod, rack = location(index)
            host_id = f"h{index:05d}"
            config = AgentConfig(host_id=host_id, site=site, pod=pod, rack=rack, slot_capacity=8)
            txn.put(keys.host(host_id), host_record(config))
            txn.put(keys.host_lease(host_id), b"", lease=lease)
        store.commit(txn)


def fill(store: Store, cache: Cache, boxes: list[int], *, attached: bool = True) -> int:
    """Mark each box's GPUs ATTACHED to the host of the same index, slots 0-7 (or, with
    ``attached=False``, FREE again with no allocation); returns the last write's
    revision."""
    keys = store.keys
    revision = 0
    for chunk in batches(boxes, TXN_RECORDS // (GPUS_PER_BOX + 1)):
        txn = Txn()
        for index in chunk:
            host = f"hosts/h{index:05d}"
            node = f"nodes/fill-{index:05d}"
            attachments = []
            for slot in range(GPUS_PER_BOX):
                name = f"boxes/b{index:05d}/gpus/{slot}"
                record = cache.get(k.GPUS, f"b{index:05d}/{slot}")
                assert record is not None, name
                gpu = pb.Gpu()
                gpu.CopyFrom(record.value)
                if attached:
                    gpu.state, gpu.node, gpu.host, gpu.host_slot = (
                        pb.GPU_STATE_ATTACHED,
                        node,
                        host,
                        slot,
                    )
                else:
                    gpu.state, gpu.node, gpu.host, gpu.host_slot = pb.GPU_STATE_FREE, "", "", 0
                gpu.generation += 1
                txn.put(keys.gpu(f"b{index:05d}", slot), gpu)
                attachments.append(
                    pb.DesiredAttachment(gpu=name, host_slot=slot, node=node, generation=1)
                )
            if attached:
                allocation = pb.HostAllocation(host=host, attachments=attachments)
                txn.put(keys.host_allocation(f"h{index:05d}"), allocation)
            else:
                txn.delete(keys.host_allocation(f"h{index:05d}"))
        revision = store.commit(txn).revision
    return revision


# -- measuring ----------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_broker(
    etcd: str, work: Path, metrics_port: int
) -> tuple[subprocess.Popen[bytes], str, float]:
    """Spawn a broker serving Prometheus metrics on ``metrics_port``; returns it, its
    endpoint and seconds until a compose succeeded."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    log = open(work / "broker.log", "ab")  # noqa: SIM115 - handed to the child
    started = time.monotonic()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dxpool.broker",
            "--etcd",
            etcd,
            "--prefix",
            PREFIX,
            "--listen",
            endpoint,
            "--agent-listen",
            "127.0.0.1:0",
            "--attach-timeout",
            "3600",
            "--log-level",
            "WARNING",
            "--metrics-port",
            str(metrics_port),
            "--metrics-address",
            "127.0.0.1",
            "--insecure",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    request = nodes_pb2.ComposeNodeRequest(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)), node_id="first"
    )
    # A refused connection puts a gRPC channel into exponential reconnect backoff (1 s,
    # then x1.6): with default options the probe would wait seconds past the moment the
    # broker binds. Retry every START_POLL_S instead, so the figure is the broker's.
    poll_ms = int(START_POLL_S * 1000)
    options = [
        ("grpc.initial_reconnect_backoff_ms", poll_ms),
        ("grpc.min_reconnect_backoff_ms", poll_ms),
        ("grpc.max_reconnect_backoff_ms", poll_ms),
    ]
    with grpc.insecure_channel(endpoint, options=options) as channel:
        stub = nodes_pb2_grpc.NodeServiceStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"broker exited; see {work / 'broker.log'}")
            try:
                stub.ComposeNode(request, timeout=30)
                break
            except grpc.RpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE,):
                    raise
                time.sleep(START_POLL_S)
    return process, endpoint, time.monotonic() - started


ONE_GPU = nodes_pb2.ComposeNodeRequest(spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)))


def run_clients(
    endpoint: str,
    clients: int,
    seconds: float,
    body: Callable[[int, nodes_pb2_grpc.NodeServiceStub, float], None],
) -> float:
    """Run ``body(index, stub, stop)`` in ``clients`` threads, each on its own channel,
    until they return (``stop``: the ``time.monotonic()`` at which to stop); returns
    the seconds the window lasted. The clock starts once every channel is connected,
    so connecting is not counted as the broker's time."""
    window: dict[str, float] = {}

    def start_clock() -> None:
        window["began"] = time.monotonic()
        window["stop"] = window["began"] + seconds

    connected = threading.Barrier(clients, action=start_clock, timeout=60)

    def worker(index: int) -> None:
        with grpc.insecure_channel(endpoint) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            connected.wait()
            body(index, nodes_pb2_grpc.NodeServiceStub(channel), window["stop"])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - window["began"]


def composes_per_second(
    endpoint: str, seconds: float, most: int, clients: int = 8
) -> tuple[float, int]:
    """1-GPU composes from ``clients`` threads for ``seconds`` or until ``most`` were made
    (half the pool: composes here never release); (composes/s, RESOURCE_EXHAUSTED)."""
    share = max(1, most // clients)
    counts = [0] * clients
    exhausted = [0] * clients

    def compose(index: int, stub: nodes_pb2_grpc.NodeServiceStub, stop: float) -> None:
        while time.monotonic() < stop and counts[index] < share:
            try:
                stub.ComposeNode(ONE_GPU, timeout=30)
                counts[index] += 1
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                exhausted[index] += 1

    elapsed = run_clients(endpoint, clients, seconds, compose)
    return sum(counts) / elapsed, sum(exhausted)


def time_placements(index: PlacementIndex, count: int, runs: int) -> tuple[float, float]:
    latency = TopologyLatencyModel(Topology.default())
    request = PlacementRequest("H100", count)
    snapshot = index.snapshot()
    result = place(request, snapshot, latency)  # warm the latency model
    assert result.placement is not None, result.unsatisfied
    samples = []
    for _ in range(runs):
        began = time.perf_counter()
        place(request, snapshot, latency)
        samples.append(time.perf_counter() - began)
    return percentile(samples, 0.5) * 1e3, percentile(samples, 0.99) * 1e3


def place_after_commits(
    store: Store, cache: Cache, index: PlacementIndex, runs: int
) -> tuple[tuple[float, float], int]:
    """p50/p99 ms of a 1-GPU ``place()`` on the first snapshot after each of ``runs``
    placements was committed (its GPU ATTACHED, its host slot allocated), and how many
    of those calls a full (generation 2) garbage collection ran within."""
    latency = TopologyLatencyModel(Topology.default())
    request = PlacementRequest("H100", 1)
    place(request, index.snapshot(), latency)  # the first preparation, not timed
    samples = []
    full = [0]

    def count_full(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full[0] += 1

    within = 0
    for turn in range(runs):
        snapshot = index.snapshot()
        seen = full[0]
        gc.callbacks.append(count_full)
        began = time.perf_counter()
        result = place(request, snapshot, latency)
        samples.append(time.perf_counter() - began)
        gc.callbacks.remove(count_full)
        within += full[0] > seen
        assert result.placement is not None, result.unsatisfied
        (binding,) = result.placement.bindings
        host = result.placement.host
        node = f"nodes/chain-{turn}"
        record = cache.get(k.GPUS, f"{binding.box}/{binding.slot}")
        assert record is not None
        gpu = pb.Gpu()
        gpu.CopyFrom(record.value)
        gpu.state, gpu.node, gpu.host, gpu.host_slot = (
            pb.GPU_STATE_ATTACHED,
            node,
            f"hosts/{host}",
            binding.host_slot,
        )
        gpu.generation += 1
        allocation = pb.HostAllocation(host=f"hosts/{host}")
        held = cache.get(k.HOST_ALLOCATIONS, host)
        if held is not None:
            allocation.CopyFrom(held.value)
        allocation.attachments.append(
            pb.DesiredAttachment(gpu=gpu.name, host_slot=binding.host_slot, node=node)
        )
        txn = Txn().put(store.keys.gpu(binding.box, binding.slot), gpu)
        txn.put(store.keys.host_allocation(host), allocation)
        cache.wait_for_revision(store.commit(txn).revision, 60)
    return (percentile(samples, 0.5) * 1e3, percentile(samples, 0.99) * 1e3), within


def run_size(gpus: int, args: argparse.Namespace) -> Figures:
    figures = Figures(gpus)
    boxes = gpus // GPUS_PER_BOX
    work = Path(tempfile.mkdtemp(prefix="dxpool-scale-"))
    with EmbeddedEtcd(work / "etcd", unsafe_no_fsync=True) as etcd:
        client = connect(etcd.endpoint, timeout_s=30)
        store = Store(client, KeySchema(PREFIX))
        try:
            began = time.monotonic()
            progress(f"{gpus:,} GPUs: loading the pool")
            load_pool(etcd.endpoint, store, boxes)
            figures.load_s = time.monotonic() - began
            progress("placement in process")
            measure_placement(etcd.endpoint, store, boxes, figures, args)
            progress("broker start, idle CPU, compose windows")
            measure_broker(etcd, work, figures, args)
        finally:
            client.close()
    return figures


def load_pool(etcd: str, store: Store, boxes: int) -> int:
    """``boxes`` boxes through a broker's API, as many hosts alive through the store;
    returns the id of the lease (an hour long) every host's liveness record is on."""
    lease = store.client.lease(3600)
    loader = BrokerServer(
        BrokerConfig(
            etcd_endpoints=etcd, key_prefix=PREFIX, listen="127.0.0.1:0", agent_listen="127.0.0.1:0"
        )
    ).start()
    try:
        load_boxes(loader.endpoint, boxes)
    finally:
        loader.stop(grace_s=0)
    load_hosts(store, boxes, lease)
    return int(lease.id)


def measure_broker(
    etcd: EmbeddedEtcd, work: Path, figures: Figures, args: argparse.Namespace
) -> None:
    metrics_port = free_port()
    process, endpoint, figures.start_s = start_broker(etcd.endpoint, work, metrics_port)
    try:
        figures.rss_mib = rss_mib(process.pid)
        cpu_before = cpu_seconds(process.pid)
        time.sleep(args.idle_s)
        figures.idle_cpu = (cpu_seconds(process.pid) - cpu_before) / args.idle_s
        figures.pool_status_ms = pool_status_ms(endpoint)
        most = figures.gpus // 2 // args.compose_windows
        figures.composes_per_s, figures.exhausted = composes_per_second(
            endpoint, args.compose_s, most
        )
        for _ in range(args.compose_windows - 1):
            rate, exhausted = composes_per_second(endpoint, args.compose_s, most)
            figures.later_windows.append(rate)
            figures.exhausted += exhausted
        if args.pairs_s > 0:
            measure_pairs(etcd, work, endpoint, process.pid, metrics_port, figures, args.pairs_s)
    finally:
        process.terminate()
        process.wait(30)


def measure_pairs(
    etcd: EmbeddedEtcd,
    work: Path,
    endpoint: str,
    broker_pid: int,
    metrics_port: int,
    figures: Figures,
    seconds: float,
) -> None:
    """Compose+release pairs/s with the stand-in agents running (see the module doc)."""
    log = open(work / "pool_agents.log", "ab")  # noqa: SIM115 - handed to the child
    agents = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("pool_agents.py")),
            "--etcd",
            etcd.endpoint,
            "--prefix",
            PREFIX,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
    )
    log.close()
    try:
        assert agents.stdout is not None
        if agents.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"stand-in agents did not start; see {work / 'pool_agents.log'}")
        began = time.monotonic()
        progress("stand-in agents attach the composed nodes")
        figures.settled_nodes = settle(endpoint)
        figures.settle_s = time.monotonic() - began
        assert etcd.pid is not None
        pids = (broker_pid, agents.pid, etcd.pid)
        counted = broker_counters(metrics_port)
        before = [cpu_seconds(pid) for pid in pids] + [time.process_time()]
        began = time.monotonic()
        progress(f"pairs window of {seconds:g} s")
        figures.pairs = pairs_per_second(endpoint, seconds)
        window = time.monotonic() - began
        after = [cpu_seconds(pid) for pid in pids] + [time.process_time()]
        figures.pairs_counters = {
            name: value - counted.get(name, 0.0)
            for name, value in broker_counters(metrics_port).items()
        }
        broker, agents_cpu, etcd_cpu, clients = (
            (a - b) / window for a, b in zip(after, before, strict=True)
        )
        figures.pairs_cpu = broker, agents_cpu, etcd_cpu, clients
        began = time.monotonic()
        settle(endpoint)
        figures.pairs_released_s = time.monotonic() - began
    finally:
        agents.terminate()
        agents.wait(30)


def broker_counters(metrics_port: int) -> dict[str, float]:
    """The broker's own counters that explain a throughput figure, read from its metrics
    port: lost compares (``conflicts <operation>``, ``conflicts compose``), full garbage
    collections (``full collections``), group commits and the composes they carried."""
    counters: dict[str, float] = {}
    for sample in broker_samples(metrics_port):
        if sample.name == "dxpool_transaction_conflicts_total":
            counters[f"conflicts {sample.labels['operation']}"] = sample.value
        elif sample.name == "dxpool_compose_conflicts_total":
            counters["conflicts compose"] = sample.value
        elif sample.name == "python_gc_collections_total":
            if sample.labels.get("generation") == "2":
                counters["full collections"] = sample.value
        elif sample.name == "dxpool_compose_group_size_count":
            counters["group commits"] = sample.value
        elif sample.name == "dxpool_compose_group_size_sum":
            counters["grouped composes"] = sample.value
    return counters


POOL_STATUS_CALLS = 20


def pool_status_ms(endpoint: str) -> float:
    """The median GetPoolStatus call (``dxpool status``) on the idle broker, in ms."""
    samples = []
    with Client(endpoint, insecure=True) as client:
        client.pool_status()
        for _ in range(POOL_STATUS_CALLS):
            began = time.perf_counter()
            client.pool_status()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e3


def progress(message: str) -> None:
    """A line on stderr saying which phase runs now (the figures come at the end)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


UNSETTLED = ("NODE_STATE_PENDING", "NODE_STATE_ATTACHING", "NODE_STATE_RELEASING")


def settle(endpoint: str, timeout_s: float = 600.0) -> int:
    """Wait until no node is PENDING, ATTACHING or RELEASING; returns how many were at
    the first look. Raises RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    first = None
    with Client(endpoint, insecure=True) as client:
        while True:
            by_state = client.pool_status().nodes_by_state
            waiting = sum(by_state.get(state, 0) for state in UNSETTLED)
            first = waiting if first is None else first
            if waiting == 0:
                return first
            if time.monotonic() > deadline:
                raise RuntimeError(f"{waiting} nodes still in flight after {timeout_s:.0f} s")
            time.sleep(0.2)


def pairs_per_second(endpoint: str, seconds: float, clients: int = 8) -> Pairs:
    """1-GPU compose then release of that node, from ``clients`` threads for ``seconds``."""
    counts = [0] * clients
    exhausted = [0] * clients
    composes: list[float] = []
    releases: list[float] = []
    first_refusal: list[str] = []  # the first RESOURCE_EXHAUSTED's message

    def pair(index: int, stub: nodes_pb2_grpc.NodeServiceStub, stop: float) -> None:
        while time.monotonic() < stop:
            began = time.perf_counter()
            try:
                node = stub.ComposeNode(ONE_GPU, timeout=30)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                exhausted[index] += 1
                if not first_refusal:
                    first_refusal.append(str(error.details()))
                time.sleep(0.01)
                continue
            composed = time.perf_counter()
            stub.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name), timeout=30)
            composes.append(composed - began)
            releases.append(time.perf_counter() - composed)
            counts[index] += 1

    elapsed = run_clients(endpoint, clients, seconds, pair)

    def ms(samples: list[float]) -> tuple[float, float]:
        return percentile(samples, 0.5) * 1e3, percentile(samples, 0.99) * 1e3

    first = first_refusal[0] if first_refusal else ""
    return Pairs(sum(counts) / elapsed, sum(exhausted), first, ms(composes), ms(releases))


def measure_placement(
    etcd: str, store: Store, boxes: int, figures: Figures, args: argparse.Namespace
) -> None:
    cache = Cache(etcd, KeySchema(PREFIX))
    cache.start(timeout_s=300)
    index = PlacementIndex(cache)
    if args.freeze:  # as BrokerServer.start does once its cache is loaded
        gc.freeze()
    try:
        order = list(range(boxes))
        random.Random(SEED).shuffle(order)
        filled = 0
        runs = args.placements
        for percent in (0, 50, 90):
            target = boxes * percent // 100
            if target > filled:
                cache.wait_for_revision(fill(store, cache, order[filled:target]), timeout_s=300)
                filled = target
            for count in (1, 8):
                figures.placement[(percent, count)] = time_placements(index, count, runs)
        cache.wait_for_revision(fill(store, cache, order[:filled], attached=False), timeout_s=300)
        samples = []
        for box_index in order[:SNAPSHOT_SAMPLES]:
            some_gpu = store.keys.gpu(f"b{box_index:05d}", 0)
            record = store.get(some_gpu)
            assert record is not None
            changed: pb.Gpu = record.value
            changed.memory_mib += 1
            cache.wait_for_revision(store.commit(Txn().put(some_gpu, changed)).revision, 60)
            began = time.perf_counter()
            index_snapshot = index.snapshot()
            samples.append(time.perf_counter() - began)
            del index_snapshot
        figures.snapshot_ms = statistics.median(samples) * 1e3
        figures.chained, figures.chained_gc = place_after_commits(store, cache, index, runs)
    finally:
        index.close()
        cache.stop()


def report(figures: Figures) -> None:
    print(f"== {figures.gpus:,} GPUs ({figures.gpus // GPUS_PER_BOX:,} boxes and hosts)")
    print(f"  loaded in {figures.load_s:.1f} s")
    print(
        f"  broker start to first compose {figures.start_s:.2f} s, RSS "
        f"{figures.rss_mib:.0f} MiB, idle CPU {figures.idle_cpu * 100:.1f}% of a core, "
        f"GetPoolStatus {figures.pool_status_ms:.2f} ms"
    )
    print(
        f"  composes/s with 8 clients {figures.composes_per_s:.0f} "
        f"(RESOURCE_EXHAUSTED {figures.exhausted})"
    )
    if figures.later_windows:
        later = ", ".join(f"{rate:.0f}" for rate in figures.later_windows)
        print(f"  composes/s in the windows after it, as the pool fills: {later}")
    if figures.pairs is not None:
        pairs = figures.pairs
        broker_cpu, agents_cpu, etcd_cpu, clients_cpu = figures.pairs_cpu
        print(
            f"  stand-in agents: backlog of {figures.settled_nodes} nodes settled in "
            f"{figures.settle_s:.1f} s"
        )
        print(
            f"  compose+release pairs/s with 8 clients {pairs.per_s:.0f} "
            f"(RESOURCE_EXHAUSTED {pairs.exhausted}); all released "
            f"{figures.pairs_released_s:.1f} s after the window"
        )
        if pairs.first_refusal:
            print(f"    first RESOURCE_EXHAUSTED: {pairs.first_refusal}")
        print(
            f"    in the window: ComposeNode p50/p99 {pairs.compose_ms[0]:.1f}/"
            f"{pairs.compose_ms[1]:.1f} ms, ReleaseNode p50/p99 {pairs.release_ms[0]:.1f}/"
            f"{pairs.release_ms[1]:.1f} ms"
        )
        print(
            f"    CPU over the window, % of a core: broker {broker_cpu * 100:.0f}, agents "
            f"{agents_cpu * 100:.0f}, etcd {etcd_cpu * 100:.0f}, clients {clients_cpu * 100:.0f}"
        )
        counters = figures.pairs_counters
        lost = ", ".join(
            f"{name.removeprefix('conflicts ')} {value:.0f}"
            for name, value in sorted(counters.items())
            if name.startswith("conflicts ")
        )
        groups = counters.get("group commits", 0.0)
        per_group = counters.get("grouped composes", 0.0) / groups if groups else 0.0
        print(
            f"    broker in the window: lost compares by operation: {lost or 'none'}; "
            f"full collections {counters.get('full collections', 0.0):.0f}; "
            f"{per_group:.2f} composes per commit"
        )
    for (percent, count), (p50, p99) in sorted(figures.placement.items()):
        print(f"  placement {count}-GPU at {percent:2d}% fill: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    print(f"  snapshot after a change {figures.snapshot_ms:.2f} ms (median of {SNAPSHOT_SAMPLES})")
    p50, p99 = figures.chained
    print(
        f"  placement 1-GPU after a commit: p50 {p50:.2f} ms, p99 {p99:.2f} ms "
        f"({figures.chained_gc} of them with a full garbage collection)"
    )


def table(results: list[Figures]) -> None:
    print("\n| GPUs | start s | RSS MiB | idle CPU | composes/s | pairs/s "
          "| 1-GPU p50/p99 ms (0/50/90%) | 8-GPU p50/p99 ms (0/50/90%) "
          "| 1-GPU after a commit p50/p99 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for f in results:
        cells = {}
        for count in (1, 8):
            cells[count] = " · ".join(
                f"{f.placement[(p, count)][0]:.2f}/{f.placement[(p, count)][1]:.2f}"
                for p in (0, 50, 90)
            )
        pairs = f"{f.pairs.per_s:.0f}" if f.pairs else "-"
        print(
            f"| {f.gpus:,} | {f.start_s:.2f} | {f.rss_mib:.0f} | {f.idle_cpu * 100:.1f}% "
            f"| {f.composes_per_s:.0f} | {pairs} | {cells[1]} | {cells[8]} "
            f"| {f.chained[0]:.2f}/{f.chained[1]:.2f} |"
        )


def plot(results: list[Figures], path: Path) -> bool:
    """Draws the scaling curves of ``results`` into ``path`` (PNG). False, with a hint on
    stderr, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed, so no figure was drawn: pip install 'dxpool[bench]'",
            file=sys.stderr,
        )
        return False
    sizes = [f.gpus for f in results]
    figure, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    panels = [
        (axes[0], "broker start to first compose (s)", [("start", [f.start_s for f in results])]),
        (axes[1], "broker RSS (MiB)", [("RSS", [f.rss_mib for f in results])]),
        (
            axes[2],
            "per second (8 clients)",
            [
                ("composes", [f.composes_per_s for f in results]),
                ("compose+release pairs", [f.pairs.per_s if f.pairs else 0 for f in results]),
            ],
        ),
    ]
    for axis, title, series in panels:
        for name, values in series:
            axis.plot(sizes, values, marker="o", label=name)
        axis.set_title(title)
        if len(series) > 1:
            axis.legend(fontsize="small")
    placement = axes[3]
    for count in (1, 8):
        for column, style in ((0, "-"), (1, "--")):
            name = "p50" if column == 0 else "p99"
            values = [f.placement[(50, count)][column] for f in results]
            placement.plot(sizes, values, style, marker="o", label=f"{count}-GPU {name}")
    for column, style in ((0, "-"), (1, "--")):
        name = "p50" if column == 0 else "p99"
        values = [f.chained[column] for f in results]
        placement.plot(sizes, values, style, marker="s", label=f"1-GPU after a commit {name}")
    placement.set_title("placement (ms)")
    placement.legend(fontsize="small")
    for axis in axes:
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("GPUs in the pool")
        axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="pool sizes in GPUs")
    parser.add_argument("--placements", type=int, default=200, help="place() calls per case")
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle CPU window")
    parser.add_argument("--compose-s", type=float, default=10.0, help="compose load window")
    parser.add_argument(
        "--compose-windows",
        type=int,
        default=1,
        help="compose windows back to back (the later ones on a fuller pool)",
    )
    parser.add_argument(
        "--pairs-s",
        type=float,
        default=10.0,
        help="compose+release window with stand-in agents (0 skips it)",
    )
    parser.add_argument(
        "--no-freeze",
        dest="freeze",
        action="store_false",
        help="time placement without gc.freeze() after the load (the broker freezes)",
    )
    parser.add_argument(
        "--png", type=Path, default=None, help="draw the scaling curves into this PNG file"
    )
    args = parser.parse_args()
    if args.compose_windows < 1:
        parser.error("--compose-windows must be at least 1")
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        figures = run_size(size, args)
        report(figures)
        results.append(figures)
    table(results)
    if args.png is not None and plot(results, args.png):
        print(f"\nscaling curves drawn into {args.png}")


if __name__ == "__main__":
    main()
