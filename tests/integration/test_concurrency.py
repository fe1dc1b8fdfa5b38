"""Concurrent composes never double-allocate a GPU and never lose one.

Two brokers share one etcd; 200 ComposeNode calls from 16 threads race for 64 GPUs and
64 host slots. Afterwards every GPU is owned by at most one node, the owners agree with
the nodes, and once everything is released every GPU is free again.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.patience import patient

BOXES = 8
GPUS_PER_BOX = 8
HOSTS = 4
SLOTS = 16
CALLS = 200
THREADS = 16


def all_gpus(stubs: Stubs) -> list[pb.Gpu]:
    return list(stubs.inventory.ListGpus(inventory_pb2.ListGpusRequest(page_size=1000)).gpus)


def test_two_hundred_concurrent_composes(  # type: ignore[no-untyped-def]
    broker_factory, sim_pool: SimPool, etcd_client, key_prefix: str
) -> None:
    brokers = [broker_factory(), broker_factory()]
    channels = [grpc.insecure_channel(b.endpoint) for b in brokers]
    stubs = [Stubs(c) for c in channels]
    for index in range(BOXES):
        register_sim_box(sim_pool, stubs[0], f"box{index}", gpus=GPUS_PER_BOX, rack=f"r{index % 2}")
    for index in range(HOSTS):
        sim_pool.start_agent(f"h{index}", slots=SLOTS, rack=f"r{index % 2}")
    for s in stubs:
        wait_hosts_alive(s, HOSTS)

    def one(call: int) -> tuple[str, pb.VirtualNode | None]:
        """One caller, retrying what the broker says is worth retrying, as a client does:
        UNAVAILABLE (its cache too stale to answer, which a loaded machine causes) and
        ABORTED (lost compares). The request id makes each retry the same compose."""
        count = 1 + call % 3
        request = nodes_pb2.ComposeNodeRequest(
            spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=count)),
            request_id=f"race-{call}",
        )
        deadline = time.monotonic() + patient(60)
        pause = 0.05
        while True:
            try:
                return "ok", stubs[call % 2].nodes.ComposeNode(request)
            except grpc.RpcError as error:
                code = error.code()
                retryable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
                if not retryable or time.monotonic() > deadline:
                    return code.name, None
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(one, range(CALLS)))

    outcomes = collections.Counter(code for code, _ in results)
    assert set(outcomes) <= {"ok", "RESOURCE_EXHAUSTED"}, outcomes
    nodes = [node for _, node in results if node is not None]
    claimed = [b.gpu for node in nodes for b in node.gpus]
    assert len(claimed) == len(set(claimed)), "a GPU was given to two nodes"
    assert len(claimed) <= BOXES * GPUS_PER_BOX
    assert len(claimed) >= BOXES * GPUS_PER_BOX - 2, "capacity left unused while requests failed"

    expected = {b.gpu: n.name for n in nodes for b in n.gpus}
    stored = [pb.Gpu.FromString(value) for value, _ in etcd_client.get_prefix(key_prefix + "gpus/")]
    assert {g.name: g.node for g in stored if g.node} == expected, "etcd disagrees with nodes"
    # The other broker's cache follows etcd through its watch: equal soon, not at once.
    wait_until(
        lambda: {g.name: g.node for g in all_gpus(stubs[1]) if g.node} == expected,
        message="the second broker's view to match etcd",
    )
    slots = [(n.host, b.host_slot) for n in nodes for b in n.gpus]
    assert len(slots) == len(set(slots)), "a host slot was given twice"

    for node in nodes:
        stubs[0].nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_until(
        lambda: all(g.state == pb.GPU_STATE_FREE for g in all_gpus(stubs[0])),
        timeout_s=60,
        message="every GPU free after release",
    )
    gpus = all_gpus(stubs[1])
    assert len(gpus) == BOXES * GPUS_PER_BOX
    assert all(not g.node for g in gpus)
    for host in range(HOSTS):
        assert sim_pool.fabric.mappings(f"h{host}") == {}
    for channel in channels:
        channel.close()
