"""NodeService: compose, plan, get, list, release and watch virtual nodes."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.cache import Cache
from dxpool.broker.compose import Composer
from dxpool.broker.rpc import handler, page, stream_handler
from dxpool.broker.store import Versioned
from dxpool.broker.validation import check_page_size
from dxpool.errors import NotFound, ResourceExhausted
from dxpool.names import parse_host, parse_node
from dxpool.store import keys as k

MAX_WATCHERS = 64
WATCH_QUEUE = 10_000
_Event = nodes_pb2.NodeEvent


class NodeService(nodes_pb2_grpc.NodeServiceServicer):
    def __init__(self, composer: Composer, cache: Cache) -> None:
        self._composer = composer
        self._cache = cache
        self._watchers = threading.BoundedSemaphore(MAX_WATCHERS)

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
        record = self._cache.get(k.NODES, parse_node(request.name))
        if record is None:
            raise NotFound(
                f"node {request.name} does not exist; list nodes with `dxpool node list`",
                reason="NODE_NOT_FOUND",
            )
        node: pb.VirtualNode = record.value
        return node

    @handler("NodeService.ListNodes")
    def ListNodes(
        self, request: nodes_pb2.ListNodesRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.ListNodesResponse:
        host = f"hosts/{parse_host(request.host)}" if request.host else ""
        items = [
            (name, r.value)
            for name, r in self._cache.items(k.NODES)
            if (request.show_released or r.value.state != pb.NODE_STATE_RELEASED)
            and (not host or r.value.host == host)
        ]
        nodes, token = page(items, check_page_size(request.page_size), request.page_token)
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
        if not self._watchers.acquire(blocking=False):
            raise ResourceExhausted(
                f"the broker serves at most {MAX_WATCHERS} watches at once; retry later",
                reason="TOO_MANY_WATCHES",
            )
        events: queue.Queue[_Event | None] = queue.Queue(WATCH_QUEUE)

        def on_change(collection: str, name: str, record: Versioned[Any] | None) -> None:
            if collection != k.NODES or (only is not None and name != only):
                return
            if record is None:
                event = _Event(type=_Event.TYPE_DELETED, node=pb.VirtualNode(name=f"nodes/{name}"))
            else:
                event = _Event(type=_Event.TYPE_CHANGED, node=record.value)
            try:
                events.put_nowait(event)
            except queue.Full:  # a stalled client: end its watch, it can re-watch
                events.put(None)

        unsubscribe = self._cache.subscribe(on_change)
        context.add_callback(lambda: events.put(None))
        try:
            if only is not None:
                record = self._cache.get(k.NODES, only)
                if record is None:
                    raise NotFound(f"node {request.name} does not exist", reason="NODE_NOT_FOUND")
                yield _Event(type=_Event.TYPE_EXISTING, node=record.value)
            else:
                for _name, record in self._cache.items(k.NODES):
                    yield _Event(type=_Event.TYPE_EXISTING, node=record.value)
            while context.is_active():
                event = events.get()
                if event is None:
                    return
                yield event
        finally:
            unsubscribe()
            self._watchers.release()
