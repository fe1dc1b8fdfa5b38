"""Gangs with a record: committed in chunks beyond one etcd transaction, rolled back
whole on failure or broker loss; distinct hosts, one switch, and queued gangs.

Hosts are written straight into etcd (no agent runs, so members stay PENDING): what is
checked is the record, the chunks and the rollback. A broker killed mid-gang is a real
process (``tests/broker/nodes/gang_child.py``) killed with SIGKILL after its first chunk.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.broker.control.sharing_duties import SharingSettings
from dxpool.broker.nodes.gang_chunks import ChunkedGangs
from dxpool.broker.state.stm import CHUNK_ATTEMPTS
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Txn
from tests.broker.commit_races import meddle_before_commits, rewrite_allocations
from tests.broker.nodes.test_gang import add_host, gpu_owners, reason, spec, stored_nodes
from tests.conftest import Stubs, add_box, wait_until

FAST = SharingSettings(interval_s=0.2, coalesce_s=0.01)
REPO = Path(__file__).resolve().parents[3]


def gang(
    members: int,
    gpus: str = "H100:8",
    *,
    gang_id: str = "",
    request_id: str = "",
    **options: Any,
) -> nodes_pb2.ComposeGangRequest:
    return nodes_pb2.ComposeGangRequest(
        members=[spec(gpus) for _ in range(members)],
        gang_id=gang_id,
        request_id=request_id,
        **options,
    )


@pytest.fixture
def leader(broker_factory: Callable[..., BrokerServer]) -> BrokerServer:
    broker = broker_factory(sharing=FAST)
    assert broker.election.wait_until_leader(30)
    return broker


def make_pool(
    broker: BrokerServer,
    etcd_client: Any,
    key_prefix: str,
    *,
    hosts: int,
    boxes: int,
    slots: int = 8,
    racks: int = 1,
) -> Stubs:
    stubs = Stubs(grpc.insecure_channel(broker.endpoint))
    for i in range(hosts):
        add_host(etcd_client, key_prefix, f"h{i:02d}", slots=slots)
    for i in range(boxes):
        add_box(stubs, f"b{i:02d}", gpus=8, rack=f"r{i % racks}")
    wait_until(
        lambda: (
            len(broker.index.snapshot().hosts) == hosts
            and len(broker.index.snapshot().gpus_by_box) == boxes
        ),
        30,
        message="pool in the index",
    )
    return stubs


def record(etcd_client: Any, key_prefix: str, gang_id: str) -> pb.GangRecord | None:
    raw, _ = etcd_client.get(KeySchema(key_prefix).gang(gang_id))
    return pb.GangRecord.FromString(raw) if raw is not None else None


def test_a_gang_beyond_one_transaction_is_committed_in_chunks_and_valid_at_once(
    leader: BrokerServer, etcd_client: Any, key_prefix: str
) -> None:
    stubs = make_pool(leader, etcd_client, key_prefix, hosts=16, boxes=16)
    assert leader.gangs is not None
    before = leader.gangs.transactions
    made = stubs.nodes.ComposeGang(gang(14, gang_id="big", request_id="r-big"))
    assert made.state == pb.GANG_STATE_VALID and made.size == 14
    assert [n.name for n in made.nodes] == [f"nodes/big-{i}" for i in range(14)]
    assert len({n.host for n in made.nodes}) == 14  # 8 slots each: one member per host
    owners = gpu_owners(etcd_client, key_prefix)
    assert len(owners) == 14 * 8 == len(set(owners))
    # the record, two or more chunks, the flip
    assert leader.gangs.transactions - before >= 4
    stored = record(etcd_client, key_prefix, "big")
    assert stored is not None and stored.state == pb.GANG_STATE_VALID and stored.committed == 14
    again = stubs.nodes.ComposeGang(gang(14, gang_id="big", request_id="r-big"))
    assert again.name == "gangs/big" and len(again.nodes) == 14
    fetched = stubs.nodes.GetGang(nodes_pb2.GetGangRequest(name="gangs/big"))
    assert fetched.state == pb.GANG_STATE_VALID and len(fetched.nodes) == 14
    released = stubs.nodes.ReleaseGang(nodes_pb2.ReleaseGangRequest(name="gangs/big"))
    assert released.state == pb.GANG_STATE_RELEASED
    assert all(n.state == pb.NODE_STATE_RELEASING for n in released.nodes)


def test_distinct_hosts_put_every_member_on_a_host_of_its_own(
    leader: BrokerServer, etcd_client: Any, key_prefix: str
) -> None:
    stubs = make_pool(leader, etcd_client, key_prefix, hosts=4, boxes=1, slots=8)
    piled = stubs.nodes.ComposeGang(gang(2, "H100:1"))
    assert len({n.host for n in piled.nodes}) == 1  # without the option they share one
    spread = stubs.nodes.ComposeGang(gang(4, "H100:1", distinct_hosts=True))
    assert spread.state == pb.GANG_STATE_VALID
    assert len({n.host for n in spread.nodes}) == 4
    with pytest.raises(grpc.RpcError) as refused:
        stubs.nodes.ComposeGang(gang(5, "H100:1", distinct_hosts=True))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Nothing was committed" in (refused.value.details() or "")


def test_same_switch_puts_every_members_gpus_under_one_switch(
    leader: BrokerServer, etcd_client: Any, key_prefix: str
) -> None:
    stubs = make_pool(leader, etcd_client, key_prefix, hosts=4, boxes=4, racks=2)
    made = stubs.nodes.ComposeGang(gang(2, "H100:8", same_switch=True))
    racks = {
        leader.cache.get("boxes", b.gpu.split("/")[1]).value.location.rack
        for n in made.nodes
        for b in n.gpus
    }
    assert len(racks) == 1
    with pytest.raises(grpc.RpcError) as refused:
        stubs.nodes.ComposeGang(gang(3, "H100:8", same_switch=True))
    assert "no rack switch holds 24" in (refused.value.details() or "")


def test_a_queued_gang_waits_as_one_and_is_composed_when_it_fits(
    leader: BrokerServer, etcd_client: Any, key_prefix: str
) -> None:
    stubs = make_pool(leader, etcd_client, key_prefix, hosts=4, boxes=1)
    waiting = stubs.nodes.ComposeGang(gang(2, "H100:8", gang_id="q", queue=True))
    assert waiting.state == pb.GANG_STATE_QUEUED and not waiting.nodes
    assert waiting.queue.position == 1 and waiting.queue.reason
    assert not stored_nodes(etcd_client, key_prefix)  # no member until it fits whole
    entries = stubs.nodes.ListQueue(nodes_pb2.ListQueueRequest()).entries
    assert [(e.name, e.gpus) for e in entries] == [("gangs/q", 16)]
    add_box(stubs, "b99", gpus=8)
    wait_until(
        lambda: (
            stubs.nodes.GetGang(nodes_pb2.GetGangRequest(name="gangs/q")).state
            == pb.GANG_STATE_VALID
        ),
        30,
        message="the queued gang composed",
    )
    assert len(stored_nodes(etcd_client, key_prefix)) == 2


def test_a_member_whose_capacity_goes_mid_way_rolls_the_gang_back(
    leader: BrokerServer,
    broker_factory: Callable[..., BrokerServer],
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gang (every GPU of the pool) is held after its first chunk; a compose on
    another broker takes the GPUs placed for the last member meanwhile. The last chunk
    fails its compare, the member has nowhere else to go, and the gang is rolled back:
    every member committed so far RELEASING, the record FAILED."""
    stubs = make_pool(leader, etcd_client, key_prefix, hosts=13, boxes=12)
    other = broker_factory(sharing=FAST)
    other_stubs = Stubs(grpc.insecure_channel(other.endpoint))
    wait_until(
        lambda: len(other.index.snapshot().gpus_by_box) == 12, timeout_s=90, message="other broker"
    )
    assert leader.gangs is not None
    real = ChunkedGangs._commit
    commits = 0
    reached, go_on = threading.Event(), threading.Event()

    def held(self: ChunkedGangs, txn: Txn, *, created: set[str] | None = None) -> int:
        nonlocal commits
        revision = real(self, txn, created=created)
        commits += 1
        if commits == 2:
            reached.set()
            assert go_on.wait(90)
        return revision

    monkeypatch.setattr(ChunkedGangs, "_commit", held)
    with ThreadPoolExecutor(1) as executor:
        composing = executor.submit(stubs.nodes.ComposeGang, gang(12, gang_id="g"))
        assert reached.wait(90)
        wait_until(
            lambda: (
                sum(g.free for b in other.index.snapshot().gpus_by_box.values() for g in b) == 8
            ),
            timeout_s=90,
            message="the first chunk at the other broker",
        )
        taken = [other_stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec("H100:8")))]
        go_on.set()
        with pytest.raises(grpc.RpcError) as refused:
            composing.result(120)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rolled back" in (refused.value.details() or "")
    stored = record(etcd_client, key_prefix, "g")
    assert stored is not None and stored.state == pb.GANG_STATE_FAILED
    members = [n for n in stored_nodes(etcd_client, key_prefix) if n.gang == "gangs/g"]
    assert members and all(n.state == pb.NODE_STATE_RELEASING for n in members)
    owners = gpu_owners(etcd_client, key_prefix)
    live = {b.gpu for n in taken for b in n.gpus}
    assert {g for g, n in owners.items() if not n.startswith("nodes/g-")} == live


