"""Helpers for the tests of streams: node records written straight into etcd, stalled
clients, and reading a watch into a view.

Node changes are written into etcd directly (many per transaction) rather than through
ComposeNode: the broker's cache watch applies them exactly as it applies a compose from
another broker, thousands per second, with no agent involved. The node controller leaves
READY and RELEASED nodes alone, so these records change only when a test changes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import grpc

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.node_watch import NodeFeed, WatcherInfo
from dxpool.broker.api.server import BrokerServer
from dxpool.records import timestamp
from dxpool.store.keys import KeySchema
from tests.patience import patient

# A client channel whose receive window stays at HTTP/2's 64 KiB (no BDP probing), so a
# client that stops reading blocks the broker's sends after a few events.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]
_BATCH_BYTES = 1_000_000  # etcd refuses requests over 1.5 MiB


def node(
    name: str, state: int = pb.NODE_STATE_READY, *, size: int = 0, note: str = ""
) -> pb.VirtualNode:
    """A node record; ``size`` pads its message to make events that many bytes bigger.

    Stamped now, as the broker stamps every change: the leader's garbage collection
    deletes RELEASED nodes by their update time, and an unset one reads as long ago.
    """
    return pb.VirtualNode(
        name=f"nodes/{name}",
        state=state,
        host="hosts/h1",
        message=note + "x" * size,
        update_time=timestamp(),
    )


def write_nodes(etcd_client, prefix: str, nodes: Iterable[pb.VirtualNode]) -> int:  # type: ignore[no-untyped-def]
    """Put the node records, many per transaction; returns the last revision written."""
    schema = KeySchema(prefix)
    revision = 0
    batch: list[object] = []
    size = 0

    def flush() -> None:
        nonlocal revision, batch, size
        if batch:
            _, responses = etcd_client.transaction(compare=[], success=batch, failure=[])
            revision = max(revision, int(responses[0].response_put.header.revision))
        batch, size = [], 0

    for record in nodes:
        raw = record.SerializeToString()
        if size + len(raw) > _BATCH_BYTES or len(batch) >= 100:
            flush()
        batch.append(
            etcd_client.transactions.put(schema.node(record.name.removeprefix("nodes/")), raw)
        )
        size += len(raw)
    flush()
    return revision


def fill_window(  # type: ignore[no-untyped-def]
    etcd_client, prefix: str, names: Callable[[int], list[str]], until: Callable[[], object]
) -> None:
    """Write rounds of big changes (80 KiB, more than a stalled client's window) until
    ``until()``: e.g. the broker's send to a stalled watcher has been blocked a while."""
    round_ = 0

    def done() -> object:
        nonlocal round_
        if until():
            return True
        batch = [node(n, size=8192, note=f"r{round_}") for n in names(round_)]
        write_nodes(etcd_client, prefix, batch)
        round_ += 1
        return False

    wait_for(done, 15, "the send to the stalled watcher to block")


def delete_nodes(etcd_client, prefix: str, names: Iterable[str]) -> int:  # type: ignore[no-untyped-def]
    """Delete node records in one transaction; returns its revision."""
    schema = KeySchema(prefix)
    ops = [etcd_client.transactions.delete(schema.node(n)) for n in names]
    _, responses = etcd_client.transaction(compare=[], success=ops, failure=[])
    return int(responses[0].response_delete_range.header.revision)


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> object:
    timeout_s = patient(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {predicate()!r}")


def settle(broker: BrokerServer, revision: int, timeout_s: float = 10) -> None:
    """Wait until the broker has applied (and told its watchers) everything up to ``revision``."""
    wait_for(lambda: broker.cache.notified_revision >= revision, timeout_s, f"revision {revision}")


def blocked_watchers(feed: NodeFeed, at_least_s: float) -> list[WatcherInfo]:
    """Watches whose send has waited for the client at least ``at_least_s``."""
    return [w for w in feed.watchers() if w.sending_s >= at_least_s]


class View:
    """What a watcher knows: node id -> node, applied from events as the protocol says."""

    def __init__(self) -> None:
        self.nodes: dict[str, pb.VirtualNode] = {}
        self.revision = 0
        self.listing: dict[str, pb.VirtualNode] | None = None
        self.synced = 0
        self.resets = 0

    def apply(self, event: nodes_pb2.NodeEvent) -> None:
        kind = nodes_pb2.NodeEvent
        self.revision = event.revision
        if event.type == kind.TYPE_EXISTING:
            if self.listing is None:
                self.listing = {}
            self.listing[event.node.name] = event.node
        elif event.type == kind.TYPE_SYNCED:
            self.synced += 1
            if event.reset:
                self.resets += 1
                self.nodes = self.listing or {}
            self.listing = None
        elif event.type == kind.TYPE_DELETED:
            self.nodes.pop(event.node.name, None)
        else:
            self.nodes[event.node.name] = event.node

    def apply_all(
        self, events: Iterator[nodes_pb2.NodeEvent], until: Callable[[View], bool]
    ) -> None:
        for event in events:
            self.apply(event)
            if until(self):
                return


def listed(stub: nodes_pb2_grpc.NodeServiceStub) -> dict[str, pb.VirtualNode]:
    """Every node the broker holds, RELEASED ones included."""
    response = stub.ListNodes(nodes_pb2.ListNodesRequest(page_size=1000, show_released=True))
    assert not response.next_page_token
    return {n.name: n for n in response.nodes}


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call succeeded")


def realistic_node(name: str, note: str = "") -> pb.VirtualNode:
    """A node of eight GPUs, about the size of a real record."""
    record = pb.VirtualNode(
        name=f"nodes/{name}",
        host="hosts/h1",
        state=pb.NODE_STATE_READY,
        message=note,
        request_id=f"request-{name}",
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=8), tenant="tenant-a"),
    )
    for slot in range(8):
        record.gpus.add(
            gpu=f"boxes/box1/gpus/{slot}",
            model="H100",
            host_slot=slot,
            bdf=f"0000:{slot + 0x40:02x}:00.0",
            latency_ns=3000,
        )
    return record


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB."""
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: SIM115
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")
