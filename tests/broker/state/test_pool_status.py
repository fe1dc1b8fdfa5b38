"""GetPoolStatus's counts over a real etcd (a PoolTally over a loaded cache): by model and
state, hosts, and what fits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dxpool.api.v1 import inventory_pb2 as inv
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.pool_tally import PoolTally
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn


def gpu(box: str, slot: int, model: str, state: int, **fields: object) -> pb.Gpu:
    return pb.Gpu(
        name=f"boxes/{box}/gpus/{slot}", box=f"boxes/{box}", slot=slot, model=model,
        state=state, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.fixture
def cache(etcd_client, key_prefix: str) -> Iterator[Cache]:  # type: ignore[no-untyped-def]
    keys = KeySchema(key_prefix)
    txn = Txn()
    txn.put(keys.box("b1"), pb.Box(name="boxes/b1", state=pb.BOX_STATE_ACTIVE))
    txn.put(keys.box("b2"), pb.Box(name="boxes/b2", state=pb.BOX_STATE_CORDONED))
    gpus = [
        gpu("b1", 0, "H100", pb.GPU_STATE_FREE),
        gpu("b1", 1, "H100", pb.GPU_STATE_FREE),
        gpu("b1", 2, "H100", pb.GPU_STATE_FREE, health=pb.GPU_HEALTH_UNHEALTHY),
        gpu("b1", 3, "H100", pb.GPU_STATE_ATTACHED, node="nodes/n1", host="hosts/h1"),
        gpu("b1", 4, "A100", pb.GPU_STATE_FREE),
        gpu("b1", 5, "A100", pb.GPU_STATE_FENCING, host="hosts/h2"),
        gpu("b1", 6, "A100", pb.GPU_STATE_QUARANTINED, host="hosts/h2"),
        gpu("b2", 0, "A100", pb.GPU_STATE_FREE),  # in a cordoned box
    ]
    for record in gpus:
        txn.put(keys.gpu(record.box.removeprefix("boxes/"), record.slot), record)
    for host, slots in (("h1", 4), ("h2", 8), ("h3", 8)):
        txn.put(keys.host(host), pb.Host(name=f"hosts/{host}", slot_capacity=slots))
    txn.put(keys.host_lease("h1"), b"")
    txn.put(keys.host_lease("h3"), b"")  # h2 is dead
    allocation = pb.HostAllocation(
        host="hosts/h1", attachments=[pb.DesiredAttachment(gpu="boxes/b1/gpus/3", host_slot=0)]
    )
    txn.put(keys.host_allocation("h1"), allocation)
    txn.put(keys.node("n1"), pb.VirtualNode(name="nodes/n1", state=pb.NODE_STATE_READY))
    txn.put(keys.node("n2"), pb.VirtualNode(name="nodes/n2", state=pb.NODE_STATE_RELEASED))
    Store(etcd_client, keys).commit(txn)
    made = Cache(etcd_client, keys)
    made.start()
    yield made
    made.stop()


def status_of(cache: Cache) -> inv.PoolStatus:
    tally = PoolTally(cache)
    try:
        return tally.status()
    finally:
        tally.close()


def test_counts_by_model_and_state(cache: Cache) -> None:
    status = status_of(cache)

    every, a100, h100 = status.models
    assert (every.model, a100.model, h100.model) == ("", "A100", "H100")
    assert (h100.total, h100.free, h100.in_use, h100.unavailable) == (4, 2, 1, 1)
    assert (a100.total, a100.free, a100.fencing, a100.quarantined, a100.unavailable) == (
        4, 1, 1, 1, 1,
    )  # fmt: skip
    assert (every.total, every.free) == (8, 3)
    assert dict(status.nodes_by_state) == {"NODE_STATE_READY": 1, "NODE_STATE_RELEASED": 1}


def test_fits_are_bounded_by_free_gpus_and_live_host_slots(cache: Cache) -> None:
    status = status_of(cache)

    assert (status.hosts_alive, status.hosts_dead) == (2, 1)
    assert status.free_host_slots == 3 + 8  # h1 uses one of 4; dead h2 does not count
    fits = {fit.gpus: fit.nodes for fit in status.fits}
    # 3 usable GPUs: three 1-GPU nodes, one 2-GPU node; no host and no pool has 4 or 8.
    assert fits == {1: 3, 2: 1, 4: 0, 8: 0}
