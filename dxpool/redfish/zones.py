"""The Zones and Endpoints of one Redfish fabric, read and changed through a session.

A fabric manager's ``Fabrics/{fabric}/Zones/{zone}`` lists in ``Links.Endpoints`` the
endpoints that reach each other; a GPU (a ``Target`` endpoint) is mapped to a host by
being in a zone with the host's port (an ``Initiator`` endpoint). :class:`FabricZones`
does what the host agent's mapper and the broker's box fabric both need:

**Membership changes** (:meth:`FabricZones.add`, :meth:`FabricZones.remove`) go through
the zone's ``#Zone.AddEndpoint`` / ``#Zone.RemoveEndpoint`` actions where the zone offers
them (Zone v1.5+; ``Links.Endpoints`` is read-only in every version of the schema), with
``ZoneETag`` and ``EndpointETag`` so the service refuses the change when the zone or the
endpoint changed since they were read. A zone without the actions is changed by a PATCH
of ``Links.Endpoints`` with ``If-Match`` - older services accept it; one that refuses it
(400, 405) is remembered and not asked again. The fabric map's ``membership`` can pin
either way. An action answered 202 is followed to its end (:mod:`dxpool.redfish.tasks`).
ETags come from the ``ETag`` header or ``@odata.etag``; a service with neither is
written unconditionally.

**Lookup** (:meth:`FabricZones.holding`): the zones holding an endpoint, read from the
endpoint's own ``Links.Zones`` where the service is trusted to keep it (``zone_lookup``
in the map: ``endpoint``, or ``auto`` once a change dxpool made showed up there), else
by reading every zone - in one request where the service root advertises ``$expand``,
one per zone otherwise. A service seen with ``Links.Zones`` out of step with the zones is
scanned from then on.

**Retries** (:meth:`FabricZones.retrying`): an operation runs again - from its first
read - only when that is safe: after 412 (something changed underneath), 429, 5xx or no
answer (the next read shows whether a write that timed out took effect). Every other
error is raised at once.

:func:`members`, :func:`zone_links`, :func:`odata_id`, :func:`last_segment` and
:func:`roles` read the JSON shapes DMTF's schemas give these resources.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from http import HTTPStatus
from typing import Any, TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from dxpool.redfish.fabric_map import DEFAULT_TASK_TIMEOUT_S, Membership, ZoneLookup
from dxpool.redfish.session import (
    RedfishError,
    RedfishResource,
    RedfishSession,
    RedfishStatusError,
)
from dxpool.redfish.tasks import await_operation

log = logging.getLogger(__name__)

T = TypeVar("T")
INITIATOR = "Initiator"
TARGET = "Target"
BOTH = "Both"
ADD_ENDPOINT = "#Zone.AddEndpoint"
REMOVE_ENDPOINT = "#Zone.RemoveEndpoint"
RETRY_WAIT_MIN_S = 0.1
RETRY_WAIT_MAX_S = 2.0
PATCH_REFUSED = frozenset({HTTPStatus.BAD_REQUEST, HTTPStatus.METHOD_NOT_ALLOWED, 501})
EXPAND_REFUSED = frozenset({HTTPStatus.BAD_REQUEST, 501})
MAX_PAGES = 1000


def retry_safe(error: BaseException) -> bool:
    """True for a :class:`RedfishError` after which redoing the operation can help."""
    return isinstance(error, RedfishError) and error.retryable


class FabricZones:
    """Zones and endpoints of ``fabric`` at the service behind ``session``.

    ``attempts`` bounds :meth:`retrying`; ``retry_wait_s`` is its first pause, doubling up
    to 2 s (tests pass 0). ``membership`` and ``zone_lookup`` are the fabric map's;
    ``task_timeout_s`` bounds following a 202. The session stays the caller's. Safe for
    several threads (the session sends one request at a time; what is learned about the
    service is kept under a lock). Raises :class:`RedfishError`.
    """

    def __init__(
        self,
        session: RedfishSession,
        fabric: str,
        *,
        attempts: int,
        retry_wait_s: float = RETRY_WAIT_MIN_S,
        membership: Membership = Membership.AUTO,
        zone_lookup: ZoneLookup = ZoneLookup.AUTO,
        task_timeout_s: float = DEFAULT_TASK_TIMEOUT_S,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.session = session
        self.fabric = fabric
        self.path = f"/redfish/v1/Fabrics/{fabric}"
        self._attempts = attempts
        self._retry_wait_s = retry_wait_s
        self._membership = membership
        self._zone_lookup = zone_lookup
        self._task_timeout_s = task_timeout_s
        self._learned = threading.Lock()
        self._patch_refused = ""  # the service's words when it refused a membership PATCH
        self._reverse_links: bool | None = None  # Links.Zones kept current (auto lookup)
        self._expand: str | None = None  # the $expand value the service takes; "" none

    # -- paths and reads -------------------------------------------------------------------

    def zone_path(self, zone: str) -> str:
        return f"{self.path}/Zones/{zone}"

    def endpoint_path(self, endpoint: str) -> str:
        return f"{self.path}/Endpoints/{endpoint}"

    def read(self, zone: str) -> RedfishResource:
        """One GET of the zone (not retried)."""
        return self.session.get(self.zone_path(zone))

    def read_endpoint(self, endpoint: str) -> RedfishResource:
        """One GET of the endpoint (not retried)."""
        return self.session.get(self.endpoint_path(endpoint))

    def endpoint(self, endpoint: str) -> dict[str, Any]:
        """The endpoint resource's JSON (retried)."""
        return self.retrying(lambda: self.read_endpoint(endpoint)).body

    @property
    def trusts_endpoint_zones(self) -> bool:
        """True when lookups read the endpoint's ``Links.Zones`` instead of every zone."""
        if self._zone_lookup is ZoneLookup.ENDPOINT:
            return True
        with self._learned:
            return self._zone_lookup is ZoneLookup.AUTO and self._reverse_links is True

    # -- membership ------------------------------------------------------------------------

    def add(self, zone: str, current: RedfishResource, endpoint: str, endpoint_etag: str) -> None:
        """One conditional change adding ``endpoint`` to ``zone``: ``current`` is the zone
        and ``endpoint_etag`` the endpoint's ETag as read when the caller decided, so the
        service refuses (412) if either changed since. Not retried; see :meth:`retrying`."""
        self._change(zone, current, endpoint, endpoint_etag, add=True)

    def remove(self, zone: str, endpoints: Collection[str]) -> list[str]:
        """One try at taking each of ``endpoints`` out of ``zone`` - only those, whatever
        else the zone holds. Returns the ones it held. A zone that is gone (404) holds
        nothing. Not retried; see :meth:`retrying`."""
        try:
            current = self.read(zone)
        except RedfishStatusError as error:
            if error.status == HTTPStatus.NOT_FOUND:
                return []
            raise
        held = [m for m in members(current) if m in endpoints]
        if not held:
            return []
        try:
            if self._uses_action(zone, current, REMOVE_ENDPOINT):
                for index, endpoint in enumerate(held):
                    if index:
                        current = self.read(zone)  # the last change moved the zone's ETag
                        if endpoint not in members(current):
                            continue
                    self._change(zone, current, endpoint, "", add=False)
            else:
                self._patch(zone, current, [m for m in members(current) if m not in held])
        except RedfishStatusError as error:
            if error.status != HTTPStatus.NOT_FOUND or self._exists(zone):
                raise
            return []  # deleted meanwhile: it holds nothing any more
        return held

    def _exists(self, zone: str) -> bool:
        try:
            self.read(zone)
        except RedfishStatusError as error:
            if error.status == HTTPStatus.NOT_FOUND:
                return False
            raise
        return True

    def _change(
        self,
        zone: str,
        current: RedfishResource,
        endpoint: str,
        endpoint_etag: str,
        *,
        add: bool,
    ) -> None:
        name = ADD_ENDPOINT if add else REMOVE_ENDPOINT
        if self._uses_action(zone, current, name):
            body: dict[str, Any] = {"Endpoint": {"@odata.id": self.endpoint_path(endpoint)}}
            if current.etag:
                body["ZoneETag"] = current.etag
            if endpoint_etag:
                body["EndpointETag"] = endpoint_etag
            reply = self.session.post(action_target(current.body, name), body)
            await_operation(
                self.session,
                reply,
                what=f"{name} of endpoint {endpoint} on zone {zone}",
                timeout_s=self._task_timeout_s,
            )
            return
        held = members(current)
        self._patch(zone, current, [*held, endpoint] if add else [m for m in held if m != endpoint])

    def _uses_action(self, zone: str, current: RedfishResource, name: str) -> bool:
        offered = bool(action_target(current.body, name))
        if offered and self._membership is not Membership.PATCH:
            return True
        if self._membership is Membership.ACTIONS:
            raise RedfishError(
                f"zone {zone} at {self.session.url} offers no {name} action, "
                "and the fabric map's service.membership: actions allows no other way; use "
                "membership: auto or patch for a service that changes zones by PATCH",
                retryable=False,
            )
        return False

    def _patch(self, zone: str, current: RedfishResource, endpoints: list[str]) -> None:
        with self._learned:
            refused = self._patch_refused
        if refused and self._membership is not Membership.PATCH:
            raise RedfishError(
                f"zone {zone} at {self.session.url} offers neither #Zone.AddEndpoint nor "
                f"#Zone.RemoveEndpoint, and the service refused a PATCH of Links.Endpoints "
                f"before ({refused}); give its zones the actions (Zone v1.5+) or fix the zone "
                "by hand",
                retryable=False,
            )
        links = [{"@odata.id": self.endpoint_path(e)} for e in endpoints]
        try:
            self.session.patch(self.zone_path(zone), {"Links": {"Endpoints": links}}, current.etag)
        except RedfishStatusError as error:
            if error.status not in PATCH_REFUSED:
                raise
            with self._learned:
                self._patch_refused = error.message
            raise RedfishError(
                f"{self.session.url} refused to change zone {zone} by a PATCH of "
                f"Links.Endpoints, which DMTF's Zone schema makes read-only ({error.message}); "
                "the zone offers no #Zone.AddEndpoint/#Zone.RemoveEndpoint action either",
                retryable=False,
            ) from error

    # -- lookup ----------------------------------------------------------------------------

    def holding(
        self,
        endpoint: str,
        *,
        endpoint_now: RedfishResource | None = None,
        after_change: bool = False,
    ) -> dict[str, RedfishResource]:
        """Every zone whose members include ``endpoint``, as read now (retried).

        ``endpoint_now`` is the endpoint as just read (saves a read); ``after_change``
        says dxpool just changed this endpoint's zones, which is when ``auto`` lookup
        learns whether the service keeps ``Links.Zones`` current. A zone deleted
        meanwhile holds nothing and is left out.
        """
        first = endpoint_now

        def lookup() -> dict[str, RedfishResource]:
            nonlocal first
            if self._zone_lookup is ZoneLookup.SCAN:
                return {z: r for z, r in self.scan().items() if endpoint in members(r)}
            current = first if first is not None else self.read_endpoint(endpoint)
            first = None  # a retry reads afresh
            listed = zone_links(current.body)
            if listed is not None and self.trusts_endpoint_zones:
                found = self._read_listed(endpoint, listed)
                if found is not None:
                    return found
            found = {z: r for z, r in self.scan().items() if endpoint in members(r)}
            if self._zone_lookup is ZoneLookup.AUTO:
                self._learn(endpoint, listed, set(found), after_change)
            return found

        return self.retrying(lookup)

    def _read_listed(self, endpoint: str, listed: list[str]) -> dict[str, RedfishResource] | None:
        """The zones ``Links.Zones`` names, each checked to hold the endpoint; None (and
        scanned from now on) when one does not."""
        found: dict[str, RedfishResource] = {}
        for zone in listed:
            try:
                current = self.read(zone)
            except RedfishStatusError as error:
                if error.status == HTTPStatus.NOT_FOUND:
                    continue
                raise
            if endpoint not in members(current):
                self._distrust(f"endpoint {endpoint} lists zone {zone}, which does not hold it")
                return None
            found[zone] = current
        return found

    def _learn(
        self, endpoint: str, listed: list[str] | None, found: set[str], after_change: bool
    ) -> None:
        if listed is None:
            self._distrust(f"endpoint {endpoint} has no Links.Zones")
        elif set(listed) != found:
            self._distrust(
                f"endpoint {endpoint} lists zones {sorted(listed)} but is held by {sorted(found)}"
            )
        elif after_change:
            with self._learned:
                if self._reverse_links is None:
                    self._reverse_links = True
                    log.info(
                        "redfish service keeps Endpoint.Links.Zones current; reading it "
                        "instead of every zone",
                        extra={"url": self.session.url, "fabric": self.fabric},
                    )

    def _distrust(self, why: str) -> None:
        with self._learned:
            if self._reverse_links is False:
                return
            self._reverse_links = False
        log.warning(
            "redfish service does not keep Endpoint.Links.Zones current; every zone is read "
            "to find an endpoint's",
            extra={"url": self.session.url, "fabric": self.fabric, "why": why},
        )

    def scan(self) -> dict[str, RedfishResource]:
        """Every zone of the fabric, by id, as read now (not retried). One request where
        the service takes ``$expand``, one per zone (after the listing) otherwise. A zone
        deleted between the listing and its read is left out."""
        expand = self._expand_value()
        if expand:
            try:
                listed = self._list(f"{self.path}/Zones", {"$expand": expand})
            except RedfishStatusError as error:
                if error.status not in EXPAND_REFUSED:
                    raise
                with self._learned:
                    self._expand = ""
            else:
                return self._expanded(listed)
        found: dict[str, RedfishResource] = {}
        for zone in self.zone_ids():
            try:
                found[zone] = self.read(zone)
            except RedfishStatusError as error:
                if error.status != HTTPStatus.NOT_FOUND:
                    raise
        return found

    def _expanded(self, listed: list[dict[str, Any]]) -> dict[str, RedfishResource]:
        found: dict[str, RedfishResource] = {}
        for member in listed:
            zone = last_segment(odata_id(member))
            if not zone:
                continue
            if "Links" in member or "Id" in member:
                etag = member.get("@odata.etag")
                found[zone] = RedfishResource(member, etag if isinstance(etag, str) else "")
                continue
            try:  # the service left this member unexpanded
                found[zone] = self.read(zone)
            except RedfishStatusError as error:
                if error.status != HTTPStatus.NOT_FOUND:
                    raise
        return found

    def _expand_value(self) -> str:
        with self._learned:
            known = self._expand
        if known is not None:
            return known
        root = self.session.get("/redfish/v1/").body
        features = root.get("ProtocolFeaturesSupported", {})
        query = features.get("ExpandQuery", {}) if isinstance(features, dict) else {}
        value = ""
        if isinstance(query, dict) and (query.get("NoLinks") or query.get("ExpandAll")):
            value = ".($levels=1)" if query.get("Levels") else "."
        with self._learned:
            self._expand = value
        return value

    def zone_ids(self) -> list[str]:
        """The id of every zone of the fabric, in the service's order (not retried)."""
        listed = self._list(f"{self.path}/Zones")
        return [zone for zone in (last_segment(odata_id(m)) for m in listed) if zone]

    def _list(self, path: str, query: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """A collection's members, following ``Members@odata.nextLink`` pages."""
        found: list[dict[str, Any]] = []
        page: str | None = path
        for _ in range(MAX_PAGES):
            if page is None:
                return found
            body = self.session.get(page, query if page == path else None).body
            found.extend(m for m in body.get("Members", []) if isinstance(m, dict))
            following = body.get("Members@odata.nextLink")
            page = following if isinstance(following, str) and following else None
        raise RedfishError(f"{path} at {self.session.url} has more than {MAX_PAGES} pages")

    def retrying(self, operation: Callable[[], T]) -> T:
        """Run ``operation``; run it again (up to ``attempts`` in all) after a retryable
        :class:`RedfishError`. The operation must start from a fresh read."""
        retrier = Retrying(
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=self._retry_wait_s, max=RETRY_WAIT_MAX_S),
            retry=retry_if_exception(retry_safe),
            reraise=True,
        )
        return retrier(operation)


