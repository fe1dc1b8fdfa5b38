"""ComposeGang, GetGang and ReleaseGang against a real broker and etcd.

Hosts are registered by writing their records and liveness keys into etcd (no agent
runs, so members stay PENDING): what is checked here is placement and the one
transaction. Interleavings are forced with the broker's own host locks: a gang that has
placed waits at a lock while something else takes its GPUs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.nodes.gang import gang_ops, without_placement
from dxpool.broker.placement import Binding, Placement
from dxpool.broker.state.stm import PLACE_ATTEMPTS
from dxpool.limits import MAX_GANG_MEMBERS, MAX_TXN_OPS
from dxpool.store.keys import KeySchema
from tests.broker.commit_races import meddle_before_commits, rewrite_allocations
from tests.conftest import Stubs, add_box, pool_records, wait_until


def spec(gpus: str = "H100:4", **fields: Any) -> pb.NodeSpec:
    model, _, count = gpus.partition(":")
    return pb.NodeSpec(gpus=pb.GpuRequest(model=model, count=int(count)), **fields)


def gang_request(
    members: int, gpus: str = "H100:4", request_id: str = "", gang_id: str = "", **fields: Any
) -> nodes_pb2.ComposeGangRequest:
    return nodes_pb2.ComposeGangRequest(
        members=[spec(gpus, **fields) for _ in range(members)],
        request_id=request_id,
        gang_id=gang_id,
    )


def reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    return info.reason


def add_host(etcd_client: Any, key_prefix: str, host_id: str, slots: int = 4) -> None:
    keys = KeySchema(key_prefix)
    host = pb.Host(
        name=f"hosts/{host_id}",
        location=pb.Location(site="s1", pod="p1", rack="r1"),
        slot_capacity=slots,
    )
    etcd_client.put(keys.host(host_id), host.SerializeToString())
    etcd_client.put(keys.host_lease(host_id), b"")


def wait_indexed(broker: BrokerServer, hosts: list[str], gpus: int) -> None:
    def ready() -> bool:
        snapshot = broker.index.snapshot()
        free = sum(g.free for box in snapshot.gpus_by_box.values() for g in box)
        return all(h in snapshot.hosts for h in hosts) and free == gpus

    wait_until(ready, message="the broker to see the hosts and boxes")


@pytest.fixture
def pool(broker: BrokerServer, stubs: Stubs, etcd_client: Any, key_prefix: str) -> Stubs:
    """Two hosts of 4 slots, one box of 8 H100s."""
    for host in ("h1", "h2"):
        add_host(etcd_client, key_prefix, host)
    add_box(stubs, "box1", gpus=8)
    wait_indexed(broker, ["h1", "h2"], 8)
    return stubs


def gpu_owners(etcd_client: Any, key_prefix: str) -> dict[str, str]:
    gpus = [pb.Gpu.FromString(v) for v, _ in etcd_client.get_prefix(key_prefix + "gpus/")]
    return {g.name: g.node for g in gpus if g.node}


def report_released(etcd_client: Any, key_prefix: str, hosts: list[str]) -> None:
    """Act as the hosts' agents (these tests run none): report every GPU their
    allocations mark ``release`` as scrubbed and detached (RELEASED), so the broker
    frees it."""
    keys = KeySchema(key_prefix)
    for host in hosts:
        raw, _ = etcd_client.get(keys.host_allocation(host))
        allocation = pb.HostAllocation.FromString(raw) if raw else pb.HostAllocation()
        status = pb.HostStatus(host=f"hosts/{host}")
        for attachment in allocation.attachments:
            if attachment.release:
                status.attachments.add(
                    gpu=attachment.gpu,
                    generation=attachment.generation,
                    phase=pb.ATTACHMENT_PHASE_RELEASED,
                    host_slot=attachment.host_slot,
                    scrubbed=True,
                )
        etcd_client.put(keys.host_status(host), status.SerializeToString())


def stored_nodes(etcd_client: Any, key_prefix: str) -> list[pb.VirtualNode]:
    return [pb.VirtualNode.FromString(v) for v, _ in etcd_client.get_prefix(key_prefix + "nodes/")]


# -- compose -----------------------------------------------------------------------------


def test_a_gang_places_every_member_and_commits_them_together(
    pool: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    gang = pool.nodes.ComposeGang(gang_request(2, gang_id="job1", request_id="r1"))

    assert gang.name == "gangs/job1"
    assert [n.name for n in gang.nodes] == ["nodes/job1-0", "nodes/job1-1"]
    assert {n.host for n in gang.nodes} == {"hosts/h1", "hosts/h2"}  # 4 slots each
    assert all(n.state == pb.NODE_STATE_PENDING for n in gang.nodes)
    assert all((n.gang, n.gang_size, n.request_id) == ("gangs/job1", 2, "r1") for n in gang.nodes)
    claimed = [b.gpu for n in gang.nodes for b in n.gpus]
    assert len(claimed) == 8 == len(set(claimed))
    assert gpu_owners(etcd_client, key_prefix) == {
        b.gpu: n.name for n in gang.nodes for b in n.gpus
    }
    keys = KeySchema(key_prefix)
    value, _ = etcd_client.get(keys.request("r1"))
    assert value == b"gangs/job1"
    for host in ("h1", "h2"):
        raw, _ = etcd_client.get(keys.host_allocation(host))
        allocation = pb.HostAllocation.FromString(raw)
        assert sorted(a.host_slot for a in allocation.attachments) == [0, 1, 2, 3]
    # The read API sees the same gang.
    got = pool.nodes.GetGang(nodes_pb2.GetGangRequest(name="gangs/job1"))
    assert [n.name for n in got.nodes] == ["nodes/job1-0", "nodes/job1-1"]


def test_switch_affinity_holds_each_member_under_one_switch(
    broker: BrokerServer, stubs: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    """Each member's GPUs come from one rack; members may use different racks."""
    for host in ("h1", "h2"):
        add_host(etcd_client, key_prefix, host)
    for box, rack in (("a1", "r1"), ("a2", "r1"), ("b1", "r2"), ("b2", "r2")):
        add_box(stubs, box, gpus=2, rack=rack)
    wait_indexed(broker, ["h1", "h2"], 8)
    gang = stubs.nodes.ComposeGang(
        gang_request(2, "H100:3", gang_id="sw", affinity=pb.GPU_AFFINITY_SWITCH)
    )
    racks = {"a1": "r1", "a2": "r1", "b1": "r2", "b2": "r2"}
    used = [{racks[b.gpu.split("/")[1]] for b in node.gpus} for node in gang.nodes]
    assert sorted(used, key=sorted) == [{"r1"}, {"r2"}]
    with pytest.raises(grpc.RpcError) as refused:  # one GPU left in each rack
        stubs.nodes.ComposeGang(
            gang_request(1, "H100:2", gang_id="more", affinity=pb.GPU_AFFINITY_SWITCH)
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_members_sharing_a_host_get_distinct_slots(
    broker: BrokerServer, stubs: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    add_host(etcd_client, key_prefix, "big", slots=8)
    add_box(stubs, "box1", gpus=8)
    wait_indexed(broker, ["big"], 8)

    gang = stubs.nodes.ComposeGang(gang_request(4, "H100:2"))

    assert {n.host for n in gang.nodes} == {"hosts/big"}
    slots = [b.host_slot for n in gang.nodes for b in n.gpus]
    assert sorted(slots) == list(range(8))
    allocation_key = KeySchema(key_prefix).host_allocation("big")
    raw, _ = etcd_client.get(allocation_key)
    assert len(pb.HostAllocation.FromString(raw).attachments) == 8
    # Released together, every member's GPUs stay in the one allocation they share,
    # each marked release (scrub, detach, report) until the agent reports it: the
    # second member's write does not drop the first one's entries.
    stubs.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name=gang.name))
    raw, _ = etcd_client.get(allocation_key)
    left = pb.HostAllocation.FromString(raw).attachments
    assert all(a.release for a in left)
    assert sorted((a.node, a.gpu) for a in left) == sorted(
        (n.name, b.gpu) for n in gang.nodes for b in n.gpus
    )
    # Once the agent reports them RELEASED, they are freed and leave the allocation.
    report_released(etcd_client, key_prefix, ["big"])
    wait_until(lambda: not gpu_owners(etcd_client, key_prefix), message="GPUs freed")
    raw, _ = etcd_client.get(allocation_key)
    assert list(pb.HostAllocation.FromString(raw).attachments) == []


