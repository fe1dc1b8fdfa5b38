"""A dxpool pool in one process for the trace benchmarks: the embedding API
(:class:`~dxpool.broker.nodes.memory_pool.InMemoryPool`), whose placement, commits and
releases go through the broker's own cache, placement index, pipeline and records.

Every decision is the allocator's, on the state its own earlier decisions left: a
granted node is committed as compose commits it (its GPUs assigned, the host's
allocation holding its slots, CPU and memory) and released as the node controller
frees it; a CPU-only pod is a host reservation of its CPU and memory, chosen by
placement (:mod:`~dxpool.broker.placement.reserve`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.traces.allocator import NONE, Cause, Grant, Resources, refusal
from dxpool.broker.nodes.memory_pool import HostChoice, HostRequest, InMemoryPool
from dxpool.broker.placement import Pipeline, PlacementRequest
from dxpool.fabric.latency import LatencyModel


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


@dataclass(frozen=True, slots=True)
class Node:
    """A granted node: its id in the pool and the host it went to."""

    node: str
    host: str


@dataclass(slots=True)
class DecisionTimes:
    """Seconds per placement decision (snapshot plus ``place()``), granted or not: wall
    clock, and this process's CPU time (what the decision cost, without the time other
    processes of a shared machine took meanwhile)."""

    samples: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, wall: float, cpu: float) -> None:
        self.samples.append(wall)
        self.cpu.append(cpu)

    def percentile(self, fraction: float, *, of_cpu: bool = False) -> float:
        """The sample at ``fraction`` (0-1) of the sorted samples; 0 when there are none."""
        ordered = sorted(self.cpu if of_cpu else self.samples)
        if not ordered:
            return 0.0
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class DxpoolPool:
    """An :class:`~bench.traces.allocator.Allocator` backed by dxpool's placement.

    ``pipeline`` defaults to the broker's (the registry's default pipeline); requests
    ask for the models given (any model when none), no latency bound, and the CPU and
    memory given (``PlacementRequest.cpu_cores``, ``host_memory_mib``).

    With no latency bound, placement can serve ``n`` GPUs exactly when the pool has
    ``n`` free GPUs (of one of the models asked, when models are named) and some live
    host ``n`` free slots with the CPU and memory asked for free. A request the counts
    already refuse is therefore refused without asking placement (whose account of why
    runs over every host and would dominate a run at 130% demand), unless
    ``verify_refusals`` is set: then placement is asked anyway and must refuse too.
    Either way, a request the counts admit that placement refuses is a bug and raises
    ``RuntimeError``.
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
        hosts = len(layout.host_slots)
        cpus = list(layout.host_cpus) or [0] * hosts
        memory = list(layout.host_memory_mib) or [0] * hosts
        if len(cpus) != hosts or len(memory) != hosts:
            raise ValueError(f"CPU and memory must be given for all {hosts} hosts or none")
        self.name = name
        self.capacity = layout.gpus
        self.times = DecisionTimes()
        self._verify_refusals = verify_refusals
        self._pool = InMemoryPool(latency=latency, pipeline=pipeline)

        def location(index: int) -> tuple[str, str, str]:
            return ("dc1", "p1", f"r{index % layout.racks}")

        for index, (model, count) in enumerate(layout.boxes):
            self._pool.add_box(f"b{index:05d}", model, count, location=location(index))
        self._free_slots: dict[str, int] = {}
        self._free_cpu: dict[str, int] = {}
        self._free_memory: dict[str, int] = {}
        for index, slots in enumerate(layout.host_slots):
            host = f"h{index:05d}"
            self._pool.add_host(
                host,
                slots,
                cpu_cores=cpus[index],
                memory_mib=memory[index],
                location=location(index),
            )
            self._free_slots[host] = slots
            self._free_cpu[host] = cpus[index]
            self._free_memory[host] = memory[index]
        self._next_node = 0

    @property
    def pool(self) -> InMemoryPool:
        """The embedded pool (its records, index and placement)."""
        return self._pool

    @property
    def allocated(self) -> int:
        return self.capacity - self._pool.counts().gpus

    def free_slot_counts(self) -> list[int]:
        """Free proxy slots of every host, in host order."""
        return list(self._free_slots.values())

    def allocate(self, gpus: int, needs: Resources = NONE) -> Grant | Cause:
        refused = self._refusal(gpus, needs)
        if gpus == 0:
            return refused if refused is not None else self._reserve_only(needs)
        if refused is not None and not self._verify_refusals:
            return refused
        request = PlacementRequest(
            "|".join(needs.models),
            gpus,
            cpu_cores=needs.cpu,
            host_memory_mib=needs.memory_mib,
        )
        began, began_cpu = time.perf_counter(), time.process_time()
        result = self._pool.place(request)
        self.times.add(time.perf_counter() - began, time.process_time() - began_cpu)
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
        node = self._node_id()
        self._pool.commit(node, request, placement)
        self._take(placement.host, gpus, needs, 1)
        return Grant(Node(node, placement.host), gpus)

    def release(self, grant: Grant) -> None:
        node = grant.key
        assert isinstance(node, Node)
        spec = self._pool.node(node.node)
        assert spec is not None
        self._pool.release(node.node)
        needs = Resources(spec.spec.cpu_cores, spec.spec.host_memory_mib)
        self._take(node.host, grant.gpus, needs, -1)

    def _node_id(self) -> str:
        self._next_node += 1
        return f"n{self._next_node}"

    def _take(self, host: str, gpus: int, needs: Resources, sign: int) -> None:
        self._free_slots[host] -= sign * gpus
        self._free_cpu[host] -= sign * needs.cpu
        self._free_memory[host] -= sign * needs.memory_mib

    def _reserve_only(self, needs: Resources) -> Grant | Cause:
        """A CPU-only pod: its CPU and memory held on a host by placement."""
        node = self._node_id()
        began, began_cpu = time.perf_counter(), time.process_time()
        held = self._pool.reserve(node, HostRequest(needs.cpu, needs.memory_mib))
        self.times.add(time.perf_counter() - began, time.process_time() - began_cpu)
        if isinstance(held, HostChoice):
            raise RuntimeError(
                f"{self.name}: no host for a CPU-only pod the counts admit: "
                + "; ".join(held.unsatisfied)
            )
        host_id = held.host.removeprefix("hosts/")
        self._take(host_id, 0, needs, 1)
        return Grant(Node(node, host_id), 0)

    def _refusal(self, gpus: int, needs: Resources) -> Cause | None:
        """Why the counts refuse ``gpus`` GPUs and ``needs`` now, or None when some host
        can take them."""
        counts = self._pool.counts()
        rooms = (
            (slots, self._free_cpu[host], self._free_memory[host])
            for host, slots in self._free_slots.items()
        )
        totals = (counts.slots, counts.cpu_cores, counts.memory_mib)
        return refusal(gpus, needs, counts.gpus, totals, rooms, counts.free_by_model)
