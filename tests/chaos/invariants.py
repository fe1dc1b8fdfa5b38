"""The pool's safety and liveness invariants, checked on consistent snapshots.

Inputs are public records only: the etcd keys of :class:`dxpool.store.keys.KeySchema`
holding the messages of ``proto/dxpool/v1/resources.proto``, and the simulated fabric's
proxy tables (:meth:`SimFabric.mapping` / :meth:`SimFabric.mappings`). Nothing here
imports the broker or the agent, so the checks keep their meaning when those change.

Snapshots
=========

:class:`EtcdSnapshot` is ONE range read of the whole key prefix, so every record in it is
as of one etcd revision; invariants between records (a GPU and its node, a GPU and its
host's allocation) are checked on states that really existed together.

:class:`FabricSnapshot` reads every host-side table and every box-side entry, and reads
again until two full reads agree, so it is one state of the fabric too.

The fabric and etcd cannot be read atomically together. :func:`check_fabric` therefore
takes an etcd snapshot *before* and one *after* the fabric read, and judges a GPU's
mapping only when the GPU's record has the same ``mod_revision`` in both: then the record
was exactly that while the fabric was read. A GPU whose record changed in between is
counted as inconclusive, never reported.

Invariants (the ``Kind`` of each violation)
===========================================

A node is *live* in PENDING, ATTACHING or READY (it believes it holds its GPUs), and
*terminal* in RELEASED, FAILED or LOST. ``Gpu.node`` is the single owner of a GPU.

Safety, at every revision (:func:`check_records`):

* ``DOUBLE_CLAIM`` — a GPU is listed in the bindings of two live nodes. Whatever
  ``Gpu.node`` says, two tenants believe they hold one GPU. (A GPU listed by a live node
  and by terminal nodes is normal: released and failed nodes keep their bindings. So is
  a shrinking node's DETACHING binding of a GPU whose record no longer names it: the
  release path freed the GPU, which another node may already hold, and the controller
  drops the binding in a later transaction; nothing acts on such a binding.)
* ``READY_NODE_GPU`` — a READY node lists a GPU that is not ATTACHED to it (owned by
  another node, free, or in another state). READY and ATTACHED are committed together.
* ``OWNER_MISSING`` / ``OWNER_RELEASED`` / ``OWNER_UNAWARE`` — ``Gpu.node`` names a node
  that does not exist, that is RELEASED (a released node owns nothing), or that does not
  list the GPU or sits on another host than ``Gpu.host``.
* ``GPU_FIELDS`` — a FREE GPU with an owner or host; an ATTACHING, ATTACHED or DETACHING
  GPU without owner or host; a FENCING GPU without a host to fence.
* ``HOST_SLOT_TWICE`` — two GPUs ATTACHING/ATTACHED on one slot of one host, or one
  host's allocation giving a slot (or a GPU) twice. A DETACHING GPU may still sit in a
  slot that a new ATTACHING GPU was given: the agent waits for the slot, so that is
  allowed.
* ``ALLOCATION_MISMATCH`` — an attachment in ``hostalloc/{host}`` whose GPU is not owned
  by that node on that host, slot and generation, or is FREE, FENCING, QUARANTINED...; or
  an ATTACHING/ATTACHED GPU missing from its host's allocation. The allocation is what an
  agent acts on: an entry for a GPU the host must not have makes the agent attach it. An
  entry marked ``release`` (scrub and detach) must be for a GPU DETACHING or FENCING on
  that host at that generation: the broker drops it when it records the outcome.
* ``ACCOUNTING`` — every slot of every box has exactly one GPU record with a known
  state, and no GPU record lies outside a box: free + owned + fencing + quarantined +
  faulted = total.
* ``RECORD_UNREADABLE`` — a record does not parse or its name disagrees with its key.
* ``TENANT_USAGE`` — a tenant's recorded usage (nodes, GPUs, and of those the borrowed
  ones) is not what its charged nodes in PENDING, ATTACHING, READY, RESIZING or DEGRADED
  hold (every binding they still list): usage changes only with those nodes, in the same
  transactions, so the two agree at every revision.
* ``GUARANTEE_PREEMPTED`` — a node within its tenant's guarantee (not ``preemptible``)
  carries a notice given for a waiting request: lent capacity is reclaimed, and lower
  priority preempted, from borrowed nodes only.
* ``ACK_LOST`` (:func:`check_acknowledged`) — a compose the client got a node back for is
  not in etcd, and the test did not release it (a released node may be collected).

Safety between etcd and the fabric (:func:`check_fabric`):

* ``FREE_GPU_MAPPED`` — a FREE GPU is mapped to a host.
* ``MAPPED_TO_WRONG_HOST`` / ``MAPPED_AT_WRONG_SLOT`` — a GPU is mapped to another host
  than etcd's ``Gpu.host``, or, while ATTACHING, ATTACHED or DETACHING, at another slot
  than ``Gpu.host_slot`` (a FENCING or QUARANTINED GPU only has to be on its host: the
  box side revokes it whatever slot it sits in).
* ``MAPPED_IN_STATE`` — a GPU is mapped while in a state that allows no mapping (only
  ATTACHING, ATTACHED, DETACHING, FENCING and QUARANTINED do: FENCING until the broker has
  revoked it, QUARANTINED because a failed detach or scrub may leave it mapped).
* ``MAPPED_UNREGISTERED`` — a fabric GPU unknown to etcd is mapped.
* ``ATTACHED_NOT_MAPPED`` — an ATTACHED GPU is not mapped to its host slot: its node is
  READY without the hardware.
* ``GPU_ON_TWO_HOSTS`` / ``FABRIC_TABLES_DIVERGE`` — one GPU in two hosts' tables, or a
  host-side table that disagrees with the box-side entry (the sim keeps one table, so
  only a fabric that can diverge shows these).

Liveness, once faults have stopped and the pool has had time to settle:

* :func:`check_settled` — ``NODE_NOT_SETTLED`` (a node still PENDING, ATTACHING or
  RELEASING), ``GPU_NOT_SETTLED`` (ATTACHING, DETACHING or FENCING),
  ``TERMINAL_NODE_OWNS_GPU``, ``QUARANTINED_WITHOUT_REASON``, ``HOST_NOT_ALIVE`` (an agent
  that runs but holds no lease), ``LIVE_NODE_ON_LOST_HOST``.
* :func:`check_drained` — after every node was released: ``NODE_NOT_RELEASED``,
  ``GPU_NOT_FREE`` (FREE, or QUARANTINED with a reason, only), ``MAPPING_LEFT``,
  ``ALLOCATION_LEFT``, ``STATUS_LEFT``.
* :func:`check_fenced` — ``FENCE_TIMEOUT``: a host whose lease etcd dropped longer ago
  than the fencing bound, while its agent is still gone, has live nodes, GPUs
  ATTACHING/ATTACHED/DETACHING on it, or box-side mappings to it.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf.message import DecodeError, Message

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema

M = TypeVar("M")

GpuKey = tuple[str, int]  # (box, slot)
HostSlot = tuple[str, int]  # (host, host_slot)

LIVE_NODE_STATES = frozenset(
    {
        pb.NODE_STATE_PENDING,
        pb.NODE_STATE_ATTACHING,
        pb.NODE_STATE_READY,
        pb.NODE_STATE_RESIZING,
        pb.NODE_STATE_DEGRADED,
    }
)
TERMINAL_NODE_STATES = frozenset({pb.NODE_STATE_RELEASED, pb.NODE_STATE_FAILED, pb.NODE_STATE_LOST})
TRANSIENT_NODE_STATES = frozenset(
    {
        pb.NODE_STATE_PENDING,
        pb.NODE_STATE_ATTACHING,
        pb.NODE_STATE_RELEASING,
        pb.NODE_STATE_RESIZING,
    }
)
OWNED_GPU_STATES = frozenset(
    {pb.GPU_STATE_ATTACHING, pb.GPU_STATE_ATTACHED, pb.GPU_STATE_DETACHING}
)
DESIRED_GPU_STATES = frozenset({pb.GPU_STATE_ATTACHING, pb.GPU_STATE_ATTACHED})
# States of a GPU whose host's allocation may list it for release (scrub, detach, report).
RELEASE_GPU_STATES = frozenset({pb.GPU_STATE_DETACHING, pb.GPU_STATE_FENCING})
TRANSIENT_GPU_STATES = frozenset(
    {pb.GPU_STATE_ATTACHING, pb.GPU_STATE_DETACHING, pb.GPU_STATE_FENCING}
)
# States in which a GPU may be mapped to its host (Gpu.host, Gpu.host_slot).
MAPPABLE_GPU_STATES = frozenset(
    {
        pb.GPU_STATE_ATTACHING,
        pb.GPU_STATE_ATTACHED,
        pb.GPU_STATE_DETACHING,
        pb.GPU_STATE_FENCING,
        pb.GPU_STATE_QUARANTINED,
    }
)
# States a GPU of a lost host may no longer be in once it is fenced.
UNFENCED_GPU_STATES = frozenset(
    {pb.GPU_STATE_ATTACHING, pb.GPU_STATE_ATTACHED, pb.GPU_STATE_DETACHING}
)


class Kind(enum.StrEnum):
    """What a violation breaks; see the module docstring for each."""

    DOUBLE_CLAIM = "DOUBLE_CLAIM"
    READY_NODE_GPU = "READY_NODE_GPU"
    OWNER_MISSING = "OWNER_MISSING"
    OWNER_RELEASED = "OWNER_RELEASED"
    OWNER_UNAWARE = "OWNER_UNAWARE"
    GPU_FIELDS = "GPU_FIELDS"
    HOST_SLOT_TWICE = "HOST_SLOT_TWICE"
    ALLOCATION_MISMATCH = "ALLOCATION_MISMATCH"
    ACCOUNTING = "ACCOUNTING"
    RECORD_UNREADABLE = "RECORD_UNREADABLE"
    ACK_LOST = "ACK_LOST"
    FREE_GPU_MAPPED = "FREE_GPU_MAPPED"
    MAPPED_TO_WRONG_HOST = "MAPPED_TO_WRONG_HOST"
    MAPPED_AT_WRONG_SLOT = "MAPPED_AT_WRONG_SLOT"
    MAPPED_IN_STATE = "MAPPED_IN_STATE"
    MAPPED_UNREGISTERED = "MAPPED_UNREGISTERED"
    ATTACHED_NOT_MAPPED = "ATTACHED_NOT_MAPPED"
    GPU_ON_TWO_HOSTS = "GPU_ON_TWO_HOSTS"
    FABRIC_TABLES_DIVERGE = "FABRIC_TABLES_DIVERGE"
    NODE_NOT_SETTLED = "NODE_NOT_SETTLED"
    GPU_NOT_SETTLED = "GPU_NOT_SETTLED"
    TERMINAL_NODE_OWNS_GPU = "TERMINAL_NODE_OWNS_GPU"
    QUARANTINED_WITHOUT_REASON = "QUARANTINED_WITHOUT_REASON"
    HOST_NOT_ALIVE = "HOST_NOT_ALIVE"
    LIVE_NODE_ON_LOST_HOST = "LIVE_NODE_ON_LOST_HOST"
    NODE_NOT_RELEASED = "NODE_NOT_RELEASED"
    GPU_NOT_FREE = "GPU_NOT_FREE"
    MAPPING_LEFT = "MAPPING_LEFT"
    ALLOCATION_LEFT = "ALLOCATION_LEFT"
    STATUS_LEFT = "STATUS_LEFT"
    FENCE_TIMEOUT = "FENCE_TIMEOUT"
    TENANT_USAGE = "TENANT_USAGE"
    GUARANTEE_PREEMPTED = "GUARANTEE_PREEMPTED"
    # Reported by the chaos run itself rather than by a snapshot check.
    UNEXPECTED_ERROR = "UNEXPECTED_ERROR"
    PROCESS_DIED = "PROCESS_DIED"
    NOT_RECOVERED = "NOT_RECOVERED"


@dataclass(frozen=True)
class Violation:
    """One broken invariant: its kind, the resource it concerns, and what was seen."""

    kind: Kind
    subject: str
    detail: str
    revision: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "subject": self.subject,
            "detail": self.detail,
            "revision": self.revision,
        }

    def __str__(self) -> str:
        at = f" @rev {self.revision}" if self.revision else ""
        return f"{self.kind} {self.subject}{at}: {self.detail}"


# -- etcd snapshot ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Record(Generic[M]):
    """A record as it was at the snapshot's revision."""

    value: M
    mod_revision: int


