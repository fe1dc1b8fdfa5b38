"""A host for CPU cores and memory alone: work that runs on a host without GPUs.

A pool's hosts also run work that needs no GPU (the CPU-only pods of a Kubernetes
cluster, a data loader beside a training node). What it holds of a host's CPU and
memory is what GPU nodes cannot have, so a scheduler that embeds placement reserves it
through the same records (a ``HostReservation`` in the host's allocation) and placement
sees it as any node's.

:func:`choose_host` picks the host with the pipeline's own host filters (the pin,
liveness, labels, excluded hosts, CPU and memory; not the proxy slot filter, since the
work takes no slot) and prefers the host with the **fewest free proxy slots**, then the
least room (:meth:`~dxpool.broker.placement.model.ResourceScale.room`), then the lowest
id: CPU on a host whose slots are taken is the CPU that GPU nodes can least use, and
among those the tightest fit keeps roomy hosts roomy, as for GPU nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dxpool.broker.placement.framework import HostFilterPlugin
from dxpool.broker.placement.guard import applying, failure, guarded_text
from dxpool.broker.placement.model import (
    HostInfo,
    PlacementRequest,
    Snapshot,
    check_excluded_hosts,
)
from dxpool.broker.placement.pipeline import Pipeline
from dxpool.broker.placement.plugins.hosts import HostSlots
from dxpool.broker.placement.registry import default_pipeline
from dxpool.broker.placement.status import Code
from dxpool.errors import InvalidArgument, NotFound
from dxpool.names import check_id
from dxpool.request import check_host_resources
from dxpool.text import check_labels

_DEFAULT = default_pipeline()


@dataclass(frozen=True, slots=True)
class HostRequest:
    """CPU cores and memory (MiB) of one host, and no GPU: ``cpu_cores`` and
    ``host_memory_mib`` (at least one of them), and as for a GPU node's request a
    ``host_selector``, ``exclude_hosts`` and a ``host`` pin. Construction raises
    :class:`~dxpool.errors.InvalidArgument` naming the field to fix."""

    cpu_cores: int
    host_memory_mib: int = 0
    host_selector: frozenset[tuple[str, str]] = field(default_factory=frozenset)
    exclude_hosts: frozenset[str] = field(default_factory=frozenset)
    host: str | None = None

    def __post_init__(self) -> None:
        check_host_resources(self.cpu_cores, self.host_memory_mib, memory_field="host_memory_mib")
        if not (self.cpu_cores or self.host_memory_mib):
            raise InvalidArgument(
                "a host reservation asks for CPU cores or memory: set cpu_cores or "
                "host_memory_mib (a node with GPUs is placed with a PlacementRequest)",
                reason="INVALID_HOST_RESOURCES",
            )
        if not isinstance(self.host_selector, frozenset):
            raise InvalidArgument("host_selector must be a frozenset of (key, value) pairs")
        check_labels(dict(self.host_selector), "host_selector")
        check_excluded_hosts(self.exclude_hosts)
        if self.host is not None:
            check_id(self.host, "host")

    def as_node(self) -> PlacementRequest:
        """The request a host filter judges: a node of one GPU (never looked at) with
        these host fields."""
        return PlacementRequest(
            "",
            1,
            host=self.host,
            host_selector=self.host_selector,
            cpu_cores=self.cpu_cores,
            host_memory_mib=self.host_memory_mib,
            exclude_hosts=self.exclude_hosts,
        )


@dataclass(frozen=True, slots=True)
class HostChoice:
    """The host chosen, or None and one line per host filter that stood in the way."""

    host: str | None
    unsatisfied: tuple[str, ...] = ()


def choose_host(
    request: HostRequest, snapshot: Snapshot, pipeline: Pipeline | None = None
) -> HostChoice:
    """The host a reservation of ``request`` goes to (see the module docstring). Pure;
    raises :class:`~dxpool.errors.NotFound` for a pin to a host the snapshot lacks."""
    if request.host is not None and request.host not in snapshot.hosts:
        raise NotFound(
            f"host hosts/{request.host} is not registered: pin a registered host or leave "
            "the host empty",
            reason="HOST_NOT_FOUND",
        )
    asked = request.as_node()
    filters: tuple[HostFilterPlugin, ...] = tuple(
        plugin
        for plugin in applying((pipeline or _DEFAULT).host_filters, asked)
        if not isinstance(plugin, HostSlots)
    )
    hosts = snapshot.hosts
    visited = [request.host] if request.host is not None else snapshot.host_ids()
    room = snapshot.resource_scale().room
    found = _fewest_free_slots(asked, filters, [hosts[host] for host in visited], room)
    if found is not None:
        return HostChoice(found)
    failed: dict[str, list[HostInfo]] = {plugin.name: [] for plugin in filters}
    stops = [0] * len(filters)
    errors: list[str] = []
    for host_id in visited:  # nothing fits: say why, filter by filter
        host = hosts[host_id]
        dropped = False
        for index, plugin in enumerate(filters):
            try:
                status = plugin.filter_host(asked, host)
            except Exception as error:
                status = failure(plugin.name, error)
            if status.code is Code.SUCCESS:
                continue
            stops[index] += 1
            if status.code is Code.ERROR:
                errors.append(f"hosts/{host_id}: {status.message()}")
            else:
                failed[plugin.name].append(host)
            dropped = True
            break
        if not dropped:  # only a check that disagrees with its filter gets here
            errors.append(f"hosts/{host_id}: a host filter's check disagrees with the filter")
    lines: list[str] = []
    reached = len(visited)
    for index, plugin in enumerate(filters):
        if failed[plugin.name]:
            line = guarded_text(plugin.name, plugin.explain, asked, failed[plugin.name], reached)
            if line:
                lines.append(line)
        reached -= stops[index]
    lines.extend(errors)
    return HostChoice(None, tuple(lines) or ("no host is registered",))


def _fewest_free_slots(
    request: PlacementRequest,
    filters: tuple[HostFilterPlugin, ...],
    hosts: list[HostInfo],
    room: Callable[[HostInfo], int],
) -> str | None:
    """The host every filter keeps with the fewest free slots, then the least room, then
    the lowest id; a host is filtered only when it could beat the best so far, and by
    a filter's ``keeps`` where it has one (no status is made)."""
    checks: list[Callable[[PlacementRequest, HostInfo], bool]] = []
    for plugin in filters:
        keeps = getattr(plugin, "keeps", None)
        checks.append(keeps if callable(keeps) else _keeps_by_status(plugin))
    best: tuple[int, int, str] | None = None
    for host in hosts:
        free = host.free_slot_count()
        if best is not None and free > best[0]:
            continue
        try:
            if not all(check(request, host) for check in checks):
                continue
        except Exception:
            continue  # the pass that explains reports it
        key = (free, room(host), host.host)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


def _keeps_by_status(plugin: HostFilterPlugin) -> Callable[[PlacementRequest, HostInfo], bool]:
    def keeps(request: PlacementRequest, host: HostInfo) -> bool:
        return plugin.filter_host(request, host).code is Code.SUCCESS

    return keeps
