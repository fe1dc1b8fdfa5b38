"""What large requests from other clients cost a well-behaved client.

Starts a private etcd (fsync on), a broker process (plaintext, no authentication, the
audit log on) and four host agent processes on the simulated fabric, like
``bench/compose_latency.py``. One client in this process (the victim) loops, one call
after the other: GetBox, then ComposeNode (1 GPU) and ReleaseNode of the node it made.
Its latencies are taken over ``--seconds`` with nothing else running (quiet), then over
as long again while ``--attackers`` processes send large requests as fast as the broker
answers them, ``--rounds`` times in turn (so the machine's own swings fall on both), one
scenario after the other:

* ``compose-3.9MB``: ComposeNode whose ``node_id`` is 3.9 MB (under gRPC's default
  4 MiB limit; the request is refused either way);
* ``release-1MB``: ReleaseNode whose ``name`` is 1 MB;
* ``getbox-at-server-limit``: GetBox padded to just under the broker's server-wide
  receive limit (what reaches the per-method check, if any);
* ``getbox-small``: GetBox of a box that does not exist (NOT_FOUND), 20 bytes: the cost
  of as many calls as the attackers can make at all, whatever their size, for
  comparison (a flood, which no size limit bounds).

Prints, per scenario and per victim call, p50 and p99 quiet and under attack, the ratio
of the p99s (target: at most 2), the attackers' rate and the codes they saw, the
broker's CPU in each phase, and how much the audit log and etcd's database grew.

Everything shares the machine (2 cores on the test machines), so the attackers' own CPU
is part of what the victim pays; compare ratios, not absolute times.

Usage: python bench/large_requests.py [--seconds 10] [--rounds 3] [--attackers 4]
        [--scenarios compose-3.9MB,release-1MB,getbox-at-server-limit,getbox-small]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import etcd3
import grpc
from etcd3 import etcdrpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from bench.compose_latency import percentile, start_stack, wait_for_free_pool
from dxpool.api.v1 import inventory_pb2, inventory_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.store.client import connect

SERVER_LIMIT_FALLBACK = 4 * 1024 * 1024 - 1024  # gRPC's default, less room for framing
SCENARIOS = ("compose-3.9MB", "release-1MB", "getbox-at-server-limit", "getbox-small")


def server_limit() -> int:
    """The broker's server-wide receive limit, where this version has one."""
    try:
        from dxpool.broker.api.request_limits import SERVER_MAX_RECEIVE_BYTES
    except ImportError:
        return SERVER_LIMIT_FALLBACK
    return int(SERVER_MAX_RECEIVE_BYTES) - 64


def payload(scenario: str) -> tuple[str, bytes]:
    """The method path and the serialized request an attacker sends."""
    if scenario == "compose-3.9MB":
        request = nodes_pb2.ComposeNodeRequest(
            spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)),
            node_id="n" * 3_900_000,
        )
        return "/dxpool.v1.NodeService/ComposeNode", request.SerializeToString()
    if scenario == "release-1MB":
        release = nodes_pb2.ReleaseNodeRequest(name="nodes/" + "n" * 1_000_000)
        return "/dxpool.v1.NodeService/ReleaseNode", release.SerializeToString()
    if scenario == "getbox-at-server-limit":
        get = inventory_pb2.GetBoxRequest(name="boxes/" + "b" * server_limit())
        return "/dxpool.v1.InventoryService/GetBox", get.SerializeToString()
    if scenario == "getbox-small":
        small = inventory_pb2.GetBoxRequest(name="boxes/not-there")
        return "/dxpool.v1.InventoryService/GetBox", small.SerializeToString()
    raise SystemExit(f"unknown scenario {scenario!r}; use one of {', '.join(SCENARIOS)}")


def attacker(endpoint: str, scenario: str, stop: object, codes: object) -> None:
    """One attacking process: send the scenario's request until ``stop`` is set."""
    method, data = payload(scenario)
    options = [("grpc.max_send_message_length", -1)]
    channel = grpc.insecure_channel(endpoint, options=options)
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    seen: collections.Counter[str] = collections.Counter()
    while not stop.is_set():  # type: ignore[attr-defined]
        try:
            call(data, timeout=30)
            seen["OK"] += 1
        except grpc.RpcError as error:
            seen[error.code().name] += 1  # type: ignore[attr-defined]
    channel.close()
    codes.put(dict(seen))  # type: ignore[attr-defined]


def victim(endpoint: str, seconds: float) -> dict[str, list[float]]:
    """GetBox, ComposeNode and ReleaseNode one after the other for ``seconds``; ms each."""
    channel = grpc.insecure_channel(endpoint)
    inventory = inventory_pb2_grpc.InventoryServiceStub(channel)
    nodes = nodes_pb2_grpc.NodeServiceStub(channel)
    request = nodes_pb2.ComposeNodeRequest(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1))
    )
    figures: dict[str, list[float]] = {"GetBox": [], "compose+release": []}
    errors: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        try:
            inventory.GetBox(inventory_pb2.GetBoxRequest(name="boxes/box0"), timeout=60)
            middle = time.perf_counter()
            node = nodes.ComposeNode(request, timeout=60)
            nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name), timeout=60)
        except grpc.RpcError as error:
            errors[error.code().name] += 1  # type: ignore[attr-defined]
            time.sleep(0.01)
            continue
        end = time.perf_counter()
        figures["GetBox"].append((middle - start) * 1000)
        figures["compose+release"].append((end - middle) * 1000)
    channel.close()
    if errors:
        print(f"    victim calls failed: {dict(errors)}")
    return figures