_MESSAGE_TYPES: dict[str, type[Message]] = {
    k.BOXES: pb.Box,
    k.GPUS: pb.Gpu,
    k.HOSTS: pb.Host,
    k.HOST_ALLOCATIONS: pb.HostAllocation,
    k.HOST_STATUSES: pb.HostStatus,
    k.NODES: pb.VirtualNode,
    k.TENANTS: pb.Tenant,
    k.GANGS: pb.GangRecord,
}


@dataclass
class EtcdSnapshot:
    """Every dxpool record under one prefix at one etcd revision.

    Keyed by resource name: GPUs ``boxes/{box}/gpus/{slot}``, nodes ``nodes/{id}``,
    boxes ``boxes/{id}``, hosts, allocations and statuses ``hosts/{id}``; ``leases`` holds
    the names of hosts whose liveness key exists. ``taken_at`` is ``time.monotonic()``
    when the read was sent: every write acknowledged before it is in the snapshot.
    """

    revision: int
    taken_at: float = 0.0
    boxes: dict[str, Record[pb.Box]] = field(default_factory=dict)
    gpus: dict[str, Record[pb.Gpu]] = field(default_factory=dict)
    hosts: dict[str, Record[pb.Host]] = field(default_factory=dict)
    leases: set[str] = field(default_factory=set)
    allocations: dict[str, Record[pb.HostAllocation]] = field(default_factory=dict)
    statuses: dict[str, Record[pb.HostStatus]] = field(default_factory=dict)
    nodes: dict[str, Record[pb.VirtualNode]] = field(default_factory=dict)
    tenants: dict[str, Record[pb.Tenant]] = field(default_factory=dict)
    gangs: dict[str, Record[pb.GangRecord]] = field(default_factory=dict)
    requests: dict[str, str] = field(default_factory=dict)
    unreadable: list[Violation] = field(default_factory=list)

    @classmethod
    def read(cls, client: Any, schema: KeySchema) -> EtcdSnapshot:
        """One linearizable range read of ``schema.prefix`` with an ``etcd3`` client."""
        taken_at = time.monotonic()
        response = client.get_prefix_response(schema.prefix)
        items = ((kv.key.decode(), kv.value, int(kv.mod_revision)) for kv in response.kvs)
        return cls.from_items(schema, int(response.header.revision), items, taken_at=taken_at)

    @classmethod
    def from_items(
        cls,
        schema: KeySchema,
        revision: int,
        items: Iterable[tuple[str, bytes, int]],
        *,
        taken_at: float = 0.0,
    ) -> EtcdSnapshot:
        """Decode ``(key, value, mod_revision)`` triples read at ``revision``."""
        snap = cls(revision=revision, taken_at=taken_at)
        for key, value, mod_revision in items:
            try:
                collection, rest = schema.split(key)
            except ValueError:
                continue  # not a dxpool record (another tool's key under the prefix)
            snap._add(collection, rest, key, value, mod_revision)
        return snap

    def _add(self, collection: str, rest: str, key: str, value: bytes, mod_revision: int) -> None:
        if collection == k.HOST_LEASES:
            self.leases.add(f"hosts/{rest}")
            return
        if collection == k.BROKERS:
            return  # a broker's registration: not pool state
        if collection == k.REQUESTS:
            self.requests[rest] = value.decode(errors="replace")
            return
        message = _MESSAGE_TYPES[collection]()
        try:
            message.ParseFromString(value)
        except DecodeError as error:
            self._unreadable(key, f"does not parse as {type(message).__name__}: {error}")
            return
        if collection == k.GPUS:
            box, _, slot = rest.partition("/")
            name = f"boxes/{box}/gpus/{slot}"
            self._expect_name(key, name, message)
            self.gpus[name] = Record(message, mod_revision)  # type: ignore[arg-type]
        elif collection == k.BOXES:
            name = f"boxes/{rest}"
            self._expect_name(key, name, message)
            self.boxes[name] = Record(message, mod_revision)  # type: ignore[arg-type]
        elif collection == k.NODES:
            name = f"nodes/{rest}"
            self._expect_name(key, name, message)
            self.nodes[name] = Record(message, mod_revision)  # type: ignore[arg-type]
        elif collection == k.HOSTS:
            self.hosts[f"hosts/{rest}"] = Record(message, mod_revision)  # type: ignore[arg-type]
        elif collection == k.HOST_ALLOCATIONS:
            self.allocations[f"hosts/{rest}"] = Record(message, mod_revision)  # type: ignore[arg-type]
        elif collection == k.HOST_STATUSES:
            self.statuses[f"hosts/{rest}"] = Record(message, mod_revision)  # type: ignore[arg-type]
        elif collection == k.TENANTS:
            self.tenants[rest] = Record(message, mod_revision)  # type: ignore[arg-type]
        elif collection == k.GANGS:
            self.gangs[f"gangs/{rest}"] = Record(message, mod_revision)  # type: ignore[arg-type]

    def _expect_name(self, key: str, name: str, message: Message) -> None:
        found = getattr(message, "name", name)
        if found != name:
            self._unreadable(key, f"record names itself {found!r}, its key says {name!r}")

    def _unreadable(self, key: str, detail: str) -> None:
        self.unreadable.append(Violation(Kind.RECORD_UNREADABLE, key, detail, self.revision))

    def gpu_items(self) -> list[tuple[str, pb.Gpu]]:
        """Every GPU as (name, record), by name."""
        return [(name, record.value) for name, record in sorted(self.gpus.items())]

    def node_items(self) -> list[tuple[str, pb.VirtualNode]]:
        """Every node as (name, record), by name."""
        return [(name, record.value) for name, record in sorted(self.nodes.items())]

    def gpu(self, name: str) -> pb.Gpu | None:
        record = self.gpus.get(name)
        return record.value if record is not None else None

    def node(self, name: str) -> pb.VirtualNode | None:
        record = self.nodes.get(name)
        return record.value if record is not None else None

    def gpu_counts(self) -> dict[str, int]:
        """GPUs by state name (``FREE``, ``ATTACHED``, ...) plus ``total``."""
        counts: Counter[str] = Counter(
            pb.GpuState.Name(r.value.state).removeprefix("GPU_STATE_") for r in self.gpus.values()
        )
        counts["total"] = len(self.gpus)
        return dict(counts)

    def node_counts(self) -> dict[str, int]:
        counts: Counter[str] = Counter(
            pb.NodeState.Name(r.value.state).removeprefix("NODE_STATE_")
            for r in self.nodes.values()
        )
        return dict(counts)