def members(zone: RedfishResource) -> list[str]:
    """The endpoint ids in a zone's ``Links.Endpoints``, in the service's order."""
    links = zone.body.get("Links", {})
    endpoints = links.get("Endpoints", []) if isinstance(links, dict) else []
    return [last_segment(odata_id(link)) for link in endpoints if odata_id(link)]


def zone_links(endpoint: dict[str, Any]) -> list[str] | None:
    """The zone ids in an endpoint's ``Links.Zones``; None when it has no such property
    (it is optional in the Endpoint schema)."""
    links = endpoint.get("Links")
    if not isinstance(links, dict) or not isinstance(links.get("Zones"), list):
        return None
    return [last_segment(odata_id(link)) for link in links["Zones"] if odata_id(link)]


def action(resource: dict[str, Any], name: str) -> dict[str, Any] | None:
    """Action ``name`` of a resource, from ``Actions`` or ``Actions.Oem``; None if absent."""
    actions = resource.get("Actions")
    if not isinstance(actions, dict):
        return None
    found = actions.get(name)
    oem = actions.get("Oem")
    if found is None and isinstance(oem, dict):
        found = oem.get(name)
    return found if isinstance(found, dict) else None


def action_target(resource: dict[str, Any], name: str) -> str:
    """The ``target`` of action ``name`` (see :func:`action`), or ""."""
    target = (action(resource, name) or {}).get("target")
    return target if isinstance(target, str) else ""


def odata_id(link: object) -> str:
    """The ``@odata.id`` of a link object, or ""."""
    if isinstance(link, dict) and isinstance(link.get("@odata.id"), str):
        return str(link["@odata.id"])
    return ""


def last_segment(path: str) -> str:
    """A resource's id: the last segment of its path."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def roles(endpoint: dict[str, Any]) -> set[str]:
    """The ``EntityRole`` of each of an endpoint's ``ConnectedEntities``."""
    entities = endpoint.get("ConnectedEntities", [])
    return {
        str(entity.get("EntityRole"))
        for entity in entities
        if isinstance(entity, dict) and entity.get("EntityRole")
    }


__all__ = [
    "ADD_ENDPOINT",
    "BOTH",
    "INITIATOR",
    "REMOVE_ENDPOINT",
    "TARGET",
    "FabricZones",
    "action",
    "action_target",
    "last_segment",
    "members",
    "odata_id",
    "retry_safe",
    "roles",
    "zone_links",
]
