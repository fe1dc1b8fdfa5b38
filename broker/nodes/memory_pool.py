"""A dxpool pool in one process, for schedulers and simulators that embed placement.

:class:`InMemoryPool` holds an inventory (boxes of GPUs, hosts with proxy slots, CPU and
memory) in the broker's own :class:`~dxpool.broker.state.cache.Cache` and
:class:`~dxpool.broker.state.placement_index.PlacementIndex`, with no etcd: its records are the
stored ``resources.proto`` messages, written with rising revisions the way the broker
applies what it reads from etcd. So :meth:`~InMemoryPool.place` decides exactly as a
broker would on the same inventory, on the index's versioned snapshots (placement
carries its work over from one to the next), and :meth:`~InMemoryPool.commit` and
:meth:`~InMemoryPool.release` write the records compose and the node controller write:
the GPUs assigned to the node (``broker/nodes/fit.py``, the code compose commits with), the
host's allocation holding their proxy slots and the node's CPU and memory
(``HostReservation``), the node record, and back again.

It adds what a scheduler needs around placement:

* **anti-affinity** (:class:`AntiAffinity`): "not on hosts running X", "at most N of X
  per host", as the hosts to exclude (``PlacementRequest.exclude_hosts``), counted from
  the labels of the nodes the pool holds;
* **host reservations** of CPU cores and memory with no GPU (:meth:`~InMemoryPool.reserve`,
  :mod:`~dxpool.broker.placement.reserve`), held in the allocation like any node's;
* model sets naming a model twice, accepted and held with each model once (as every
  request, see :class:`~dxpool.broker.placement.model.PlacementRequest`).

One writer at a time: calls are serialized by a lock, and a placement is decided on the
snapshot of the moment. A placement committed later than other commits is checked
against the records first (:class:`~dxpool.errors.Aborted` when its GPUs, slots, CPU
or memory went meanwhile: place again).

**The garbage collector.** A pool given a :class:`~dxpool.gc_policy.CollectorPolicy`
(``collector=``) calls its :meth:`~dxpool.gc_policy.CollectorPolicy.between` after each
commit, compose, reservation and release, outside the pool's lock, as the broker does
after each compose: start the policy once the inventory is loaded, and collections run
there rather than inside placement. Without one, the collector is left as it is.

Usage::

    pool = InMemoryPool()
    pool.add_box("b1", "H100", 8)
    pool.add_host("h1", slots=8, cpu_cores=96, memory_mib=393216)
    request = PlacementRequest("H100", 2, cpu_cores=16)
    result = pool.place(request)
    node = pool.commit("n1", request, result.placement, labels={"app": "db"})
    pool.release("n1")
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.fit import assign_gpus, reserve_host_resources
from dxpool.broker.placement.model import (
    LatencyModel,
    Placement,
    PlacementRequest,
    PlacementResult,
    Snapshot,
)
from dxpool.broker.placement.pipeline import Pipeline
from dxpool.broker.placement.placer import place
from dxpool.broker.placement.reserve import HostChoice, HostRequest, choose_host
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.placement_index import PlacementIndex
from dxpool.errors import Aborted, AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from dxpool.fabric.latency import TopologyLatencyModel
from dxpool.fabric.topology import Topology
from dxpool.gc_policy import CollectorPolicy
from dxpool.names import check_id
from dxpool.records import copy, timestamp
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Versioned
from dxpool.text import check_labels

_UNREACHABLE = "127.0.0.1:9"  # the cache is never started: no watch, no etcd
DEFAULT_GPU_MEMORY_MIB = 81920


@dataclass(frozen=True, slots=True)
class AntiAffinity:
    """Keep a node off the hosts that run ``limit`` or more nodes whose labels hold
    every pair of ``selector``: ``limit`` 1 is "not on hosts running X", N is "at most N
    of X per host" for a node that is itself an X. An empty selector counts every
    node."""

    selector: Mapping[str, str]
    limit: int = 1

    def __post_init__(self) -> None:
        check_labels(dict(self.selector), "anti-affinity selector")
        if self.limit < 1:
            raise InvalidArgument(
                f"anti-affinity limit {self.limit}: a host may run at most limit - 1 such "
                "nodes, so the limit is 1 (none) or more",
                reason="INVALID_ANTI_AFFINITY",
            )


@dataclass(slots=True)
class _Held:
    """What the pool knows of one node it holds."""

    host: str
    labels: frozenset[tuple[str, str]]
    gpus: tuple[tuple[str, int], ...]  # (box, slot)
    reservation: bool


@dataclass(frozen=True, slots=True)
class PoolCounts:
    """GPUs, proxy slots, CPU cores and memory free in the pool, in all."""

    gpus: int
    slots: int
    cpu_cores: int
    memory_mib: int
    free_by_model: Mapping[str, int] = field(default_factory=dict)


class InMemoryPool:
    """See the module docstring. ``latency`` defaults to the tree model of the default
    topology, ``pipeline`` to the broker's; ``clock`` stamps the records; ``collector``
    (started by the caller, not by the pool) runs between the pool's writes."""

    def __init__(
        self,
        *,
        latency: LatencyModel | None = None,
        pipeline: Pipeline | None = None,
        clock: Callable[[], float] = time.time,
        prefix: str = "/dxpool/v1/",
        collector: CollectorPolicy | None = None,
    ) -> None:
        self.collector = collector
        self.latency = latency or TopologyLatencyModel(Topology.default())
        self.pipeline = pipeline
        self._clock = clock
        self._lock = threading.RLock()
        self._schema = KeySchema(prefix)
        self._cache = Cache(_UNREACHABLE, self._schema)
        self._revision = 0
        self._index = PlacementIndex(self._cache)
        self._nodes: dict[str, _Held] = {}
        self._on_host: dict[str, set[str]] = {}
        self._by_label: dict[tuple[str, str], Counter[str]] = {}
        self._free_gpus = 0
        self._free_slots = 0
        self._free_cpu = 0
        self._free_memory = 0

    # -- the inventory ---------------------------------------------------------------

    @property
    def cache(self) -> Cache:
        """The records, as the broker's cache holds them (read them, never write)."""
        return self._cache

    @property
    def index(self) -> PlacementIndex:
        return self._index

    def snapshot(self) -> Snapshot:
        """The placement index's snapshot of now (versioned: placement carries over)."""
        return self._index.snapshot()

    def _put(self, collection: str, name: str, value: object | None) -> None:
        self._revision += 1
        key = self._schema.key(collection, name)
        record = None if value is None else Versioned(value, self._revision, 1)
        self._cache.apply_read(key, record, self._revision)

    def _get(self, collection: str, name: str) -> Any:
        found = self._cache.get(collection, name)
        return None if found is None else found.value

    def add_box(
        self,
        box_id: str,
        model: str,
        count: int,
        *,
        memory_mib: int = DEFAULT_GPU_MEMORY_MIB,
        location: tuple[str, str, str] = ("", "", ""),
        schedulable: bool = True,
    ) -> None:
        """A box of ``count`` GPUs of ``model`` (slots 0..count-1), all free, at
        ``location`` (site, pod, rack)."""
        check_id(box_id, "box")
        if not 1 <= count <= 64:
            raise InvalidArgument(f"a box holds 1 to 64 GPUs, got {count}")
        with self._lock:
            if self._get(k.BOXES, box_id) is not None:
                raise AlreadyExists(f"box boxes/{box_id} exists", reason="BOX_EXISTS")
            site, pod, rack = location
            state = pb.BOX_STATE_ACTIVE if schedulable else pb.BOX_STATE_CORDONED
            self._put(
                k.BOXES,
                box_id,
                pb.Box(
                    name=f"boxes/{box_id}",
                    location=pb.Location(site=site, pod=pod, rack=rack),
                    state=state,
                ),
            )
            for slot in range(count):
                gpu = pb.Gpu(
                    name=f"boxes/{box_id}/gpus/{slot}",
                    box=f"boxes/{box_id}",
                    slot=slot,
                    model=model,
                    memory_mib=memory_mib,
                    state=pb.GPU_STATE_FREE,
                )
                self._put(k.GPUS, f"{box_id}/{slot}", gpu)
            self._free_gpus += count

    def add_host(
        self,
        host_id: str,
        slots: int,
        *,
        cpu_cores: int = 0,
        memory_mib: int = 0,
        labels: Mapping[str, str] | None = None,
        location: tuple[str, str, str] = ("", "", ""),
    ) -> None:
        """A live host with ``slots`` proxy slots, declaring ``cpu_cores`` and
        ``memory_mib`` (0: not declared) and ``labels``."""
        check_id(host_id, "host")
        check_labels(dict(labels or {}), "labels")
        with self._lock:
            if self._get(k.HOSTS, host_id) is not None:
                raise AlreadyExists(f"host hosts/{host_id} exists", reason="HOST_EXISTS")
            site, pod, rack = location
            self._put(
                k.HOSTS,
                host_id,
                pb.Host(
                    name=f"hosts/{host_id}",
                    location=pb.Location(site=site, pod=pod, rack=rack),
                    slot_capacity=slots,
                    cpu_cores=cpu_cores,
                    memory_mib=memory_mib,
                    labels=dict(labels or {}),
                ),
            )
            self._put(k.HOST_LEASES, host_id, b"")
            self._put(k.HOST_ALLOCATIONS, host_id, pb.HostAllocation(host=f"hosts/{host_id}"))
            self._free_slots += slots
            self._free_cpu += cpu_cores
            self._free_memory += memory_mib

    def set_alive(self, host_id: str, alive: bool) -> None:
        """A host's agent holds its lease (True) or lost it (False): placement keeps
        only live hosts; the nodes on it stay as they are."""
        with self._lock:
            if self._get(k.HOSTS, host_id) is None:
                raise NotFound(f"host hosts/{host_id} does not exist", reason="HOST_NOT_FOUND")
            self._put(k.HOST_LEASES, host_id, b"" if alive else None)

    def counts(self) -> PoolCounts:
        """What is free in the pool, in all (GPUs of boxes that are schedulable or not)."""
        with self._lock:
            return PoolCounts(
                self._free_gpus,
                self._free_slots,
                self._free_cpu,
                self._free_memory,
                dict(self.snapshot().free_by_model()),
            )

    # -- placing ---------------------------------------------------------------------

    def excluded_by(self, rules: Iterable[AntiAffinity]) -> frozenset[str]:
        """The hosts ``rules`` keep a node off (see :class:`AntiAffinity`)."""
        with self._lock:
            excluded: set[str] = set()
            for rule in rules:
                excluded.update(self._running(frozenset(rule.selector.items()), rule.limit))
            return frozenset(excluded)

    def _running(self, selector: frozenset[tuple[str, str]], limit: int) -> set[str]:
        """The hosts running ``limit`` or more nodes whose labels hold ``selector``."""
        if not selector:
            return {host for host, nodes in self._on_host.items() if len(nodes) >= limit}
        counters = [self._by_label.get(pair, Counter()) for pair in selector]
        rarest = min(counters, key=len)
        found: set[str] = set()
        for host, count in rarest.items():
            if count < limit:
                continue
            matching = sum(
                1 for node in self._on_host[host] if selector <= self._nodes[node].labels
            )
            if matching >= limit:
                found.add(host)
        return found

    def place(
        self, request: PlacementRequest, anti_affinity: Iterable[AntiAffinity] = ()
    ) -> PlacementResult:
        """Where ``request`` would go now, and why (nothing is written): the broker's
        :func:`~dxpool.broker.placement.place` on the index's snapshot, with the hosts
        ``anti_affinity`` excludes added to the request's own."""
        with self._lock:
            rules = tuple(anti_affinity)
            if rules:
                excluded = request.exclude_hosts | self.excluded_by(rules)
                request = replace(request, exclude_hosts=excluded)
            return place(request, self.snapshot(), self.latency, self.pipeline)

    def commit(
        self,
        node_id: str,
        request: PlacementRequest,
        placement: Placement,
        *,
        labels: Mapping[str, str] | None = None,
    ) -> pb.VirtualNode:
        """Writes ``placement`` (of ``request``) as compose commits it: the node PENDING,
        its GPUs ATTACHING to it, the host's allocation holding their slots and the
        node's CPU and memory. Raises :class:`~dxpool.errors.Aborted` when a GPU, slot,
        CPU or memory it relies on went since it was placed (nothing is written),
        :class:`~dxpool.errors.AlreadyExists` for a node id in use."""
        check_id(node_id, "node")
        check_labels(dict(labels or {}), "labels")
        with self._lock:
            node = self._commit(node_id, request, placement, labels)
        self._between()
        return node

    def _commit(
        self,
        node_id: str,
        request: PlacementRequest,
        placement: Placement,
        labels: Mapping[str, str] | None,
    ) -> pb.VirtualNode:
        with self._lock:
            self._check_new(node_id)
            host = self._get(k.HOSTS, placement.host)
            allocation = self._allocation(placement.host)
            spec = pb.NodeSpec(
                gpus=pb.GpuRequest(
                    model=request.model,
                    count=request.count,
                    min_memory_mib=request.min_memory_mib,
                    mixed_models=request.mixed_models,
                ),
                labels=dict(labels or {}),
                cpu_cores=request.cpu_cores,
                host_memory_mib=request.host_memory_mib,
            )
            node = self._new_node(node_id, spec, placement.host)
            if not reserve_host_resources(host, allocation, spec, node.name):
                raise Aborted(
                    f"hosts/{placement.host} no longer has the CPU or memory placed on: "
                    "place again",
                    reason="COMMIT_CONFLICT",
                )
            used = {attachment.host_slot for attachment in allocation.attachments}
            assigned = assign_gpus(self._cache, placement, node, allocation, used, False)
            if assigned is None:
                raise Aborted(
                    "a GPU or host slot placed on was taken or its box cordoned since: place again",
                    reason="COMMIT_CONFLICT",
                )
            for name, _, gpu in assigned:
                self._put(k.GPUS, name, gpu)
            self._put(k.HOST_ALLOCATIONS, placement.host, allocation)
            self._put(k.NODES, node_id, node)
            gpus = tuple((b.box, b.slot) for b in placement.bindings)
            self._hold(node_id, _Held(placement.host, _pairs(labels), gpus, False), spec)
            return node

    def compose(
        self,
        node_id: str,
        request: PlacementRequest,
        *,
        labels: Mapping[str, str] | None = None,
        anti_affinity: Iterable[AntiAffinity] = (),
    ) -> pb.VirtualNode:
        """:meth:`place` then :meth:`commit`; raises
        :class:`~dxpool.errors.ResourceExhausted` with placement's account when nothing
        fits."""
        with self._lock:
            result = self.place(request, anti_affinity)
            if result.placement is None:
                raise ResourceExhausted(
                    "no placement: " + "; ".join(result.unsatisfied), reason="NO_CAPACITY"
                )
            check_id(node_id, "node")
            check_labels(dict(labels or {}), "labels")
            node = self._commit(node_id, request, result.placement, labels)
        self._between()
        return node

    def reserve(
        self,
        node_id: str,
        request: HostRequest,
        *,
        labels: Mapping[str, str] | None = None,
        anti_affinity: Iterable[AntiAffinity] = (),
    ) -> pb.VirtualNode | HostChoice:
        """Holds ``request``'s CPU cores and memory on a host, with no GPU: a node
        record with no GPUs and its ``HostReservation`` in the host's allocation, on the
        host :func:`~dxpool.broker.placement.reserve.choose_host` picks. Returns the
        node, or the choice (no host, and why) when no host can hold it."""
        check_id(node_id, "node")
        check_labels(dict(labels or {}), "labels")
        with self._lock:
            self._check_new(node_id)
            rules = tuple(anti_affinity)
            if rules:
                excluded = request.exclude_hosts | self.excluded_by(rules)
                request = replace(request, exclude_hosts=excluded)
            choice = choose_host(request, self.snapshot(), self.pipeline)
            if choice.host is None:
                return choice
            spec = pb.NodeSpec(
                labels=dict(labels or {}),
                cpu_cores=request.cpu_cores,
                host_memory_mib=request.host_memory_mib,
            )
            node = self._new_node(node_id, spec, choice.host)
            allocation = self._allocation(choice.host)
            held = reserve_host_resources(
                self._get(k.HOSTS, choice.host), allocation, spec, node.name
            )
            assert held, "placement chose a host without the CPU or memory"
            self._put(k.HOST_ALLOCATIONS, choice.host, allocation)
            self._put(k.NODES, node_id, node)
            self._hold(node_id, _Held(choice.host, _pairs(labels), (), True), spec)
        self._between()
        return node

    def release(self, node_id: str) -> None:
        """Lets a node go as the controller does once its GPUs are detached and
        scrubbed: its GPUs FREE, its slots, CPU and memory out of the host's allocation,
        its record gone (as the leader collects released nodes)."""
        with self._lock:
            self._release(node_id)
        self._between()

    def _between(self) -> None:
        """The collector's turn, outside the lock: see the module docstring."""
        if self.collector is not None:
            self.collector.between()

    def _release(self, node_id: str) -> None:
        with self._lock:
            held = self._nodes.pop(node_id, None)
            if held is None:
                raise NotFound(f"node nodes/{node_id} does not exist", reason="NODE_NOT_FOUND")
            node: pb.VirtualNode = self._get(k.NODES, node_id)
            name = f"nodes/{node_id}"
            for box, slot in held.gpus:
                gpu = self._get(k.GPUS, f"{box}/{slot}")
                self._put(k.GPUS, f"{box}/{slot}", lifecycle.free(lifecycle.begin_detach(gpu)))
            allocation = self._allocation(held.host)
            kept = [a for a in allocation.attachments if a.node != name]
            reservations = [r for r in allocation.reservations if r.node != name]
            del allocation.attachments[:]
            allocation.attachments.extend(kept)
            del allocation.reservations[:]
            allocation.reservations.extend(reservations)
            self._put(k.HOST_ALLOCATIONS, held.host, allocation)
            self._put(k.NODES, node_id, None)
            self._on_host[held.host].discard(node_id)
            for pair in held.labels:
                counter = self._by_label[pair]
                counter[held.host] -= 1
                if counter[held.host] <= 0:
                    del counter[held.host]
            self._free_gpus += len(held.gpus)
            self._free_slots += len(held.gpus)
            self._free_cpu += node.spec.cpu_cores
            self._free_memory += node.spec.host_memory_mib

    def node(self, node_id: str) -> pb.VirtualNode | None:
        """A node the pool holds, as its record stands."""
        with self._lock:
            found: pb.VirtualNode | None = self._get(k.NODES, node_id)
            return found

    # -- bookkeeping -----------------------------------------------------------------

    def _check_new(self, node_id: str) -> None:
        if node_id in self._nodes:
            raise AlreadyExists(
                f"node nodes/{node_id} exists; pick another id", reason="NODE_EXISTS"
            )

    def _allocation(self, host_id: str) -> pb.HostAllocation:
        found = self._get(k.HOST_ALLOCATIONS, host_id)
        # cached records are shared: never mutate them
        return copy(found) if found is not None else pb.HostAllocation(host=f"hosts/{host_id}")

    def _new_node(self, node_id: str, spec: pb.NodeSpec, host: str) -> pb.VirtualNode:
        now = self._clock()
        node = pb.VirtualNode(
            name=f"nodes/{node_id}",
            spec=spec,
            host=f"hosts/{host}",
            state=pb.NODE_STATE_PENDING,
            message="waiting for the host agent to attach the GPUs",
            create_time=timestamp(now),
            update_time=timestamp(now),
        )
        lifecycle.new_node_event(node, now)
        return node

    def _hold(self, node_id: str, held: _Held, spec: pb.NodeSpec) -> None:
        self._nodes[node_id] = held
        self._on_host.setdefault(held.host, set()).add(node_id)
        for pair in held.labels:
            self._by_label.setdefault(pair, Counter())[held.host] += 1
        self._free_gpus -= len(held.gpus)
        self._free_slots -= len(held.gpus)
        self._free_cpu -= spec.cpu_cores
        self._free_memory -= spec.host_memory_mib


def _pairs(labels: Mapping[str, str] | None) -> frozenset[tuple[str, str]]:
    return frozenset((labels or {}).items())


__all__ = ["AntiAffinity", "HostChoice", "HostRequest", "InMemoryPool", "PoolCounts"]