def gpu_name(box: str, slot: int) -> str:
    return f"boxes/{box}/gpus/{slot}"


def gpu_key(name: str) -> GpuKey:
    """``boxes/b1/gpus/3`` -> ``("b1", 3)``."""
    _, box, _, slot = name.split("/")
    return box, int(slot)


def _state(value: int) -> str:
    return pb.GpuState.Name(value).removeprefix("GPU_STATE_")  # type: ignore[arg-type]


def _node_state(value: int) -> str:
    return pb.NodeState.Name(value).removeprefix("NODE_STATE_")  # type: ignore[arg-type]


# -- fabric snapshot -------------------------------------------------------------------------


class FabricView(Protocol):
    """What the checker reads of a fabric; :class:`dxpool.fabric.sim.SimFabric` is one."""

    def boxes(self) -> Mapping[str, Sequence[object]]: ...

    def hosts(self) -> Mapping[str, int]: ...

    def mapping(self, box: str, slot: int) -> tuple[str, int] | None: ...

    def mappings(self, host: str) -> Mapping[int, tuple[str, int]]: ...


@dataclass(frozen=True)
class FabricSnapshot:
    """The box-side entry of every GPU and the host-side table of every host."""

    box_side: dict[GpuKey, HostSlot]
    host_side: dict[str, dict[int, GpuKey]]
    gpus: frozenset[GpuKey]

    @classmethod
    def read(cls, fabric: FabricView, attempts: int = 8) -> FabricSnapshot | None:
        """Read until two full reads agree (one state of the fabric); None if the fabric
        kept changing for ``attempts`` reads."""
        previous = cls._read_once(fabric)
        for _ in range(attempts - 1):
            current = cls._read_once(fabric)
            if current == previous:
                return current
            previous = current
        return None

    @classmethod
    def _read_once(cls, fabric: FabricView) -> FabricSnapshot:
        gpus = frozenset(
            (box, slot) for box, specs in fabric.boxes().items() for slot in range(len(specs))
        )
        box_side: dict[GpuKey, HostSlot] = {}
        for box, slot in sorted(gpus):
            target = fabric.mapping(box, slot)
            if target is not None:
                box_side[(box, slot)] = (target[0], int(target[1]))
        host_side = {
            host: {int(s): (g[0], int(g[1])) for s, g in fabric.mappings(host).items()}
            for host in sorted(fabric.hosts())
        }
        return cls(box_side, host_side, gpus)

    def mapped_to(self, host: str) -> dict[int, GpuKey]:
        """The host-side table of ``host`` (a host id, not ``hosts/...``)."""
        return dict(self.host_side.get(host, {}))