def test_the_same_request_id_returns_the_same_gang_and_a_different_request_is_refused(
    pool: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    first = pool.nodes.ComposeGang(gang_request(2, "H100:2", request_id="again"))
    before = pool_records(etcd_client, key_prefix)

    second = pool.nodes.ComposeGang(gang_request(2, "H100:2", request_id="again"))

    assert second == first
    assert pool_records(etcd_client, key_prefix) == before
    with pytest.raises(grpc.RpcError) as other:
        pool.nodes.ComposeGang(gang_request(2, "H100:1", request_id="again"))
    assert other.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert reason(other.value) == "REQUEST_ID_REUSED"
    # A node's request id is not a gang's, and the other way round.
    with pytest.raises(grpc.RpcError) as node_id:
        pool.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec(), request_id="again"))
    assert node_id.value.code() == grpc.StatusCode.ALREADY_EXISTS
    pool.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec("H100:1"), request_id="n1"))
    with pytest.raises(grpc.RpcError) as gang_id:
        pool.nodes.ComposeGang(gang_request(1, "H100:1", request_id="n1"))
    assert gang_id.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert reason(gang_id.value) == "REQUEST_ID_REUSED"


def test_a_gang_whose_last_member_does_not_fit_writes_nothing(
    pool: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    before = pool_records(etcd_client, key_prefix)

    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeGang(gang_request(3, "H100:3", request_id="too-big"))

    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason(refused.value) == "NO_CAPACITY"
    message = refused.value.details() or ""
    assert "gang member 2 of 3" in message and "Nothing was committed" in message
    assert pool_records(etcd_client, key_prefix) == before


def test_a_gang_beyond_one_transaction_is_placed_whole_before_anything_is_written(
    pool: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    """A gang too large for one etcd transaction goes the chunked way (a gang record,
    see tests/broker/nodes/test_gang_chunks.py); one the pool cannot hold is refused for
    capacity before anything is written, and one over the member limit is invalid."""
    largest = gang_request(11, "H100:8")
    assert gang_ops(largest.members) <= MAX_TXN_OPS  # 88 + 33 + 1
    assert gang_ops(gang_request(12, "H100:8").members) > MAX_TXN_OPS
    before = pool_records(etcd_client, key_prefix)

    with pytest.raises(grpc.RpcError) as capacity:
        pool.nodes.ComposeGang(gang_request(12, "H100:8"))
    assert capacity.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Nothing was committed" in (capacity.value.details() or "")
    assert pool_records(etcd_client, key_prefix) == before
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeGang(gang_request(MAX_GANG_MEMBERS + 1, "H100:1"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason(refused.value) == "GANG_TOO_LARGE"
    assert pool_records(etcd_client, key_prefix) == before


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (nodes_pb2.ComposeGangRequest(), "at least one member spec"),
        (gang_request(1, gang_id="Bad_Id"), "invalid gang id"),
        (gang_request(2, gang_id="g" * 62), "too long for 2 members"),
        (
            nodes_pb2.ComposeGangRequest(members=[spec("H100:1"), spec("H100:0")]),
            "members[1]",
        ),
        (gang_request(1, request_id="bad id"), "invalid request_id"),
    ],
)
def test_malformed_gangs_are_invalid_argument(
    pool: Stubs,
    etcd_client: Any,
    key_prefix: str,
    request_: nodes_pb2.ComposeGangRequest,
    expected: str,
) -> None:
    before = pool_records(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeGang(request_)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in (refused.value.details() or "")
    assert pool_records(etcd_client, key_prefix) == before


def test_a_pinned_unknown_host_is_not_found(pool: Stubs) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeGang(gang_request(1, "H100:1", host="hosts/nowhere"))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "members[0]" in (refused.value.details() or "")


def test_a_gang_id_whose_member_names_are_taken_is_already_exists(
    pool: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    pool.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec("H100:1"), node_id="job-1"))
    before = pool_records(etcd_client, key_prefix)
    with pytest.raises(grpc.RpcError) as refused:
        pool.nodes.ComposeGang(gang_request(2, "H100:1", gang_id="job"))
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert reason(refused.value) == "GANG_EXISTS"
    assert pool_records(etcd_client, key_prefix) == before


# -- races -------------------------------------------------------------------------------


def test_concurrent_gangs_for_the_same_gpus_never_both_land_partly(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, key_prefix: str
) -> None:
    """Two brokers, eight GPUs, many rounds of two gangs of 2 x 4 GPUs each: in every
    round exactly one gang exists whole and the other left no record at all."""
    brokers = [broker_factory(), broker_factory()]
    channels = [grpc.insecure_channel(b.endpoint) for b in brokers]
    stubs = [Stubs(c) for c in channels]
    for host in ("h1", "h2"):
        add_host(etcd_client, key_prefix, host)
    add_box(stubs[0], "box1", gpus=8)
    try:
        for round_ in range(6):
            for broker in brokers:
                wait_indexed(broker, ["h1", "h2"], 8)
            start = threading.Barrier(2)

            def one(
                side: int, round_: int = round_, start: threading.Barrier = start
            ) -> nodes_pb2.Gang | grpc.StatusCode:
                start.wait()
                try:
                    return stubs[side].nodes.ComposeGang(
                        gang_request(2, gang_id=f"r{round_}s{side}")
                    )
                except grpc.RpcError as error:
                    return error.code()

            with ThreadPoolExecutor(2) as pool:
                outcomes = list(pool.map(one, (0, 1)))

            gangs = [o for o in outcomes if isinstance(o, nodes_pb2.Gang)]
            codes = [o for o in outcomes if not isinstance(o, nodes_pb2.Gang)]
            assert len(gangs) == 1, outcomes
            assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED]
            winner = gangs[0]
            owners = gpu_owners(etcd_client, key_prefix)
            assert owners == {b.gpu: n.name for n in winner.nodes for b in n.gpus}
            names = {n.name for n in stored_nodes(etcd_client, key_prefix)}
            assert {n.name for n in winner.nodes} <= names
            loser = 1 - int(winner.name.endswith("s1"))
            assert not any(name.startswith(f"nodes/r{round_}s{loser}-") for name in names)
            _release_and_free(stubs[0], winner.name, etcd_client, key_prefix)
    finally:
        for channel in channels:
            channel.close()


def test_a_gang_that_lost_its_gpus_while_waiting_for_a_host_lock_writes_nothing(
    broker: BrokerServer, pool: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    """The gang places both members, then waits for h1's lock; meanwhile a node takes
    one of the GPUs it chose. The re-check under the locks sees it, the gang places
    again, finds only 7 free GPUs and leaves nothing behind."""
    composer = broker.nodes._composer
    with ThreadPoolExecutor(1) as executor:
        with composer.host_locks.lock("h1"):
            composing = executor.submit(pool.nodes.ComposeGang, gang_request(2))
            wait_until(
                lambda: composer.host_locks.waiting("h1") > 0, message="the gang at the lock"
            )
            # h1 is locked: pin the thief to h2 so it does not wait behind the gang.
            thief = pool.nodes.ComposeNode(
                nodes_pb2.ComposeNodeRequest(spec=spec("H100:1", host="hosts/h2"))
            )
        with pytest.raises(grpc.RpcError) as refused:
            composing.result(timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert gpu_owners(etcd_client, key_prefix) == {thief.gpus[0].gpu: thief.name}
    assert [n.name for n in stored_nodes(etcd_client, key_prefix)] == [thief.name]


def test_a_gang_that_loses_its_compare_to_another_broker_writes_nothing(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, key_prefix: str
) -> None:
    """Broker A's gang has placed and waits at a host lock; broker B's gang takes the
    same GPUs. A's cache may not have seen B's commit yet, so A's re-check can pass:
    its transaction's compares fail, it places again and finds nothing."""
    first, second = broker_factory(), broker_factory()
    a, b = (Stubs(grpc.insecure_channel(x.endpoint)) for x in (first, second))
    for host in ("h1", "h2"):
        add_host(etcd_client, key_prefix, host)
    add_box(a, "box1", gpus=8)
    wait_indexed(first, ["h1", "h2"], 8)
    wait_indexed(second, ["h1", "h2"], 8)
    locks = first.nodes._composer.host_locks
    with ThreadPoolExecutor(1) as executor:
        with locks.lock("h1"):
            composing = executor.submit(a.nodes.ComposeGang, gang_request(2, gang_id="ga"))
            wait_until(lambda: locks.waiting("h1") > 0, message="A's gang at the lock")
            won = b.nodes.ComposeGang(gang_request(2, gang_id="gb"))
        with pytest.raises(grpc.RpcError) as refused:
            composing.result(timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert gpu_owners(etcd_client, key_prefix) == {g.gpu: n.name for n in won.nodes for g in n.gpus}
    assert sorted(n.name for n in stored_nodes(etcd_client, key_prefix)) == [
        "nodes/gb-0",
        "nodes/gb-1",
    ]


# -- release -----------------------------------------------------------------------------


def _release_and_free(stubs: Stubs, name: str, etcd_client: Any, key_prefix: str) -> None:
    released = stubs.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name=name))
    assert all(n.state == pb.NODE_STATE_RELEASING for n in released.nodes)
    report_released(etcd_client, key_prefix, sorted({n.host[6:] for n in released.nodes}))
    wait_until(
        lambda: not gpu_owners(etcd_client, key_prefix), message="the gang's GPUs to be freed"
    )


def test_releasing_a_gang_releases_every_member_in_one_transaction(
    pool: Stubs, etcd_client: Any, key_prefix: str
) -> None:
    gang = pool.nodes.ComposeGang(gang_request(2, gang_id="job"))
    events = etcd_client.watch_prefix(key_prefix + "nodes/")
    iterator, cancel = events

    released = pool.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name=gang.name))

    assert [n.state for n in released.nodes] == [pb.NODE_STATE_RELEASING] * 2
    revisions = set()
    for _ in range(2):
        event = next(iterator)
        revisions.add(event.mod_revision)
    cancel()
    assert len(revisions) == 1, "members released by more than one transaction"
    again = pool.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name=gang.name))
    assert {n.name for n in again.nodes} == {n.name for n in gang.nodes}
    # Freed only once the agent reports them scrubbed and detached.
    report_released(etcd_client, key_prefix, sorted({n.host[6:] for n in gang.nodes}))
    wait_until(lambda: not gpu_owners(etcd_client, key_prefix), message="GPUs freed")
    wait_until(
        lambda: all(
            n.state == pb.NODE_STATE_RELEASED
            for n in pool.nodes.GetGang(nodes_pb2.GetGangRequest(name=gang.name)).nodes
        ),
        message="every member RELEASED",
    )
    # Its GPUs are free for the next gang.
    pool.nodes.ComposeGang(gang_request(2))