def test_a_broker_killed_mid_gang_is_rolled_back_by_the_leader(
    leader: BrokerServer,
    etcd_server: EmbeddedEtcd,
    etcd_client: Any,
    key_prefix: str,
) -> None:
    """A real process commits the gang record and its first chunk, then is killed
    (SIGKILL). Its record stays RESERVING until its deadline; the leader's reaper then
    rolls the gang back: every member released, the record FAILED naming the broker."""
    make_pool(leader, etcd_client, key_prefix, hosts=13, boxes=13)
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.broker.nodes.gang_child",
            etcd_server.endpoint,
            key_prefix,
            "dead",
            "13",
            "8",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert child.stdout is not None
        lines = []
        for line in child.stdout:
            lines.append(line)
            if "chunk committed" in line:
                break
        assert any("chunk committed" in line for line in lines), "".join(lines)
        child.kill()
        child.wait(90)
        committed = record(etcd_client, key_prefix, "dead")
        assert committed is not None and committed.state == pb.GANG_STATE_RESERVING
        assert 0 < committed.committed < 13
        first = [n for n in stored_nodes(etcd_client, key_prefix) if n.gang == "gangs/dead"]
        assert len(first) == committed.committed
        wait_until(
            lambda: (
                (r := record(etcd_client, key_prefix, "dead")) is not None
                and r.state == pb.GANG_STATE_FAILED
            ),
            60,
            message="the leader to roll the gang back",
        )
    finally:
        if child.poll() is None:
            child.kill()
    rolled = record(etcd_client, key_prefix, "dead")
    assert rolled is not None and "child" in rolled.message
    members = [n for n in stored_nodes(etcd_client, key_prefix) if n.gang == "gangs/dead"]
    assert members and all(n.state == pb.NODE_STATE_RELEASING for n in members)