# -- safety: etcd records ----------------------------------------------------------------------


def check_records(snap: EtcdSnapshot) -> list[Violation]:
    """Every safety invariant that lives in etcd alone (see the module docstring)."""
    found = list(snap.unreadable)
    found += _check_accounting(snap)
    found += _check_gpu_fields(snap)
    found += _check_owners(snap)
    found += _check_claims(snap)
    found += _check_host_slots(snap)
    found += _check_allocations(snap)
    found += _check_tenant_usage(snap)
    found += _check_preemptions(snap)
    return found


# The states in which a charged node counts in its tenant's usage.
_CHARGED_STATES = frozenset(
    {
        pb.NODE_STATE_PENDING,
        pb.NODE_STATE_ATTACHING,
        pb.NODE_STATE_READY,
        pb.NODE_STATE_RESIZING,
        pb.NODE_STATE_DEGRADED,
    }
)


def _check_tenant_usage(snap: EtcdSnapshot) -> list[Violation]:
    """A tenant's usage is what its charged nodes hold: nodes, GPUs (every binding the
    node still lists), and of those the borrowed (preemptible) ones."""
    held: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for _, node in snap.node_items():
        if node.charged and node.spec.tenant and node.state in _CHARGED_STATES:
            counts = held[node.spec.tenant]
            counts[0] += 1
            counts[1] += len(node.gpus)
            if node.preemptible:
                counts[2] += 1
                counts[3] += len(node.gpus)
    found: list[Violation] = []
    for tenant in sorted(set(held) | set(snap.tenants)):
        record = snap.tenants.get(tenant)
        usage = record.value.usage if record is not None else pb.TenantUsage()
        recorded = [usage.nodes, usage.gpus, usage.borrowed_nodes, usage.borrowed_gpus]
        if recorded != held.get(tenant, [0, 0, 0, 0]):
            found.append(
                Violation(
                    Kind.TENANT_USAGE,
                    f"tenants/{tenant}",
                    f"usage (nodes, gpus, borrowed nodes, borrowed gpus) {recorded}, its "
                    f"charged nodes hold {held.get(tenant, [0, 0, 0, 0])}",
                    snap.revision,
                )
            )
    return found


