"""Host filters: which hosts can take the node."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from dxpool.broker.placement.model import HostInfo, PlacementRequest, ResourceScale
from dxpool.broker.placement.status import SUCCESS, Status
from dxpool.broker.placement.text import format_memory, plural, sample_names


class PinnedHost:
    """When the request pins a host, keeps that host only."""

    name = "pinned_host"
    reads = frozenset({"host"})

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
    """Keeps hosts whose agent holds a session with a broker (a liveness record)."""

    name = "host_alive"
    reads: frozenset[str] = frozenset()
    _DEAD = Status.unschedulable("not alive: its agent holds no session", plugin=name)

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
            return f"hosts: hosts/{failed[0].host} is not alive (its agent holds no session)"
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
    reads = frozenset({"host_selector"})

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


class HostResources:
    """With ``cpu_cores`` or ``host_memory_mib`` asked for, keeps hosts that declare CPU
    cores and memory and have that much not held by their nodes. Like every host filter
    it judges the host itself; hosts kept are grouped as before."""

    name = "host_resources"
    reads = frozenset({"cpu_cores", "host_memory_mib"})

    def applies(self, request: PlacementRequest) -> bool:
        return request.cpu_cores > 0 or request.host_memory_mib > 0

    def filter_host(self, request: PlacementRequest, host: HostInfo) -> Status:
        short = _short_of(request, host)
        if not short:
            return SUCCESS
        return Status.unschedulable("; ".join(short), plugin=self.name)

    def keeps(self, request: PlacementRequest, host: HostInfo) -> bool:
        """Whether :meth:`filter_host` keeps ``host``, without making a status."""
        cpu, memory = request.cpu_cores, request.host_memory_mib
        return (
            not cpu or (host.cpu_cores > 0 and host.cpu_cores - host.used_cpu_cores >= cpu)
        ) and (
            not memory or (host.memory_mib > 0 and host.memory_mib - host.used_memory_mib >= memory)
        )

    def least_room(self, request: PlacementRequest, scale: ResourceScale) -> int:
        """No host with less :meth:`~ResourceScale.room` than this is kept."""
        return request.cpu_cores * max(scale.memory_mib, 1) + request.host_memory_mib * max(
            scale.cpu_cores, 1
        )

    def explain(
        self, request: PlacementRequest, failed: Sequence[HostInfo], reached: int
    ) -> str | None:
        if not failed:
            return None
        wanted = _wanted(request)
        if reached == 1:
            short = "; ".join(_short_of(request, failed[0]))
            return f"host resources: hosts/{failed[0].host}: {short}"
        roomiest = min(
            failed,
            key=lambda host: (
                -(host.cpu_cores - host.used_cpu_cores),
                -(host.memory_mib - host.used_memory_mib),
                host.host,
            ),
        )
        return (
            f"host resources: {len(failed)} of {reached} hosts lack {wanted}; the roomiest, "
            f"hosts/{roomiest.host}, has {_free(roomiest)}; ask for less, or declare more "
            "with the agent's --cpus and --memory"
        )


def _wanted(request: PlacementRequest) -> str:
    parts = []
    if request.cpu_cores:
        parts.append(plural(request.cpu_cores, "free CPU core"))
    if request.host_memory_mib:
        parts.append(f"{format_memory(request.host_memory_mib)} free memory")
    return " and ".join(parts)


def _free(host: HostInfo) -> str:
    cores = host.cpu_cores - host.used_cpu_cores
    memory = host.memory_mib - host.used_memory_mib
    shown = format_memory(memory) if memory else "0MiB"
    return f"{plural(cores, 'free CPU core')} and {shown} free memory"


def _short_of(request: PlacementRequest, host: HostInfo) -> list[str]:
    """What ``host`` lacks for ``request``, one phrase per resource; empty if nothing."""
    short = []
    if request.cpu_cores:
        free = host.cpu_cores - host.used_cpu_cores
        if not host.cpu_cores:
            short.append("declares no CPU cores")
        elif free < request.cpu_cores:
            short.append(f"{plural(free, 'free CPU core')}, {request.cpu_cores} needed")
    if request.host_memory_mib:
        free = host.memory_mib - host.used_memory_mib
        if not host.memory_mib:
            short.append("declares no memory")
        elif free < request.host_memory_mib:
            short.append(
                f"{format_memory(free) if free else '0MiB'} free memory, "
                f"{format_memory(request.host_memory_mib)} needed"
            )
    return short


class HostSlots:
    """Keeps hosts with at least ``count`` free proxy slots."""

    name = "host_slots"
    reads = frozenset({"count"})

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


class HostNotExcluded:
    """Drops the hosts the request names in ``exclude_hosts`` (anti-affinity: the caller
    names the hosts running what the node must keep away from)."""

    name = "host_not_excluded"
    reads = frozenset({"exclude_hosts"})
    _EXCLUDED = Status.unschedulable("excluded by the request", plugin=name)

    def applies(self, request: PlacementRequest) -> bool:
        return bool(request.exclude_hosts)

    def filter_host(self, request: PlacementRequest, host: HostInfo) -> Status:
        return self._EXCLUDED if host.host in request.exclude_hosts else SUCCESS

    def keeps(self, request: PlacementRequest, host: HostInfo) -> bool:
        """Whether :meth:`filter_host` keeps ``host``, without making a status."""
        return host.host not in request.exclude_hosts

    def explain(
        self, request: PlacementRequest, failed: Sequence[HostInfo], reached: int
    ) -> str | None:
        if not failed:
            return None
        if reached == 1:
            return f"hosts: hosts/{failed[0].host} is excluded by the request"
        names = sample_names([f"hosts/{host.host}" for host in failed])
        return f"hosts: {len(failed)} of {reached} excluded by the request ({names})"
