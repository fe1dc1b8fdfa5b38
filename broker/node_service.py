"""NodeService: compose, plan, get, list, release and watch virtual nodes, and hand a
node's GPUs to a VM (libvirt ``<hostdev>`` XML, :mod:`dxpool.broker.hostdev`).

WatchNodes streams come from a :class:`~dxpool.broker.node_watch.NodeFeed`: coalesced per
node, resumable by revision, and never able to block a compose or the cache's watch.
How many run at once is the broker's stream budget (``broker/streams.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.cache import Cache
from dxpool.broker.compose import Composer
from dxpool.broker.hostdev import node_hostdev
from dxpool.broker.node_watch import NodeFeed, WatchSettings
from dxpool.broker.rpc import cache_page, handler, stream_handler
from dxpool.broker.validation import check_page_size
from dxpool.errors import InvalidArgument, NotFound
from dxpool.names import parse_host, parse_node
from dxpool.store import keys as k
from dxpool.store.typed import Versioned


class NodeService(nodes_pb2_grpc.NodeServiceServicer):
    def __init__(
        self, composer: Composer, cache: Cache, watch: WatchSettings | None = None
    ) -> None:
        self._composer = composer
        self._cache = cache
        self.feed = NodeFeed(cache, watch, lookup=composer.lookup)

    def close(self) -> None:
        """End every watch (UNAVAILABLE, so clients re-watch); returns at once."""
        self.feed.close()

    @handler("NodeService.ComposeNode")
    def ComposeNode(
        self, request: nodes_pb2.ComposeNodeRequest, context: grpc.ServicerContext
    ) -> pb.VirtualNode:
        return self._composer.compose(request)

    @handler("NodeService.PlanNode")
    def PlanNode(
        self, request: nodes_pb2.ComposeNodeRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.NodePlan:
        return self._composer.plan(request)

    @handler("NodeService.GetNode")
    def GetNode(
        self, request: nodes_pb2.GetNodeRequest, context: grpc.ServicerContext
    ) -> pb.VirtualNode:
        return self._node(request.name)

    @handler("NodeService.GetNodeHostdev")
    def GetNodeHostdev(
        self, request: nodes_pb2.GetNodeHostdevRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.NodeHostdev:
        return node_hostdev(self._node(request.name))

    def _node(self, name: str) -> pb.VirtualNode:
        """The node ``name`` names, read through to etcd on a cache miss; NotFound."""
        record = self._composer.lookup(k.NODES, parse_node(name))
        if record is None:
            raise NotFound(
                f"node {name} does not exist; list nodes with `dxpool node list`",
                reason="NODE_NOT_FOUND",
            )
        node: pb.VirtualNode = record.value
        return node

    @handler("NodeService.ListNodes")
    def ListNodes(
        self, request: nodes_pb2.ListNodesRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.ListNodesResponse:
        host = f"hosts/{parse_host(request.host)}" if request.host else ""

        def keep(record: Versioned[pb.VirtualNode]) -> bool:
            node = record.value
            return (request.show_released or node.state != pb.NODE_STATE_RELEASED) and (
                not host or node.host == host
            )

        chunk, token = cache_page(
            self._cache, k.NODES, check_page_size(request.page_size), request.page_token, keep
        )
        nodes = [r.value for _, r in chunk]
        return nodes_pb2.ListNodesResponse(nodes=nodes, next_page_token=token)

    @handler("NodeService.ReleaseNode")
    def ReleaseNode(
        self, request: nodes_pb2.ReleaseNodeRequest, context: grpc.ServicerContext
    ) -> pb.VirtualNode:
        return self._composer.release(request.name, force=request.force)

    @stream_handler("NodeService.WatchNodes")
    def WatchNodes(
        self, request: nodes_pb2.WatchNodesRequest, context: grpc.ServicerContext
    ) -> Iterator[nodes_pb2.NodeEvent]:
        only = parse_node(request.name) if request.name else None
        if request.start_revision < 0:
            raise InvalidArgument(
                f"invalid start_revision {request.start_revision}: pass 0 to start with a "
                "listing, or the revision of the last event handled on an earlier watch",
                reason="INVALID_REVISION",
            )
        yield from self.feed.watch(only, request.start_revision, context)
