"""WatchNodes against a real broker and etcd: a stalled watcher never holds anyone up, a
watcher that stops reading is cut off with a resumable position, and a resume replays
every change after it (or says it cannot, with a reset listing).

Interleavings are forced, not hoped for: a client whose receive window is 64 KiB and
that stops reading leaves the broker's send blocked, which the test observes
(``blocked_watchers``) before acting.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.node_watch import WatchSettings
from dxpool.broker.api.server import BrokerServer
from dxpool.store.embedded import free_port
from tests.conftest import SimPool, Stubs, add_box, register_sim_box, wait_hosts_alive
from tests.patience import patient
from tests.streaming import (
    SMALL_WINDOW,
    View,
    blocked_watchers,
    delete_nodes,
    fill_window,
    listed,
    node,
    realistic_node,
    rpc_error,
    rss_mib,
    settle,
    wait_for,
    write_nodes,
)

Event = nodes_pb2.NodeEvent


def watch(
    stub: nodes_pb2_grpc.NodeServiceStub, name: str = "", start: int = 0, timeout: float = 30
) -> Iterator[nodes_pb2.NodeEvent]:
    return stub.WatchNodes(  # type: ignore[no-any-return]
        nodes_pb2.WatchNodesRequest(name=name, start_revision=start), timeout=timeout
    )


def until_synced(stream: Iterator[nodes_pb2.NodeEvent]) -> list[nodes_pb2.NodeEvent]:
    """The events up to and including the next TYPE_SYNCED."""
    events = []
    for event in stream:
        events.append(event)
        if event.type == Event.TYPE_SYNCED:
            return events
    raise AssertionError(f"the stream ended before TYPE_SYNCED: {events}")


def kinds(events: list[nodes_pb2.NodeEvent]) -> list[tuple[str, str]]:
    return [(Event.Type.Name(e.type).removeprefix("TYPE_"), e.node.name) for e in events]


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, error
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


@pytest.fixture
def channel(broker: BrokerServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(broker.endpoint) as channel:
        yield channel


@pytest.fixture
def nodes(channel: grpc.Channel) -> nodes_pb2_grpc.NodeServiceStub:
    return nodes_pb2_grpc.NodeServiceStub(channel)


def stalled(endpoint: str) -> tuple[grpc.Channel, nodes_pb2_grpc.NodeServiceStub]:
    channel = grpc.insecure_channel(endpoint, options=SMALL_WINDOW)
    return channel, nodes_pb2_grpc.NodeServiceStub(channel)


# -- defect: one stalled watcher froze the broker -------------------------------------


@pytest.mark.slow
def test_stalled_watcher_never_blocks_the_cache_composes_or_the_controller(  # type: ignore[no-untyped-def]
    broker_factory, sim_pool: SimPool, etcd_client, key_prefix: str
) -> None:
    """A client opens a watch, reads one event and stops reading, while 15,000 node
    changes (more than the 10,000 events the broker once queued per watcher before
    every writer blocked) and a round of composes and releases go through."""
    broker = broker_factory(watch=WatchSettings(send_timeout_s=300))
    with grpc.insecure_channel(broker.endpoint) as channel:
        stubs = Stubs(channel)
        register_sim_box(sim_pool, stubs, "box1")
        sim_pool.start_agent("h1")
        wait_hosts_alive(stubs)
        stall_channel, stall_stub = stalled(broker.endpoint)
        with stall_channel:
            stream = watch(stall_stub, timeout=300)
            assert next(stream).type == Event.TYPE_SYNCED  # then never read again
            feed = broker.nodes.feed
            fill_window(
                etcd_client,
                key_prefix,
                lambda r: [f"big{i}" for i in range(10)],
                until=lambda: blocked_watchers(feed, 1.0),
            )
            started = time.monotonic()
            for round_ in range(30):
                write_nodes(
                    etcd_client,
                    key_prefix,
                    [node(f"n{i}", note=f"round {round_}") for i in range(500)],
                )
            # The cache's etcd watch kept applying: the broker reads the last round.
            wait_for(
                lambda: (
                    stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name="nodes/n499")).message
                    == "round 29"
                ),
                10,
                "the cache to apply the last change",
            )
            # Still the same send, blocked since before the changes began.
            assert [w.sending_s > time.monotonic() - started for w in feed.watchers()] == [True]
            # Composes and releases (RPC threads committing) and the controller
            # (RELEASING -> RELEASED) are not held up either.
            for index in range(8):
                created = stubs.nodes.ComposeNode(
                    nodes_pb2.ComposeNodeRequest(
                        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)),
                        node_id=f"c{index}",
                    ),
                    timeout=5,
                )
                stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=created.name), timeout=5)
            released = [f"n{i}" for i in range(100)]
            for name in released:
                stubs.nodes.ReleaseNode(
                    nodes_pb2.ReleaseNodeRequest(name=f"nodes/{name}"), timeout=5
                )
            wait_for(
                lambda: all(
                    n.state == pb.NODE_STATE_RELEASED
                    for name, n in listed(stubs.nodes).items()
                    if name.removeprefix("nodes/") in released
                ),
                15,
                "the controller to finish the releases",
            )
            elapsed = time.monotonic() - started
            assert elapsed < patient(30), f"writers took {elapsed:.1f}s next to a stalled watcher"
            stream.cancel()  # type: ignore[attr-defined]


# -- cut-off and resume ---------------------------------------------------------------


def test_watcher_that_stops_reading_is_cut_off_and_resumes_without_loss(  # type: ignore[no-untyped-def]
    broker_factory, etcd_client, key_prefix: str
) -> None:
    broker = broker_factory(watch=WatchSettings(send_timeout_s=0.5))
    settle(
        broker, write_nodes(etcd_client, key_prefix, [node(f"n{i}", size=200) for i in range(30)])
    )
    stall_channel, stall_stub = stalled(broker.endpoint)
    with stall_channel, grpc.insecure_channel(broker.endpoint) as channel:
        view = View()
        stream = watch(stall_stub)
        view.apply_all(stream, until=lambda v: v.synced == 1)
        assert len(view.nodes) == 30
        # The client stops reading; changes, deletions and new nodes pile up.
        fill_window(
            etcd_client,
            key_prefix,
            lambda r: [f"big{r}-{i}" for i in range(10)],
            until=lambda: blocked_watchers(broker.nodes.feed, 0.2),
        )
        delete_nodes(etcd_client, key_prefix, [f"n{i}" for i in range(5)])
        write_nodes(etcd_client, key_prefix, [node(f"n{i}", note="changed") for i in range(5, 10)])
        fill_window(
            etcd_client,
            key_prefix,
            lambda r: [f"more{r}-{i}" for i in range(10)],
            until=lambda: not broker.nodes.feed.watchers(),  # cut off
        )
        # Reading again: what the broker had sent, then the reason it ended.
        with pytest.raises(grpc.RpcError) as ended:
            for event in stream:
                view.apply(event)
        assert ended.value.code() == grpc.StatusCode.ABORTED  # type: ignore[attr-defined]
        assert "WATCH_TOO_SLOW" in ended.value.details()  # type: ignore[attr-defined]
        stubs = nodes_pb2_grpc.NodeServiceStub(channel)
        resumed = until_synced(watch(stubs, start=view.revision))
        assert resumed[-1].type == Event.TYPE_SYNCED and not resumed[-1].reset
        assert all(e.type != Event.TYPE_EXISTING for e in resumed)
        for event in resumed:
            view.apply(event)
        assert view.nodes == listed(stubs)
        assert "nodes/n0" not in view.nodes
        assert view.nodes["nodes/n7"].message == "changed"


def test_resume_replays_each_change_after_the_revision_in_order(  # type: ignore[no-untyped-def]
    broker: BrokerServer, nodes: nodes_pb2_grpc.NodeServiceStub, etcd_client, key_prefix: str
) -> None:
    settle(broker, write_nodes(etcd_client, key_prefix, [node("a"), node("b"), node("c")]))
    first = until_synced(watch(nodes))
    assert kinds(first) == [("EXISTING", f"nodes/{n}") for n in "abc"] + [("SYNCED", "")]
    assert first[-1].reset and all(e.revision == 0 for e in first[:-1])
    start = first[-1].revision
    changed = write_nodes(etcd_client, key_prefix, [node("a", note="new")])
    deleted = delete_nodes(etcd_client, key_prefix, ["b"])
    created = write_nodes(etcd_client, key_prefix, [node("d")])
    settle(broker, created)

    replay = until_synced(watch(nodes, start=start))
    assert kinds(replay) == [
        ("CHANGED", "nodes/a"),
        ("DELETED", "nodes/b"),
        ("CHANGED", "nodes/d"),
        ("SYNCED", ""),
    ]
    assert [e.revision for e in replay[:3]] == [changed, deleted, created]
    assert replay[0].node.message == "new" and not replay[-1].reset
    assert replay[-1].revision >= created
    # Resuming from any event gives exactly what came after it.
    assert kinds(until_synced(watch(nodes, start=deleted))) == [
        ("CHANGED", "nodes/d"),
        ("SYNCED", ""),
    ]


def test_changes_in_one_transaction_are_never_split_by_a_resume_position(  # type: ignore[no-untyped-def]
    nodes: nodes_pb2_grpc.NodeServiceStub, etcd_client, key_prefix: str
) -> None:
    stream = watch(nodes)
    until_synced(stream)
    revision = write_nodes(etcd_client, key_prefix, [node("a"), node("b")])
    first, second = next(stream), next(stream)
    assert kinds([first, second]) == [("CHANGED", "nodes/a"), ("CHANGED", "nodes/b")]
    # Cut off after `a`, a client resumes from a's position and must still get `b`.
    assert first.revision < revision and first.revision <= second.revision <= revision
    replay = until_synced(watch(nodes, start=first.revision))
    assert kinds(replay) == [("CHANGED", "nodes/a"), ("CHANGED", "nodes/b"), ("SYNCED", "")]
    # Replayed once the watch has passed the transaction, the positions are exact.
    assert [e.revision for e in replay] == [revision - 1, revision, revision]


def test_resume_the_broker_cannot_replay_gets_a_reset_listing(  # type: ignore[no-untyped-def]
    broker_factory, etcd_client, key_prefix: str
) -> None:
    broker = broker_factory(watch=WatchSettings(max_tombstones=2))
    settle(broker, write_nodes(etcd_client, key_prefix, [node(n) for n in "abcde"]))
    with grpc.insecure_channel(broker.endpoint) as channel:
        stub = nodes_pb2_grpc.NodeServiceStub(channel)
        start = until_synced(watch(stub))[-1].revision
        for name in "abc":  # three deletions: the broker remembers only the last two
            deleted = delete_nodes(etcd_client, key_prefix, [name])
        settle(broker, deleted)
        assert broker.nodes.feed.horizon > start
        reset = until_synced(watch(stub, start=start))
        assert kinds(reset) == [("EXISTING", "nodes/d"), ("EXISTING", "nodes/e"), ("SYNCED", "")]
        assert reset[-1].reset
        assert all(e.revision == start for e in reset[:-1])  # a cut-off here lists again
        # From after the forgotten deletion the replay is exact again.
        assert kinds(until_synced(watch(stub, start=broker.nodes.feed.horizon))) == [
            ("DELETED", "nodes/b"),
            ("DELETED", "nodes/c"),
            ("SYNCED", ""),
        ]
    # Another broker never saw those deletions: it lists too.
    other = broker_factory()
    with grpc.insecure_channel(other.endpoint) as channel:
        reset = until_synced(watch(nodes_pb2_grpc.NodeServiceStub(channel), start=start))
        assert reset[-1].reset and len(reset) == 3


def test_watcher_owed_a_forgotten_deletion_is_aborted_then_relists(  # type: ignore[no-untyped-def]
    broker_factory, etcd_client, key_prefix: str
) -> None:
    broker = broker_factory(watch=WatchSettings(max_tombstones=1, send_timeout_s=300))
    settle(broker, write_nodes(etcd_client, key_prefix, [node("a"), node("b")]))
    stall_channel, stall_stub = stalled(broker.endpoint)
    with stall_channel, grpc.insecure_channel(broker.endpoint) as channel:
        view = View()
        stream = watch(stall_stub)
        view.apply_all(stream, until=lambda v: v.synced == 1)
        fill_window(
            etcd_client,
            key_prefix,
            lambda r: [f"big{i}" for i in range(10)],
            until=lambda: blocked_watchers(broker.nodes.feed, 1.0),
        )
        # While its send is blocked, two deletions: the second drops the first from
        # memory before the watcher could be sent it. The broker applies them from its
        # own etcd watch, so wait for both before reading: read sooner, and the watcher
        # could take the first deletion before the second arrives to drop it.
        first = delete_nodes(etcd_client, key_prefix, ["a"])
        settle(broker, delete_nodes(etcd_client, key_prefix, ["b"]), timeout_s=60)
        assert broker.nodes.feed.horizon >= first
        assert blocked_watchers(broker.nodes.feed, 1.0)  # still behind the forgotten one
        with pytest.raises(grpc.RpcError) as ended:
            for event in stream:
                view.apply(event)
        assert ended.value.code() == grpc.StatusCode.ABORTED  # type: ignore[attr-defined]
        info = error_info(ended.value)
        assert info.reason == "WATCH_TOO_SLOW"
        assert int(info.metadata["revision"]) == view.revision
        stub = nodes_pb2_grpc.NodeServiceStub(channel)
        resumed = until_synced(watch(stub, start=view.revision))
        assert resumed[-1].reset
        for event in resumed:
            view.apply(event)
        assert view.nodes == listed(stub)
        assert "nodes/a" not in view.nodes and "nodes/b" not in view.nodes


def test_named_watch_replays_its_deletion_and_ignores_other_nodes(  # type: ignore[no-untyped-def]
    broker: BrokerServer, nodes: nodes_pb2_grpc.NodeServiceStub, etcd_client, key_prefix: str
) -> None:
    settle(broker, write_nodes(etcd_client, key_prefix, [node("a"), node("b")]))
    first = until_synced(watch(nodes, name="nodes/a"))
    assert kinds(first) == [("EXISTING", "nodes/a"), ("SYNCED", "")]
    write_nodes(etcd_client, key_prefix, [node("b", note="other")])
    deleted = delete_nodes(etcd_client, key_prefix, ["a"])
    settle(broker, deleted)
    replay = until_synced(watch(nodes, name="nodes/a", start=first[-1].revision))
    assert kinds(replay) == [("DELETED", "nodes/a"), ("SYNCED", "")]
    assert replay[0].revision == deleted
    # Nothing left to replay for a node that is gone: NOT_FOUND, as for a fresh watch.
    for start in (0, deleted):
        error = rpc_error(lambda s=start: next(watch(nodes, name="nodes/a", start=s)))  # type: ignore[misc]
        assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


def test_bad_watch_requests_are_invalid_argument(nodes: nodes_pb2_grpc.NodeServiceStub) -> None:
    error = rpc_error(lambda: next(watch(nodes, start=-1)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "start_revision" in error.details()  # type: ignore[attr-defined]
    error = rpc_error(lambda: next(watch(nodes, name="boxes/x")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]


def test_idle_watch_gets_progress_marks_that_keep_its_position_current(  # type: ignore[no-untyped-def]
    broker_factory, etcd_client, key_prefix: str
) -> None:
    broker = broker_factory(watch=WatchSettings(progress_interval_s=0.2))
    settle(broker, write_nodes(etcd_client, key_prefix, [node("a")]))
    with grpc.insecure_channel(broker.endpoint) as channel:
        stream = watch(nodes_pb2_grpc.NodeServiceStub(channel), name="nodes/a")
        until_synced(stream)
        other = write_nodes(etcd_client, key_prefix, [node("b")])
        for _ in range(50):  # only progress marks: `b` is not this watch's node
            mark = next(stream)
            assert mark.type == Event.TYPE_SYNCED and not mark.reset
            if mark.revision >= other:
                break
        assert mark.revision >= other
        stream.cancel()  # type: ignore[attr-defined]


# -- memory -----------------------------------------------------------------------------

CHANGES = 2000


def test_stalled_watcher_keeps_broker_memory_flat(  # type: ignore[no-untyped-def]
    etcd_server, etcd_client, key_prefix: str, tmp_path
) -> None:
    """Broker process RSS across 2,000 node changes while one watcher reads nothing.

    The broker runs as its own process so its RSS is its own. Every node exists before
    the measurement starts (the cache holds them all), so any growth is what the
    stalled watcher costs.
    """
    port = free_port()
    log = (tmp_path / "broker.log").open("wb")
    broker = subprocess.Popen(
        [sys.executable, "-m", "dxpool.broker", "--etcd", etcd_server.endpoint,
         "--prefix", key_prefix, "--listen", f"127.0.0.1:{port}",
         "--agent-listen", "127.0.0.1:0", "--log-level", "WARNING", "--insecure"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        endpoint = f"127.0.0.1:{port}"
        names = [f"n{i}" for i in range(200)]
        with grpc.insecure_channel(endpoint) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = nodes_pb2_grpc.NodeServiceStub(channel)
            stall_channel, stall_stub = stalled(endpoint)
            with stall_channel:
                stream = watch(stall_stub, timeout=300)
                next(stream)  # then never read again
                for round_ in range(3):  # warm up: every node exists, allocator settled
                    write_nodes(
                        etcd_client, key_prefix, [realistic_node(n, f"w{round_}") for n in names]
                    )

                def applied(note: str) -> bool:
                    request = nodes_pb2.GetNodeRequest(name="nodes/n199")
                    try:
                        return stub.GetNode(request, timeout=5).message == note  # type: ignore[no-any-return]
                    except grpc.RpcError as error:
                        if error.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                            raise
                        return False

                wait_for(lambda: applied("w2"), 10, "the warm-up")
                before = rss_mib(broker.pid)
                for round_ in range(CHANGES // len(names)):
                    write_nodes(
                        etcd_client, key_prefix, [realistic_node(n, f"m{round_}") for n in names]
                    )
                wait_for(lambda: applied(f"m{CHANGES // len(names) - 1}"), 20, "the changes")
                after = rss_mib(broker.pid)
                stream.cancel()  # type: ignore[attr-defined]
        print(f"broker RSS {before:.1f} -> {after:.1f} MiB over {CHANGES} node changes "
              f"with a stalled watcher: {after - before:+.1f} MiB")  # fmt: skip
        assert after - before < 10, f"broker RSS grew {after - before:.1f} MiB"
    finally:
        broker.terminate()
        try:
            broker.wait(10)
        finally:
            if broker.poll() is None:
                broker.kill()
            log.close()


# -- ListNodes with a label selector ----------------------------------------------------


def test_list_nodes_filters_by_label_selector_across_pages(  # type: ignore[no-untyped-def]
    broker: BrokerServer, nodes: nodes_pb2_grpc.NodeServiceStub, etcd_client, key_prefix: str
) -> None:
    records = []
    for index in range(10):
        record = node(f"n{index:02d}")
        record.spec.labels["team"] = "ml" if index % 3 == 0 else "infra"
        if index % 2 == 0:
            record.spec.labels["tier"] = "prod"
        records.append(record)
    settle(broker, write_nodes(etcd_client, key_prefix, records))

    def names(selector: str) -> list[str]:
        found, token = [], ""
        while True:
            page = nodes.ListNodes(
                nodes_pb2.ListNodesRequest(label_selector=selector, page_size=2, page_token=token)
            )
            assert len(page.nodes) <= 2
            found += [n.name.removeprefix("nodes/") for n in page.nodes]
            token = page.next_page_token
            if not token:
                return found

    assert names("team=ml") == ["n00", "n03", "n06", "n09"]
    assert names("team=ml,tier") == ["n00", "n06"]
    assert names("team!=ml,!tier") == ["n01", "n05", "n07"]
    assert len(names("")) == 10
    assert names("owner=bob") == []


def test_list_nodes_refuses_a_bad_selector(nodes: nodes_pb2_grpc.NodeServiceStub) -> None:
    error = rpc_error(lambda: nodes.ListNodes(nodes_pb2.ListNodesRequest(label_selector="a=b=c")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid label selector 'a=b=c'" in (error.details() or "")
    assert error_info(error).reason == "INVALID_SELECTOR"


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        (pb.GpuRequest(model="H100||A100", count=2), "join several models with '|'"),
        (pb.GpuRequest(model="H100", count=2, mixed_models=True), "mixed_models needs a model set"),
    ],
)
def test_bad_model_sets_are_invalid_argument_saying_what_to_write(
    stubs: Stubs, gpus: pb.GpuRequest, message: str
) -> None:
    compose = nodes_pb2.ComposeNodeRequest(spec=pb.NodeSpec(gpus=gpus))
    plan = nodes_pb2.PlanNodeRequest(spec=compose.spec)
    for call, request in ((stubs.nodes.ComposeNode, compose), (stubs.nodes.PlanNode, plan)):
        with pytest.raises(grpc.RpcError) as raised:
            call(request)  # type: ignore[operator]
        error = raised.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert message in error.details()  # type: ignore[attr-defined]
        assert error_info(error).reason == "INVALID_GPU_MODEL"


def test_a_model_set_composes_one_model_through_grpc(stubs: Stubs, sim_pool: SimPool) -> None:
    register_sim_box(sim_pool, stubs, "hbox", gpus=2, model="H100")
    register_sim_box(sim_pool, stubs, "abox", gpus=4, model="A100")
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs, 1)
    spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100|A100", count=3))
    node = stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec, node_id="n1"))
    assert {binding.model for binding in node.gpus} == {"A100"}
    mixed = pb.NodeSpec(gpus=pb.GpuRequest(model="H100|A100", count=3, mixed_models=True))
    other = stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=mixed, node_id="n2"))
    assert len(other.gpus) == 3
    assert {binding.model for binding in [*node.gpus, *other.gpus]} == {"A100", "H100"}


def test_excluded_hosts_keep_a_node_off_them_or_say_why_not(
    stubs: Stubs, sim_pool: SimPool
) -> None:
    register_sim_box(sim_pool, stubs, "b1", gpus=4)
    sim_pool.start_agent("h1")
    sim_pool.start_agent("h2")
    wait_hosts_alive(stubs, 2)
    spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1), exclude_hosts=["hosts/h1"])
    node = stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec, node_id="n1"))
    assert node.host == "hosts/h2"
    assert list(node.spec.exclude_hosts) == ["hosts/h1"]
    spec.exclude_hosts.append("hosts/h2")
    with pytest.raises(grpc.RpcError) as raised:
        stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec, node_id="n2"))
    error = raised.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "off 2 excluded hosts" in error.details()  # type: ignore[attr-defined]
    assert "hosts: 2 of 2 excluded by the request" in error.details()  # type: ignore[attr-defined]


def test_switch_affinity_composes_from_one_rack_or_says_why_not(
    stubs: Stubs, sim_pool: SimPool
) -> None:
    register_sim_box(sim_pool, stubs, "a1", gpus=2, rack="r1")
    register_sim_box(sim_pool, stubs, "b1", gpus=2, rack="r2")
    register_sim_box(sim_pool, stubs, "b2", gpus=2, rack="r2")
    sim_pool.start_agent("h1", rack="r1")
    wait_hosts_alive(stubs, 1)
    spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=3), affinity=pb.GPU_AFFINITY_SWITCH)
    plan = stubs.nodes.PlanNode(nodes_pb2.ComposeNodeRequest(spec=spec))
    assert plan.hosts[0].reasons[0].endswith("(nearest-switch s1/p1/r2)")
    node = stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec, node_id="n1"))
    assert node.spec.affinity == pb.GPU_AFFINITY_SWITCH
    assert sorted(b.gpu.split("/gpus/")[0] for b in node.gpus) == [
        "boxes/b1",
        "boxes/b1",
        "boxes/b2",
    ]
    with pytest.raises(grpc.RpcError) as raised:  # r2 has one GPU left, r1 two
        stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec, node_id="n2"))
    error = raised.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "from one rack switch" in error.details()  # type: ignore[attr-defined]
    assert "at most 2 free H100 under one rack switch (s1/p1/r1" in error.details()  # type: ignore[attr-defined]
    assert error_info(error).reason == "NO_CAPACITY"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (pb.NodeSpec(affinity=7), "spec.affinity 7 is not a GpuAffinity"),
        (pb.NodeSpec(max_gpus_per_box=-1), "spec.max_gpus_per_box -1 is out of range"),
        (
            pb.NodeSpec(affinity=pb.GPU_AFFINITY_BOX, max_gpus_per_box=1),
            "contradicts affinity box",
        ),
        (pb.NodeSpec(host_selector={"": "prod"}), "spec.host_selector has an empty key"),
        (pb.NodeSpec(cpu_cores=-1), "spec.cpu_cores -1 is out of range"),
        (pb.NodeSpec(host_memory_mib=2**60), "spec.host_memory_mib 1152921504606846976 is out"),
        (pb.NodeSpec(exclude_hosts=["h1"]), "spec.exclude_hosts: 'h1' is not a host name"),
        (pb.NodeSpec(exclude_hosts=["hosts/h 1"]), "invalid host name 'hosts/h 1'"),
        (
            pb.NodeSpec(exclude_hosts=[f"hosts/h{i}" for i in range(129)]),
            "spec.exclude_hosts names 129 hosts: exclude at most 128",
        ),
    ],
)
def test_bad_affinity_or_spread_is_invalid_argument(
    stubs: Stubs, spec: pb.NodeSpec, message: str
) -> None:
    spec.gpus.CopyFrom(pb.GpuRequest(model="H100", count=2))
    with pytest.raises(grpc.RpcError) as raised:
        stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec))
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert message in error.details()  # type: ignore[attr-defined]


def test_plan_node_still_answers_an_older_client_sending_a_compose_request(
    stubs: Stubs, broker: BrokerServer
) -> None:
    """PlanNode took ComposeNodeRequest before it had a request of its own; the spec
    kept its field number, so an older client's bytes still plan."""
    add_box(stubs, "box1", gpus=2)
    with grpc.insecure_channel(broker.endpoint) as channel:
        older = channel.unary_unary(
            "/dxpool.v1.NodeService/PlanNode",
            request_serializer=nodes_pb2.ComposeNodeRequest.SerializeToString,
            response_deserializer=nodes_pb2.NodePlan.FromString,
        )
        plan = older(
            nodes_pb2.ComposeNodeRequest(
                spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)),
                node_id="n1",
                request_id="r1",
            ),
            timeout=60,
        )
    assert not plan.host and plan.unsatisfied  # no host registered: nothing fits
