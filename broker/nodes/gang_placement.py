"""Placing every member of a gang before any is committed, with the gang's options.

Members are placed one after another through the public ``place()``:

* **plain**: each member on the placement index's snapshot, its choice held in the
  index at once (:meth:`~dxpool.broker.state.placement_index.PlacementIndex.hold`), so the next
  member (and any compose of this broker) sees those GPUs and slots taken. Snapshots
  carry the index's journal, so each placement is brought forward from the previous one
  instead of made from scratch: what lets a gang of 1,536 members be placed in seconds
  on a pool of 100,000 GPUs.
* **distinct hosts**: as plain; a member whose choice lands on a host an earlier member
  took is placed again pinned to other hosts (those with room for it, tightest first),
  each a cheap pinned placement.
* **same switch**: the switch is chosen first: among the top-of-rack switches (a box's
  site/pod/rack, as ``--affinity switch`` reads it) whose usable GPUs of the members'
  model hold every member, the one with the fewest (so larger switches stay whole for
  larger gangs), then by name; every member is then placed on a snapshot holding that
  switch's boxes only, one after another (each taken out before the next; with
  distinct hosts, the hosts used are taken out too), and held in the index as well.

Holds are advice to this broker's placements; the commits' compares are what keep a GPU
from being given twice. The caller lets go of every hold (:meth:`Members.let_go`) once
the members are committed or given up.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from dxpool.broker.nodes.gang import without_placement
from dxpool.broker.placement import Placement, PlacementRequest, Snapshot, place
from dxpool.broker.placement.selection import Switch, switch_name, switch_of
from dxpool.broker.state.placement_index import PlacementIndex
from dxpool.fabric.latency import LatencyModel
from dxpool.request import model_set

MAX_PINNED_TRIES = 256
"""How many other hosts a distinct-host member is tried on before it is refused."""


class MemberUnplaced(Exception):  # noqa: N818 - an outcome, not an error of the code
    """Member ``index`` found no placement; ``reasons`` say why."""

    def __init__(self, index: int, reasons: Sequence[str]) -> None:
        super().__init__(f"member {index}: {'; '.join(reasons)}")
        self.index = index
        self.reasons = tuple(reasons)


@dataclass
class Members:
    """Placements of a gang's members, held in the index until :meth:`let_go`."""

    index: PlacementIndex
    placements: list[Placement | None] = field(default_factory=list)
    held: list[Placement] = field(default_factory=list)

    def hold(self, member: int, placement: Placement) -> bool:
        if not self.index.hold(placement):
            return False
        while len(self.placements) <= member:
            self.placements.append(None)
        self.placements[member] = placement
        self.held.append(placement)
        return True

    def drop(self, member: int) -> None:
        """Forget member ``member``'s placement (and let go of its hold)."""
        placement = self.placements[member]
        if placement is not None:
            self.placements[member] = None
            if placement in self.held:
                self.held.remove(placement)
                self.index.let_go(placement)

    def let_go(self) -> None:
        for placement in self.held:
            self.index.let_go(placement)
        self.held.clear()

    def hosts(self, but: int | None = None) -> set[str]:
        return {p.host for i, p in enumerate(self.placements) if p is not None and i != but}


def choose_switch(snapshot: Snapshot, requests: Sequence[PlacementRequest]) -> Switch | None:
    """The switch whose usable GPUs (of the members' models) hold every member: the one
    with the fewest such GPUs, then by name; None when no switch does."""
    total = sum(r.count for r in requests)
    wanted = {m.lower() for r in requests for m in model_set(r.model)}
    usable: dict[Switch, int] = defaultdict(int)
    for box_id, gpus in snapshot.gpus_by_box.items():
        box = snapshot.boxes.get(box_id)
        if box is None or not box.schedulable:
            continue
        count = sum(
            1 for g in gpus if g.free and g.healthy and (not wanted or g.model.lower() in wanted)
        )
        if count:
            usable[switch_of(box)] += count
    fitting = sorted((count, switch) for switch, count in usable.items() if count >= total)
    return fitting[0][1] if fitting else None