def etcd_usage(etcd_endpoint: str) -> tuple[int, int]:
    """(audit records, bytes of etcd's database file) now."""
    client = connect(etcd_endpoint)
    try:
        prefix = b"/dxpool/v1-audit/"
        counted = client.kvstub.Range(
            etcdrpc.RangeRequest(
                key=prefix, range_end=etcd3.utils.prefix_range_end(prefix), count_only=True
            ),
            client.timeout,
        )
        status = client.maintenancestub.Status(etcdrpc.StatusRequest(), client.timeout)
        return int(counted.count), int(status.dbSize)
    finally:
        client.close()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def attacked(
    endpoint: str, scenario: str, attackers: int, seconds: float, broker_pid: int
) -> tuple[dict[str, list[float]], dict[str, int], float]:
    """The victim's latencies while ``attackers`` processes send the scenario's request,
    the codes they saw, and the broker's CPU seconds over the victim's window."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    codes = context.Queue()
    processes = [
        context.Process(target=attacker, args=(endpoint, scenario, stop, codes))
        for _ in range(attackers)
    ]
    for process in processes:
        process.start()
    time.sleep(1.0)  # let them connect and reach their pace
    cpu = cpu_seconds(broker_pid)
    figures = victim(endpoint, seconds)
    cpu = cpu_seconds(broker_pid) - cpu
    stop.set()
    seen: collections.Counter[str] = collections.Counter()
    for _ in processes:
        seen.update(codes.get(timeout=120))
    for process in processes:
        process.join(60)
    return figures, dict(seen), cpu


def line(name: str, quiet: list[float], loud: list[float]) -> float:
    ratio = percentile(loud, 0.99) / percentile(quiet, 0.99)
    print(
        f"    {name:<16} quiet p50 {statistics.median(quiet):8.2f} ms p99 "
        f"{percentile(quiet, 0.99):8.2f} ms (n={len(quiet)})   attacked p50 "
        f"{statistics.median(loud):8.2f} ms p99 {percentile(loud, 0.99):8.2f} ms "
        f"(n={len(loud)})   p99 ratio {ratio:6.2f}"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=3, help="quiet+attacked pairs")
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    for scenario in scenarios:
        payload(scenario)  # a typo fails before anything starts
    with tempfile.TemporaryDirectory(prefix="dxpool-bench-") as raw:
        etcd, processes, endpoint, _ = start_stack(Path(raw))
        try:
            broker_pid = processes[0].pid
            run(
                etcd.endpoint,
                endpoint,
                broker_pid,
                scenarios,
                args.attackers,
                args.seconds,
                args.rounds,
            )
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(10)
            etcd.stop()


def run(
    etcd_endpoint: str,
    endpoint: str,
    broker_pid: int,
    scenarios: list[str],
    attackers: int,
    seconds: float,
    rounds: int,
) -> None:
    print(
        f"{attackers} attacking processes; {rounds} rounds of {seconds:g} s quiet and "
        f"{seconds:g} s attacked per scenario"
    )
    victim(endpoint, min(seconds, 2.0))  # warm up
    worst = 0.0
    for scenario in scenarios:
        quiet: dict[str, list[float]] = collections.defaultdict(list)
        loud: dict[str, list[float]] = collections.defaultdict(list)
        codes: collections.Counter[str] = collections.Counter()
        quiet_cpu = loud_cpu = 0.0
        records, size = etcd_usage(etcd_endpoint)
        for _ in range(rounds):  # alternating, so the machine's own swings hit both
            channel = grpc.insecure_channel(endpoint)
            wait_for_free_pool(nodes_pb2_grpc.NodeServiceStub(channel))
            channel.close()
            cpu = cpu_seconds(broker_pid)
            for name, samples in victim(endpoint, seconds).items():
                quiet[name] += samples
            quiet_cpu += cpu_seconds(broker_pid) - cpu
            figures, seen, cpu = attacked(endpoint, scenario, attackers, seconds, broker_pid)
            for name, samples in figures.items():
                loud[name] += samples
            codes.update(seen)
            loud_cpu += cpu
        records_after, size_after = etcd_usage(etcd_endpoint)
        window = rounds * seconds
        print(
            f"  {scenario}: attackers made {sum(codes.values()) / window:.0f} calls/s, saw "
            f"{dict(codes)}; {records_after - records} audit records written (the victim's "
            f"included); etcd's database grew by {(size_after - size) / 2**20:.1f} MiB"
        )
        print(
            f"    broker CPU: {100 * quiet_cpu / window:.0f}% of a core quiet, "
            f"{100 * loud_cpu / window:.0f}% attacked"
        )
        for name, samples in quiet.items():
            worst = max(worst, line(name, samples, loud[name]))
    print(f"worst p99 ratio attacked/quiet = {worst:.2f} (target <= 2)")


if __name__ == "__main__":
    threading.current_thread().name = "victim"
    main()