def _check_preemptions(snap: EtcdSnapshot) -> list[Violation]:
    """A request (a node or gang waiting) takes GPUs only from borrowed nodes: a notice
    for one on a node within its tenant's guarantee breaks the guarantee."""
    found: list[Violation] = []
    for name, node in snap.node_items():
        by = node.preemption.by if node.HasField("preemption") else ""
        if by.startswith(("nodes/", "gangs/")) and not node.preemptible:
            found.append(
                Violation(
                    Kind.GUARANTEE_PREEMPTED,
                    name,
                    f"guaranteed node given a notice for {by}: {node.preemption.reason}",
                    snap.revision,
                )
            )
    return found


def _check_accounting(snap: EtcdSnapshot) -> list[Violation]:
    found: list[Violation] = []
    rev = snap.revision
    expected: set[str] = set()
    for box_name, box in snap.boxes.items():
        box_id = box_name.removeprefix("boxes/")
        expected |= {gpu_name(box_id, s) for s in range(box.value.gpu_count)}
    for name in sorted(expected - snap.gpus.keys()):
        found.append(Violation(Kind.ACCOUNTING, name, "slot of a box has no GPU record", rev))
    for name in sorted(snap.gpus.keys() - expected):
        found.append(
            Violation(Kind.ACCOUNTING, name, "GPU record outside every registered box", rev)
        )
    for name, gpu in snap.gpu_items():
        if gpu.state not in pb.GpuState.values() or gpu.state == 0:
            found.append(Violation(Kind.ACCOUNTING, name, f"GPU in unknown state {gpu.state}", rev))
    return found


def _check_gpu_fields(snap: EtcdSnapshot) -> list[Violation]:
    found: list[Violation] = []
    for name, gpu in snap.gpu_items():
        problem = ""
        if gpu.state == pb.GPU_STATE_FREE and (gpu.node or gpu.host):
            problem = f"FREE but owner={gpu.node!r} host={gpu.host!r}"
        elif gpu.state in OWNED_GPU_STATES and not (gpu.node and gpu.host):
            problem = f"{_state(gpu.state)} but owner={gpu.node!r} host={gpu.host!r}"
        elif gpu.state == pb.GPU_STATE_FENCING and not gpu.host:
            problem = "FENCING but no host to fence"
        if problem:
            found.append(Violation(Kind.GPU_FIELDS, name, problem, snap.revision))
    return found


def _check_owners(snap: EtcdSnapshot) -> list[Violation]:
    found: list[Violation] = []
    rev = snap.revision
    for name, gpu in snap.gpu_items():
        if not gpu.node:
            continue
        node = snap.node(gpu.node)
        if node is None:
            found.append(
                Violation(
                    Kind.OWNER_MISSING,
                    name,
                    f"{_state(gpu.state)} GPU owned by {gpu.node}, which does not exist",
                    rev,
                )
            )
        elif node.state == pb.NODE_STATE_RELEASED:
            found.append(
                Violation(
                    Kind.OWNER_RELEASED,
                    name,
                    f"{_state(gpu.state)} GPU owned by {gpu.node}, which is RELEASED",
                    rev,
                )
            )
        elif all(b.gpu != name for b in node.gpus) or node.host != gpu.host:
            found.append(
                Violation(
                    Kind.OWNER_UNAWARE,
                    name,
                    f"GPU owned by {gpu.node} on {gpu.host}; the node is on {node.host} and "
                    f"lists {[b.gpu for b in node.gpus]}",
                    rev,
                )
            )
    return found


def _let_go_by_shrink(
    snap: EtcdSnapshot, node_name: str, node: pb.VirtualNode, binding: pb.GpuBinding
) -> bool:
    """A RESIZING node's DETACHING binding whose GPU no longer names the node: a shrink
    the release path finished, whose binding the controller has not dropped yet."""
    if node.state != pb.NODE_STATE_RESIZING:
        return False
    if binding.phase != pb.ATTACHMENT_PHASE_DETACHING:
        return False
    gpu = snap.gpu(binding.gpu)
    return gpu is not None and gpu.node != node_name


