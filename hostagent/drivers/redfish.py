"""A :class:`~dxpool.hostagent.driver.ProxyMapper` over a DMTF Redfish fabric manager.

PCIe and CXL fabric managers (H3 Platform's Falcon, Liqid, GigaIO) expose their fabric
as Redfish ``Fabrics/{fabric}``: ``Endpoints`` are the ends of the fabric - host ports
(``ConnectedEntities[].EntityRole`` ``Initiator``) and devices (``Target``) - and
``Zones`` say which endpoints reach each other. A GPU is assigned to a host by adding
its endpoint to a zone that holds the host port, and taken away by removing it - through
the zone's ``#Zone.AddEndpoint`` / ``#Zone.RemoveEndpoint`` actions, or a PATCH of
``Links.Endpoints`` where a service has no actions (:mod:`dxpool.redfish.zones`).

Which zone is which host slot, and which endpoint is which GPU, comes from the fabric
map (:mod:`dxpool.redfish.fabric_map`): a zone per host slot (one GPU each) or one zone
per host port (several GPUs; the slot each was mapped for is recorded by
:mod:`~dxpool.hostagent.drivers.redfish_slots`). Zones may hold other endpoints - a
switch's, a memory device's: only the map's GPUs are ever added or removed. The map is
checked against the service when the mapper is built (:meth:`RedfishProxyMapper.discover`).

**Exclusivity is dxpool's own check.** Nothing in DMTF's schema makes a service refuse
to put one endpoint in two zones (``Endpoint.Links.Zones`` is an array), so a map never
relies on a 409. Before the write it reads the GPU's endpoint and the zones holding it,
and refuses (:class:`~dxpool.hostagent.errors.AttachConflictError`) when any zone but the
slot's own holds it. The write carries the zone's ETag and the endpoint's
(``ZoneETag``/``EndpointETag`` with the action, ``If-Match`` with a PATCH), so a service
that checks them refuses a change made on a stale view (412, read again and decided
anew). After the write it reads again, and if a second zone appeared meanwhile - another
agent mapping the same GPU at the same moment, on a service without ETags - it takes the
GPU out of its own zone again and reports the conflict: the GPU is never left in two
hosts' zones by this mapper. A 409 from a service that does refuse is a conflict too.

Retries (:mod:`tenacity`, the map's ``attempts``) happen only when redoing the operation
from a fresh read is safe: after 412, 429, 5xx and when no answer came. Other 4xx are not
retried and carry the service's message.

Redfish zones carry no dxpool generation, so unlike the simulated fabric the service
cannot refuse a map for a fenced generation: a fence revokes what is mapped, and the
broker keeps the fenced host's GPUs from being handed out until it has (see
docs/ARCHITECTURE.md, "Fencing a host at the box side").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TypeVar

from dxpool.hostagent.drivers.redfish_slots import LEDGER_FILE, SlotLedger
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
NOT_FOUND = 404


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
    ``state_dir`` keeps the slot record of a zone-per-port host across restarts (memory
    only without it). ``generation`` is logged with each map but cannot be enforced:
    Redfish zones do not carry it (see the module docstring). Safe for several threads.
    Raises :class:`~dxpool.hostagent.errors.DriverError` naming the zone or endpoint and
    what the service said.
    """

    def __init__(
        self,
        fabric_map: RedfishFabricMap,
        host: str,
        session: RedfishSession,
        *,
        retry_wait_s: float = RETRY_WAIT_MIN_S,
        state_dir: Path | None = None,
    ) -> None:
        if host not in fabric_map.hosts:
            raise DriverError(
                f"host {host!r} is not in the Redfish fabric map; add it under hosts: with its "
                "endpoint and its zones",
                retryable=False,
            )
        service = fabric_map.service
        self._map = fabric_map
        self._host = host
        self._session = session
        self._zones = FabricZones(
            session,
            service.fabric,
            attempts=service.attempts,
            retry_wait_s=retry_wait_s,
            membership=service.membership,
            zone_lookup=service.zone_lookup,
            task_timeout_s=service.task_timeout_s,
        )
        own = fabric_map.hosts[host]
        self._ledger = (
            SlotLedger(own.slots, state_dir / LEDGER_FILE if state_dir is not None else None)
            if own.per_port
            else None
        )
        self._pending_lock = threading.Lock()
        self._pending: set[GpuRef] = set()  # maps under way: their slot records stay

    @property
    def zones(self) -> FabricZones:
        """The zone access this mapper uses (tests read what it learned)."""
        return self._zones

    # -- ProxyMapper -----------------------------------------------------------------------

    def map(self, gpu: GpuRef, host_slot: int, generation: int) -> None:
        zone = self._slot_zone(host_slot)
        wanted = self._gpu_endpoint(gpu)
        ledger = self._ledger
        with self._pending_lock:
            self._pending.add(gpu)
        try:
            if ledger is not None:
                with driver_errors():
                    self._reserve(ledger, gpu, host_slot)
            self._retrying(lambda: self._map_once(gpu, wanted, zone, host_slot))
        except BaseException:
            if ledger is not None and not self._holds(zone, wanted):
                ledger.release(gpu)
            raise
        finally:
            with self._pending_lock:
                self._pending.discard(gpu)
        log.info(
            "redfish zone mapped",
            extra={"gpu": gpu.name, "zone": zone, "host_slot": host_slot, "generation": generation},
        )

    def _map_once(self, gpu: GpuRef, wanted: str, zone: str, host_slot: int) -> None:
        zones = self._zones
        current = zones.read(zone)
        held = members(current)
        if self._own.endpoint not in held:
            raise DriverError(
                f"zone {zone} ({self._slot_name(host_slot)}) does not hold the host's endpoint "
                f"{self._own.endpoint}; correct the zone or the fabric map",
                retryable=False,
            )
        self._check_room(gpu, wanted, zone, host_slot, held)
        endpoint_now = zones.read_endpoint(wanted)
        elsewhere = sorted(set(zones.holding(wanted, endpoint_now=endpoint_now)) - {zone})
        if elsewhere:
            raise AttachConflictError(
                f"{gpu.name} (endpoint {wanted}) is in {self._describe_zones(elsewhere)}; a GPU "
                f"is mapped to one host at a time - unmap it there first"
            )
        if wanted in held:
            return  # mapped already, and nowhere else
        try:
            zones.add(zone, current, wanted, endpoint_now.etag)
        except RedfishStatusError as error:
            if error.status == CONFLICT:
                raise AttachConflictError(
                    f"{gpu.name} (endpoint {wanted}) cannot join zone {zone}: {error.message}; "
                    "it is mapped elsewhere - unmap it there first"
                ) from error
            raise
        after = zones.holding(wanted, after_change=True)
        if zone not in after:
            raise DriverError(
                f"{self._session.url} accepted adding {gpu.name} (endpoint {wanted}) to zone "
                f"{zone}, but the zone does not hold it when read back"
            )
        appeared = sorted(set(after) - {zone})
        if appeared:
            self._undo(gpu, wanted, zone, appeared)

    def _undo(self, gpu: GpuRef, wanted: str, zone: str, appeared: list[str]) -> None:
        """Take ``wanted`` out of our ``zone`` again: another zone took it meanwhile."""
        log.warning(
            "gpu joined another zone while being mapped; undoing the map",
            extra={"gpu": gpu.name, "zone": zone, "other_zones": appeared},
        )
        self._zones.retrying(lambda: self._zones.remove(zone, [wanted]))
        raise AttachConflictError(
            f"{gpu.name} (endpoint {wanted}) joined {self._describe_zones(appeared)} while it "
            f"was being added to zone {zone}; the map was undone so no two hosts share it"
        )

    def unmap(self, gpu: GpuRef) -> None:
        wanted = self._gpu_endpoint(gpu)
        own = self._own.zones
        if self._zones.trusts_endpoint_zones:
            with driver_errors():
                found = self._zones.holding(wanted)
            own = tuple(zone for zone in own if zone in found)
        for zone in own:
            self._retrying(partial(self._zones.remove, zone, [wanted]))
        if self._ledger is not None:
            self._ledger.release(gpu)

    def mappings(self) -> dict[int, GpuRef]:
        if self._ledger is not None:
            (zone,) = self._own.zones
            held = members(self._retrying(lambda: self._zones.read(zone)))
            return self._ledger.assign(self._gpus(held), keep=self._in_flight())
        found: dict[int, GpuRef] = {}
        for host_slot, zone in enumerate(self._own.zones):
            held = members(self._retrying(partial(self._zones.read, zone)))
            gpus = self._gpus(held)
            if len(gpus) > 1:
                log.warning(
                    "slot zone holds more than one GPU; reporting the first",
                    extra={"zone": zone, "gpus": [g.name for g in gpus]},
                )
            if gpus:
                found[host_slot] = gpus[0]
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

            def attempt(zone: str = zone) -> list[GpuRef]:
                current = self._zones.read(zone)
                held = members(current)
                if entry.endpoint not in held:
                    return []
                gpus = self._gpus(held)
                if any(m in initiators and m != entry.endpoint for m in held):
                    # other hosts use the zone: take only this host out of it
                    self._zones.remove(zone, [entry.endpoint])
                else:  # the host's own zone: take its GPUs out, keep everything else
                    gone = set(self._zones.remove(zone, [self._gpu_endpoint(g) for g in gpus]))
                    gpus = [g for g in gpus if self._gpu_endpoint(g) in gone]
                return gpus

            revoked.extend(self._retrying(attempt))
        log.warning(
            "redfish host fenced",
            extra={"host": host, "gpus": [g.name for g in revoked]},
        )
        return sorted(set(revoked))

    # -- discovery -------------------------------------------------------------------------

    def discover(self) -> None:
        """Check the fabric map against the service: the fabric, every mapped endpoint
        with the role the map gives it, and this host's zones (they exist and hold the
        host's endpoint). Raises a non-retryable :class:`DriverError` listing every
        mismatch."""
        with driver_errors():
            self._check_fabric()
            problems: list[str] = []
            for host, entry in sorted(self._map.hosts.items()):
                self._check_role(problems, entry.endpoint, INITIATOR, f"host {host}")
            for box, ids in sorted(self._map.boxes.items()):
                for slot, endpoint in enumerate(ids):
                    self._check_role(problems, endpoint, TARGET, f"GPU {box}/{slot}")
            for index, zone in enumerate(self._own.zones):
                where = "port" if self._own.per_port else f"host slot {index}"
                try:
                    held = members(self._zones.retrying(partial(self._zones.read, zone)))
                except RedfishStatusError as error:
                    if error.status != NOT_FOUND:
                        raise
                    problems.append(f"zone {zone} ({where} of {self._host}) does not exist")
                    continue
                if self._own.endpoint not in held:
                    problems.append(
                        f"zone {zone} ({where} of {self._host}) does not hold the host's "
                        f"endpoint {self._own.endpoint}"
                    )
        if problems:
            raise DriverError(
                f"the Redfish fabric map does not match {self._session.url} fabric "
                f"{self._map.service.fabric}: " + "; ".join(problems),
                retryable=False,
            )

    def _check_fabric(self) -> None:
        try:
            self._zones.retrying(lambda: self._session.get(self._zones.path))
        except RedfishStatusError as error:
            if error.status != NOT_FOUND:
                raise
            raise DriverError(
                f"{self._session.url} has no fabric {self._map.service.fabric} "
                f"({self._zones.path} answered 404): {self._fabrics_offered()}; correct "
                "service.fabric in the fabric map",
                retryable=False,
            ) from error

    def _fabrics_offered(self) -> str:
        try:
            listing = self._session.get("/redfish/v1/Fabrics").body
        except RedfishStatusError:
            return "the service has no Fabrics collection at all (it is no fabric manager)"
        names = [str(m.get("@odata.id", "")).rsplit("/", 1)[-1] for m in listing.get("Members", [])]
        return f"its fabrics are {', '.join(names) or 'none'}"

    def _check_role(self, problems: list[str], endpoint: str, role: str, owner: str) -> None:
        try:
            body = self._zones.endpoint(endpoint)
        except RedfishStatusError as error:
            if error.status != NOT_FOUND:
                raise
            problems.append(f"endpoint {endpoint} ({owner}) does not exist")
            return
        found = roles(body)
        if role not in found and BOTH not in found:
            problems.append(
                f"endpoint {endpoint} ({owner}) has EntityRole "
                f"{', '.join(sorted(found)) or 'none'}, not {role}"
            )

    def close(self) -> None:
        """End the Redfish session."""
        self._session.close()

    # -- helpers ---------------------------------------------------------------------------

    @property
    def _own(self) -> RedfishHost:
        return self._map.hosts[self._host]

    def _slot_name(self, host_slot: int) -> str:
        return f"host slot {host_slot} of {self._host}"

    def _slot_zone(self, host_slot: int) -> str:
        zone = self._own.zone_for_slot(host_slot)
        if zone is None:
            raise DriverError(
                f"host slot {host_slot} of {self._host} is outside the {self._own.slots} slots "
                "the Redfish fabric map gives the host; add zones (or slots) or lower the "
                "host's slot capacity",
                retryable=False,
            )
        return zone

    def _gpu_endpoint(self, gpu: GpuRef) -> str:
        endpoint = self._map.gpu_endpoint(gpu)
        if endpoint is None:
            raise DriverError(
                f"{gpu.name} has no endpoint in the Redfish fabric map; list it under "
                f"boxes.{gpu.box}",
                retryable=False,
            )
        return endpoint

    def _gpus(self, held: Iterable[str]) -> list[GpuRef]:
        """The map's GPUs among a zone's members (host ports, switches and other devices
        are not GPUs)."""
        return [gpu for gpu in (self._map.gpu_of(m) for m in held) if gpu is not None]

    def _reserve(self, ledger: SlotLedger, gpu: GpuRef, host_slot: int) -> None:
        """Record ``gpu`` at ``host_slot`` of the port, after checking from the zone that
        the slot is free and the GPU is not mapped at another slot here."""
        (zone,) = self._own.zones
        held = self._gpus(members(self._retrying(lambda: self._zones.read(zone))))
        current = ledger.assign(held, keep=self._in_flight())
        at = next((slot for slot, g in current.items() if g == gpu), None)
        if at is not None and at != host_slot:
            raise AttachConflictError(
                f"{gpu.name} is mapped at host slot {at} of {self._host}, not {host_slot}; "
                "unmap it first"
            )
        holder = current.get(host_slot)
        if holder is not None and holder != gpu:
            raise AttachConflictError(
                f"host slot {host_slot} of {self._host} (zone {zone}) already holds "
                f"{holder.name}; unmap it first or pick a free slot"
            )
        ledger.reserve(gpu, host_slot)

    def _check_room(
        self, gpu: GpuRef, wanted: str, zone: str, host_slot: int, held: list[str]
    ) -> None:
        others = [g for g in self._gpus(held) if g != gpu]
        if not self._own.per_port:
            if others:
                raise AttachConflictError(
                    f"{self._slot_name(host_slot)} (zone {zone}) already holds "
                    f"{self._describe(self._gpu_endpoint(g) for g in others)}; unmap it first "
                    "or pick a free slot"
                )
        elif wanted not in held and len(others) >= self._own.port_slots:
            raise AttachConflictError(
                f"the port zone {zone} of {self._host} already holds {len(others)} GPUs, all "
                f"its {self._own.port_slots} slots; unmap one first"
            )

    def _in_flight(self) -> set[GpuRef]:
        with self._pending_lock:
            return set(self._pending)

    def _holds(self, zone: str, endpoint: str) -> bool:
        try:
            return endpoint in members(self._zones.read(zone))
        except RedfishError:
            return True  # unknown: keep the slot record, the next resync settles it

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

    def _describe_zones(self, zones: Iterable[str]) -> str:
        parts = []
        for zone in zones:
            owner = self._map.host_of_zone(zone)
            parts.append(f"zone {zone} (host {owner})" if owner else f"zone {zone}")
        return ", ".join(parts)

    def _retrying(self, operation: Callable[[], T]) -> T:
        with driver_errors():
            return self._zones.retrying(operation)


def connect_redfish_mapper(
    fabric_map: RedfishFabricMap, host: str, *, state_dir: Path | None = None
) -> RedfishProxyMapper:
    """Log in to the map's service, check the map against it, and return the mapper for
    ``host``. Raises :class:`DriverError`; the session is closed again on failure."""
    with driver_errors():
        session = RedfishSession(fabric_map.service)
    try:
        mapper = RedfishProxyMapper(fabric_map, host, session, state_dir=state_dir)
        mapper.discover()
    except BaseException:
        session.close()
        raise
    return mapper


__all__ = ["RedfishProxyMapper", "connect_redfish_mapper"]
