"""How many bytes a request to each method may have, checked before it is decoded.

A request costs the broker in proportion to its size: gRPC core buffers it, Python copies
it, protobuf decodes it, validation walks it, and whatever is recorded of it goes to
etcd. With gRPC's default limit (4 MiB for every method) four clients sending requests
of a few megabytes slowed every other client by seconds, though every one of their
requests was refused. So each method takes what it needs and no more:

* ``grpc.max_receive_message_length`` (the server's option) is the largest limit of the
  table, :data:`SERVER_MAX_RECEIVE_BYTES`: gRPC core refuses anything larger from the
  message's length prefix with RESOURCE_EXHAUSTED, before Python sees a byte of it.
* :func:`limit_for` gives each method's own limit; the request guard
  (:mod:`~dxpool.broker.api.decoding`) compares the raw payload's length with it before the
  payload is decoded and refuses a larger one with RESOURCE_EXHAUSTED, reason
  ``REQUEST_TOO_LARGE``. Nothing about such a call is recorded (it is counted in
  ``dxpool_rpc_oversized_total{method}``).

Each limit is the largest request the validation rules (:mod:`dxpool.limits`) accept,
with every text in ASCII, rounded up to a power of two; a test builds that request for
every method and checks that it fits. A request whose texts are long *and* mostly
multi-byte characters can be valid field by field and still too large: the error says
by how much.

=======================  =========  ====================================================
method                   limit      what fills it
=======================  =========  ====================================================
ComposeGang              1 MiB      31 members of the largest specs (30 KiB), or the
                                    most members (4096) of ordinary specs (a model, a
                                    count, a tenant, a few short labels)
ComposeNode, PlanNode    32 KiB     a spec with 32 labels and 32 host selectors, 63-char
                                    keys and 256-char values, and 128 excluded hosts of
                                    63-char ids (30 KiB)
CreateBox                32 KiB     32 labels (10 KiB) and 64 slot specs (6 KiB)
List{Nodes,Boxes,Hosts}  8 KiB      a 4096-character label selector and a page token
ResizeNode               8 KiB      64 GPU names to remove
SetTenantQuota           8 KiB      64 per-model limits
AgentService.            2 MiB      a host's whole status: 512 attachments with every
ReportStatus                        text at its limit (1.5 MiB) and 1024 round trips
AgentService.Connect     16 KiB     a hello: the host's registration with 32 labels
                                    (11 KiB); each message of the stream
everything else          4 KiB      names, ids, page tokens, a 256-character reason
=======================  =========  ====================================================

The agent service is served on its own port (:mod:`~dxpool.broker.api.agent_server`), so a
host's status, the one request larger than a ComposeGang, raises only that port's
receive limit (:data:`AGENT_SERVER_MAX_RECEIVE_BYTES`), not the API port's.
"""

from __future__ import annotations

from collections.abc import Mapping

from dxpool.api.v1 import agent_pb2, inventory_pb2, nodes_pb2

__all__ = [
    "AGENT_SERVER_MAX_RECEIVE_BYTES",
    "DEFAULT_MAX_REQUEST_BYTES",
    "MAX_REQUEST_BYTES",
    "SERVER_MAX_RECEIVE_BYTES",
    "limit_for",
]

KIB = 1024
DEFAULT_MAX_REQUEST_BYTES = 4 * KIB
"""Any method the table does not name: reads, deletes, health checking, reflection."""

_INVENTORY = inventory_pb2.DESCRIPTOR.services_by_name["InventoryService"].full_name
_NODES = nodes_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name
_AGENT = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name

MAX_REQUEST_BYTES: Mapping[str, int] = {
    f"/{_NODES}/ComposeGang": 1024 * KIB,
    f"/{_NODES}/ComposeNode": 32 * KIB,
    f"/{_NODES}/PlanNode": 32 * KIB,
    f"/{_INVENTORY}/CreateBox": 32 * KIB,
    f"/{_NODES}/ListNodes": 8 * KIB,
    f"/{_INVENTORY}/ListBoxes": 8 * KIB,
    f"/{_INVENTORY}/ListHosts": 8 * KIB,
    f"/{_NODES}/ResizeNode": 8 * KIB,
    f"/{_NODES}/SetTenantQuota": 8 * KIB,
    f"/{_AGENT}/ReportStatus": 2048 * KIB,
    f"/{_AGENT}/Connect": 16 * KIB,
}
"""Methods that need more than :data:`DEFAULT_MAX_REQUEST_BYTES`, by full method path."""

SERVER_MAX_RECEIVE_BYTES = max(
    DEFAULT_MAX_REQUEST_BYTES,
    *(size for method, size in MAX_REQUEST_BYTES.items() if not method.startswith(f"/{_AGENT}/")),
)
"""The API port's ``grpc.max_receive_message_length``: nothing larger reaches Python."""

AGENT_SERVER_MAX_RECEIVE_BYTES = max(
    size for method, size in MAX_REQUEST_BYTES.items() if method.startswith(f"/{_AGENT}/")
)
"""The agent port's ``grpc.max_receive_message_length``."""


def limit_for(method: str, limits: Mapping[str, int] = MAX_REQUEST_BYTES) -> int:
    """The most bytes a request to ``method`` (``/package.Service/Method``) may have."""
    return limits.get(method, DEFAULT_MAX_REQUEST_BYTES)
