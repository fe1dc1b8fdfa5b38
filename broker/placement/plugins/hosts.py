"""Host filters: which hosts can take the node."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from dxpool.broker.placement.model import HostInfo, PlacementRequest
from dxpool.broker.placement.status import SUCCESS, Status
from dxpool.broker.placement.text import plural, sample_names


class PinnedHost:
    """When the request pins a host, keeps that host only."""

    name = "pinned_host"

    def applies(self, request: PlacementRequest) -> bool:
        return request.host is not None

    def filter_host(self, request: PlacementRequest, host: HostInfo) -> Status:
        if host.host == request.host:
            return SUCCESS
        return Status.unschedulable(f"not the pinned host hosts/{request.host}", plugin=self.name)

    def explain(
        self, request: PlacementRequest, failed: Sequence[HostInfo], reached: int
    ) -> str | None:
        return None  # skipping the other hosts is the point of a pin, not a failure


class HostAlive:
    """Keeps hosts whose agent holds its etcd lease."""

    name = "host_alive"
    _DEAD = Status.unschedulable("not alive: its agent's lease expired", plugin=name)

    def applies(self, request: PlacementRequest) -> bool:
        return True

    def filter_host(self, request: PlacementRequest, host: HostInfo) -> Status:
        return SUCCESS if host.alive else self._DEAD

    def explain(
        self, request: PlacementRequest, failed: Sequence[HostInfo], reached: int
    ) -> str | None:
        if not failed:
            return None
        if reached == 1:
            return f"hosts: hosts/{failed[0].host} is not alive (its agent's lease expired)"
        if len(failed) == reached:
            return f"hosts: none of the {reached} hosts is alive"
        names = sample_names([f"hosts/{host.host}" for host in failed])
        return f"hosts: {len(failed)} of {reached} not alive ({names})"


@functools.lru_cache(maxsize=1024)
def _too_few_slots(free: int, needed: int) -> Status:
    """One Status per (free, needed): a full pool rejects most hosts on every placement,
    and formatting a reason for each cost more than the rest of the filter."""
    return Status.unschedulable(
        f"{plural(free, 'free proxy slot')}, {needed} needed", plugin=HostSlots.name
    )


class HostLabels:
    """With a ``host_selector``, keeps hosts whose labels hold every selected key=value.

    It depends on the host itself, not its class, as every host filter may: the pipeline
    filters hosts one by one (each once, then only the hosts that changed) and groups
    only the hosts kept, so a selector costs one subset test per host."""

    name = "host_labels"

    def applies(self, request: PlacementRequest) -> bool:
        return bool(request.host_selector)

    def filter_host(self, request: PlacementRequest, host: HostInfo) -> Status:
        missing = request.host_selector - host.labels
        if not missing:
            return SUCCESS
        return Status.unschedulable(f"labels lack {_pairs(missing)}", plugin=self.name)

    def explain(
        self, request: PlacementRequest, failed: Sequence[HostInfo], reached: int
    ) -> str | None:
        if not failed:
            return None
        wanted = _pairs(request.host_selector)
        if reached == 1:
            return f"host labels: hosts/{failed[0].host} does not have {wanted}"
        # the host that lacks the fewest pairs is the closest to what was asked
        closest = min(
            failed, key=lambda host: (len(request.host_selector - host.labels), host.host)
        )
        lacks = _pairs(request.host_selector - closest.labels)
        return (
            f"host labels: {len(failed)} of {reached} hosts do not have {wanted}; the closest, "
            f"hosts/{closest.host}, lacks {lacks}; label hosts with the agent's --label "
            "or change --host-selector"
        )


def _pairs(pairs: frozenset[tuple[str, str]]) -> str:
    """``"env=prod, zone=a"``, sorted."""
    return ", ".join(f"{key}={value}" for key, value in sorted(pairs))


class HostSlots:
    """Keeps hosts with at least ``count`` free proxy slots."""

    name = "host_slots"

    def applies(self, request: PlacementRequest) -> bool:
        return True

    def filter_host(self, request: PlacementRequest, host: HostInfo) -> Status:
        free = host.free_slot_count()
        if free >= request.count:
            return SUCCESS
        return _too_few_slots(free, request.count)

    def explain(
        self, request: PlacementRequest, failed: Sequence[HostInfo], reached: int
    ) -> str | None:
        if not failed:
            return None
        roomiest = min(failed, key=lambda host: (-host.free_slot_count(), host.host))
        most = roomiest.free_slot_count()
        if reached == 1:
            return (
                f"host capacity: hosts/{roomiest.host} has {plural(most, 'free proxy slot')}, "
                f"{request.count} needed"
            )
        kind = "alive host" if all(host.alive for host in failed) else "host"
        if most == 0 and len(failed) == reached:
            return f"hosts: no {kind} has a free slot"
        return (
            f"host capacity: {len(failed)} of {reached} hosts have fewer than "
            f"{request.count} free proxy slots; the most is {most} on hosts/{roomiest.host}"
        )
