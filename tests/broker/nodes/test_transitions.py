"""Record transitions shared by the controller and the singleton duties."""

from __future__ import annotations

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.transitions import drop_release
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.stm import transact
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn


def test_dropping_a_release_keeps_the_hosts_reservations(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    """The release attachment goes; every other attachment and every node's CPU and
    memory reservation on the host stay (placement reads them for CPU/memory fit)."""
    schema = KeySchema(key_prefix)
    store = Store(etcd_client, schema)
    gpu = pb.Gpu(name="boxes/b1/gpus/0", host="hosts/h1", generation=3)
    allocation = pb.HostAllocation(
        host="hosts/h1",
        attachments=[
            pb.DesiredAttachment(gpu="boxes/b1/gpus/0", node="nodes/gone", release=True,
                                 generation=3),
            pb.DesiredAttachment(gpu="boxes/b1/gpus/1", node="nodes/stays", host_slot=1),
        ],
        reservations=[pb.HostReservation(node="nodes/stays", cpu_cores=8, memory_mib=4096)],
    )  # fmt: skip
    store.commit(Txn().put(schema.host_allocation("h1"), allocation))
    cache = Cache(etcd_client, schema)
    cache.start()
    try:
        transact(store, cache, lambda view: drop_release(view, gpu))
        stored = store.get(schema.host_allocation("h1"))
        assert stored is not None
        assert [a.gpu for a in stored.value.attachments] == ["boxes/b1/gpus/1"]
        assert list(stored.value.reservations) == list(allocation.reservations)
        assert cache.get(k.HOST_ALLOCATIONS, "h1") is not None
    finally:
        cache.stop()