def _check_claims(snap: EtcdSnapshot) -> list[Violation]:
    found: list[Violation] = []
    rev = snap.revision
    claims: dict[str, list[str]] = defaultdict(list)
    for node_name, node in snap.node_items():
        if node.state not in LIVE_NODE_STATES:
            continue
        for binding in node.gpus:
            if not _let_go_by_shrink(snap, node_name, node, binding):
                claims[binding.gpu].append(f"{node_name} ({_node_state(node.state)})")
        if node.state != pb.NODE_STATE_READY:
            continue
        for binding in node.gpus:
            gpu = snap.gpu(binding.gpu)
            if gpu is None or gpu.node != node_name or gpu.state != pb.GPU_STATE_ATTACHED:
                seen = (
                    "missing"
                    if gpu is None
                    else f"{_state(gpu.state)} owned by {gpu.node or 'nobody'}"
                )
                found.append(
                    Violation(
                        Kind.READY_NODE_GPU,
                        node_name,
                        f"READY node lists {binding.gpu}, which is {seen}",
                        rev,
                    )
                )
    for gpu_name_, nodes in sorted(claims.items()):
        if len(nodes) > 1:
            gpu = snap.gpu(gpu_name_)
            owner = gpu.node if gpu is not None else "missing"
            found.append(
                Violation(
                    Kind.DOUBLE_CLAIM,
                    gpu_name_,
                    f"claimed by live nodes {', '.join(nodes)}; Gpu.node is {owner or 'empty'}",
                    rev,
                )
            )
    return found


def _check_host_slots(snap: EtcdSnapshot) -> list[Violation]:
    found: list[Violation] = []
    rev = snap.revision
    slots: dict[HostSlot, list[str]] = defaultdict(list)
    for name, gpu in snap.gpu_items():
        if gpu.state in DESIRED_GPU_STATES and gpu.host:
            slots[(gpu.host, gpu.host_slot)].append(f"{name} ({_state(gpu.state)})")
    for (host, slot), gpus in sorted(slots.items()):
        if len(gpus) > 1:
            found.append(
                Violation(Kind.HOST_SLOT_TWICE, f"{host} slot {slot}", f"GPUs {gpus}", rev)
            )
    for host, allocation in sorted(snap.allocations.items()):
        by_slot: dict[int, list[str]] = defaultdict(list)
        by_gpu: Counter[str] = Counter()
        for attachment in allocation.value.attachments:
            by_slot[attachment.host_slot].append(attachment.gpu)
            by_gpu[attachment.gpu] += 1
        for slot, gpus_ in sorted(by_slot.items()):
            if len(gpus_) > 1:
                found.append(
                    Violation(
                        Kind.HOST_SLOT_TWICE,
                        f"{host} slot {slot}",
                        f"the host's allocation gives the slot to {gpus_}",
                        rev,
                    )
                )
        for listed, count in sorted(by_gpu.items()):
            if count > 1:
                found.append(
                    Violation(
                        Kind.HOST_SLOT_TWICE,
                        listed,
                        f"listed {count} times in the allocation of {host}",
                        rev,
                    )
                )
    return found


def _check_allocations(snap: EtcdSnapshot) -> list[Violation]:
    found: list[Violation] = []
    rev = snap.revision
    desired: dict[str, list[tuple[str, pb.DesiredAttachment]]] = defaultdict(list)
    for host, allocation in sorted(snap.allocations.items()):
        for attachment in allocation.value.attachments:
            desired[attachment.gpu].append((host, attachment))
            target = snap.gpu(attachment.gpu)
            if target is None:
                found.append(
                    Violation(
                        Kind.ALLOCATION_MISMATCH,
                        attachment.gpu,
                        f"in the allocation of {host}, but no such GPU exists",
                        rev,
                    )
                )
                continue
            wanted_states = RELEASE_GPU_STATES if attachment.release else DESIRED_GPU_STATES
            if (
                target.state not in wanted_states
                or (not attachment.release and target.node != attachment.node)
                or target.host != host
                or target.host_slot != attachment.host_slot
                or target.generation != attachment.generation
            ):
                found.append(
                    Violation(
                        Kind.ALLOCATION_MISMATCH,
                        attachment.gpu,
                        f"{host} wants it for {attachment.node} slot {attachment.host_slot} "
                        f"gen {attachment.generation}; the GPU is {_state(target.state)} owned by "
                        f"{target.node or 'nobody'} on {target.host or 'no host'} slot "
                        f"{target.host_slot} gen {target.generation}",
                        rev,
                    )
                )
    for name, gpu in snap.gpu_items():
        if gpu.state not in DESIRED_GPU_STATES:
            continue
        wanted = [
            a
            for where, a in desired.get(name, [])
            if where == gpu.host and a.generation == gpu.generation and not a.release
        ]
        if not wanted:
            found.append(
                Violation(
                    Kind.ALLOCATION_MISMATCH,
                    name,
                    f"{_state(gpu.state)} for {gpu.node} on {gpu.host} gen {gpu.generation}, "
                    "but the host's allocation does not list it",
                    rev,
                )
            )
    return found


def check_acknowledged(
    snap: EtcdSnapshot, acknowledged: Mapping[str, float], released: Iterable[str]
) -> list[Violation]:
    """``acknowledged``: node name -> ``time.monotonic()`` when the client got it back.

    A node acknowledged before the snapshot was read must be in it, unless the test
    released it (a released node may be garbage-collected).
    """
    gone = set(released)
    return [
        Violation(
            Kind.ACK_LOST,
            name,
            f"compose was acknowledged {snap.taken_at - at:.1f}s before this read, "
            "but the node is not in etcd",
            snap.revision,
        )
        for name, at in sorted(acknowledged.items())
        if at < snap.taken_at and name not in snap.nodes and name not in gone
    ]


# -- safety: etcd against the fabric ---------------------------------------------------------


@dataclass(frozen=True)
class FabricCheck:
    """Result of :func:`check_fabric`: violations, and how many mapped or ATTACHED GPUs
    could not be judged because their record changed while the fabric was read."""

    violations: list[Violation]
    inconclusive: int