def test_an_unknown_gang_is_not_found(pool: Stubs) -> None:
    for call in (
        lambda: pool.nodes.GetGang(nodes_pb2.GetGangRequest(name="gangs/none")),
        lambda: pool.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name="gangs/none")),
    ):
        with pytest.raises(grpc.RpcError) as missing:
            call()
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert reason(missing.value) == "GANG_NOT_FOUND"
    # A node composed alone is no gang, even when its name looks like a member's.
    pool.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec("H100:1"), node_id="solo-0"))
    with pytest.raises(grpc.RpcError) as solo:
        pool.nodes.GetGang(nodes_pb2.GetGangRequest(name="gangs/solo"))
    assert solo.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as bad:
        pool.nodes.GetGang(nodes_pb2.GetGangRequest(name="nodes/x"))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_gang_release_racing_a_member_release_leaves_every_member_releasing(
    broker: BrokerServer,
    broker_factory: Callable[..., BrokerServer],
    pool: Stubs,
    etcd_client: Any,
    key_prefix: str,
) -> None:
    """ReleaseGang has read the gang and waits at a host lock; meanwhile another broker
    releases one member. The gang's transaction then either sees that release or loses
    its compare and runs again: every member ends RELEASING, each GPU detaching once."""
    gang = pool.nodes.ComposeGang(gang_request(2, gang_id="race"))
    other = Stubs(grpc.insecure_channel(broker_factory().endpoint))
    locks = broker.nodes._composer.host_locks
    host = gang.nodes[0].host.removeprefix("hosts/")
    with ThreadPoolExecutor(1) as executor:
        with locks.lock(host):
            releasing = executor.submit(
                pool.nodes.ReleaseGang, nodes_pb2.ReleaseGangRequest(name=gang.name)
            )
            wait_until(lambda: locks.waiting(host) > 0, message="the gang release at the lock")
            alone = other.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=gang.nodes[0].name))
            assert alone.state == pb.NODE_STATE_RELEASING
        released = releasing.result(timeout=30)
    assert [n.state for n in released.nodes] == [pb.NODE_STATE_RELEASING] * 2
    assert released.nodes[0].message == alone.message  # left as the first release made it
    report_released(etcd_client, key_prefix, sorted({n.host[6:] for n in gang.nodes}))
    wait_until(lambda: not gpu_owners(etcd_client, key_prefix), message="GPUs freed")


