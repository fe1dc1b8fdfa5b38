"""Host CPU cores and memory are never given twice: composes racing on two brokers for
hosts that declare them (agent --cpus/--memory) hold at most what each host offers, and
a released node's share is free again at once."""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import grpc

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive

HOSTS = 2
CALLS = 24
THREADS = 8


def spec() -> pb.NodeSpec:
    return pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1), cpu_cores=3, host_memory_mib=8192)


def test_racing_composes_never_oversubscribe_host_cpus_or_memory(  # type: ignore[no-untyped-def]
    broker_factory, sim_pool: SimPool, etcd_client, key_prefix: str
) -> None:
    brokers = [broker_factory(), broker_factory()]
    channels = [grpc.insecure_channel(b.endpoint) for b in brokers]
    stubs = [Stubs(c) for c in channels]
    register_sim_box(sim_pool, stubs[0], "box0", gpus=16)
    for index in range(HOSTS):
        # 8 cores fit two nodes of 3, and 20 GiB fits two of 8 GiB: two nodes per host
        extra = ("--cpus", "8", "--memory", "20GiB")
        sim_pool.start_agent(f"h{index}", slots=16, extra=extra)
    for s in stubs:
        wait_hosts_alive(s, HOSTS)

    def one(call: int) -> tuple[str, pb.VirtualNode | None]:
        try:
            node = stubs[call % 2].nodes.ComposeNode(
                nodes_pb2.ComposeNodeRequest(spec=spec(), request_id=f"cpu-{call}")
            )
            return "ok", node
        except grpc.RpcError as error:
            return error.code().name, None

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(one, range(CALLS)))

    outcomes = collections.Counter(code for code, _ in results)
    assert outcomes == {"ok": 2 * HOSTS, "RESOURCE_EXHAUSTED": CALLS - 2 * HOSTS}, outcomes
    nodes = [node for _, node in results if node is not None]
    assert collections.Counter(node.host for node in nodes) == {"hosts/h0": 2, "hosts/h1": 2}
    for value, _ in etcd_client.get_prefix(key_prefix + "hostalloc/"):
        allocation = pb.HostAllocation.FromString(value)
        assert sum(r.cpu_cores for r in allocation.reservations) == 6
        assert sum(r.memory_mib for r in allocation.reservations) == 16384
        held = {r.node for r in allocation.reservations}
        assert held == {n.name for n in nodes if n.host == allocation.host}

    refused = stubs[0].nodes.PlanNode(nodes_pb2.ComposeNodeRequest(spec=spec()))
    assert not refused.host
    assert any(line.startswith("host resources: 2 of 2 hosts lack") for line in refused.unsatisfied)

    released = nodes[0]
    stubs[0].nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=released.name))
    again = stubs[0].nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec()))
    assert again.host == released.host
    for channel in channels:
        channel.close()