def check_fabric(before: EtcdSnapshot, fabric: FabricSnapshot, after: EtcdSnapshot) -> FabricCheck:
    """Judge the fabric read between two etcd snapshots (see the module docstring)."""
    found = _check_fabric_tables(fabric, after.revision)
    inconclusive = 0
    for (box, slot), (host, host_slot) in sorted(fabric.box_side.items()):
        name = gpu_name(box, slot)
        known, gpu = _stable(before, after, name)
        if not known:
            inconclusive += 1
            continue
        where = f"mapped to {host} slot {host_slot}"
        rev = after.revision
        if gpu is None:
            found.append(Violation(Kind.MAPPED_UNREGISTERED, name, f"{where}; not in etcd", rev))
        elif gpu.state == pb.GPU_STATE_FREE:
            found.append(Violation(Kind.FREE_GPU_MAPPED, name, f"FREE in etcd but {where}", rev))
        elif gpu.state not in MAPPABLE_GPU_STATES:
            found.append(
                Violation(Kind.MAPPED_IN_STATE, name, f"{_state(gpu.state)} but {where}", rev)
            )
        elif gpu.host != f"hosts/{host}":
            found.append(
                Violation(
                    Kind.MAPPED_TO_WRONG_HOST,
                    name,
                    f"{_state(gpu.state)} on {gpu.host or 'no host'} (owner "
                    f"{gpu.node or 'nobody'}) but {where}",
                    rev,
                )
            )
        elif gpu.host_slot != host_slot and gpu.state in OWNED_GPU_STATES:
            found.append(
                Violation(
                    Kind.MAPPED_AT_WRONG_SLOT,
                    name,
                    f"{_state(gpu.state)} at slot {gpu.host_slot} of {gpu.host} but {where}",
                    rev,
                )
            )
    for name, record in sorted(after.gpus.items()):
        if record.value.state != pb.GPU_STATE_ATTACHED:
            continue
        known, gpu = _stable(before, after, name)
        if not known or gpu is None:
            inconclusive += 1
            continue
        target = fabric.box_side.get(gpu_key(name))
        want = (gpu.host.removeprefix("hosts/"), gpu.host_slot)
        if target != want:
            seen = f"mapped to {target[0]} slot {target[1]}" if target else "not mapped"
            found.append(
                Violation(
                    Kind.ATTACHED_NOT_MAPPED,
                    name,
                    f"ATTACHED to {gpu.host} slot {gpu.host_slot} for {gpu.node}, but {seen}",
                    after.revision,
                )
            )
    return FabricCheck(found, inconclusive)


def _stable(before: EtcdSnapshot, after: EtcdSnapshot, name: str) -> tuple[bool, pb.Gpu | None]:
    """``(True, record)`` if the GPU's record was the same in both snapshots, so it was
    that while the fabric was read in between (``(True, None)``: absent in both);
    ``(False, None)`` if it changed."""
    first, second = before.gpus.get(name), after.gpus.get(name)
    if first is None and second is None:
        return True, None
    if first is None or second is None or first.mod_revision != second.mod_revision:
        return False, None
    return True, first.value


def _check_fabric_tables(fabric: FabricSnapshot, revision: int) -> list[Violation]:
    found: list[Violation] = []
    hosts_of: dict[GpuKey, list[HostSlot]] = defaultdict(list)
    for host, table in sorted(fabric.host_side.items()):
        for host_slot, gpu in sorted(table.items()):
            hosts_of[gpu].append((host, host_slot))
    for gpu, places in sorted(hosts_of.items()):
        name = gpu_name(*gpu)
        if len({host for host, _ in places}) > 1:
            found.append(
                Violation(Kind.GPU_ON_TWO_HOSTS, name, f"in host tables {places}", revision)
            )
        box_side = fabric.box_side.get(gpu)
        for place in places:
            if box_side != place:
                found.append(
                    Violation(
                        Kind.FABRIC_TABLES_DIVERGE,
                        name,
                        f"host {place[0]} slot {place[1]} holds it; box side says {box_side}",
                        revision,
                    )
                )
    for gpu, place in sorted(fabric.box_side.items()):
        if fabric.host_side.get(place[0], {}).get(place[1]) != gpu:
            found.append(
                Violation(
                    Kind.FABRIC_TABLES_DIVERGE,
                    gpu_name(*gpu),
                    f"box side maps it to {place}; that host slot holds "
                    f"{fabric.host_side.get(place[0], {}).get(place[1])}",
                    revision,
                )
            )
    return found


# -- liveness ----------------------------------------------------------------------------------


def check_settled(snap: EtcdSnapshot, running_hosts: Iterable[str] = ()) -> list[Violation]:
    """After faults stopped and the pool had time to settle: no transient states left.

    ``running_hosts``: host names (``hosts/{id}``) whose agent runs, and so must hold a
    lease.
    """
    found: list[Violation] = []
    rev = snap.revision
    for name, node in snap.node_items():
        if node.state in TRANSIENT_NODE_STATES:
            found.append(
                Violation(
                    Kind.NODE_NOT_SETTLED,
                    name,
                    f"still {_node_state(node.state)} on {node.host}: {node.message}",
                    rev,
                )
            )
        elif node.state in LIVE_NODE_STATES and node.host not in snap.leases:
            found.append(
                Violation(
                    Kind.LIVE_NODE_ON_LOST_HOST,
                    name,
                    f"{_node_state(node.state)} on {node.host}, which holds no lease",
                    rev,
                )
            )
    for name, gpu in snap.gpu_items():
        if gpu.state in TRANSIENT_GPU_STATES:
            found.append(
                Violation(
                    Kind.GPU_NOT_SETTLED,
                    name,
                    f"still {_state(gpu.state)} for {gpu.node or 'nobody'} on {gpu.host}",
                    rev,
                )
            )
        if gpu.state == pb.GPU_STATE_QUARANTINED and not gpu.message:
            found.append(Violation(Kind.QUARANTINED_WITHOUT_REASON, name, "no message", rev))
        owner = snap.node(gpu.node) if gpu.node else None
        if owner is not None and owner.state in TERMINAL_NODE_STATES:
            found.append(
                Violation(
                    Kind.TERMINAL_NODE_OWNS_GPU,
                    name,
                    f"{_state(gpu.state)}, owned by {gpu.node}, which is "
                    f"{_node_state(owner.state)}",
                    rev,
                )
            )
    for host in sorted(set(running_hosts) - snap.leases):
        found.append(Violation(Kind.HOST_NOT_ALIVE, host, "its agent runs but holds no lease", rev))
    return found


