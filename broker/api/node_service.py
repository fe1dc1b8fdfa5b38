"""NodeService: compose, plan, get, list, release and watch virtual nodes, and hand a
node's GPUs to a VM (libvirt ``<hostdev>`` XML, :mod:`dxpool.broker.api.hostdev`).

WatchNodes streams come from a :class:`~dxpool.broker.api.node_watch.NodeFeed`: coalesced per
node, resumable by revision, and never able to block a compose or the cache's watch.
How many run at once is the broker's stream budget (``broker/api/streams.py``).

With authentication on, a tenant is scoped to its own nodes (``VirtualNode.owner``, set
at compose): another owner's node is NOT_FOUND to it (Get, Release, a named Watch),
missing from its listings, and absent from its watch. Operators see every node. Which
roles may call at all is ``broker/api/auth.py``'s table.

A tenant's nodes are charged to it: ComposeNode sets ``spec.tenant`` to the caller's
tenant name (naming another is refused by the table), so its quota applies whatever the
request said; an operator may charge a node to a tenant by naming it. SetTenantQuota,
GetTenant and ListTenants read and set quotas and usage (:mod:`dxpool.broker.nodes.tenants`).
ComposeGang charges every member to the caller's tenant the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.auth import owner_scope
from dxpool.broker.api.hostdev import node_hostdev
from dxpool.broker.api.node_watch import NodeFeed, WatchSettings
from dxpool.broker.api.rpc import handler, stream_handler
from dxpool.broker.api.sharing import Sharing
from dxpool.broker.nodes.compose import Composer
from dxpool.broker.nodes.tenants import Tenants
from dxpool.broker.nodes.validation import check_page_size
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.pages import cache_page, check_page_token
from dxpool.errors import InvalidArgument, NotFound
from dxpool.identity import Identity, Role
from dxpool.names import parse_host, parse_node
from dxpool.selector import parse_selector
from dxpool.store.typed import Versioned

Identify = Callable[[grpc.ServicerContext], Identity]


def _not_found(name: str) -> NotFound:
    return NotFound(
        f"node {name} does not exist; list nodes with `dxpool node list`",
        reason="NODE_NOT_FOUND",
    )


class NodeService(nodes_pb2_grpc.NodeServiceServicer):
    """``identify`` names the caller when authentication is on (None: it is off, and
    every caller sees every node)."""

    def __init__(
        self,
        composer: Composer,
        cache: Cache,
        watch: WatchSettings | None = None,
        *,
        identify: Identify | None = None,
        sharing: Sharing | None = None,
    ) -> None:
        self._composer = composer
        self._sharing = sharing
        self._gangs = composer.gangs()
        self._resizer = composer.resizer()
        self._tenants = Tenants(composer.store, cache)
        self._cache = cache
        self._identify = identify
        self.feed = NodeFeed(cache, watch, lookup=composer.lookup_node)

    def _caller(self, context: grpc.ServicerContext) -> Identity | None:
        return self._identify(context) if self._identify is not None else None

    def _scope(self, context: grpc.ServicerContext) -> str | None:
        """The owner this caller is limited to; None: every node."""
        return owner_scope(self._caller(context))

    def close(self) -> None:
        """End every watch (UNAVAILABLE, so clients re-watch); returns at once."""
        self.feed.close()

    @handler("NodeService.ComposeNode")
    def ComposeNode(
        self, request: nodes_pb2.ComposeNodeRequest, context: grpc.ServicerContext
    ) -> pb.VirtualNode:
        caller = self._caller(context)
        charged = _charged_to_caller(request, caller)
        owner = caller.uri if caller else ""
        if self._sharing is not None:
            return self._sharing.composer.compose(charged, owner=owner)
        return self._composer.compose(charged, owner=owner)

    @handler("NodeService.PlanNode")
    def PlanNode(
        self, request: nodes_pb2.PlanNodeRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.NodePlan:
        compose = nodes_pb2.ComposeNodeRequest(spec=request.spec)
        charged = _charged_to_caller(compose, self._caller(context))
        if self._sharing is not None:
            return self._sharing.planner.plan(charged)
        return self._composer.plan(charged)

    @handler("NodeService.SetTenantQuota")
    def SetTenantQuota(
        self, request: nodes_pb2.SetTenantQuotaRequest, context: grpc.ServicerContext
    ) -> pb.Tenant:
        return self._tenants.set_quota(request.name, request.quota)

    @handler("NodeService.GetTenant")
    def GetTenant(
        self, request: nodes_pb2.GetTenantRequest, context: grpc.ServicerContext
    ) -> pb.Tenant:
        return self._tenants.get(request.name)

    @handler("NodeService.ListTenants")
    def ListTenants(
        self, request: nodes_pb2.ListTenantsRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.ListTenantsResponse:
        tenants, token = self._tenants.list(request.page_size, check_page_token(request.page_token))
        return nodes_pb2.ListTenantsResponse(tenants=tenants, next_page_token=token)

    @handler("NodeService.DeleteTenant")
    def DeleteTenant(
        self, request: nodes_pb2.DeleteTenantRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.DeleteTenantResponse:
        self._tenants.delete(request.name)
        return nodes_pb2.DeleteTenantResponse()

    @handler("NodeService.GetNode")
    def GetNode(
        self, request: nodes_pb2.GetNodeRequest, context: grpc.ServicerContext
    ) -> pb.VirtualNode:
        return self._node(request.name, context)

    @handler("NodeService.GetNodeHostdev")
    def GetNodeHostdev(
        self, request: nodes_pb2.GetNodeHostdevRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.NodeHostdev:
        return node_hostdev(self._node(request.name, context))

    def _node(self, name: str, context: grpc.ServicerContext) -> pb.VirtualNode:
        """The node ``name`` names, read through to etcd on a cache miss; NotFound also
        when the caller is a tenant that does not own it."""
        scope = self._scope(context)
        record = self._composer.lookup_node(parse_node(name))
        if record is None or (scope is not None and record.value.owner != scope):
            raise _not_found(name)
        node = record.value
        return self._sharing.with_position(node) if self._sharing is not None else node

    @handler("NodeService.ListNodes")
    def ListNodes(
        self, request: nodes_pb2.ListNodesRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.ListNodesResponse:
        host = f"hosts/{parse_host(request.host)}" if request.host else ""
        selector = parse_selector(request.label_selector)
        scope = self._scope(context)

        def keep(record: Versioned[pb.VirtualNode]) -> bool:
            node = record.value
            return (
                (request.show_released or node.state != pb.NODE_STATE_RELEASED)
                and (not host or node.host == host)
                and (scope is None or node.owner == scope)
                and selector.matches(node.spec.labels)
            )

        chunk, token = cache_page(
            self._cache.nodes, check_page_size(request.page_size), request.page_token, keep
        )
        nodes = [r.value for _, r in chunk]
        if self._sharing is not None:
            nodes = [self._sharing.with_position(node) for node in nodes]
        return nodes_pb2.ListNodesResponse(nodes=nodes, next_page_token=token)

    @handler("NodeService.ReleaseNode")
    def ReleaseNode(
        self, request: nodes_pb2.ReleaseNodeRequest, context: grpc.ServicerContext
    ) -> pb.VirtualNode:
        return self._composer.release(request.name, force=request.force, owner=self._scope(context))

    @handler("NodeService.ResizeNode")
    def ResizeNode(
        self, request: nodes_pb2.ResizeNodeRequest, context: grpc.ServicerContext
    ) -> pb.VirtualNode:
        try:
            return self._resizer.resize(request, owner=self._scope(context))
        finally:
            self._composer.between_decisions()  # the collector's turn, as after a compose

    @handler("NodeService.ComposeGang")
    def ComposeGang(
        self, request: nodes_pb2.ComposeGangRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.Gang:
        caller = self._caller(context)
        charged = _gang_charged_to_caller(request, caller)
        owner = caller.uri if caller else ""
        try:
            if self._sharing is not None:
                return self._sharing.compose_gang(charged, owner, self._gangs)
            return self._gangs.compose(charged, owner=owner)
        finally:
            self._composer.between_decisions()  # the collector's turn, as after a compose

    @handler("NodeService.GetGang")
    def GetGang(
        self, request: nodes_pb2.GetGangRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.Gang:
        if self._sharing is not None:
            return self._sharing.get_gang(request.name, self._scope(context), self._gangs)
        return self._gangs.get(request.name, owner=self._scope(context))

    @handler("NodeService.ReleaseGang")
    def ReleaseGang(
        self, request: nodes_pb2.ReleaseGangRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.Gang:
        if self._sharing is not None:
            return self._sharing.release_gang(
                request.name, request.force, self._scope(context), self._gangs
            )
        return self._gangs.release(request.name, force=request.force, owner=self._scope(context))

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
        scope = self._scope(context)
        events = self.feed.watch(only, request.start_revision, context)
        if self._sharing is not None:
            events = self._sharing.events_with_position(events)
        if scope is None:
            yield from events
            return
        if only is not None:
            record = self._composer.lookup_node(only)
            if record is not None and record.value.owner != scope:
                raise _not_found(request.name)
        yield from _owned_events(events, scope)

    @handler("NodeService.ListQueue")
    def ListQueue(
        self, request: nodes_pb2.ListQueueRequest, context: grpc.ServicerContext
    ) -> nodes_pb2.ListQueueResponse:
        if self._sharing is None:
            return nodes_pb2.ListQueueResponse()
        return self._sharing.list_queue(request, self._scope(context))


def _charged_to_caller(
    request: nodes_pb2.ComposeNodeRequest, caller: Identity | None
) -> nodes_pb2.ComposeNodeRequest:
    """``request`` charged to the caller's tenant when the caller is a tenant (the
    authorization table has refused a request naming another); unchanged otherwise."""
    if caller is None or caller.role is not Role.TENANT or request.spec.tenant == caller.name:
        return request
    charged = nodes_pb2.ComposeNodeRequest()
    charged.CopyFrom(request)
    charged.spec.tenant = caller.name
    return charged


def _gang_charged_to_caller(
    request: nodes_pb2.ComposeGangRequest, caller: Identity | None
) -> nodes_pb2.ComposeGangRequest:
    """``request`` with every member charged to the caller's tenant when the caller is a
    tenant (the authorization table has refused a request naming another), as
    :func:`_charged_to_caller` does for one node; unchanged otherwise."""
    if caller is None or caller.role is not Role.TENANT:
        return request
    if all(spec.tenant == caller.name for spec in request.members):
        return request
    charged = nodes_pb2.ComposeGangRequest()
    charged.CopyFrom(request)
    for spec in charged.members:
        spec.tenant = caller.name
    return charged


def _owned_events(
    events: Iterator[nodes_pb2.NodeEvent], owner: str
) -> Iterator[nodes_pb2.NodeEvent]:
    """The events of ``owner``'s nodes (and every SYNCED mark, which carries no node).

    A deletion carries only the node's name, so it is passed on for nodes this stream
    has shown as ``owner``'s; a deletion of an owned node that this stream never showed
    (one resumed after the node was RELEASED and before it was collected) is not sent.
    """
    shown: set[str] = set()
    for event in events:
        if event.type == nodes_pb2.NodeEvent.TYPE_SYNCED:
            yield event
        elif event.type == nodes_pb2.NodeEvent.TYPE_DELETED:
            if event.node.name in shown:
                shown.discard(event.node.name)
                yield event
        elif event.node.owner == owner:
            shown.add(event.node.name)
            yield event