# -- placement against one snapshot ------------------------------------------------------


def test_without_placement_takes_gpus_and_slots_out_of_a_copy(
    broker: BrokerServer, pool: Stubs
) -> None:
    snapshot = broker.index.snapshot()
    gpu = snapshot.gpus_by_box["box1"][3]
    placement = Placement(
        host="h1",
        bindings=(Binding(gpu.name, "box1", gpu.slot, gpu.model, host_slot=2, latency_ns=0),),
        score=0.0,
    )

    after = without_placement(snapshot, placement)

    assert not after.gpus_by_box["box1"][3].free
    assert after.hosts["h1"].used_slots == frozenset({2})
    assert after.hosts["h1"].free_slot_count() == 3
    # The snapshot placement was given stays as it was.
    assert snapshot.gpus_by_box["box1"][3].free
    assert snapshot.hosts["h1"].used_slots == frozenset()
    assert after.gpus_by_box["box1"][0] is snapshot.gpus_by_box["box1"][0]
    assert after.hosts["h2"] is snapshot.hosts["h2"]


def test_a_released_gang_and_its_request_id_are_collected_after_the_retention(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, key_prefix: str
) -> None:
    broker = broker_factory(retention_s=0.5)
    stubs = Stubs(grpc.insecure_channel(broker.endpoint))
    add_host(etcd_client, key_prefix, "h1")
    add_box(stubs, "box1", gpus=2)
    wait_indexed(broker, ["h1"], 2)
    gang = stubs.nodes.ComposeGang(gang_request(2, "H100:1", request_id="collect-me"))
    stubs.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name=gang.name))
    report_released(etcd_client, key_prefix, ["h1"])  # scrubbed: the members go RELEASED

    request_key = KeySchema(key_prefix).request("collect-me")
    wait_until(
        lambda: (
            not stored_nodes(etcd_client, key_prefix) and etcd_client.get(request_key)[0] is None
        ),
        message="the members and the gang's request id to be collected",
    )
    # The request id may be used again, for a new gang.
    again = stubs.nodes.ComposeGang(gang_request(2, "H100:1", request_id="collect-me"))
    assert again.name != gang.name


