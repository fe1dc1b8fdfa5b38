"""ComposeNode with ``queue``: compose now if the node fits, else wait in the queue.

A queued compose first goes the ordinary way (:meth:`Composer.compose`): a node that fits
now is placed now. When it is refused for a reason that time can cure (no capacity, the
tenant's quota full for now, lending paused while an owner reclaims), the node is
committed in state QUEUED instead: a node record with no host and no GPUs, its
``queue`` saying when it was queued, until when it may wait and why. The request id and
the node name behave as for any compose (a retry returns the same node, QUEUED or
later), and releasing the node cancels the request. The leading broker's dispatcher
(:mod:`dxpool.broker.control.dispatcher`) places and commits it later, in queue order
(:mod:`dxpool.broker.state.queue_order`).

A request its tenant's quota could never hold, whatever the tenant releases (more GPUs
than ``quota.gpus``, say), is refused at once rather than left waiting forever; so is a
model no GPU in the pool has (FAILED_PRECONDITION), an unknown host, a malformed request.

The queued node remembers the ``uid`` of its tenant's record (the enqueue gives a record
one if it has none, or creates the record): a tenant deleted while the request waits
(and perhaps created anew) is told apart from the tenant that queued it, so the request
fails instead of being charged to a stranger (:mod:`dxpool.broker.nodes.admission`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from dxpool import lifecycle
from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.compose import Composer
from dxpool.broker.nodes.compose_gate import ComposeGate
from dxpool.broker.nodes.tenants import breach, new_tenant
from dxpool.broker.nodes.validation import check_node_spec, check_queue_timeout
from dxpool.broker.state.records import copy, timestamp
from dxpool.broker.state.stm import TxnView, transact
from dxpool.errors import AlreadyExists, ResourceExhausted
from dxpool.limits import MAX_TEXT
from dxpool.names import check_id, check_request_id, node_name
from dxpool.store import keys as k

WAITABLE = frozenset({"NO_CAPACITY", "QUOTA_EXCEEDED", "LENDING_PAUSED"})
"""Refusals a queued request waits out instead of answering."""


def short(text: str, limit: int = MAX_TEXT * 2) -> str:
    """``text`` cut to ``limit`` characters (a queue reason is shown in lists)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def never_fits(
    tenant_id: str, record: pb.Tenant | None, spec_models: list[str], nodes: int
) -> ResourceExhausted | None:
    """The quota refusal a request would get even if its tenant held nothing: a request
    that can never be served under the quota as it is (None when it can)."""
    if record is None or not record.HasField("quota"):
        return None
    empty = pb.Tenant()
    empty.CopyFrom(record)
    empty.usage.Clear()
    return breach(tenant_id, empty, spec_models, nodes=nodes)


class QueuedComposer:
    """ComposeNode, queued when asked to (see the module docstring). Thread-safe."""

    def __init__(
        self, composer: Composer, gate: ComposeGate, clock: Callable[[], float] = time.time
    ) -> None:
        self._composer = composer
        self._gate = gate
        self._clock = clock

    def compose(self, request: nodes_pb2.ComposeNodeRequest, owner: str = "") -> pb.VirtualNode:
        """The node composed now, or (with ``queue``) QUEUED when it does not fit now."""
        check_queue_timeout(request.queue, request.queue_timeout_s)
        check_node_spec(request.spec)
        try:
            self._gate.check(request.spec, request.spec.gpus.count)
            return self._composer.compose(request, owner)
        except ResourceExhausted as error:
            if not request.queue or error.reason not in WAITABLE:
                raise
            if error.reason == "QUOTA_EXCEEDED":
                self._refuse_hopeless(request.spec, error)
            return self._enqueue(request, owner, error.message)

    def _refuse_hopeless(self, spec: pb.NodeSpec, error: ResourceExhausted) -> None:
        record = self._gate.tenant(spec.tenant)
        hopeless = never_fits(spec.tenant, record, [spec.gpus.model] * spec.gpus.count, 1)
        if hopeless is not None:
            raise ResourceExhausted(
                f"{hopeless.message}. The request can never fit this quota, so it is not queued",
                reason="QUOTA_EXCEEDED",
                metadata=dict(hopeless.metadata),
            ) from error

    def _enqueue(
        self, request: nodes_pb2.ComposeNodeRequest, owner: str, why: str
    ) -> pb.VirtualNode:
        check_request_id(request.request_id)
        if request.node_id:
            check_id(request.node_id, "node")
        node_id = request.node_id or f"node-{secrets.token_hex(4)}"
        spec = request.spec
        tenant_id = spec.tenant

        def body(view: TxnView) -> pb.VirtualNode:
            if request.request_id:
                used = view.requests.get(request.request_id)
                existing = self._composer.node_for_request(request.request_id, spec, used, owner)
                if existing is not None:
                    return existing
            if view.nodes.get(node_id) is not None:
                raise AlreadyExists(
                    f"node nodes/{node_id} already exists; pick another node_id or omit it",
                    reason="NODE_EXISTS",
                )
            now = self._clock()
            node = pb.VirtualNode(
                name=node_name(node_id),
                spec=spec,
                state=pb.NODE_STATE_QUEUED,
                message=short(f"waiting in the queue: {why}"),
                request_id=request.request_id,
                create_time=timestamp(now),
                update_time=timestamp(now),
                owner=owner,
            )
            node.queue.enqueue_time.CopyFrom(timestamp(now))
            node.queue.reason = short(why)
            if request.queue_timeout_s:
                node.queue.deadline.CopyFrom(timestamp(now + request.queue_timeout_s))
            if tenant_id:
                node.queue.tenant_uid = self._tenant_uid(view, tenant_id)
            lifecycle.new_node_event(node, now)
            view.put(k.NODES, node_id, node)
            if request.request_id:
                view.put(k.REQUESTS, request.request_id, node.name)
            return node

        return transact(
            self._composer.store,
            self._composer.cache,
            body,
            what=f"queueing nodes/{node_id}",
            audited=True,
        )

    def _tenant_uid(self, view: TxnView, tenant_id: str) -> str:
        """The uid of the tenant's record, giving the record one (or creating it) in
        this transaction when it has none. A record with a uid is read from the cache
        without a compare: a deletion meanwhile is caught at admission by the uid."""
        cached = self._composer.cache.tenants.get(tenant_id)
        if cached is not None and cached.value.uid:
            return str(cached.value.uid)
        record = view.tenants.get(tenant_id)
        tenant = copy(record.value) if record is not None else new_tenant(tenant_id)
        if not tenant.uid:
            tenant.uid = new_tenant(tenant_id).uid
        view.put(k.TENANTS, tenant_id, tenant)
        return str(tenant.uid)


__all__ = ["WAITABLE", "QueuedComposer", "never_fits", "short"]
