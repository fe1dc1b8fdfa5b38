"""Forgetting RELEASED nodes: the record and the request ids that name it, together.

A RELEASED node is kept for the retention period so its request ids stay idempotency
keys; the leader's garbage collection then forgets it (:mod:`dxpool.broker.control.duties`). A
compose that names a node (or a gang whose members are) after a RELEASED one forgets that
node first, as the collection would have, so a name is taken only while its node holds
GPUs or may still come to: deleting a node frees its name, as in Kubernetes. Watchers
see the old node DELETED, then the new one created.
"""

from __future__ import annotations

from collections.abc import Sequence

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.resize import resize_request_value
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.records import seconds
from dxpool.broker.state.stm import TxnView, transact
from dxpool.store import keys as k
from dxpool.store.typed import Store


def forget_released(view: TxnView, node_id: str, *, released_before: float | None = None) -> bool:
    """Delete node ``node_id`` in ``view`` if it is RELEASED (and, with
    ``released_before``, was last updated no later than that), with its request ids
    that still name it; True if it was. A gang's request id names the gang and goes with
    whichever member is forgotten first. Anything else is left as it is."""
    record = view.nodes.get(node_id)
    if record is None or record.value.state != pb.NODE_STATE_RELEASED:
        return False
    node = record.value
    if released_before is not None and seconds(node.update_time) > released_before:
        return False
    view.delete(k.NODES, node_id)
    if node.request_id:
        request = view.requests.get(node.request_id)
        if request is not None and bytes(request.value).decode() in (
            node.name,
            node.gang or node.name,
        ):
            view.delete(k.REQUESTS, node.request_id)
    if node.resize_request_id:
        request = view.requests.get(node.resize_request_id)
        if request is not None and bytes(request.value).decode() == resize_request_value(node.name):
            view.delete(k.REQUESTS, node.resize_request_id)
    return True


def free_released_names(store: Store, cache: Cache, node_ids: Sequence[str]) -> None:
    """Forget those of ``node_ids`` that are RELEASED nodes, in one transaction, so a
    compose can take their names. Names held by nodes in any other state stay taken
    (the compose then answers NODE_EXISTS); a no-op when none is RELEASED."""
    if not any(_released(cache, node_id) for node_id in node_ids):
        return

    def body(view: TxnView) -> None:
        for node_id in node_ids:
            forget_released(view, node_id)

    transact(store, cache, body, what="freeing released node names", operation="forget")


def _released(cache: Cache, node_id: str) -> bool:
    record = cache.nodes.get(node_id)
    return record is not None and record.value.state == pb.NODE_STATE_RELEASED


__all__ = ["forget_released", "free_released_names"]
