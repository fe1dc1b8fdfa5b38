"""The Python client of the dxpool broker, for VM orchestrators and scripts.

Example::

    from dxpool.client import Client

    with Client() as pool:  # endpoint: $DXPOOL_ENDPOINT, the config file, or 127.0.0.1:8470
        # TLS: Client(tls=ClientTls(ca=..., cert=..., key=...)), or token="..." for a
        # bearer token; by default both come from $DXPOOL_CA/CERT/KEY/TOKEN_FILE or the
        # config file, and with none configured the connection is plaintext.
        node = pool.compose_node("H100:4", max_latency="4us")
        node = pool.wait_for_node(node.name)  # READY, or FailedPrecondition if it FAILED
        ...
        pool.release_node(node.name)

Contracts:

* Methods return the API's protobuf messages (``dxpool.api.v1``); ``list_*`` methods walk
  every page and return one list.
* Resources may be named by short id or full name: ``"h1"`` or ``"hosts/h1"``, ``"box1/3"``
  or ``"boxes/box1/gpus/3"``. A malformed name raises
  :class:`~dxpool.errors.InvalidArgument` before anything is sent.
* A failed call raises the :mod:`dxpool.errors` class of its gRPC code, carrying the
  broker's message and, when the broker sent a ``google.rpc.Status`` with an ``ErrorInfo``,
  its ``reason`` and ``metadata``. Codes without a class raise
  :class:`~dxpool.errors.DxpoolError` whose ``code`` is the gRPC code.
* UNAVAILABLE is retried a bounded number of times with exponential backoff. Retries never
  duplicate work: creating calls carry a ``request_id`` (a fresh uuid4 unless given) that
  the broker deduplicates, cordon/uncordon/release are idempotent, and ``delete_box``
  treats NOT_FOUND on a retry as "an earlier attempt went through".
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Final, TypeVar, Unpack

import grpc
from google.protobuf.descriptor import EnumDescriptor
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    stop_before_delay,
    wait_exponential,
    wait_random,
)

from dxpool import names
from dxpool.api.v1 import (
    audit_pb2,
    audit_pb2_grpc,
    fabric_pb2,
    fabric_pb2_grpc,
    inventory_pb2,
    inventory_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
    resources_pb2,
)
from dxpool.config import resolve_connection, resolve_endpoint
from dxpool.errors import (
    Aborted,
    DxpoolError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    from_code,
    from_rpc_error,
)
from dxpool.hints import connection_hint
from dxpool.lifecycle import NODE_REACHABLE
from dxpool.limits import MAX_GPU_MEMORY_MIB, MAX_GPUS_PER_BOX
from dxpool.node_request import (
    GpusLike,
    NodeRequest,
    NodeRequestChanges,
    gpu_request_proto,
    parse_node_request,
)
from dxpool.request import check_model, parse_gpus
from dxpool.tls import ClientTls

__all__ = [
    "Client",
    "GpuState",
    "Location",
    "LocationLike",
    "NodeState",
    "NodeStateLike",
    "box_name",
    "gang_name",
    "gpu_name",
    "gpu_state",
    "host_name",
    "node_name",
    "node_state",
    "node_state_name",
    "tenant_name",
]

_log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S: Final = 10.0
DEFAULT_MAX_ATTEMPTS: Final = 5
DEFAULT_WAIT_TIMEOUT_S: Final = 120.0
DEFAULT_RECONNECT_TIMEOUT_S: Final = 120.0
"""How long a watch keeps trying to resume while the broker cannot be reached (a
restart on a loaded machine takes seconds; an informer-style consumer wants minutes)."""
_PAGE_SIZE: Final = 500
_CHANNEL_OPTIONS: Final = [
    # Reconnect quickly after a refused connection, so a retry can reach a broker that
    # has just come back instead of failing fast on the channel's backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

Location = resources_pb2.Location
NodeState = resources_pb2.NodeState
GpuState = resources_pb2.GpuState
_GANG_STATE = resources_pb2.GangState
# Gangs with a record that are not composed yet: waited for by wait_for_gang.
_GANG_WAITING = frozenset(
    {
        _GANG_STATE.GANG_STATE_QUEUED,
        _GANG_STATE.GANG_STATE_RESERVING,
        _GANG_STATE.GANG_STATE_ABORTING,
    }
)
LocationLike = Location | tuple[str, str, str]
"""A location as a message or as ``(site, pod, rack)``."""
NodeStateLike = int | str
"""A node state as its enum value or its name: ``NodeState.NODE_STATE_READY``, ``"READY"``
or ``"ready"``."""

_Req = TypeVar("_Req", bound=Message)
_Resp = TypeVar("_Resp", bound=Message)
_Item = TypeVar("_Item")
_T = TypeVar("_T")

# From each node state, the states a node can still reach (see dxpool.lifecycle).
_REACHABLE: Final[Mapping[int, frozenset[int]]] = NODE_REACHABLE


def _enum_value(value: int | str, enum: EnumDescriptor, kind: str) -> int:
    """An enum value given as its number, its full name or its name without the prefix."""
    if not isinstance(value, str):
        return value
    prefix = enum.values[0].name.removesuffix("UNSPECIFIED")
    text = value.strip().upper().replace("-", "_").removeprefix(prefix)
    choices = [v.name.removeprefix(prefix) for v in enum.values if v.number != 0]
    if text not in choices:
        raise InvalidArgument(
            f"unknown {kind} {value!r}: expected one of {', '.join(c.lower() for c in choices)}",
            reason=f"INVALID_{kind.upper().replace(' ', '_')}",
        )
    return enum.values_by_name[prefix + text].number


def node_state_name(value: int) -> str:
    """``NodeState.NODE_STATE_READY`` -> ``"READY"`` (the number itself if unknown)."""
    found = NodeState.DESCRIPTOR.values_by_number.get(value)
    return found.name.removeprefix("NODE_STATE_") if found is not None else str(value)


def node_state(value: NodeStateLike) -> int:
    """``"ready"``, ``"READY"`` or ``"NODE_STATE_READY"`` -> ``NodeState.NODE_STATE_READY``."""
    return _enum_value(value, NodeState.DESCRIPTOR, "node state")


def gpu_state(value: int | str) -> int:
    """``"free"``, ``"FREE"`` or ``"GPU_STATE_FREE"`` -> ``GpuState.GPU_STATE_FREE``."""
    return _enum_value(value, GpuState.DESCRIPTOR, "GPU state")


def _simple_name(value: str, collection: str, kind: str) -> str:
    """``"h1"`` or ``"hosts/h1"`` -> ``"hosts/h1"``, validated."""
    return names.full_name(value, collection, kind)


def box_name(value: str) -> str:
    """``"box1"`` or ``"boxes/box1"`` -> ``"boxes/box1"``; InvalidArgument if malformed."""
    return _simple_name(value, "boxes", "box")


def host_name(value: str) -> str:
    """``"h1"`` or ``"hosts/h1"`` -> ``"hosts/h1"``; InvalidArgument if malformed."""
    return _simple_name(value, "hosts", "host")


def node_name(value: str) -> str:
    """``"n1"`` or ``"nodes/n1"`` -> ``"nodes/n1"``; InvalidArgument if malformed."""
    return _simple_name(value, "nodes", "node")


def gang_name(value: str) -> str:
    """``"g1"`` or ``"gangs/g1"`` -> ``"gangs/g1"``; InvalidArgument if malformed."""
    return _simple_name(value, "gangs", "gang")


def tenant_name(value: str) -> str:
    """``"team-a"`` or ``"tenants/team-a"`` -> ``"tenants/team-a"``, validated."""
    return _simple_name(value, "tenants", "tenant")


def gpu_name(value: str) -> str:
    """``"box1/3"`` or ``"boxes/box1/gpus/3"`` -> ``"boxes/box1/gpus/3"``, validated."""
    if value.startswith("boxes/"):
        return names.parse_gpu(value).name
    box, sep, slot = value.partition("/")
    if not sep:
        raise InvalidArgument(
            f"invalid gpu name {value!r}: expected 'BOX/SLOT' (e.g. box1/3) or "
            "'boxes/{box}/gpus/{slot}'",
            reason="INVALID_NAME",
        )
    return names.parse_gpu(f"boxes/{box}/gpus/{slot}").name


def _location(value: LocationLike | None) -> Location | None:
    if value is None or isinstance(value, Location):
        return value
    if len(value) != 3 or not all(isinstance(part, str) for part in value):
        raise InvalidArgument(
            f"invalid location {value!r}: expected (site, pod, rack) strings",
            reason="INVALID_LOCATION",
        )
    site, pod, rack = value
    return Location(site=site, pod=pod, rack=rack)


def _node_request(
    request: NodeRequest | GpusLike | None, fields: NodeRequestChanges
) -> NodeRequest:
    """The request a node call sends: ``request`` itself, with ``fields`` replacing its
    values where given, or a request parsed from its GPUs (``request``, or the ``gpus``
    keyword the calls have always taken) and ``fields``."""
    changes = dict(fields)
    gpus = changes.pop("gpus", None)
    if isinstance(request, NodeRequest):
        if not fields:
            return request
        return request.copy(gpus=gpus, **changes)  # type: ignore[arg-type]
    if (request is None) == (gpus is None):
        raise TypeError("give a node request, or its GPUs as the first argument or gpus=")
    return parse_node_request(request if gpus is None else gpus, **changes)  # type: ignore[arg-type]


def _node_id(value: str | None) -> str:
    """A node id to send (``"n1"`` or ``"nodes/n1"``), checked; "" to have one made."""
    return names.check_id(value.removeprefix("nodes/"), "node") if value else ""


def _request_id(value: str | None) -> str:
    """An idempotency key to send, checked; a fresh uuid4 when none is given."""
    return names.check_request_id(value or str(uuid.uuid4()))


def _error_from_rpc(error: grpc.RpcError) -> DxpoolError:
    """The :mod:`dxpool.errors` exception for a failed call, with its ErrorInfo if any."""
    return from_rpc_error(error)


def _reached(full_name: str, node: resources_pb2.VirtualNode, wanted: frozenset[int]) -> bool:
    """True if ``node`` is in a wanted state; FailedPrecondition if it can never get there."""
    if node.state in wanted:
        return True
    if not wanted & _REACHABLE.get(node.state, wanted):
        state = node_state_name(node.state)
        goals = " or ".join(sorted(node_state_name(w) for w in wanted))
        detail = f": {node.message}" if node.message else ""
        raise FailedPrecondition(
            f"node {full_name} is {state} and can no longer become {goals}" + detail,
            reason=f"NODE_{state}",
        )
    return False


def _wait_timeout(
    full_name: str, timeout_s: float, seen: list[resources_pb2.VirtualNode]
) -> TimeoutError:
    state = node_state_name(seen[-1].state) if seen else "not seen yet"
    return TimeoutError(f"node {full_name} still {state} after {timeout_s:g}s")


def _open_channel(
    endpoint: str, tls: ClientTls | None, token: str | None, *, insecure: bool
) -> grpc.Channel:
    """A channel to ``endpoint``: plaintext, TLS, or TLS plus a bearer token."""
    if not insecure and tls is None and token is None:
        tls, token = resolve_connection()
    if insecure or (tls is None and token is None):
        return grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
    tls = tls or ClientTls()
    credentials = tls.credentials()
    if token is not None:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(token)
        )
    return grpc.secure_channel(
        endpoint, credentials, options=[*_CHANNEL_OPTIONS, *tls.channel_options()]
    )


class Client:
    """A connection to one broker. Thread-safe; use as a context manager or call ``close``.

    ``endpoint`` None resolves it from ``$DXPOOL_ENDPOINT``, the config file or the default
    (see :mod:`dxpool.config`). ``timeout_s`` bounds every unary call; a call that
    finds the broker unreachable is tried up to ``max_attempts`` times in all.

    ``tls`` (and ``token``, a bearer token sent on every call) None resolve from the
    environment and the config file like the endpoint; ``insecure=True`` connects in
    plaintext whatever they say. A token is sent only over TLS (gRPC refuses to send call
    credentials in plaintext), so a token without ``tls`` connects with TLS verified
    against the system's roots.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        tls: ClientTls | None = None,
        token: str | None = None,
        insecure: bool = False,
    ) -> None:
        if insecure and (tls is not None or token is not None):
            raise InvalidArgument("insecure=True connects in plaintext: give no tls or token")
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be positive, got {timeout_s}")
        if max_attempts < 1:
            raise InvalidArgument(f"max_attempts must be 1 or more, got {max_attempts}")
        self.endpoint = resolve_endpoint(endpoint)
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self._channel = _open_channel(self.endpoint, tls, token, insecure=insecure)
        self._closed = False
        self._inventory = inventory_pb2_grpc.InventoryServiceStub(self._channel)
        self._nodes = nodes_pb2_grpc.NodeServiceStub(self._channel)
        self._fabric = fabric_pb2_grpc.FabricServiceStub(self._channel)
        self._audit = audit_pb2_grpc.AuditServiceStub(self._channel)

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled. Closing twice is a no-op."""
        self._closed = True
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(endpoint={self.endpoint!r})"

    # -- plumbing ------------------------------------------------------------------------

    def _retry(self, attempt: Callable[[], _T]) -> _T:
        retrying = Retrying(
            retry=retry_if_exception_type(Unavailable),
            stop=stop_after_attempt(self.max_attempts),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            reraise=True,
            before_sleep=lambda state: _log.debug(
                "broker unavailable, retrying",
                extra={"endpoint": self.endpoint, "attempt": state.attempt_number},
            ),
        )
        return retrying(attempt)

    def _once(self, rpc: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        try:
            return rpc(request, timeout=self.timeout_s)
        except grpc.RpcError as error:
            raise self._hinted(_error_from_rpc(error)) from None

    def _hinted(self, error: DxpoolError) -> DxpoolError:
        """``error`` with a next step when the broker could not be reached."""
        error.hint = connection_hint(error.code, error.message, self.endpoint)
        return error

    def _unary(self, rpc: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        return self._retry(lambda: self._once(rpc, request))

    def _collect(
        self,
        rpc: grpc.UnaryUnaryMultiCallable[_Req, _Resp],
        make_request: Callable[[str], _Req],
        page: Callable[[_Resp], tuple[Iterable[_Item], str]],
    ) -> list[_Item]:
        items: list[_Item] = []
        token = ""
        while True:
            found, token = page(self._unary(rpc, make_request(token)))
            items.extend(found)
            if not token:
                return items

    # -- inventory -----------------------------------------------------------------------

    def create_box(
        self,
        box_id: str,
        *,
        gpus: int,
        model: str,
        memory_mib: int,
        location: LocationLike | None = None,
        labels: Mapping[str, str] | None = None,
        fabric_endpoint: str = "",
        request_id: str | None = None,
    ) -> resources_pb2.Box:
        """Register box ``box_id`` with ``gpus`` GPUs of ``model`` and ``memory_mib`` each.

        Raises AlreadyExists if the box exists, unless this is a retry of the same
        ``request_id``, which returns the box.
        """
        box_id = box_id.removeprefix("boxes/")
        names.check_id(box_id, "box")
        if not 1 <= gpus <= MAX_GPUS_PER_BOX:
            raise InvalidArgument(f"a box holds 1 to {MAX_GPUS_PER_BOX} GPUs, got gpus={gpus}")
        if not model:
            raise InvalidArgument("a box needs a GPU model, e.g. model='H100'")
        check_model(model)
        if not 1 <= memory_mib <= MAX_GPU_MEMORY_MIB:
            raise InvalidArgument(
                f"GPU memory must be 1 to {MAX_GPU_MEMORY_MIB} MiB (16 TiB), "
                f"got memory_mib={memory_mib}"
            )
        box = resources_pb2.Box(
            gpu_count=gpus, labels=dict(labels or {}), fabric_endpoint=fabric_endpoint
        )
        where = _location(location)
        if where is not None:
            box.location.CopyFrom(where)
        request = inventory_pb2.CreateBoxRequest(
            box_id=box_id,
            box=box,
            gpu_model=model,
            gpu_memory_mib=memory_mib,
            request_id=_request_id(request_id),
        )
        return self._unary(self._inventory.CreateBox, request)

    def get_box(self, name: str) -> resources_pb2.Box:
        return self._unary(self._inventory.GetBox, inventory_pb2.GetBoxRequest(name=box_name(name)))

    def list_boxes(self, *, label_selector: str = "") -> list[resources_pb2.Box]:
        """Every box, or those whose labels match ``label_selector`` (the grammar of
        :mod:`dxpool.selector`; InvalidArgument for a malformed one), each with
        ``gpus_free`` filled in."""
        return self._collect(
            self._inventory.ListBoxes,
            lambda token: inventory_pb2.ListBoxesRequest(
                page_size=_PAGE_SIZE, page_token=token, label_selector=label_selector
            ),
            lambda response: (response.boxes, response.next_page_token),
        )

    def cordon_box(self, name: str, reason: str = "") -> resources_pb2.Box:
        """Make a box unschedulable for new nodes. Idempotent; attached GPUs stay."""
        request = inventory_pb2.CordonBoxRequest(name=box_name(name), reason=reason)
        return self._unary(self._inventory.CordonBox, request)

    def uncordon_box(self, name: str) -> resources_pb2.Box:
        """Make a box schedulable again. Idempotent."""
        request = inventory_pb2.UncordonBoxRequest(name=box_name(name))
        return self._unary(self._inventory.UncordonBox, request)

    def delete_box(self, name: str) -> None:
        """Remove a box and its GPUs. FailedPrecondition while any of its GPUs is owned.

        NOT_FOUND on the first attempt raises NotFound; on a retry it means an earlier
        attempt that looked unavailable did delete the box, and returns normally.
        """
        request = inventory_pb2.DeleteBoxRequest(name=box_name(name))
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            try:
                self._once(self._inventory.DeleteBox, request)
            except NotFound:
                if attempts == 1:
                    raise

        self._retry(attempt)

    def get_gpu(self, name: str) -> resources_pb2.Gpu:
        return self._unary(self._inventory.GetGpu, inventory_pb2.GetGpuRequest(name=gpu_name(name)))

    def pool_status(self) -> inventory_pb2.PoolStatus:
        """The pool at a glance: GPUs by model and state, nodes by state, live and dead
        hosts, free proxy slots, and how many 1/2/4/8-GPU nodes fit now."""
        return self._unary(self._inventory.GetPoolStatus, inventory_pb2.GetPoolStatusRequest())

    def reclaim_gpu(self, name: str, reason: str = "") -> resources_pb2.Gpu:
        """Put a QUARANTINED GPU back into service: it goes FENCING, the leader broker
        revokes and scrubs it at the box side, then it is FREE. Idempotent while FENCING;
        FailedPrecondition for a GPU in any other state."""
        request = inventory_pb2.ReclaimGpuRequest(name=gpu_name(name), reason=reason)
        return self._unary(self._inventory.ReclaimGpu, request)

    def clear_gpu_health(self, name: str, reason: str = "") -> resources_pb2.Gpu:
        """Mark a GPU healthy again after checking it, so it can be handed out; idempotent.
        FailedPrecondition while its host's agent still reports it unhealthy."""
        request = inventory_pb2.ClearGpuHealthRequest(name=gpu_name(name), reason=reason)
        return self._unary(self._inventory.ClearGpuHealth, request)

    def list_gpus(
        self, *, parent: str | None = None, state: int | str | None = None, model: str = ""
    ) -> list[resources_pb2.Gpu]:
        """GPUs of one box (``parent``) or all, optionally only one state and model."""
        parent_name = box_name(parent) if parent else ""
        state_value = gpu_state(state) if state is not None else 0
        return self._collect(
            self._inventory.ListGpus,
            lambda token: inventory_pb2.ListGpusRequest(
                parent=parent_name,
                state=GpuState.ValueType(state_value),
                model=model,
                page_size=_PAGE_SIZE,
                page_token=token,
            ),
            lambda response: (response.gpus, response.next_page_token),
        )

    def get_host(self, name: str) -> resources_pb2.Host:
        request = inventory_pb2.GetHostRequest(name=host_name(name))
        return self._unary(self._inventory.GetHost, request)

    def list_hosts(self, *, label_selector: str = "") -> list[resources_pb2.Host]:
        """Every host, or those whose labels match ``label_selector`` (see
        :meth:`list_boxes`)."""
        return self._collect(
            self._inventory.ListHosts,
            lambda token: inventory_pb2.ListHostsRequest(
                page_size=_PAGE_SIZE, page_token=token, label_selector=label_selector
            ),
            lambda response: (response.hosts, response.next_page_token),
        )

    # -- audit ---------------------------------------------------------------------------

    def cordon_host(self, name: str, reason: str = "") -> resources_pb2.Host:
        """Stop placement from giving host ``name`` new nodes; its nodes stay."""
        request = inventory_pb2.CordonHostRequest(name=host_name(name), reason=reason)
        return self._unary(self._inventory.CordonHost, request)

    def uncordon_host(self, name: str) -> resources_pb2.Host:
        """Make host ``name`` schedulable again, ending a drain of it."""
        request = inventory_pb2.UncordonHostRequest(name=host_name(name))
        return self._unary(self._inventory.UncordonHost, request)

    def drain_host(self, name: str, reason: str = "") -> resources_pb2.Host:
        """Cordon host ``name`` and release its nodes, each after its preemption notice;
        ``Host.drain`` reports progress (see :meth:`get_host`)."""
        request = inventory_pb2.DrainHostRequest(
            name=host_name(name), reason=reason, policy=resources_pb2.DRAIN_POLICY_RELEASE
        )
        return self._unary(self._inventory.DrainHost, request)

    def drain_box(self, name: str, reason: str = "", *, policy: str = "move") -> resources_pb2.Box:
        """Cordon box ``name`` and move (``policy="move"``: onto other boxes, on each node's
        own host) or release (``"release"``) the GPUs nodes hold in it; ``Box.drain``
        reports progress."""
        policies = {
            "move": resources_pb2.DRAIN_POLICY_MOVE,
            "release": resources_pb2.DRAIN_POLICY_RELEASE,
        }
        if policy not in policies:
            raise InvalidArgument(f"policy must be move or release, got {policy!r}")
        request = inventory_pb2.DrainBoxRequest(
            name=box_name(name), reason=reason, policy=policies[policy]
        )
        return self._unary(self._inventory.DrainBox, request)

    def list_audit_records(
        self,
        *,
        since: datetime.datetime | None = None,
        identity: str = "",
        target: str = "",
    ) -> list[audit_pb2.AuditRecord]:
        """The audit records of mutating calls, oldest first: from ``since`` (an aware
        datetime), by ``identity`` (``dxpool://tenant/team-a``), naming ``target``
        (``nodes/n1``, ``boxes/box1``)."""
        since_ts = None
        if since is not None:
            if since.tzinfo is None:
                raise InvalidArgument("since must be timezone-aware, e.g. in UTC")
            since_ts = Timestamp()
            since_ts.FromDatetime(since)
        return self._collect(
            self._audit.ListAuditRecords,
            lambda token: audit_pb2.ListAuditRecordsRequest(
                page_size=_PAGE_SIZE,
                page_token=token,
                since=since_ts,
                identity=identity,
                target=target,
            ),
            lambda response: (response.records, response.next_page_token),
        )

    # -- nodes ---------------------------------------------------------------------------

    def compose_node(
        self,
        request: NodeRequest | GpusLike | None = None,
        *,
        node_id: str | None = None,
        request_id: str | None = None,
        queue: bool = False,
        queue_timeout_s: int = 0,
        **fields: Unpack[NodeRequestChanges],
    ) -> resources_pb2.VirtualNode:
        """Place and commit a node; it comes back PENDING (see :meth:`wait_for_node`).

        ``request`` is a :class:`~dxpool.node_request.NodeRequest`, sent whole, or its
        GPUs (``"H100:4"``, a mapping or a GpuSpec, as :mod:`dxpool.request` reads them)
        with the rest of the request as keyword ``fields`` (with a NodeRequest, the
        fields given replace its own, as :meth:`NodeRequest.copy` does):
        ``max_latency`` is a duration ("4us") or nanoseconds; ``min_memory`` a size
        ("80GiB") or MiB; ``max_slowdown`` (e.g. 1.05) bounds the predicted slowdown of
        ``workload`` (a profile name or ``ROUND_TRIPS@STEP_TIME``, see
        :mod:`dxpool.fabric.overhead`); ``affinity="box"`` requires every GPU from one box,
        ``affinity="switch"`` every GPU from boxes under one rack switch;
        ``spread`` ("boxes", "boxes:M" or M) takes at most that many GPUs from any one box;
        ``host_selector`` keeps hosts whose labels hold every key=value given; ``cpus``
        and ``host_memory`` (a size such as "64GiB", or MiB) must be free on the host;
        ``exclude_hosts`` (host ids or ``hosts/{host}`` names) keeps the node off them.
        Retrying with the same ``request_id`` returns the same node.
        Raises ResourceExhausted when nothing fits, NotFound for an unknown host.

        With ``queue`` a node that does not fit now comes back QUEUED instead and is
        placed as capacity frees (``queue_timeout_s``: how long it may wait, 0 until
        released); :meth:`wait_for_node` waits through QUEUED. ``priority`` (0-1000)
        orders waiting requests and lets one preempt borrowed nodes of lower priority;
        ``min_gpus`` makes the node elastic (shrunk toward it, not preempted, when the
        lent capacity it holds is reclaimed); ``preemption_grace_s`` is the notice it
        gets before its GPUs are taken (default: the broker's).
        """
        spec = _node_request(request, fields).to_proto()
        call = nodes_pb2.ComposeNodeRequest(
            spec=spec,
            node_id=_node_id(node_id),
            request_id=_request_id(request_id),
            queue=queue,
            queue_timeout_s=queue_timeout_s,
        )
        return self._unary(self._nodes.ComposeNode, call)

    def plan_node(
        self,
        request: NodeRequest | GpusLike | None = None,
        *,
        node_id: str | None = None,
        request_id: str | None = None,
        **fields: Unpack[NodeRequestChanges],
    ) -> nodes_pb2.NodePlan:
        """Explain where :meth:`compose_node` with these arguments would go, what it
        would preempt to fit (``preemptions``) and whether its tenant's quota holds it;
        commits nothing.

        ``node_id`` and ``request_id`` are accepted, as :meth:`compose_node` takes them,
        and checked, but a plan does not use them."""
        spec = _node_request(request, fields).to_proto()
        _node_id(node_id)
        _request_id(request_id)
        return self._unary(self._nodes.PlanNode, nodes_pb2.PlanNodeRequest(spec=spec))

    def get_node(self, name: str) -> resources_pb2.VirtualNode:
        return self._unary(self._nodes.GetNode, nodes_pb2.GetNodeRequest(name=node_name(name)))

    def get_node_hostdev(self, name: str) -> nodes_pb2.NodeHostdev:
        """The libvirt ``<hostdev>`` XML that hands a READY vfio node's GPUs to a VM on its
        host. FailedPrecondition when the node is not READY or not composed for vfio."""
        request = nodes_pb2.GetNodeHostdevRequest(name=node_name(name))
        return self._unary(self._nodes.GetNodeHostdev, request)

    def list_nodes(
        self, *, host: str | None = None, show_released: bool = False, label_selector: str = ""
    ) -> list[resources_pb2.VirtualNode]:
        """Nodes, optionally only those on ``host`` and those whose ``spec.labels`` match
        ``label_selector`` (the grammar of :mod:`dxpool.selector`; InvalidArgument for a
        malformed one); RELEASED ones only if asked."""
        host_filter = host_name(host) if host else ""
        return self._collect(
            self._nodes.ListNodes,
            lambda token: nodes_pb2.ListNodesRequest(
                host=host_filter,
                show_released=show_released,
                label_selector=label_selector,
                page_size=_PAGE_SIZE,
                page_token=token,
            ),
            lambda response: (response.nodes, response.next_page_token),
        )

    def release_node(self, name: str, *, force: bool = False) -> resources_pb2.VirtualNode:
        """Start detaching a node's GPUs. Idempotent: a RELEASING or RELEASED node is
        returned unchanged. ``force`` does not wait for the host's agent: the broker
        fences the GPUs at the box side, scrubs and frees them (for a dead or hung host)."""
        request = nodes_pb2.ReleaseNodeRequest(name=node_name(name), force=force)
        return self._unary(self._nodes.ReleaseNode, request)

    def resize_node(
        self,
        name: str,
        gpus: int = 0,
        *,
        remove: Iterable[str] = (),
        request_id: str | None = None,
    ) -> resources_pb2.VirtualNode:
        """Grow or shrink a READY node's GPUs in place, on its host: ``gpus`` is the
        count it should have; ``remove`` names the GPUs to take out (``"box1/3"`` or
        ``"boxes/box1/gpus/3"``) instead of the most recently added ones. The node comes
        back RESIZING until the GPUs are attached or freed (see :meth:`wait_for_node`;
        a grow whose GPUs cannot be attached ends READY without them). Retrying
        with the same ``request_id`` returns the node without resizing again.
        Raises FailedPrecondition when the node is not READY, ResourceExhausted when
        its host cannot take more GPUs."""
        request = nodes_pb2.ResizeNodeRequest(
            name=node_name(name),
            gpu_count=gpus,
            remove=[gpu_name(g) for g in remove],
            request_id=_request_id(request_id),
        )
        return self._unary(self._nodes.ResizeNode, request)

    # -- gangs ---------------------------------------------------------------------------

    def compose_gang(
        self,
        request: NodeRequest | GpusLike | None = None,
        count: int = 0,
        *,
        gang_id: str | None = None,
        request_id: str | None = None,
        queue: bool = False,
        queue_timeout_s: int = 0,
        distinct_hosts: bool = False,
        same_switch: bool = False,
        **fields: Unpack[NodeRequestChanges],
    ) -> nodes_pb2.Gang:
        """Compose ``count`` nodes of the same request all or nothing; they come back
        PENDING as ``nodes/{gang}-0`` ... (see :meth:`wait_for_gang`).

        ``request`` and ``fields`` are :meth:`compose_node`'s, but for ``min_gpus`` (the
        keyword form takes no elastic members). Retrying with the same
        ``request_id`` returns the same gang. Raises ResourceExhausted when some member
        does not fit or the members together exceed the tenant's quota (reason
        QUOTA_EXCEEDED; nothing is composed), InvalidArgument for more members than a
        gang may have (the message states the limit). ``distinct_hosts`` puts every
        member on a host of its own, ``same_switch`` every member's GPUs under one rack
        switch; with ``queue`` a gang that does not fit now comes back QUEUED (no member
        yet) and is composed whole as capacity frees."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise InvalidArgument(
                f"count must be a whole number of members, 1 or more; got {count!r}"
            )
        if "min_gpus" in fields:
            raise TypeError("compose_gang() got an unexpected keyword argument 'min_gpus'")
        spec = _node_request(request, fields).to_proto()
        call = nodes_pb2.ComposeGangRequest(
            members=[spec] * count,
            gang_id=gang_name(gang_id).removeprefix("gangs/") if gang_id else "",
            request_id=_request_id(request_id),
            queue=queue,
            queue_timeout_s=queue_timeout_s,
            distinct_hosts=distinct_hosts,
            same_switch=same_switch,
        )
        return self._unary(self._nodes.ComposeGang, call)

    def get_gang(self, name: str) -> nodes_pb2.Gang:
        """The gang's members as they are now (``"g1"`` or ``"gangs/g1"``)."""
        request = nodes_pb2.GetGangRequest(name=gang_name(name))
        return self._unary(self._nodes.GetGang, request)

    def release_gang(self, name: str, *, force: bool = False) -> nodes_pb2.Gang:
        """Start releasing every member of a gang in one transaction; idempotent.
        ``force`` as for :meth:`release_node`."""
        request = nodes_pb2.ReleaseGangRequest(name=gang_name(name), force=force)
        return self._unary(self._nodes.ReleaseGang, request)

    def wait_for_gang(
        self,
        name: str,
        *,
        until: Iterable[NodeStateLike] = (NodeState.NODE_STATE_READY,),
        timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> nodes_pb2.Gang:
        """Block until every member is in one of the ``until`` states; the gang then.

        Raises FailedPrecondition as soon as any member can no longer get there (e.g. its
        host was lost: the message names the member; the others are left as they are,
        release the gang), TimeoutError when ``timeout_s`` passes first for any member.
        A gang that waits in the queue, or is still being committed, is waited for
        first; one that failed (rolled back, timed out) raises FailedPrecondition."""
        deadline = time.monotonic() + timeout_s
        wanted = tuple(until)
        releasing = NodeState.NODE_STATE_RELEASED in {node_state(w) for w in wanted}
        gang = self._wait_gang_valid(name, deadline, timeout_s, releasing=releasing)
        members = []
        for node in gang.nodes:
            # every member is looked at at least once, even after the deadline
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                members.append(self.wait_for_node(node.name, until=wanted, timeout_s=remaining))
            except FailedPrecondition as error:
                raise FailedPrecondition(
                    f"gang {gang.name}: {error.message}; release the gang "
                    f"(`dxpool gang delete {gang.name}`)",
                    reason=error.reason,
                ) from None
            except TimeoutError as error:
                raise TimeoutError(
                    f"gang {gang.name} not ready after {timeout_s:g}s: {error}"
                ) from None
        return nodes_pb2.Gang(
            name=gang.name, nodes=members, state=gang.state, message=gang.message, size=gang.size
        )

    def _wait_gang_valid(
        self, name: str, deadline: float, timeout_s: float, *, releasing: bool = False
    ) -> nodes_pb2.Gang:
        """The gang once it exists whole (polled with backoff while QUEUED or being
        committed); ``releasing``: a gang that ended (FAILED, RELEASED) is what is
        waited for, not an error."""
        pause = 0.05
        while True:
            gang = self.get_gang(name)
            state = gang.state
            ended = (_GANG_STATE.GANG_STATE_FAILED, _GANG_STATE.GANG_STATE_RELEASED)
            if releasing and state in ended:
                return gang
            if state in ended:
                raise FailedPrecondition(
                    f"gang {gang.name} is {_GANG_STATE.Name(state)}: {gang.message}",
                    reason="GANG_NOT_COMPOSED",
                )
            if state not in _GANG_WAITING:
                return gang
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"gang {gang.name} not composed after {timeout_s:g}s: "
                    f"{_GANG_STATE.Name(state)} ({gang.message})"
                )
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.01)))
            pause = min(pause * 2, 2.0)

    # -- the queue -----------------------------------------------------------------------

    def list_queue(self, *, tenant: str = "") -> list[nodes_pb2.QueueEntry]:
        """The waiting requests in the order they will be served (a tenant caller: its
        own, at their positions in the whole queue)."""
        tenant_id = tenant_name(tenant).removeprefix("tenants/") if tenant else ""
        return self._collect(
            self._nodes.ListQueue,
            lambda token: nodes_pb2.ListQueueRequest(
                tenant=tenant_id, page_size=_PAGE_SIZE, page_token=token
            ),
            lambda response: (response.entries, response.next_page_token),
        )

    # -- tenants -------------------------------------------------------------------------

    def set_tenant_quota(
        self,
        name: str,
        *,
        gpus: int | None = None,
        gpus_by_model: Mapping[str, int] | None = None,
        nodes: int | None = None,
        guaranteed_gpus: int | None = None,
        borrow_limit: int | None = None,
        max_priority: int | None = None,
    ) -> resources_pb2.Tenant:
        """Replace tenant ``name``'s quota (``"team-a"`` or ``"tenants/team-a"``). A
        limit left out (None, or a model not named) is no limit; 0 allows nothing.
        ``guaranteed_gpus`` makes the tenant take part in loaning (nodes beyond it are
        borrowed and preemptible), ``borrow_limit`` bounds its borrowing, ``max_priority``
        caps its nodes' priority. Returns the tenant with its current usage. Operators
        only."""
        quota = resources_pb2.TenantQuota(gpus_by_model=dict(gpus_by_model or {}))
        if gpus is not None:
            quota.gpus = gpus
        if nodes is not None:
            quota.nodes = nodes
        if guaranteed_gpus is not None:
            quota.guaranteed_gpus = guaranteed_gpus
        if borrow_limit is not None:
            quota.borrow_limit = borrow_limit
        if max_priority is not None:
            quota.max_priority = max_priority
        request = nodes_pb2.SetTenantQuotaRequest(name=tenant_name(name), quota=quota)
        return self._unary(self._nodes.SetTenantQuota, request)

    def get_tenant(self, name: str) -> resources_pb2.Tenant:
        """Tenant ``name``'s quota (absent: no limits) and current usage."""
        request = nodes_pb2.GetTenantRequest(name=tenant_name(name))
        return self._unary(self._nodes.GetTenant, request)

    def list_tenants(self) -> list[resources_pb2.Tenant]:
        """Every tenant with a quota or a charged node so far, by name. Operators only."""
        return self._collect(
            self._nodes.ListTenants,
            lambda token: nodes_pb2.ListTenantsRequest(page_size=_PAGE_SIZE, page_token=token),
            lambda response: (response.tenants, response.next_page_token),
        )

    def delete_tenant(self, name: str) -> None:
        """Delete tenant ``name``'s record, its quota and usage with it. FailedPrecondition
        while nodes charged to it hold GPUs. Operators only.

        NOT_FOUND on the first attempt raises NotFound; on a retry it means an earlier
        attempt that looked unavailable did delete the tenant, and returns normally.
        """
        request = nodes_pb2.DeleteTenantRequest(name=tenant_name(name))
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            try:
                self._once(self._nodes.DeleteTenant, request)
            except NotFound:
                if attempts == 1:
                    raise

        self._retry(attempt)

    def watch_nodes(
        self,
        name: str | None = None,
        *,
        timeout_s: float | None = None,
        start_revision: int = 0,
        resume: bool = True,
        include_synced: bool = False,
        reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S,
    ) -> Iterator[nodes_pb2.NodeEvent]:
        """Stream the current state of one node (or all), then every change.

        Each event's ``revision`` is a resume position: a later watch with that
        ``start_revision`` replays every change after it instead of listing again.
        The iterator resumes by itself (``resume=True``) when the broker cuts the watch
        off because the consumer stopped reading (ABORTED, WATCH_TOO_SLOW), when the
        broker stops or restarts, or when the connection drops (UNAVAILABLE): it watches
        again from the last event it yielded, with backoff, so nothing is missed, though
        events may repeat. It gives up, raising the last error, once the broker has been
        out of reach for ``reconnect_timeout_s`` with no event in between. With
        ``resume=False`` those errors are raised at once.

        TYPE_SYNCED events (end of a listing or replay, progress marks) are yielded only
        with ``include_synced``. A consumer that keeps a view of all nodes needs them: a
        TYPE_SYNCED with ``reset`` ends a full listing (TYPE_EXISTING events) that
        replaces its view, which happens after a resume the broker could not replay.

        Raises ResourceExhausted when the broker serves as many watches as it allows
        (:meth:`wait_for_node` then polls instead). ``timeout_s`` bounds the whole
        iteration, resumes included (DxpoolError DEADLINE_EXCEEDED). Closing the
        iterator cancels the call.
        """
        request_name = node_name(name) if name else ""
        if isinstance(start_revision, bool) or start_revision < 0:
            raise InvalidArgument(
                f"invalid start_revision {start_revision!r}: give 0 (start with a listing) "
                "or the revision of the last event handled"
            )
        if reconnect_timeout_s < 0:
            raise InvalidArgument(
                f"invalid reconnect_timeout_s {reconnect_timeout_s!r}: give 0 or more seconds"
            )
        return self._watch(
            request_name, timeout_s, start_revision, resume, include_synced, reconnect_timeout_s
        )

    def _watch(
        self,
        name: str,
        timeout_s: float | None,
        revision: int,
        resume: bool,
        include_synced: bool,
        reconnect_timeout_s: float,
    ) -> Iterator[nodes_pb2.NodeEvent]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        retrying = Retrying(
            retry=retry_if_exception(
                lambda error: resume and isinstance(error, DxpoolError) and self._resumable(error)
            ),
            stop=stop_after_delay(reconnect_timeout_s),
            wait=wait_exponential(multiplier=0.1, max=2.0) + wait_random(0, 0.05),
            reraise=True,
            before_sleep=lambda state: _log.debug(
                "watch ended; resuming",
                extra={
                    "endpoint": self.endpoint,
                    "revision": revision,
                    "attempt": state.attempt_number,
                },
            ),
        )
        for attempt in retrying:
            with attempt:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise from_code(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the watch of {name or 'all nodes'} ran past its {timeout_s:g}s timeout",
                    )
                request = nodes_pb2.WatchNodesRequest(name=name, start_revision=revision)
                stream = self._stream(self._nodes.WatchNodes, request, remaining)
                try:
                    for event in stream:
                        revision = event.revision
                        # Progress: an outage after this one is timed, and backs off, anew.
                        attempt.retry_state.start_time = time.monotonic()
                        attempt.retry_state.attempt_number = 1
                        if event.type != nodes_pb2.NodeEvent.TYPE_SYNCED or include_synced:
                            yield event
                finally:
                    stream.close()
                return

    def _resumable(self, error: DxpoolError) -> bool:
        """Whether a watch that ended with ``error`` should be resumed."""
        if isinstance(error, Aborted | Unavailable):
            return True
        # A cancel this client did not ask for: the broker ended the call.
        return error.code == grpc.StatusCode.CANCELLED and not self._closed

    def _stream(
        self,
        rpc: grpc.UnaryStreamMultiCallable[_Req, _Resp],
        request: _Req,
        timeout_s: float | None,
    ) -> Generator[_Resp, None, None]:
        call = rpc(request, timeout=timeout_s)
        try:
            yield from call
        except grpc.RpcError as error:
            raise self._hinted(_error_from_rpc(error)) from None
        finally:
            call.cancel()  # type: ignore[no-untyped-call]  # the iterator is also a grpc.Call

    def wait_for_node(
        self,
        name: str,
        *,
        until: Iterable[NodeStateLike] = (NodeState.NODE_STATE_READY,),
        timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> resources_pb2.VirtualNode:
        """Block until the node is in one of the ``until`` states and return it.

        Raises FailedPrecondition as soon as the node is in a state from which none of
        ``until`` can be reached (e.g. FAILED when READY was wanted; the message carries
        the node's own message), NotFound if the node does not exist or is deleted, and
        TimeoutError when ``timeout_s`` passes first. It watches the node; a watch cut
        off or lost is resumed, a lost broker is watched again until the deadline, and
        when the broker refuses the watch (it serves as many as it allows) it polls
        GetNode with backoff instead.
        """
        full_name = node_name(name)
        wanted = frozenset(node_state(state) for state in until)
        if not wanted:
            raise InvalidArgument("wait_for_node needs at least one state in 'until'")
        deadline = time.monotonic() + timeout_s
        seen: list[resources_pb2.VirtualNode] = []
        backoff = 0.1
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                for event in self.watch_nodes(full_name, timeout_s=remaining):
                    if event.type == nodes_pb2.NodeEvent.TYPE_DELETED:
                        raise NotFound(f"node {full_name} was deleted", reason="NODE_DELETED")
                    seen.append(event.node)
                    if _reached(full_name, event.node, wanted):
                        return event.node
            except ResourceExhausted:
                return self._poll_for_node(full_name, wanted, deadline, timeout_s, seen)
            except Unavailable:
                time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                backoff = min(backoff * 2, 2.0)
            except DxpoolError as error:
                if error.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
        raise _wait_timeout(full_name, timeout_s, seen)

    def _poll_for_node(
        self,
        full_name: str,
        wanted: frozenset[int],
        deadline: float,
        timeout_s: float,
        seen: list[resources_pb2.VirtualNode],
    ) -> resources_pb2.VirtualNode:
        """:meth:`wait_for_node` by GetNode with exponential backoff, until ``deadline``."""

        def attempt() -> resources_pb2.VirtualNode | None:
            node = self.get_node(full_name)
            seen.append(node)
            return node if _reached(full_name, node, wanted) else None

        retrying = Retrying(
            retry=retry_if_result(lambda node: node is None) | retry_if_exception_type(Unavailable),
            wait=wait_exponential(multiplier=0.05, max=1.0) + wait_random(0, 0.05),
            stop=stop_before_delay(max(0.0, deadline - time.monotonic())),
        )
        try:
            node = retrying(attempt)
        except RetryError:
            raise _wait_timeout(full_name, timeout_s, seen) from None
        assert node is not None  # a None result is retried until the stop raises
        return node

    # -- fabric --------------------------------------------------------------------------

    def get_latency(self, host: str, box: str) -> fabric_pb2.Latency:
        """Round-trip latency between a host and a box in the fabric model."""
        request = fabric_pb2.GetLatencyRequest(host=host_name(host), box=box_name(box))
        return self._unary(self._fabric.GetLatency, request)

    def predict(
        self,
        host: str,
        *,
        box: str | None = None,
        gpus: GpusLike | None = None,
        workload: str = "",
    ) -> fabric_pb2.Prediction:
        """Round trip, path and predicted slowdown from ``host`` to one ``box``, or to the
        boxes placement would give ``host`` for ``gpus`` (exactly one of them). With no
        ``workload`` every named profile is predicted."""
        if (box is None) == (gpus is None):
            raise InvalidArgument("give exactly one of box and gpus", reason="INVALID_PREDICTION")
        request = fabric_pb2.PredictRequest(host=host_name(host), workload=workload)
        if box is not None:
            request.box = box_name(box)
        else:
            assert gpus is not None
            request.gpus.CopyFrom(gpu_request_proto(parse_gpus(gpus)))
        return self._unary(self._fabric.Predict, request)
