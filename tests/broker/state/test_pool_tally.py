"""PoolTally over a real etcd: the same counts as one pass over every record, under random
changes, late events and changes landing while it loads."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dxpool.api.v1 import inventory_pb2 as inv
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.state.cache import Cache, Collection
from dxpool.broker.state.pool_status import FIT_SIZES, free_host_slots, gpu_bucket, status_message
from dxpool.broker.state.pool_tally import PoolTally
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn, Versioned
from tests.conftest import wait_until

BOXES = ("b1", "b2", "b3")
HOSTS = ("h1", "h2", "h3")
MODELS = ("H100", "A100")
GPU_STATES = (
    pb.GPU_STATE_FREE,
    pb.GPU_STATE_ATTACHING,
    pb.GPU_STATE_ATTACHED,
    pb.GPU_STATE_DETACHING,
    pb.GPU_STATE_FENCING,
    pb.GPU_STATE_QUARANTINED,
    pb.GPU_STATE_FAULTED,
)
BOX_STATES = (pb.BOX_STATE_ACTIVE, pb.BOX_STATE_CORDONED)
NODE_STATES = (pb.NODE_STATE_PENDING, pb.NODE_STATE_READY, pb.NODE_STATE_RELEASED)


@pytest.fixture
def store(etcd_client, key_prefix: str) -> Store:  # type: ignore[no-untyped-def]
    return Store(etcd_client, KeySchema(key_prefix))


@pytest.fixture
def cache(store: Store) -> Iterator[Cache]:
    made = Cache(store.client, store.keys)
    made.start()
    yield made
    made.stop()


def counted_in_one_pass(cache: Cache) -> inv.PoolStatus:
    """The pool's status counted in one pass over every cached record: what the tally
    must equal."""
    active_boxes = {
        name for name, record in cache.items(k.BOXES) if record.value.state == pb.BOX_STATE_ACTIVE
    }
    models: dict[str, Counter[str]] = {}
    for name, record in cache.items(k.GPUS):
        gpu: pb.Gpu = record.value
        bucket = gpu_bucket(gpu, usable_box=name.partition("/")[0] in active_boxes)
        models.setdefault(gpu.model, Counter())[bucket] += 1
    nodes = Counter(pb.NodeState.Name(r.value.state) for _, r in cache.items(k.NODES))

    alive = dead = 0
    slots: list[int] = []
    for host_id, record in cache.items(k.HOSTS):
        if cache.get(k.HOST_LEASES, host_id) is None:
            dead += 1
            continue
        alive += 1
        allocation = cache.get(k.HOST_ALLOCATIONS, host_id)
        slots.append(free_host_slots(record.value, allocation.value if allocation else None))
    return status_message(
        {model: dict(counts) for model, counts in models.items()},
        dict(nodes),
        hosts_alive=alive,
        hosts_dead=dead,
        free_slots=sum(slots),
        fits_by_slots={size: sum(free // size for free in slots) for size in FIT_SIZES},
    )


def random_change(store: Store, rng: random.Random) -> Txn:
    """One random put or delete of a box, GPU, host, lease, allocation or node."""
    keys = store.keys
    txn = Txn()
    kind = rng.choice(("box", "gpu", "gpu", "gpu", "host", "lease", "allocation", "node"))
    box, host = rng.choice(BOXES), rng.choice(HOSTS)
    delete = rng.random() < 0.15
    if kind == "box":
        key = keys.box(box)
        value: Any = pb.Box(name=f"boxes/{box}", state=rng.choice(BOX_STATES))
    elif kind == "gpu":
        slot = rng.randrange(4)
        key = keys.gpu(box, slot)
        state = rng.choice(GPU_STATES)
        value = pb.Gpu(
            name=f"boxes/{box}/gpus/{slot}",
            box=f"boxes/{box}",
            slot=slot,
            model=rng.choice(MODELS),
            state=state,
            node="nodes/n1" if state != pb.GPU_STATE_FREE or rng.random() < 0.1 else "",
            health=rng.choice((pb.GPU_HEALTH_HEALTHY, pb.GPU_HEALTH_UNHEALTHY)),
        )
    elif kind == "host":
        key = keys.host(host)
        value = pb.Host(name=f"hosts/{host}", slot_capacity=rng.choice((0, 4, 8, 300)))
    elif kind == "lease":
        key = keys.host_lease(host)
        value = b""
    elif kind == "allocation":
        key = keys.host_allocation(host)
        slots = rng.sample(range(-1, 9), rng.randrange(4))
        value = pb.HostAllocation(
            host=f"hosts/{host}",
            attachments=[pb.DesiredAttachment(gpu=f"g{s}", host_slot=s) for s in slots],
        )
    else:
        name = f"n{rng.randrange(5)}"
        key = keys.node(name)
        value = pb.VirtualNode(name=f"nodes/{name}", state=rng.choice(NODE_STATES))
    return txn.delete(key) if delete else txn.put(key, value)


def settled(cache: Cache, revision: int) -> None:
    """Until the cache holds ``revision`` and every listener of it has returned."""
    assert cache.wait_for_revision(revision, timeout_s=10)
    wait_until(lambda: cache.notified_revision >= revision, message="listeners ran")


def assert_agrees(tally: PoolTally, cache: Cache) -> None:
    assert tally.status() == counted_in_one_pass(cache)
    gpu_states = Counter((r.value.model, r.value.state) for _, r in cache.items(k.GPUS))
    assert tally.gpu_states() == dict(gpu_states)
    assert tally.node_states() == dict(Counter(r.value.state for _, r in cache.items(k.NODES)))
    alive = sum(1 for host, _ in cache.items(k.HOSTS) if cache.get(k.HOST_LEASES, host))
    assert tally.host_liveness() == (alive, cache.count(k.HOSTS) - alive)


@pytest.mark.parametrize("seed", range(6))
def test_the_counts_are_those_of_a_full_pass_after_every_change(
    store: Store, cache: Cache, seed: int
) -> None:
    rng = random.Random(seed)
    for _ in range(20):  # something to load
        store.commit(random_change(store, rng))
    tally = PoolTally(cache)
    try:
        revision = 0
        for step in range(120):
            revision = store.commit(random_change(store, rng)).revision
            if step % 10 == 9:
                settled(cache, revision)
                assert_agrees(tally, cache)
        settled(cache, revision)
        assert_agrees(tally, cache)
    finally:
        tally.close()


def test_a_late_event_carrying_an_older_record_does_not_move_the_counts_back(
    store: Store, cache: Cache
) -> None:
    keys = store.keys
    first = pb.Gpu(name="boxes/b1/gpus/0", box="boxes/b1", model="H100", state=pb.GPU_STATE_FREE)
    store.commit(Txn().put(keys.box("b1"), pb.Box(name="boxes/b1", state=pb.BOX_STATE_ACTIVE)))
    revision = store.commit(Txn().put(keys.gpu("b1", 0), first)).revision
    settled(cache, revision)
    stale = cache.get(k.GPUS, "b1/0")
    tally = PoolTally(cache)
    try:
        taken = pb.Gpu()
        taken.CopyFrom(first)
        taken.state, taken.node = pb.GPU_STATE_ATTACHED, "nodes/n1"
        settled(cache, store.commit(Txn().put(keys.gpu("b1", 0), taken)).revision)
        assert tally.status().models[0].in_use == 1

        # Commits are applied from several threads, so an event can reach the listeners
        # after a newer change of the same key; the tally reads the cache, not the event.
        tally._on_change(k.GPUS, "b1/0", stale)

        assert tally.status().models[0].in_use == 1
        assert_agrees(tally, cache)
    finally:
        tally.close()


class ChangingWhileCopied:
    """A cache whose copy of one collection is taken, then a change is committed and its
    listeners run, and only then is the (now stale) copy handed back: a change landing
    while a tally loads."""

    def __init__(self, cache: Cache, collection: str, change: Callable[[], int]) -> None:
        self._cache = cache
        self._collection = collection
        self._change: Callable[[], int] | None = change

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._cache, name)
        if isinstance(found, Collection):  # cache.gpus and the like: copied the same way
            return _CopiedThrough(self, found)
        return found

    def items(self, collection: str) -> list[tuple[str, Versioned[Any]]]:
        copy = self._cache.items(collection)
        if collection == self._collection and self._change is not None:
            change, self._change = self._change, None
            settled(self._cache, change())
        return copy


class _CopiedThrough:
    """A typed collection of :class:`ChangingWhileCopied`: its copy is taken there."""

    def __init__(self, cache: ChangingWhileCopied, collection: Collection[Any]) -> None:
        self._cache = cache
        self._collection = collection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    def items(self) -> list[tuple[str, Versioned[Any]]]:
        return self._cache.items(self._collection.name)


@pytest.mark.parametrize(
    ("collection", "changed_key"),
    [(k.GPUS, "gpu"), (k.BOXES, "box"), (k.NODES, "node"), (k.HOST_LEASES, "lease")],
)
def test_a_change_landing_while_the_tally_loads_is_not_undone_by_the_older_copy(
    store: Store, cache: Cache, collection: str, changed_key: str
) -> None:
    keys = store.keys
    txn = Txn().put(keys.box("b1"), pb.Box(name="boxes/b1", state=pb.BOX_STATE_ACTIVE))
    for slot in range(3):
        gpu = pb.Gpu(name=f"boxes/b1/gpus/{slot}", box="boxes/b1", slot=slot, model="H100")
        gpu.state = pb.GPU_STATE_FREE
        txn.put(keys.gpu("b1", slot), gpu)
    txn.put(keys.host("h1"), pb.Host(name="hosts/h1", slot_capacity=8))
    txn.put(keys.node("n1"), pb.VirtualNode(name="nodes/n1", state=pb.NODE_STATE_PENDING))
    settled(cache, store.commit(txn).revision)

    def change() -> int:
        if changed_key == "gpu":
            taken = pb.Gpu(name="boxes/b1/gpus/1", box="boxes/b1", slot=1, model="H100")
            taken.state, taken.node = pb.GPU_STATE_ATTACHED, "nodes/n1"
            return store.commit(Txn().put(keys.gpu("b1", 1), taken)).revision
        if changed_key == "box":
            cordoned = pb.Box(name="boxes/b1", state=pb.BOX_STATE_CORDONED)
            return store.commit(Txn().put(keys.box("b1"), cordoned)).revision
        if changed_key == "node":
            ready = pb.VirtualNode(name="nodes/n1", state=pb.NODE_STATE_READY)
            return store.commit(Txn().put(keys.node("n1"), ready)).revision
        return store.commit(Txn().put(keys.host_lease("h1"), b"")).revision

    before = counted_in_one_pass(cache)
    tally = PoolTally(ChangingWhileCopied(cache, collection, change))  # type: ignore[arg-type]
    try:
        assert tally.status() != before  # the change is counted
        assert_agrees(tally, cache)
    finally:
        tally.close()