def only_switch(snapshot: Snapshot, switch: Switch) -> Snapshot:
    """``snapshot`` with the boxes of ``switch`` only (standalone)."""
    boxes = {b: info for b, info in snapshot.boxes.items() if switch_of(info) == switch}
    gpus = {b: snapshot.gpus_by_box[b] for b in boxes if b in snapshot.gpus_by_box}
    return Snapshot(boxes=boxes, hosts=dict(snapshot.hosts), gpus_by_box=gpus)


def without_hosts(snapshot: Snapshot, hosts: set[str]) -> Snapshot:
    """``snapshot`` (standalone) with ``hosts`` unable to take a node."""
    changed = dict(snapshot.hosts)
    for host in hosts:
        if host in changed:
            changed[host] = replace(changed[host], alive=False)
    return Snapshot(boxes=snapshot.boxes, hosts=changed, gpus_by_box=snapshot.gpus_by_box)


class GangPlacer:
    """Places members (see the module docstring) on ``index`` with the latency model
    ``latency()`` gives."""

    def __init__(self, index: PlacementIndex, latency: LatencyModel) -> None:
        self._index = index
        self._latency = latency

    def place_all(
        self,
        requests: Sequence[PlacementRequest],
        *,
        distinct_hosts: bool = False,
        same_switch: bool = False,
    ) -> Members:
        """Every member placed and held; raises :class:`MemberUnplaced` (nothing held)
        when one does not fit."""
        members = Members(self._index)
        try:
            if same_switch:
                self._place_in_switch(members, requests, distinct_hosts)
            else:
                for i, request in enumerate(requests):
                    self.place_one(members, i, request, distinct_hosts=distinct_hosts)
        except BaseException:
            members.let_go()
            raise
        return members

    def place_one(
        self,
        members: Members,
        member: int,
        request: PlacementRequest,
        *,
        distinct_hosts: bool = False,
        attempts: int = 4,
    ) -> Placement:
        """Place member ``member`` on the index (again, when it was placed before) and
        hold it."""
        if member < len(members.placements):
            members.drop(member)
        taken = members.hosts(but=member) if distinct_hosts else set()
        for _ in range(attempts):
            result = place(request, self._index.snapshot(), self._latency)
            placement = result.placement
            if placement is None:
                raise MemberUnplaced(member, result.unsatisfied or ("no host can take it",))
            if placement.host in taken:
                placement = self._elsewhere(request, taken)
                if placement is None:
                    raise MemberUnplaced(
                        member, (f"no host beside the {len(taken)} the gang uses can take it",)
                    )
            if members.hold(member, placement):
                return placement
        raise MemberUnplaced(member, ("its choices kept being taken by concurrent composes",))

    def _elsewhere(self, request: PlacementRequest, taken: set[str]) -> Placement | None:
        """A placement of ``request`` pinned to a host not in ``taken``: hosts with room
        for it, fewest free slots first, each tried pinned."""
        snapshot = self._index.snapshot()
        candidates = sorted(
            (info.free_slot_count(), host)
            for host, info in snapshot.hosts.items()
            if host not in taken and info.alive and info.free_slot_count() >= request.count
        )
        for _, host in candidates[:MAX_PINNED_TRIES]:
            result = place(replace(request, host=host), snapshot, self._latency)
            if result.placement is not None:
                return result.placement
        return None

    def _place_in_switch(
        self, members: Members, requests: Sequence[PlacementRequest], distinct_hosts: bool
    ) -> None:
        full = self._index.snapshot()
        switch = choose_switch(full, requests)
        if switch is None:
            total = sum(r.count for r in requests)
            raise MemberUnplaced(0, (f"no rack switch holds {total} usable GPUs (same switch)",))
        snapshot = only_switch(full, switch)
        used: set[str] = set()
        for i, request in enumerate(requests):
            view = without_hosts(snapshot, used) if distinct_hosts else snapshot
            result = place(request, view, self._latency)
            if result.placement is None:
                raise MemberUnplaced(
                    i, (*result.unsatisfied, f"under switch {switch_name(switch)}")
                )
            if not members.hold(i, result.placement):
                raise MemberUnplaced(i, ("its choice was taken by a concurrent compose",))
            used.add(result.placement.host)
            snapshot = without_placement(
                snapshot, result.placement, request.cpu_cores, request.host_memory_mib
            )


__all__ = ["GangPlacer", "MemberUnplaced", "Members", "choose_switch", "only_switch"]
