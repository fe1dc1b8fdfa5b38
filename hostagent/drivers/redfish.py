"""A :class:`~dxpool.hostagent.driver.ProxyMapper` over a DMTF Redfish fabric manager.

PCIe fabric managers (H3 Platform's Falcon, Liqid, GigaIO) expose their fabric as
Redfish ``Fabrics/{fabric}``: ``Endpoints`` are the ends of the fabric - host ports
(``ConnectedEntities[].EntityRole`` ``Initiator``) and devices (``Target``) - and
``Zones`` say which endpoints reach each other. A GPU is assigned to a host by adding
its endpoint to a zone that holds the host port (``PATCH /redfish/v1/Fabrics/{fabric}/
Zones/{zone}`` with the new ``Links.Endpoints``), and taken away by removing it.

Which zone is which host slot, and which endpoint is which GPU, comes from the fabric
map (:mod:`dxpool.redfish.fabric_map`): one zone per host slot, holding
the host's initiator endpoint and at most one GPU. The map is checked against the
service when the mapper is built (:meth:`RedfishProxyMapper.discover`): every endpoint
and zone must exist and every endpoint must have the role the map gives it.

Every change is a read-modify-write of one zone. The write carries the zone's ETag in
``If-Match`` where the service gives ETags, so a zone that changed between our read
and our write is refused (412) and the change is read and decided again; a service
without ETags is written unconditionally (its own locking is then all there is). An
operation is retried, with :mod:`tenacity`, only when redoing it from a fresh read is
safe: after 412, 429, 5xx and when no answer came (the next read shows whether a
PATCH that timed out took effect). 409 (the GPU's endpoint is in another zone: mapped
to another host or slot) is an :class:`~dxpool.hostagent.errors.AttachConflictError`;
other 4xx are not retried and carry the service's message.

Redfish zones carry no dxpool generation, so unlike the simulated fabric the service
cannot refuse a map for a fenced generation: a fence (:meth:`RedfishProxyMapper.fence`)
revokes what is mapped, and the broker must keep the fenced host's GPUs from being
handed out until it has (see docs/ARCHITECTURE.md, "Fencing a host at the box side").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from dxpool.hostagent.errors import AttachConflictError, DriverError
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import RedfishFabricMap, RedfishHost
from dxpool.redfish.session import RedfishError, RedfishSession, RedfishStatusError
from dxpool.redfish.zones import (
    BOTH,
    INITIATOR,
    RETRY_WAIT_MIN_S,
    TARGET,
    FabricZones,
    members,
    roles,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
CONFLICT = 409


@contextmanager
def driver_errors() -> Iterator[None]:
    """Raise a :class:`RedfishError` as the :class:`DriverError` the reconciler handles
    (same message and retryability; the Redfish error is its ``__cause__``)."""
    try:
        yield
    except RedfishError as error:
        raise DriverError(error.message, retryable=error.retryable) from error


class RedfishProxyMapper:
    """:class:`~dxpool.hostagent.driver.ProxyMapper` for ``host`` on a Redfish fabric.

    ``session`` is owned by the mapper from then on (:meth:`close` ends it).
    ``retry_wait_s`` is the first pause between tries, doubling up to 2 s (tests pass 0).
    ``generation`` is logged with each map but cannot be enforced: Redfish zones do not
    carry it (see the module docstring). Safe for several threads. Raises
    :class:`~dxpool.hostagent.errors.DriverError` naming the zone or endpoint and what
    the service said.
    """

    def __init__(
        self,
        fabric_map: RedfishFabricMap,
        host: str,
        session: RedfishSession,
        *,
        retry_wait_s: float = RETRY_WAIT_MIN_S,
    ) -> None:
        if host not in fabric_map.hosts:
            raise DriverError(
                f"host {host!r} is not in the Redfish fabric map; add it under hosts: with its "
                "endpoint and one zone per host slot",
                retryable=False,
            )
        self._map = fabric_map
        self._host = host
        self._session = session
        self._zones = FabricZones(
            session,
            fabric_map.service.fabric,
            attempts=fabric_map.service.attempts,
            retry_wait_s=retry_wait_s,
        )

    # -- ProxyMapper -----------------------------------------------------------------------

    def map(self, gpu: GpuRef, host_slot: int, generation: int) -> None:
        zone = self._slot_zone(host_slot)
        wanted = self._gpu_endpoint(gpu)
        initiator = self._own.endpoint

        def attempt() -> None:
            current = self._zones.read(zone)
            held = members(current)
            if initiator not in held:
                raise DriverError(
                    f"zone {zone} (host slot {host_slot} of {self._host}) does not hold the "
                    f"host's endpoint {initiator}; correct the zone or the fabric map",
                    retryable=False,
                )
            others = [m for m in held if m not in (initiator, wanted)]
            if others:
                raise AttachConflictError(
                    f"host slot {host_slot} of {self._host} (zone {zone}) already holds "
                    f"{self._describe(others)}; unmap it first or pick a free slot"
                )
            if wanted in held:
                return
            try:
                self._zones.write(zone, [*held, wanted], current.etag)
            except RedfishStatusError as error:
                if error.status == CONFLICT:
                    raise AttachConflictError(
                        f"{gpu.name} (endpoint {wanted}) cannot join zone {zone}: "
                        f"{error.message}; it is mapped elsewhere - unmap it there first"
                    ) from error
                raise

        self._retrying(attempt)
        log.info(
            "redfish zone mapped",
            extra={"gpu": gpu.name, "zone": zone, "host_slot": host_slot, "generation": generation},
        )

    def unmap(self, gpu: GpuRef) -> None:
        wanted = self._gpu_endpoint(gpu)
        for zone in self._own.zones:

            def attempt(zone: str = zone) -> None:
                current = self._zones.read(zone)
                held = members(current)
                if wanted in held:
                    self._zones.write(zone, [m for m in held if m != wanted], current.etag)

            self._retrying(attempt)

    def mappings(self) -> dict[int, GpuRef]:
        found: dict[int, GpuRef] = {}
        initiator = self._own.endpoint
        for host_slot, zone in enumerate(self._own.zones):
            for endpoint in members(self._retrying(partial(self._zones.read, zone))):
                if endpoint == initiator:
                    continue
                gpu = self._map.gpu_of(endpoint)
                if gpu is None:
                    log.warning(
                        "zone holds an endpoint the fabric map does not know",
                        extra={"zone": zone, "endpoint": endpoint},
                    )
                    continue
                if host_slot in found:
                    log.warning(
                        "zone holds more than one GPU; reporting the last",
                        extra={"zone": zone, "gpus": [found[host_slot].name, gpu.name]},
                    )
                found[host_slot] = gpu
        return found

    def fence(self, host: str) -> list[GpuRef]:
        entry = self._map.hosts.get(host)
        if entry is None:
            raise DriverError(
                f"cannot fence host {host!r}: it is not in the Redfish fabric map, so its "
                "endpoint is unknown; add it under hosts:",
                retryable=False,
            )
        initiators = self._map.host_endpoints()
        revoked: list[GpuRef] = []
        for zone in self._zones_holding(entry):

            def attempt(zone: str = zone) -> list[str]:
                current = self._zones.read(zone)
                held = members(current)
                if entry.endpoint not in held:
                    return []
                sharing = [m for m in held if m in initiators and m != entry.endpoint]
                if sharing:  # other hosts use the zone: take only this host out of it
                    kept = [m for m in held if m != entry.endpoint]
                    cut = [m for m in held if m not in initiators]
                else:  # the host's own zone: take every device out, keep the port
                    kept = [entry.endpoint]
                    cut = [m for m in held if m != entry.endpoint]
                if kept != held:
                    self._zones.write(zone, kept, current.etag)
                return cut

            for endpoint in self._retrying(attempt):
                gpu = self._map.gpu_of(endpoint)
                if gpu is not None:
                    revoked.append(gpu)
        log.warning(
            "redfish host fenced",
            extra={"host": host, "gpus": [g.name for g in revoked]},
        )
        return sorted(set(revoked))

    # -- discovery -------------------------------------------------------------------------

    def discover(self) -> None:
        """Check the fabric map against the service: the fabric, every mapped endpoint
        with the role the map gives it, and this host's zones. Raises a non-retryable
        :class:`DriverError` listing every mismatch."""
        problems: list[str] = []
        with driver_errors():
            endpoints = self._zones.collection("Endpoints")
            zones = self._zones.collection("Zones")
        for host, entry in sorted(self._map.hosts.items()):
            _check_role(problems, endpoints, entry.endpoint, INITIATOR, f"host {host}")
        for box, ids in sorted(self._map.boxes.items()):
            for slot, endpoint in enumerate(ids):
                _check_role(problems, endpoints, endpoint, TARGET, f"GPU {box}/{slot}")
        for slot, zone in enumerate(self._own.zones):
            if zone not in zones:
                problems.append(f"zone {zone} (host slot {slot} of {self._host}) does not exist")
        if problems:
            raise DriverError(
                f"the Redfish fabric map does not match {self._session.url} fabric "
                f"{self._map.service.fabric}: " + "; ".join(problems),
                retryable=False,
            )

    def close(self) -> None:
        """End the Redfish session."""
        self._session.close()

    # -- helpers ---------------------------------------------------------------------------

    @property
    def _own(self) -> RedfishHost:
        return self._map.hosts[self._host]

    def _slot_zone(self, host_slot: int) -> str:
        zones = self._own.zones
        if not 0 <= host_slot < len(zones):
            raise DriverError(
                f"host slot {host_slot} of {self._host} has no zone in the Redfish fabric map "
                f"(it lists {len(zones)}); add one or lower the host's slot capacity",
                retryable=False,
            )
        return zones[host_slot]

    def _gpu_endpoint(self, gpu: GpuRef) -> str:
        endpoint = self._map.gpu_endpoint(gpu)
        if endpoint is None:
            raise DriverError(
                f"{gpu.name} has no endpoint in the Redfish fabric map; list it under "
                f"boxes.{gpu.box}",
                retryable=False,
            )
        return endpoint

    def _zones_holding(self, entry: RedfishHost) -> list[str]:
        """The host's configured zones plus every other zone of the fabric that holds its
        endpoint (a fence must not miss a zone someone added by hand)."""
        found = list(entry.zones)
        with driver_errors():
            holding = self._zones.holding(entry.endpoint)
        found.extend(zone for zone in holding if zone not in found)
        return found

    def _describe(self, endpoints: Iterable[str]) -> str:
        names = []
        for endpoint in endpoints:
            gpu = self._map.gpu_of(endpoint)
            names.append(f"{gpu.name} (endpoint {endpoint})" if gpu else f"endpoint {endpoint}")
        return ", ".join(names)

    def _retrying(self, operation: Callable[[], T]) -> T:
        with driver_errors():
            return self._zones.retrying(operation)


def _check_role(
    problems: list[str],
    endpoints: dict[str, dict[str, Any]],
    endpoint: str,
    role: str,
    owner: str,
) -> None:
    if endpoint not in endpoints:
        problems.append(f"endpoint {endpoint} ({owner}) does not exist")
        return
    found = roles(endpoints[endpoint])
    if role not in found and BOTH not in found:
        problems.append(
            f"endpoint {endpoint} ({owner}) has EntityRole {', '.join(sorted(found)) or 'none'}, "
            f"not {role}"
        )


def connect_redfish_mapper(fabric_map: RedfishFabricMap, host: str) -> RedfishProxyMapper:
    """Log in to the map's service, check the map against it, and return the mapper for
    ``host``. Raises :class:`DriverError`; the session is closed again on failure."""
    with driver_errors():
        session = RedfishSession(fabric_map.service)
    try:
        mapper = RedfishProxyMapper(fabric_map, host, session)
        mapper.discover()
    except BaseException:
        session.close()
        raise
    return mapper


__all__ = ["RedfishProxyMapper", "connect_redfish_mapper"]
