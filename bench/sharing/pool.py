"""A pool in one process over the broker's own modules, for replays with a clock of our
own: no etcd, no agents.

Records are the stored ``resources.proto`` messages written into a real
:class:`~dxpool.broker.state.cache.Cache` with rising revisions, as the broker applies what it
reads (``apply_read``); a real :class:`~dxpool.broker.state.placement_index.PlacementIndex`
subscribes to it and hands out the snapshots that the broker's placement (``place()``,
through :class:`~dxpool.broker.nodes.gang_placement.GangPlacer`, which holds choices in the
index exactly as the broker's gangs do) and its preemption planner
(:func:`~dxpool.broker.nodes.preemption.plan`) decide on. A node granted is committed as
compose commits it (its GPUs ATTACHED, its host slots in the host's allocation); a node
that lets GPUs go (released, preempted, shrunk) keeps them until the replay says they
are detached, as the release path keeps them DETACHING until the agent reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.gang_placement import GangPlacer, MemberUnplaced
from dxpool.broker.nodes.preemption import HeldGpu, HeldNode
from dxpool.broker.placement import Placement, PlacementRequest, Snapshot
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.placement_index import PlacementIndex
from dxpool.fabric.latency import LatencyModel, TopologyLatencyModel
from dxpool.fabric.topology import Topology
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Versioned

_PREFIX = "/replay/"
_UNREACHABLE = "127.0.0.1:9"  # the cache is never started: no watch, no etcd


@dataclass
class PoolNode:
    """A node the replay holds: its host, its GPUs (binding order) and which are being
    detached (no longer the node's, not free yet)."""

    name: str
    host: str
    gpus: list[tuple[str, int, int, str]]  # (box, slot, host slot, model)
    detaching: list[tuple[str, int, int]] = field(default_factory=list)


class ReplayPool:
    """Boxes of 8 GPUs and hosts with ``slots`` proxy slots each, ``racks`` racks."""

    def __init__(self, gpus: int, *, slots: int = 16, hosts: int | None = None, racks: int = 8):
        self._schema = KeySchema(_PREFIX)
        self._cache = Cache(_UNREACHABLE, self._schema)
        self._revision = 0
        self.latency: LatencyModel = TopologyLatencyModel(Topology.default())
        boxes = gpus // 8
        self.capacity = boxes * 8
        self._gpus: dict[tuple[str, int], pb.Gpu] = {}
        self._attachments: dict[str, list[pb.DesiredAttachment]] = {}
        self.nodes: dict[str, PoolNode] = {}
        for index in range(boxes):
            box = f"b{index:05d}"
            place = pb.Location(site="dc1", pod="p1", rack=f"r{index % racks}")
            box_record = pb.Box(name=f"boxes/{box}", location=place, state=pb.BOX_STATE_ACTIVE)
            self._put(self._schema.box(box), box_record)
            for slot in range(8):
                gpu = pb.Gpu(
                    name=f"boxes/{box}/gpus/{slot}",
                    box=f"boxes/{box}",
                    slot=slot,
                    model="H100",
                    memory_mib=81920,
                    state=pb.GPU_STATE_FREE,
                )
                self._gpus[(box, slot)] = gpu
                self._put(self._schema.gpu(box, slot), gpu)
        for index in range(hosts if hosts is not None else boxes):
            host = f"h{index:05d}"
            place = pb.Location(site="dc1", pod="p1", rack=f"r{index % racks}")
            record = pb.Host(name=f"hosts/{host}", location=place, slot_capacity=slots)
            self._put(self._schema.host(host), record)
            self._put(self._schema.host_lease(host), b"")
            self._attachments[host] = []
            self._put_allocation(host)
        self.index = PlacementIndex(self._cache)
        self.placer = GangPlacer(self.index, self.latency)
        self.allocated = 0  # GPUs held by nodes (not those being detached)
        self.detaching = 0

    def _put(self, key: str, value: object) -> None:
        self._revision += 1
        self._cache.apply_read(key, Versioned(value, self._revision, 1), self._revision)

    def _put_allocation(self, host: str) -> None:
        self._put(
            self._schema.host_allocation(host),
            pb.HostAllocation(host=f"hosts/{host}", attachments=self._attachments[host]),
        )

    def _set_gpu(self, box: str, slot: int, node: str, state: int) -> None:
        gpu = pb.Gpu()
        gpu.CopyFrom(self._gpus[(box, slot)])
        gpu.state = state  # type: ignore[assignment]
        gpu.node = node
        self._gpus[(box, slot)] = gpu
        self._put(self._schema.gpu(box, slot), gpu)

    # -- placing ----------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        return self.index.snapshot()

    def place(self, requests: Sequence[PlacementRequest]) -> list[Placement] | None:
        """Every request placed (held in the index), or None when one does not fit."""
        try:
            members = self.placer.place_all(requests)
        except MemberUnplaced:
            return None
        placements = [p for p in members.placements if p is not None]
        members.let_go()
        return placements

    def commit(self, name: str, placement: Placement) -> PoolNode:
        """Give ``placement``'s GPUs and host slots to node ``name``."""
        node = PoolNode(
            name,
            placement.host,
            [(b.box, b.slot, b.host_slot, b.model) for b in placement.bindings],
        )
        for box, slot, _, _ in node.gpus:
            self._set_gpu(box, slot, name, pb.GPU_STATE_ATTACHED)
        self._attachments[node.host] = [
            *self._attachments[node.host],
            *(
                pb.DesiredAttachment(gpu=f"boxes/{b}/gpus/{s}", host_slot=hs, node=name)
                for b, s, hs, _ in node.gpus
            ),
        ]
        self._put_allocation(node.host)
        self.nodes[name] = node
        self.allocated += len(node.gpus)
        return node

    # -- letting go -------------------------------------------------------------------------

    def let_go(self, name: str, gpus: Sequence[str] = ()) -> list[tuple[str, int, int]]:
        """Node ``name`` lets go of ``gpus`` (names; empty: all): they go DETACHING
        (neither the node's nor free) until :meth:`detached`. Returns them."""
        node = self.nodes[name]
        wanted = set(gpus)
        leaving = [g for g in node.gpus if not wanted or f"boxes/{g[0]}/gpus/{g[1]}" in wanted]
        node.gpus = [g for g in node.gpus if g not in leaving]
        out = []
        for box, slot, host_slot, _ in leaving:
            self._set_gpu(box, slot, name, pb.GPU_STATE_DETACHING)
            out.append((box, slot, host_slot))
        self.allocated -= len(leaving)
        self.detaching += len(leaving)
        if not node.gpus:
            del self.nodes[name]
        return out

    def detached(self, host: str, gpus: Sequence[tuple[str, int, int]]) -> None:
        """The GPUs a node let go of on ``host`` are scrubbed and detached: FREE, their
        host slots free."""
        slots = {hs for _, _, hs in gpus}
        names = {f"boxes/{b}/gpus/{s}" for b, s, _ in gpus}
        for box, slot, _ in gpus:
            self._set_gpu(box, slot, "", pb.GPU_STATE_FREE)
        self._attachments[host] = [
            a for a in self._attachments[host] if not (a.gpu in names and a.host_slot in slots)
        ]
        self._put_allocation(host)
        self.detaching -= len(gpus)

    # -- what the planner sees ------------------------------------------------------------

    def held_node(self, name: str, gpu_hours: float, min_gpus: int) -> HeldNode:
        node = self.nodes[name]
        return HeldNode(
            name,
            node.host,
            tuple(HeldGpu(f"boxes/{b}/gpus/{s}", b, s, model, hs) for b, s, hs, model in node.gpus),
            min_gpus,
            gpu_hours,
        )

    def free_usable(self) -> int:
        return self.capacity - self.allocated - self.detaching


__all__ = ["PoolNode", "ReplayPool"]
