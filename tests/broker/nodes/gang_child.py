"""A broker's gang composer in a process of its own, stopped for good after its first
chunk of members, for the test that kills a broker in the middle of a gang.

``python -m tests.broker.nodes.gang_child ETCD PREFIX GANG MEMBERS GPUS`` composes gang GANG of
MEMBERS members of GPUS H100s each through the broker's own parts (store, cache,
placement index, composer, chunked gangs) with a reservation deadline of 2 s; after the
transaction that commits its first chunk it prints ``chunk committed`` and waits to be
killed, as a broker that hangs or dies there would leave the gang.
"""

from __future__ import annotations

import sys
import threading

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.compose import Composer
from dxpool.broker.nodes.compose_gate import ComposeGate
from dxpool.broker.nodes.gang_chunks import ChunkedGangs
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.placement_index import PlacementIndex
from dxpool.fabric.latency import TopologyLatencyModel
from dxpool.fabric.topology import Topology
from dxpool.store.client import connect, parse_endpoints
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn


def main() -> None:
    etcd, prefix, gang_id, members, gpus = sys.argv[1:6]
    addresses = parse_endpoints(etcd, None)
    schema = KeySchema(prefix)
    store = Store(connect(addresses, timeout_s=5.0), schema)
    cache = Cache(addresses, schema)
    cache.start()
    index = PlacementIndex(cache)
    composer = Composer(store, cache, index, TopologyLatencyModel(Topology.default()))
    gangs = ChunkedGangs(composer, ComposeGate(cache), broker="child", reserve_timeout_s=2.0)
    real = gangs._commit
    commits = 0

    def commit_then_hang(txn: Txn, *, created: set[str] | None = None) -> int:
        nonlocal commits
        revision = real(txn, created=created)
        commits += 1
        if commits == 2 and revision:  # the record, then the first chunk of members
            print("chunk committed", flush=True)
            threading.Event().wait()
        return revision

    gangs._commit = commit_then_hang  # type: ignore[method-assign]
    spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=int(gpus)))
    gangs.compose(nodes_pb2.ComposeGangRequest(members=[spec] * int(members), gang_id=gang_id))
    print("gang composed", flush=True)


if __name__ == "__main__":
    main()