# -- the last attempt --------------------------------------------------------------------


def test_a_gang_that_loses_every_compare_is_aborted_and_writes_nothing(
    broker: BrokerServer,
    pool: Stubs,
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another writer rewrites the hosts' allocations after each attempt read them and
    before its commit: every attempt loses its compare, and after the last the call is
    ABORTED (COMMIT_CONFLICT) with nothing written."""
    keys = KeySchema(key_prefix)
    allocations = {keys.host_allocation(h) for h in ("h1", "h2")}
    commits = meddle_before_commits(
        broker.store,
        monkeypatch,
        lambda written: bool(allocations & written),
        lambda: rewrite_allocations(etcd_client, keys, ["h1", "h2"]),
        times=1000,
    )
    with pytest.raises(grpc.RpcError) as aborted:
        pool.nodes.ComposeGang(gang_request(2, gang_id="g", request_id="r1"), timeout=60)
    assert aborted.value.code() == grpc.StatusCode.ABORTED
    assert reason(aborted.value) == "COMMIT_CONFLICT"
    assert len(commits) == PLACE_ATTEMPTS
    assert stored_nodes(etcd_client, key_prefix) == []
    assert gpu_owners(etcd_client, key_prefix) == {}
    assert etcd_client.get(keys.request("r1"))[0] is None
