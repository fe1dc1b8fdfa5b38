"""A :class:`~dxpool.hostagent.driver.ProxyMapper` over a DMTF Redfish fabric manager.

PCIe fabric managers (H3 Platform's Falcon, Liqid, GigaIO) expose their fabric as
Redfish ``Fabrics/{fabric}``: ``Endpoints`` are the ends of the fabric - host ports
(``ConnectedEntities[].EntityRole`` ``Initiator``) and devices (``Target``) - and
``Zones`` say which endpoints reach each other. A GPU is assigned to a host by adding
its endpoint to a zone that holds the host port (``PATCH /redfish/v1/Fabrics/{fabric}/
Zones/{zone}`` with the new ``Links.Endpoints``), and taken away by removing it.

Which zone is which host slot, and which endpoint is which GPU, comes from the fabric
map (:mod:`dxpool.hostagent.drivers.redfish_config`): one zone per host slot, holding
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
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from dxpool.hostagent.drivers.redfish_config import RedfishFabricMap, RedfishHost
from dxpool.hostagent.drivers.redfish_session import (
    RedfishResource,
    RedfishSession,
    RedfishStatusError,
)
from dxpool.hostagent.errors import AttachConflictError, DriverError
from dxpool.names import GpuRef

log = logging.getLogger(__name__)

T = TypeVar("T")
INITIATOR = "Initiator"
TARGET = "Target"
BOTH = "Both"
CONFLICT = 409
RETRY_WAIT_MIN_S = 0.1
RETRY_WAIT_MAX_S = 2.0


def _retry_safe(error: BaseException) -> bool:
    return (
        isinstance(error, DriverError)
        and error.retryable
        and not isinstance(error, AttachConflictError)
    )


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
        service = fabric_map.service
        self._fabric_path = f"/redfish/v1/Fabrics/{service.fabric}"
        self._attempts = service.attempts
        self._retry_wait_s = retry_wait_s

    # -- ProxyMapper -----------------------------------------------------------------------

    def map(self, gpu: GpuRef, host_slot: int, generation: int) -> None:
        zone = self._slot_zone(host_slot)
        wanted = self._gpu_endpoint(gpu)
        initiator = self._own.endpoint

        def attempt() -> None:
            current = self._read_zone(zone)
            members = _members(current)
            if initiator not in members:
                raise DriverError(
                    f"zone {zone} (host slot {host_slot} of {self._host}) does not hold the "
                    f"host's endpoint {initiator}; correct the zone or the fabric map",
                    retryable=False,
                )
            others = [m for m in members if m not in (initiator, wanted)]
            if others:
                raise AttachConflictError(
                    f"host slot {host_slot} of {self._host} (zone {zone}) already holds "
                    f"{self._describe(others)}; unmap it first or pick a free slot"
                )
            if wanted in members:
                return
            try:
                self._write_zone(zone, [*members, wanted], current.etag)
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
                current = self._read_zone(zone)
                members = _members(current)
                if wanted in members:
                    self._write_zone(zone, [m for m in members if m != wanted], current.etag)

            self._retrying(attempt)

    def mappings(self) -> dict[int, GpuRef]:
        found: dict[int, GpuRef] = {}
        initiator = self._own.endpoint
        for host_slot, zone in enumerate(self._own.zones):
            members = _members(self._retrying(partial(self._read_zone, zone)))
            for endpoint in members:
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
                current = self._read_zone(zone)
                members = _members(current)
                if entry.endpoint not in members:
                    return []
                sharing = [m for m in members if m in initiators and m != entry.endpoint]
                if sharing:  # other hosts use the zone: take only this host out of it
                    kept = [m for m in members if m != entry.endpoint]
                    cut = [m for m in members if m not in initiators]
                else:  # the host's own zone: take every device out, keep the port
                    kept = [entry.endpoint]
                    cut = [m for m in members if m != entry.endpoint]
                if kept != members:
                    self._write_zone(zone, kept, current.etag)
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
        endpoints = self._collection("Endpoints")
        zones = self._collection("Zones")
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

    def _collection(self, name: str) -> dict[str, dict[str, Any]]:
        """Every member of ``Fabrics/{fabric}/{name}``, by id."""
        path = f"{self._fabric_path}/{name}"
        listing = self._retrying(lambda: self._session.get(path))
        members: dict[str, dict[str, Any]] = {}
        for link in listing.body.get("Members", []):
            member_path = _odata_id(link)
            if member_path:
                body = self._retrying(partial(self._session.get, member_path)).body
                members[_last_segment(member_path)] = body
        return members

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
        listing = self._retrying(lambda: self._session.get(f"{self._fabric_path}/Zones"))
        for link in listing.body.get("Members", []):
            zone = _last_segment(_odata_id(link))
            if zone and zone not in found:
                members = _members(self._retrying(partial(self._read_zone, zone)))
                if entry.endpoint in members:
                    found.append(zone)
        return found

    def _read_zone(self, zone: str) -> RedfishResource:
        return self._session.get(f"{self._fabric_path}/Zones/{zone}")

    def _write_zone(self, zone: str, members: Iterable[str], etag: str) -> None:
        links = [{"@odata.id": f"{self._fabric_path}/Endpoints/{m}"} for m in members]
        self._session.patch(
            f"{self._fabric_path}/Zones/{zone}", {"Links": {"Endpoints": links}}, etag
        )

    def _describe(self, endpoints: Iterable[str]) -> str:
        names = []
        for endpoint in endpoints:
            gpu = self._map.gpu_of(endpoint)
            names.append(f"{gpu.name} (endpoint {endpoint})" if gpu else f"endpoint {endpoint}")
        return ", ".join(names)

    def _retrying(self, operation: Callable[[], T]) -> T:
        retrier = Retrying(
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=self._retry_wait_s, max=RETRY_WAIT_MAX_S),
            retry=retry_if_exception(_retry_safe),
            reraise=True,
        )
        return retrier(operation)


def _members(zone: RedfishResource) -> list[str]:
    """The endpoint ids in a zone's ``Links.Endpoints``, in the service's order."""
    links = zone.body.get("Links", {})
    endpoints = links.get("Endpoints", []) if isinstance(links, dict) else []
    return [_last_segment(_odata_id(link)) for link in endpoints if _odata_id(link)]


def _odata_id(link: object) -> str:
    if isinstance(link, dict) and isinstance(link.get("@odata.id"), str):
        return str(link["@odata.id"])
    return ""


def _last_segment(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _roles(endpoint: dict[str, Any]) -> set[str]:
    entities = endpoint.get("ConnectedEntities", [])
    return {
        str(entity.get("EntityRole"))
        for entity in entities
        if isinstance(entity, dict) and entity.get("EntityRole")
    }


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
    roles = _roles(endpoints[endpoint])
    if role not in roles and BOTH not in roles:
        problems.append(
            f"endpoint {endpoint} ({owner}) has EntityRole {', '.join(sorted(roles)) or 'none'}, "
            f"not {role}"
        )


def connect_redfish_mapper(fabric_map: RedfishFabricMap, host: str) -> RedfishProxyMapper:
    """Log in to the map's service, check the map against it, and return the mapper for
    ``host``. Raises :class:`DriverError`; the session is closed again on failure."""
    session = RedfishSession(fabric_map.service)
    try:
        mapper = RedfishProxyMapper(fabric_map, host, session)
        mapper.discover()
    except BaseException:
        session.close()
        raise
    return mapper


__all__ = ["RedfishProxyMapper", "connect_redfish_mapper"]
