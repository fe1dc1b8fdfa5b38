"""A dxpool pool in one process: the broker's own cache, placement index and pipeline,
with no etcd.

Records are the stored ``resources.proto`` messages, written into a real
:class:`~dxpool.broker.cache.Cache` with rising revisions the way the broker applies what
it reads from etcd (``apply_read``); a real
:class:`~dxpool.broker.placement_index.PlacementIndex` subscribes to it and hands out the
snapshots that :func:`~dxpool.broker.placement.place` decides on. A granted node is
committed as compose commits it (its GPUs ATTACHED to the node, the host's allocation
holding its slots) and released as the node controller frees it, so every decision is
the allocator's, on the state its own earlier decisions left.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.traces.allocator import NONE, Cause, Grant, Resources, refusal
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.cache import Cache
from dxpool.broker.placement import Pipeline, Placement, PlacementRequest, place
from dxpool.broker.placement_index import PlacementIndex
from dxpool.fabric.latency import LatencyModel, TopologyLatencyModel
from dxpool.fabric.topology import Topology
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Versioned

_PREFIX = "/bench/"
_UNREACHABLE = "127.0.0.1:9"  # the cache is never started: no watch, no etcd


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """What a pool is made of: per box, its GPUs' model and count; per host, its proxy
    slot count and, when given, the CPU and memory (MiB) it declares (``Host.cpu_cores``,
    ``Host.memory_mib``: in the allocator's CPU unit, see ``bench.traces.data``). Boxes
    and hosts are dealt round-robin over ``racks`` racks of one pod."""

    boxes: Sequence[tuple[str, int]]
    host_slots: Sequence[int]
    racks: int = 1
    host_cpus: Sequence[int] = ()
    host_memory_mib: Sequence[int] = ()

    @property
    def gpus(self) -> int:
        return sum(count for _, count in self.boxes)


def boxes_of(gpus_by_model: dict[str, int], per_box: int = 8) -> list[tuple[str, int]]:
    """GPUs of each model put into boxes of ``per_box`` (the last box of a model may hold
    fewer); models in name order."""
    boxes: list[tuple[str, int]] = []
    for model in sorted(gpus_by_model):
        full, rest = divmod(gpus_by_model[model], per_box)
        boxes += [(model, per_box)] * full + ([(model, rest)] if rest else [])
    return boxes


@dataclass(slots=True)
class _Node:
    name: str
    host: str
    placement: Placement | None  # None: a CPU-only pod, a reservation alone
    needs: Resources


@dataclass(slots=True)
class DecisionTimes:
    """Seconds per placement decision (snapshot plus ``place()``), granted or not."""

    samples: list[float] = field(default_factory=list)

    def percentile(self, fraction: float) -> float:
        """The sample at ``fraction`` (0-1) of the sorted samples; 0 when there are none."""
        ordered = sorted(self.samples)
        if not ordered:
            return 0.0
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class DxpoolPool:
    """An :class:`~bench.traces.allocator.Allocator` backed by dxpool's placement.

    ``pipeline`` defaults to the broker's (the registry's default pipeline);
    requests ask for any GPU model, no latency bound, and the CPU and memory given
    (``PlacementRequest.cpu_cores``, ``host_memory_mib``). A granted node holds them in
    its host's allocation as a ``HostReservation``, as compose writes it.

    With any model and no bound, placement can serve ``n`` GPUs exactly when the pool
    has ``n`` free GPUs and some live host ``n`` free slots with the CPU and memory
    asked for free (as ``GetPoolStatus`` counts them). A request the counts already
    refuse is therefore refused without asking placement (whose account of why runs
    over every host and would dominate a run at 130% demand), unless ``verify_refusals``
    is set: then placement is asked anyway and must refuse too. Either way, a request
    the counts admit that placement refuses is a bug and raises ``RuntimeError``.

    A CPU-only pod (0 GPUs) is not a node: dxpool composes GPU nodes, and whatever runs
    CPU-only work on the hosts holds its share. The harness takes that part: it
    reserves the pod's CPU and memory on the host with the fewest free slots that holds
    them (then the least free CPU, then the lowest id), as the fixed servers' best fit
    does, and placement sees the reservation as any other.
    """

    def __init__(
        self,
        name: str,
        layout: PoolLayout,
        *,
        pipeline: Pipeline | None = None,
        latency: LatencyModel | None = None,
        verify_refusals: bool = False,
    ) -> None:
        if not layout.boxes or not layout.host_slots or layout.racks < 1:
            raise ValueError("a pool needs at least one box, one host and one rack")
        self.name = name
        self.capacity = layout.gpus
        self.times = DecisionTimes()
        self._verify_refusals = verify_refusals
        self._pipeline = pipeline
        self._latency = latency or TopologyLatencyModel(Topology.default())
        self._schema = KeySchema(_PREFIX)
        self._cache = Cache(_UNREACHABLE, self._schema)
        self._revision = 0
        self._gpus: dict[tuple[str, int], pb.Gpu] = {}
        self._attachments: dict[str, list[pb.DesiredAttachment]] = {}
        self._reservations: dict[str, list[pb.HostReservation]] = {}
        self._free_slots: dict[str, int] = {}
        self._free_cpu: dict[str, int] = {}
        self._free_memory: dict[str, int] = {}
        self._free_gpus = layout.gpus
        self._next_node = 0
        self._load(layout)
        self._index = PlacementIndex(self._cache)

    # -- the inventory, as the broker's cache holds it ---------------------------------

    def _put(self, key: str, value: object) -> None:
        self._revision += 1
        self._cache.apply_read(key, Versioned(value, self._revision, 1), self._revision)

    def _load(self, layout: PoolLayout) -> None:
        def location(index: int) -> pb.Location:
            return pb.Location(site="dc1", pod="p1", rack=f"r{index % layout.racks}")

        for index, (model, count) in enumerate(layout.boxes):
            box = f"b{index:05d}"
            self._put(
                self._schema.box(box),
                pb.Box(name=f"boxes/{box}", location=location(index), state=pb.BOX_STATE_ACTIVE),
            )
            for slot in range(count):
                gpu = pb.Gpu(
                    name=f"boxes/{box}/gpus/{slot}",
                    box=f"boxes/{box}",
                    slot=slot,
                    model=model,
                    memory_mib=81920,
                    state=pb.GPU_STATE_FREE,
                )
                self._gpus[(box, slot)] = gpu
                self._put(self._schema.gpu(box, slot), gpu)
        hosts = len(layout.host_slots)
        cpus = list(layout.host_cpus) or [0] * hosts
        memory = list(layout.host_memory_mib) or [0] * hosts
        if len(cpus) != hosts or len(memory) != hosts:
            raise ValueError(f"CPU and memory must be given for all {hosts} hosts or none")
        for index, slots in enumerate(layout.host_slots):
            host = f"h{index:05d}"
            record = pb.Host(
                name=f"hosts/{host}",
                location=location(index),
                slot_capacity=slots,
                cpu_cores=cpus[index],
                memory_mib=memory[index],
            )
            self._put(self._schema.host(host), record)
            self._put(self._schema.host_lease(host), b"")
            self._attachments[host] = []
            self._reservations[host] = []
            self._put_allocation(host)
            self._free_slots[host] = slots
            self._free_cpu[host] = cpus[index]
            self._free_memory[host] = memory[index]
        self._totals = [sum(layout.host_slots), sum(cpus), sum(memory)]

    def _put_allocation(self, host: str) -> None:
        allocation = pb.HostAllocation(
            host=f"hosts/{host}",
            attachments=self._attachments[host],
            reservations=self._reservations[host],
        )
        self._put(self._schema.host_allocation(host), allocation)

    def _set_gpu(self, box: str, slot: int, node: str) -> None:
        gpu = pb.Gpu()
        gpu.CopyFrom(self._gpus[(box, slot)])
        gpu.state = pb.GPU_STATE_ATTACHED if node else pb.GPU_STATE_FREE
        gpu.node = node
        self._gpus[(box, slot)] = gpu
        self._put(self._schema.gpu(box, slot), gpu)

    # -- the allocator -------------------------------------------------------------------

    @property
    def allocated(self) -> int:
        return self.capacity - self._free_gpus

    def free_slot_counts(self) -> list[int]:
        """Free proxy slots of every host, in host order."""
        return list(self._free_slots.values())

    def allocate(self, gpus: int, needs: Resources = NONE) -> Grant | Cause:
        refused = self._refusal(gpus, needs)
        if gpus == 0:
            return refused if refused is not None else self._reserve_only(needs)
        if refused is not None and not self._verify_refusals:
            return refused
        began = time.perf_counter()
        snapshot = self._index.snapshot()
        request = PlacementRequest("", gpus, cpu_cores=needs.cpu, host_memory_mib=needs.memory_mib)
        result = place(request, snapshot, self._latency, self._pipeline)
        self.times.samples.append(time.perf_counter() - began)
        placement = result.placement
        if placement is None:
            if refused is None:
                raise RuntimeError(
                    f"{self.name}: placement refused {gpus} GPUs that fit: "
                    + "; ".join(result.unsatisfied)
                )
            return refused
        if refused is not None:
            raise RuntimeError(f"{self.name}: placed {gpus} GPUs the counts refuse ({refused})")
        self._next_node += 1
        node = _Node(f"nodes/n{self._next_node}", placement.host, placement, needs)
        for binding in placement.bindings:
            self._set_gpu(binding.box, binding.slot, node.name)
        self._attachments[node.host] = [
            *self._attachments[node.host],
            *(
                pb.DesiredAttachment(gpu=b.gpu, host_slot=b.host_slot, node=node.name)
                for b in placement.bindings
            ),
        ]
        self._hold(node, gpus, 1)
        self._free_gpus -= gpus
        return Grant(node, gpus)

    def release(self, grant: Grant) -> None:
        node = grant.key
        assert isinstance(node, _Node)
        if node.placement is not None:
            for binding in node.placement.bindings:
                self._set_gpu(binding.box, binding.slot, "")
        self._attachments[node.host] = [
            a for a in self._attachments[node.host] if a.node != node.name
        ]
        self._hold(node, grant.gpus, -1)
        self._free_gpus += grant.gpus

    def _hold(self, node: _Node, gpus: int, sign: int) -> None:
        """Writes the host's allocation with ``node``'s reservation added (``sign`` 1) or
        removed (-1), and moves the free counts by its slots, CPU and memory."""
        host, needs = node.host, node.needs
        kept = [r for r in self._reservations[host] if r.node != node.name]
        if sign > 0 and (needs.cpu or needs.memory_mib):
            kept.append(
                pb.HostReservation(node=node.name, cpu_cores=needs.cpu, memory_mib=needs.memory_mib)
            )
        self._reservations[host] = kept
        self._put_allocation(host)
        self._free_slots[host] -= sign * gpus
        self._free_cpu[host] -= sign * needs.cpu
        self._free_memory[host] -= sign * needs.memory_mib
        self._totals[0] -= sign * gpus
        self._totals[1] -= sign * needs.cpu
        self._totals[2] -= sign * needs.memory_mib

    def _reserve_only(self, needs: Resources) -> Grant:
        """A CPU-only pod: its CPU and memory held on the host with the fewest free slots
        that holds them, then the least free CPU, then the lowest id."""
        fits = (
            (slots, self._free_cpu[host], host)
            for host, slots in self._free_slots.items()
            if self._free_cpu[host] >= needs.cpu and self._free_memory[host] >= needs.memory_mib
        )
        _, _, host = min(fits)
        self._next_node += 1
        node = _Node(f"nodes/cpu{self._next_node}", host, None, needs)
        self._hold(node, 0, 1)
        return Grant(node, 0)

    def _refusal(self, gpus: int, needs: Resources) -> Cause | None:
        """Why the counts refuse ``gpus`` GPUs and ``needs`` now, or None when some host
        can take them."""
        rooms = (
            (slots, self._free_cpu[host], self._free_memory[host])
            for host, slots in self._free_slots.items()
        )
        totals = (self._totals[0], self._totals[1], self._totals[2])
        return refusal(gpus, needs, self._free_gpus, totals, rooms)
