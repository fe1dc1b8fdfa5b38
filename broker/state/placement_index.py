"""The placement view of the inventory, kept current from cache events.

Placement needs, per box, its GPUs with their free/healthy flags, and per host, its
proxy slots in use and whether its agent is alive. Rebuilding that from every record on
each ComposeNode would cost O(GPUs); this index updates incrementally as the cache
changes. Its collections are persistent maps (``immutables.Map``, a hash array mapped
trie): a snapshot holds the maps as they were, an event makes new ones in O(log n)
that share everything unchanged, so taking a snapshot costs O(records changed since the
last one), not O(boxes + hosts), and a snapshot stays consistent for a whole decision
while events keep arriving.

Every change that placement can see gets a version, and a bounded journal remembers
which box or host each recent version changed (:meth:`PlacementIndex.changed_since`);
snapshots carry their version and the journal, so placement brings what it derived from
an earlier snapshot up to date by looking at those boxes and hosts only.

A compose holds the GPUs and host slots it chose between its placement and its commit
(:meth:`PlacementIndex.hold`): snapshots show them taken, so composes placing meanwhile
choose other GPUs instead of all choosing the same one and all but one placing again
after the first commits. A hold changes only what placement sees; the commit's
compares in etcd are what keep a GPU from being allocated twice.

What placement remembers between calls rests on object identity, so the index keeps
every object it can: a snapshot holds the very same :class:`BoxInfo`, GPU tuple and
:class:`Place` objects as the one before for every box and host whose records did not
change (placement then judges only the boxes that did), and while nothing changes at all
``snapshot()`` hands out the same snapshot (and what placement derived from it).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import replace
from itertools import islice
from types import MappingProxyType
from typing import cast

import immutables

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.placement.model import BoxInfo, GpuInfo, HostInfo, Placement, Snapshot
from dxpool.broker.state.cache import Cache, Routes
from dxpool.fabric.latency import Place
from dxpool.limits import MAX_HOST_SLOTS
from dxpool.store.typed import Versioned


def gpu_info(gpu: pb.Gpu) -> GpuInfo:
    return GpuInfo(
        name=gpu.name,
        box=gpu.box.removeprefix("boxes/"),
        slot=gpu.slot,
        model=gpu.model,
        memory_mib=gpu.memory_mib,
        free=gpu.state == pb.GPU_STATE_FREE and not gpu.node,
        healthy=gpu.health != pb.GPU_HEALTH_UNHEALTHY,
    )


_NO_ID: frozenset[None] = frozenset((None,))
"""A journal entry's side that changed no box (or no host)."""

JOURNAL_LENGTH = 4096
"""How many recent versions :meth:`PlacementIndex.changed_since` can account for."""