def check_drained(snap: EtcdSnapshot, fabric: FabricSnapshot | None) -> list[Violation]:
    """After every node was released: all nodes RELEASED, every GPU FREE (or QUARANTINED
    with a reason), nothing allocated, reported or mapped."""
    found: list[Violation] = []
    rev = snap.revision
    for name, record in sorted(snap.nodes.items()):
        if record.value.state != pb.NODE_STATE_RELEASED:
            found.append(
                Violation(
                    Kind.NODE_NOT_RELEASED,
                    name,
                    f"{_node_state(record.value.state)} after release: {record.value.message}",
                    rev,
                )
            )
    quarantined: set[str] = set()
    for name, gpu in snap.gpu_items():
        if gpu.state == pb.GPU_STATE_QUARANTINED and gpu.message:
            quarantined.add(name)
        elif gpu.state != pb.GPU_STATE_FREE:
            found.append(
                Violation(
                    Kind.GPU_NOT_FREE,
                    name,
                    f"{_state(gpu.state)} owned by {gpu.node or 'nobody'} on "
                    f"{gpu.host or 'no host'}: {gpu.message}",
                    rev,
                )
            )
    for host, allocation in sorted(snap.allocations.items()):
        for attachment in allocation.value.attachments:
            found.append(
                Violation(
                    Kind.ALLOCATION_LEFT,
                    attachment.gpu,
                    f"still wanted on {host} for {attachment.node}",
                    rev,
                )
            )
    for host, status in sorted(snap.statuses.items()):
        for observed in status.value.attachments:
            if observed.gpu not in quarantined:
                found.append(
                    Violation(
                        Kind.STATUS_LEFT,
                        observed.gpu,
                        f"{host} still reports it "
                        f"{pb.AttachmentPhase.Name(observed.phase).removeprefix('ATTACHMENT_PHASE_')}"
                        f": {observed.message}",
                        rev,
                    )
                )
    if fabric is not None:
        for (box, slot), (host, host_slot) in sorted(fabric.box_side.items()):
            if gpu_name(box, slot) not in quarantined:
                found.append(
                    Violation(
                        Kind.MAPPING_LEFT,
                        gpu_name(box, slot),
                        f"still mapped to {host} slot {host_slot}",
                        rev,
                    )
                )
    return found


def check_fenced(
    snap: EtcdSnapshot, fabric: FabricSnapshot | None, host: str, lost_for_s: float
) -> list[Violation]:
    """etcd dropped the lease of ``host`` (``hosts/{id}``) ``lost_for_s`` seconds ago,
    longer than the fencing bound, and its agent is still gone: its nodes must no longer
    be live, its GPUs no longer attaching, attached or detaching on it, and the box side
    must map nothing to it (QUARANTINED GPUs excepted)."""
    problems: list[str] = []
    live = [
        f"{name} ({_node_state(r.value.state)})"
        for name, r in sorted(snap.nodes.items())
        if r.value.host == host and r.value.state in LIVE_NODE_STATES
    ]
    if live:
        problems.append(f"live nodes {live}")
    unfenced = [
        f"{name} ({_state(r.value.state)})"
        for name, r in sorted(snap.gpus.items())
        if r.value.host == host and r.value.state in UNFENCED_GPU_STATES
    ]
    if unfenced:
        problems.append(f"GPUs not fenced {unfenced}")
    if fabric is not None:
        host_id = host.removeprefix("hosts/")
        mapped = [
            gpu_name(*gpu)
            for gpu, (target, _) in sorted(fabric.box_side.items())
            if target == host_id
            and (snap.gpu(gpu_name(*gpu)) or pb.Gpu()).state != pb.GPU_STATE_QUARANTINED
        ]
        if mapped:
            problems.append(f"box side still maps {mapped} to it")
    if not problems:
        return []
    return [
        Violation(
            Kind.FENCE_TIMEOUT,
            host,
            f"lease gone for {lost_for_s:.1f}s, agent still stopped: " + "; ".join(problems),
            snap.revision,
        )
    ]


def is_settled(snap: EtcdSnapshot) -> bool:
    """No node or GPU is in a transient state, and no terminal node owns a GPU."""
    return not any(
        v.kind in (Kind.NODE_NOT_SETTLED, Kind.GPU_NOT_SETTLED, Kind.TERMINAL_NODE_OWNS_GPU)
        for v in check_settled(snap)
    )


__all__ = [
    "EtcdSnapshot",
    "FabricCheck",
    "FabricSnapshot",
    "FabricView",
    "Kind",
    "Record",
    "Violation",
    "check_acknowledged",
    "check_drained",
    "check_fabric",
    "check_fenced",
    "check_records",
    "check_settled",
    "is_settled",
]