def test_a_slow_broker_that_resumes_after_the_rollback_writes_nothing_more(
    leader: BrokerServer,
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This broker is held after its first chunk past the gang's deadline; the leader
    rolls the gang back. When it resumes, its next chunk fails its compare on the gang
    record, and it answers ABORTED without committing another member."""
    stubs = make_pool(leader, etcd_client, key_prefix, hosts=13, boxes=13)
    assert leader.gangs is not None
    monkeypatch.setattr(leader.gangs, "_reserve_timeout_s", 1.0)
    real = ChunkedGangs._commit
    commits = 0
    reached, go_on = threading.Event(), threading.Event()

    def held(self: ChunkedGangs, txn: Txn, *, created: set[str] | None = None) -> int:
        nonlocal commits
        revision = real(self, txn, created=created)
        commits += 1
        if commits == 2:
            reached.set()
            assert go_on.wait(90)
        return revision

    monkeypatch.setattr(ChunkedGangs, "_commit", held)
    with ThreadPoolExecutor(1) as executor:
        composing = executor.submit(stubs.nodes.ComposeGang, gang(13, gang_id="slow"))
        assert reached.wait(90)
        committed = record(etcd_client, key_prefix, "slow")
        assert committed is not None
        wait_until(
            lambda: (
                (r := record(etcd_client, key_prefix, "slow")) is not None
                and r.state == pb.GANG_STATE_FAILED
            ),
            30,
            message="the rollback",
        )
        go_on.set()
        with pytest.raises(grpc.RpcError) as refused:
            composing.result(120)
    assert refused.value.code() == grpc.StatusCode.ABORTED
    assert reason(refused.value) == "GANG_ROLLED_BACK"
    members = [n for n in stored_nodes(etcd_client, key_prefix) if n.gang == "gangs/slow"]
    assert len(members) == committed.committed
    assert all(n.state == pb.NODE_STATE_RELEASING for n in members)


def meddle_with_chunks(
    broker: BrokerServer,
    etcd_client: Any,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    times: int,
) -> list[int]:
    """Have another writer rewrite the allocations of hosts h00 and h01 just before each
    of ``broker``'s first ``times`` chunk commits (after the chunk read them); returns
    the list that counts chunk commits."""
    keys = KeySchema(key_prefix)
    hosts = ["h00", "h01"]
    allocations = {keys.host_allocation(host) for host in hosts}
    return meddle_before_commits(
        broker.store,
        monkeypatch,
        lambda written: bool(allocations & written) and any("/nodes/" in k for k in written),
        lambda: rewrite_allocations(etcd_client, keys, hosts),
        times=times,
    )


def test_a_chunk_racing_another_writer_is_committed_on_what_it_wrote(
    leader: BrokerServer, etcd_client: Any, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stubs = make_pool(leader, etcd_client, key_prefix, hosts=2, boxes=1)
    chunks = meddle_with_chunks(leader, etcd_client, key_prefix, monkeypatch, times=1)
    made = stubs.nodes.ComposeGang(gang(2, "H100:1", gang_id="g", distinct_hosts=True))
    assert made.state == pb.GANG_STATE_VALID
    assert len(chunks) == 2  # the first lost its compare, the second read the rewrite
    owners = gpu_owners(etcd_client, key_prefix)
    assert sorted(owners.values()) == ["nodes/g-0", "nodes/g-1"]


def test_a_chunk_that_loses_every_compare_aborts_and_rolls_the_gang_back(
    leader: BrokerServer, etcd_client: Any, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer rewrites the hosts' allocations after each try of the chunk read
    them and before its commit: after the last try the call is ABORTED
    (COMMIT_CONFLICT), the record FAILED, and no member or GPU is taken."""
    stubs = make_pool(leader, etcd_client, key_prefix, hosts=2, boxes=1)
    chunks = meddle_with_chunks(leader, etcd_client, key_prefix, monkeypatch, times=1000)
    with pytest.raises(grpc.RpcError) as aborted:
        stubs.nodes.ComposeGang(gang(2, "H100:1", gang_id="g", distinct_hosts=True), timeout=60)
    assert aborted.value.code() == grpc.StatusCode.ABORTED
    assert reason(aborted.value) == "COMMIT_CONFLICT"
    assert len(chunks) == CHUNK_ATTEMPTS
    stored = record(etcd_client, key_prefix, "g")
    assert stored is not None and stored.state == pb.GANG_STATE_FAILED
    assert [n for n in stored_nodes(etcd_client, key_prefix) if n.gang == "gangs/g"] == []
    assert gpu_owners(etcd_client, key_prefix) == {}