class PlacementIndex:
    """Subscribes to a :class:`Cache`; ``snapshot()`` is safe from any thread."""

    def __init__(self, cache: Cache, *, journal_length: int = JOURNAL_LENGTH) -> None:
        self._lock = threading.Lock()
        # version v's entry sits at index v - (oldest version remembered): (box, host) ids
        self._journal: deque[tuple[str | None, str | None]] = deque(maxlen=journal_length)
        self._dirty_boxes: set[str] = set()  # changed since the last snapshot
        self._dirty_hosts: set[str] = set()
        self._box_map: immutables.Map[str, BoxInfo] = immutables.Map()
        self._host_map: immutables.Map[str, HostInfo] = immutables.Map()
        self._gpu_map: immutables.Map[str, tuple[GpuInfo, ...]] = immutables.Map()
        self._boxes: dict[str, BoxInfo] = {}
        self._gpus: dict[str, dict[int, GpuInfo]] = {}
        self._gpu_tuples: dict[str, tuple[GpuInfo, ...]] = {}
        self._host_records: dict[str, pb.Host] = {}
        self._host_places: dict[str, Place] = {}
        self._used_slots: dict[str, frozenset[int]] = {}
        self._held: dict[str, tuple[int, int]] = {}  # (CPU cores, memory MiB) nodes hold
        self._alive: set[str] = set()
        # Cordoned hosts (HostAllocation.unschedulable): placement sees them as unable to
        # take nodes, as a dead host (see broker/control/maintenance.py).
        self._cordoned: set[str] = set()
        self._hosts: dict[str, HostInfo] = {}
        self._held_gpus: Counter[tuple[str, int]] = Counter()  # (box, slot) held
        self._held_slots: dict[str, Counter[int]] = {}  # host -> its proxy slots held
        # free healthy GPUs of schedulable boxes by model, per box as of the last
        # snapshot and in all; the CPU cores and memory hosts declare, by value
        self._free_in_box: dict[str, Counter[str]] = {}
        self._free_models: Counter[str] = Counter()
        self._declared_cpu: Counter[int] = Counter()
        self._declared_memory: Counter[int] = Counter()
        self._version = 0
        self._snapshot: Snapshot | None = None  # the last one handed out, while current
        self._cache = cache
        self._unsubscribe = cache.subscribe(
            Routes()
            .on(cache.boxes, self._on_box)
            .on(cache.gpus, self._on_gpu)
            .on(cache.hosts, self._on_host)
            .on(cache.host_leases, self._on_lease)
            .on(cache.host_allocations, self._on_allocation)
        )
        self._load(cache)

    def _load(self, cache: Cache) -> None:
        """Takes every record the cache holds: nothing has been derived from this index
        yet, so the records are not journaled one by one, and each host is described
        once, after all its records are in. Events arriving meanwhile are taken as
        usual between collections (a record taken twice is taken once)."""
        for name, box in cache.boxes.items():  # the cache returns a copy
            with self._lock:
                self._on_box_change(name, box)
        gpus = cache.gpus.items()
        with self._lock:
            for name, record in gpus:
                self._on_gpu_change(name, record)
        hosts = cache.hosts.items()
        with self._lock:
            for name, host in hosts:
                self._note_host(name, host)
        leases = cache.host_leases.items()
        with self._lock:
            for name, lease in leases:
                self._note_lease(name, lease)
        allocations = cache.host_allocations.items()
        with self._lock:
            for name, allocation in allocations:
                self._note_allocation(name, allocation)
        with self._lock:
            for name in self._host_records:
                self._describe_host(name)
            self._dirty_boxes.update(self._boxes, self._gpus)
            self._dirty_hosts.update(self._hosts)
            self._snapshot = None

    def close(self) -> None:
        self._unsubscribe()

    def _on_box(self, name: str, record: Versioned[pb.Box] | None) -> None:
        with self._lock:
            if self._on_box_change(name, record):
                self._changed(name, None)

    def _on_gpu(self, name: str, record: Versioned[pb.Gpu] | None) -> None:
        with self._lock:
            if self._on_gpu_change(name, record):
                self._changed(name.partition("/")[0], None)

    def _on_host(self, name: str, record: Versioned[pb.Host] | None) -> None:
        with self._lock:
            self._note_host(name, record)
            self._host_changed(name)

    def _on_lease(self, name: str, record: Versioned[bytes] | None) -> None:
        with self._lock:
            self._note_lease(name, record)
            self._host_changed(name)

    def _on_allocation(self, name: str, record: Versioned[pb.HostAllocation] | None) -> None:
        with self._lock:
            self._note_allocation(name, record)
            self._host_changed(name)

    def _host_changed(self, name: str) -> None:
        """Under the lock: one of host ``name``'s records was noted."""
        if self._describe_host(name):
            self._changed(None, name)

    def _on_box_change(self, name: str, record: Versioned[pb.Box] | None) -> bool:
        known = self._boxes.get(name)
        if record is None:
            return self._boxes.pop(name, None) is not None
        box = record.value
        place = Place.of(box)
        if known is not None and known.place == place:
            place = known.place
        info = BoxInfo(box=name, place=place, schedulable=box.state == pb.BOX_STATE_ACTIVE)
        if info == known:
            return False  # keep the object placement already knows
        self._boxes[name] = info
        return True

    def _on_gpu_change(self, name: str, record: Versioned[pb.Gpu] | None) -> bool:
        box_id, _, slot_text = name.partition("/")
        slot = int(slot_text)
        slots = self._gpus.setdefault(box_id, {})
        if record is None:
            gone = slots.pop(slot, None) is not None
            if not slots:
                self._gpus.pop(box_id, None)
            if gone:
                self._gpu_tuples.pop(box_id, None)
            return gone
        info = gpu_info(record.value)
        if slots.get(slot) == info:
            return False  # e.g. attaching -> attached: placement sees no difference
        slots[slot] = info
        self._gpu_tuples.pop(box_id, None)
        return True

    def _note_host(self, name: str, record: Versioned[pb.Host] | None) -> None:
        """Takes a host's record."""
        if record is None:
            self._host_records.pop(name, None)
            self._host_places.pop(name, None)
        else:
            self._host_records[name] = record.value
            place = Place.of(record.value)
            if self._host_places.get(name) != place:
                self._host_places[name] = place

    def _note_lease(self, name: str, record: Versioned[bytes] | None) -> None:
        """Takes a host's lease record (present: the host is alive)."""
        if record is None:
            self._alive.discard(name)
        else:
            self._alive.add(name)

    def _note_allocation(self, name: str, record: Versioned[pb.HostAllocation] | None) -> None:
        """Takes a host's allocation record."""
        allocation = record.value if record else None
        self._used_slots[name] = frozenset(
            a.host_slot for a in (allocation.attachments if allocation else ())
        )
        if allocation is not None and allocation.unschedulable:
            self._cordoned.add(name)
        else:
            self._cordoned.discard(name)
        reservations = allocation.reservations if allocation else ()
        self._held[name] = (
            sum(r.cpu_cores for r in reservations),
            sum(r.memory_mib for r in reservations),
        )

    def _describe_host(self, name: str) -> bool:
        """Describes a host from its records as noted; whether placement sees a change."""
        host = self._host_records.get(name)
        if host is None:
            gone = self._hosts.pop(name, None)
            if gone is not None:
                self._declare(gone, -1)
            return gone is not None
        held = self._held.get(name, (0, 0))
        info = HostInfo(
            host=name,
            place=self._host_places[name],
            # The agent reports its capacity; placement walks range(slot_capacity), so a
            # misconfigured agent must not make that loop billions long.
            slot_capacity=min(max(host.slot_capacity, 0), MAX_HOST_SLOTS),
            used_slots=self._used_slots.get(name, frozenset()).union(
                self._held_slots.get(name, ())
            ),
            alive=name in self._alive and name not in self._cordoned,
            labels=frozenset(host.labels.items()),
            cpu_cores=host.cpu_cores,
            memory_mib=host.memory_mib,
            used_cpu_cores=held[0],
            used_memory_mib=held[1],
        )
        known = self._hosts.get(name)
        if info == known:
            return False
        if known is not None:
            self._declare(known, -1)
        self._declare(info, 1)
        self._hosts[name] = info
        return True

    def _declare(self, host: HostInfo, step: int) -> None:
        """Counts (``step`` 1) or uncounts (-1) the CPU cores and memory ``host``
        declares. Called with the lock held."""
        self._declared_cpu[host.cpu_cores] += step
        self._declared_memory[host.memory_mib] += step

    def _as_seen(self, box_id: str, gpu: GpuInfo) -> GpuInfo:
        """A GPU as placement sees it: taken while a compose holds it."""
        if gpu.free and (box_id, gpu.slot) in self._held_gpus:
            return replace(gpu, free=False)
        return gpu

    def hold(self, placement: Placement) -> bool:
        """Shows ``placement``'s GPUs and host slots as taken in the snapshots from now
        on, until :meth:`let_go` with the same placement; False (and nothing held) when
        one of them is already held, by a compose that placed on an older snapshot.

        A hold is advice to concurrent placements, not a lock: every hold must be let go
        exactly once, whatever the commit did (after a successful commit the records
        themselves show the GPUs and slots taken)."""
        with self._lock:
            held = self._held_slots.get(placement.host, Counter())
            if any((b.box, b.slot) in self._held_gpus for b in placement.bindings) or any(
                b.host_slot in held for b in placement.bindings
            ):
                return False
            self._mark(placement, 1)
            return True

    def let_go(self, placement: Placement) -> None:
        """Ends a :meth:`hold` of ``placement`` (call once per successful hold)."""
        with self._lock:
            self._mark(placement, -1)

    def _mark(self, placement: Placement, step: int) -> None:
        """Holds (``step`` 1) or lets go (-1) of ``placement``'s GPUs and host slots, and
        records each box and the host as changed. Called with the lock held."""
        slots = self._held_slots.setdefault(placement.host, Counter())
        boxes: list[str] = []
        held = self._held_gpus
        for binding in placement.bindings:
            gpu = (binding.box, binding.slot)
            held[gpu] += step
            if held[gpu] <= 0:
                del held[gpu]  # nobody holds it any more
            slots[binding.host_slot] += step
            if binding.box not in boxes:
                boxes.append(binding.box)
        slots = +slots
        if slots:
            self._held_slots[placement.host] = slots
        else:
            self._held_slots.pop(placement.host, None)
        for box_id in boxes:
            self._gpu_tuples.pop(box_id, None)
            self._changed(box_id, None)
        if self._describe_host(placement.host):
            self._changed(None, placement.host)

    def _changed(self, box: str | None, host: str | None) -> None:
        """A new version that changed ``box`` or ``host``. Called with the lock held."""
        self._version += 1
        self._journal.append((box, host))
        if box is not None:
            self._dirty_boxes.add(box)
        if host is not None:
            self._dirty_hosts.add(host)
        self._snapshot = None

    @property
    def version(self) -> int:
        """Changes whenever the view changes (and only then); equal versions mean equal
        snapshots."""
        with self._lock:
            return self._version

    def changed_since(
        self, version: int, until: int
    ) -> tuple[frozenset[str], frozenset[str]] | None:
        """The box ids and host ids changed by versions ``version + 1 .. until``; None
        when the journal no longer reaches back to ``version`` or ``until`` is not a
        version handed out yet (see :class:`~dxpool.broker.placement.model.ChangeJournal`)."""
        with self._lock:
            oldest = self._version - len(self._journal) + 1  # the first version remembered
            if version < oldest - 1 or until > self._version or version > until:
                return None
            # read from the newest end: the versions asked for are usually the latest
            newest = self._version
            entries = list(islice(reversed(self._journal), newest - until, newest - version))
        if not entries:
            return frozenset(), frozenset()
        boxes, hosts = zip(*entries, strict=True)
        return (
            cast(frozenset[str], frozenset(boxes) - _NO_ID),
            cast(frozenset[str], frozenset(hosts) - _NO_ID),
        )

    def snapshot(self) -> Snapshot:
        """An immutable view of the inventory as of now: the same object as last time
        while nothing changed in between. Costs O(records changed since the last one)."""
        with self._lock:
            if self._snapshot is not None:
                return self._snapshot
            with self._box_map.mutate() as boxes, self._gpu_map.mutate() as gpus:
                for box_id in self._dirty_boxes:
                    info = self._boxes.get(box_id)
                    if info is None:
                        boxes.pop(box_id, None)
                    else:
                        boxes[box_id] = info
                    if box_id not in self._gpu_tuples:
                        slots = self._gpus.get(box_id)
                        if slots is None:
                            gpus.pop(box_id, None)
                        else:
                            made = tuple(self._as_seen(box_id, slots[s]) for s in sorted(slots))
                            self._gpu_tuples[box_id] = made
                            gpus[box_id] = made
                    self._count_free(box_id, info)
                self._box_map, self._gpu_map = boxes.finish(), gpus.finish()
            with self._host_map.mutate() as hosts:
                for host_id in self._dirty_hosts:
                    host = self._hosts.get(host_id)
                    if host is None:
                        hosts.pop(host_id, None)
                    else:
                        hosts[host_id] = host
                self._host_map = hosts.finish()
            self._dirty_boxes.clear()
            self._dirty_hosts.clear()
            self._snapshot = Snapshot(
                boxes=self._box_map,
                hosts=self._host_map,
                gpus_by_box=self._gpu_map,
                version=self._version,
                journal=self,
                free_models=MappingProxyType(+self._free_models),
                largest_host=(
                    max((n for n, hosts in self._declared_cpu.items() if hosts > 0), default=0),
                    max((n for n, hosts in self._declared_memory.items() if hosts > 0), default=0),
                ),
            )
            return self._snapshot

    def _count_free(self, box_id: str, box: BoxInfo | None) -> None:
        """Counts the free healthy GPUs of ``box_id`` again, by model, as the snapshot
        being made shows them. Called with the lock held."""
        before = self._free_in_box.pop(box_id, None)
        if before is not None:
            self._free_models.subtract(before)
        if box is None or not box.schedulable:
            return
        now = Counter(
            gpu.model for gpu in self._gpu_tuples.get(box_id, ()) if gpu.free and gpu.healthy
        )
        if now:
            self._free_in_box[box_id] = now
            self._free_models.update(now)
