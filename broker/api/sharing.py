"""What NodeService asks of the pool's sharing: queued composes, the queue's order and
positions, and gangs with a record.

One object built by the broker (``BrokerServer``) from the parts in their own modules:
the queue index (:mod:`dxpool.broker.state.queue_index`), queued composes
(:mod:`dxpool.broker.nodes.enqueue`), plans that show preemption and quota
(:mod:`dxpool.broker.control.planning`) and gangs committed in chunks
(:mod:`dxpool.broker.nodes.gang_chunks`). NodeService stays a thin layer over it.
"""

from __future__ import annotations

from collections.abc import Iterator

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.planning import Planner
from dxpool.broker.nodes.compose_gate import ComposeGate
from dxpool.broker.nodes.enqueue import QueuedComposer
from dxpool.broker.nodes.gang import GangComposer
from dxpool.broker.nodes.gang_chunks import ChunkedGangs
from dxpool.broker.nodes.validation import check_page_size, check_text
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.pages import check_page_token, page
from dxpool.broker.state.queue_index import QueueIndex
from dxpool.errors import InvalidArgument
from dxpool.limits import MAX_TENANT
from dxpool.names import ID_PATTERN, ID_RULE, parse_gang, parse_node


class Sharing:
    """The queue, queued composes and gangs with a record, for NodeService. Thread-safe."""

    def __init__(
        self,
        cache: Cache,
        queue: QueueIndex,
        composer: QueuedComposer,
        gangs: ChunkedGangs,
        gate: ComposeGate,
        planner: Planner,
    ) -> None:
        self._cache = cache
        self.queue = queue
        self.composer = composer
        self.gangs = gangs
        self._gate = gate
        self.planner = planner

    def compose_gang(
        self, request: nodes_pb2.ComposeGangRequest, owner: str, small: GangComposer
    ) -> nodes_pb2.Gang:
        """A gang with a record (queued, options, or too large for one transaction), or
        else a small one committed at once by ``small``, after the gate's checks."""
        if ChunkedGangs.needs_record(request):
            return self.gang_with_position(self.gangs.compose(request, owner))
        if request.members:
            first = request.members[0]
            self._gate.check(first, sum(spec.gpus.count for spec in request.members))
        return small.compose(request, owner)

    def get_gang(self, name: str, owner: str | None, small: GangComposer) -> nodes_pb2.Gang:
        if self.gangs.has_record(name):
            return self.gang_with_position(self.gangs.get(name, owner=owner))
        return small.get(name, owner=owner)

    def release_gang(
        self, name: str, force: bool, owner: str | None, small: GangComposer
    ) -> nodes_pb2.Gang:
        if self.gangs.has_record(name):
            return self.gangs.release(name, force=force, owner=owner)
        return small.release(name, force=force, owner=owner)

    def with_position(self, node: pb.VirtualNode) -> pb.VirtualNode:
        """``node`` with ``queue.position`` filled in when it is QUEUED (a copy; records
        from the cache are shared and never changed)."""
        if node.state != pb.NODE_STATE_QUEUED:
            return node
        shown = pb.VirtualNode()
        shown.CopyFrom(node)
        shown.queue.position = self.queue.position(node.name)
        return shown

    def gang_with_position(self, gang: nodes_pb2.Gang) -> nodes_pb2.Gang:
        if gang.state != pb.GANG_STATE_QUEUED:
            return gang
        shown = nodes_pb2.Gang()
        shown.CopyFrom(gang)
        shown.queue.position = self.queue.position(gang.name)
        return shown

    def events_with_position(
        self, events: Iterator[nodes_pb2.NodeEvent]
    ) -> Iterator[nodes_pb2.NodeEvent]:
        """Watch events whose QUEUED nodes carry their position as of the event."""
        for event in events:
            if event.HasField("node") and event.node.state == pb.NODE_STATE_QUEUED:
                shown = nodes_pb2.NodeEvent()
                shown.CopyFrom(event)
                shown.node.queue.position = self.queue.position(event.node.name)
                yield shown
            else:
                yield event

    def list_queue(
        self, request: nodes_pb2.ListQueueRequest, owner: str | None
    ) -> nodes_pb2.ListQueueResponse:
        """One page of the queue in order; ``owner`` set (a tenant's call): its own
        requests only, with their positions in the whole queue."""
        size = check_page_size(request.page_size)
        token = check_page_token(request.page_token)
        check_text(request.tenant, "tenant", MAX_TENANT)
        if request.tenant and not ID_PATTERN.fullmatch(request.tenant):
            raise InvalidArgument(
                f"invalid tenant {request.tenant!r}: a tenant id is {ID_RULE}, or leave it "
                "empty for every tenant",
                reason="INVALID_NAME",
            )
        entries: list[tuple[str, nodes_pb2.QueueEntry]] = []
        for position, waiting in enumerate(self.queue.ordered(), start=1):
            if request.tenant and waiting.tenant != request.tenant:
                continue
            entry = self._entry(waiting.name, position, owner)
            if entry is not None:
                entries.append((f"{position:09d}", entry))
        chunk, next_token = page(entries, size, token)
        return nodes_pb2.ListQueueResponse(entries=chunk, next_page_token=next_token)

    def _entry(self, name: str, position: int, owner: str | None) -> nodes_pb2.QueueEntry | None:
        if name.startswith("gangs/"):
            record = self._cache.gangs.get(parse_gang(name))
            if record is None or (owner is not None and record.value.owner != owner):
                return None
            gang = record.value
            first = gang.members[0] if gang.members else pb.NodeSpec()
            gpus = (
                first.gpus.count * gang.size
                if len(gang.members) == 1
                else sum(spec.gpus.count for spec in gang.members)
            )
            status = pb.QueueStatus()
            status.CopyFrom(gang.queue)
            status.position = position
            return nodes_pb2.QueueEntry(
                name=name, tenant=first.tenant, priority=first.priority, gpus=gpus, queue=status
            )
        node_record = self._cache.nodes.get(parse_node(name))
        if node_record is None or (owner is not None and node_record.value.owner != owner):
            return None
        node = node_record.value
        status = pb.QueueStatus()
        status.CopyFrom(node.queue)
        status.position = position
        return nodes_pb2.QueueEntry(
            name=name,
            tenant=node.spec.tenant,
            priority=node.spec.priority,
            gpus=node.spec.gpus.count,
            queue=status,
        )


__all__ = ["Sharing"]
