"""The Zones and Endpoints of one Redfish fabric, read and written through a session.

A fabric manager's ``Fabrics/{fabric}/Zones/{zone}`` lists in ``Links.Endpoints`` the
endpoints that reach each other; a GPU (a ``Target`` endpoint) is mapped to a host by
being in a zone with the host's port (an ``Initiator`` endpoint). :class:`FabricZones`
reads zones, writes a zone's member list conditionally on the ETag it was read with
(``If-Match``; a service without ETags is written unconditionally), and runs an
operation again - from its first read - only when that is safe: after 412 (the zone
changed underneath), 429, 5xx or no answer (the next read shows whether a write that
timed out took effect). Every other error is raised at once.

:func:`members`, :func:`odata_id`, :func:`last_segment` and :func:`roles` read the JSON
shapes DMTF's schemas give these resources.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from http import HTTPStatus
from typing import Any, TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from dxpool.redfish.session import (
    RedfishError,
    RedfishResource,
    RedfishSession,
    RedfishStatusError,
)

T = TypeVar("T")
INITIATOR = "Initiator"
TARGET = "Target"
BOTH = "Both"
RETRY_WAIT_MIN_S = 0.1
RETRY_WAIT_MAX_S = 2.0


def retry_safe(error: BaseException) -> bool:
    """True for a :class:`RedfishError` after which redoing the operation can help."""
    return isinstance(error, RedfishError) and error.retryable


class FabricZones:
    """Zones and endpoints of ``fabric`` at the service behind ``session``.

    ``attempts`` bounds :meth:`retrying`; ``retry_wait_s`` is its first pause, doubling up
    to 2 s (tests pass 0). The session stays the caller's. Safe for several threads (the
    session sends one request at a time). Raises :class:`RedfishError`.
    """

    def __init__(
        self,
        session: RedfishSession,
        fabric: str,
        *,
        attempts: int,
        retry_wait_s: float = RETRY_WAIT_MIN_S,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.session = session
        self.fabric = fabric
        self.path = f"/redfish/v1/Fabrics/{fabric}"
        self._attempts = attempts
        self._retry_wait_s = retry_wait_s

    def read(self, zone: str) -> RedfishResource:
        """One GET of the zone (not retried)."""
        return self.session.get(f"{self.path}/Zones/{zone}")

    def write(self, zone: str, endpoints: Iterable[str], etag: str) -> None:
        """One PATCH of the zone's member list, conditional on ``etag`` when it is not
        empty (not retried)."""
        links = [{"@odata.id": f"{self.path}/Endpoints/{e}"} for e in endpoints]
        self.session.patch(f"{self.path}/Zones/{zone}", {"Links": {"Endpoints": links}}, etag)

    def zone_ids(self) -> list[str]:
        """The id of every zone of the fabric, in the service's order (retried)."""
        listing = self.retrying(lambda: self.session.get(f"{self.path}/Zones"))
        found = (last_segment(odata_id(link)) for link in listing.body.get("Members", []))
        return [zone for zone in found if zone]

    def holding(self, endpoint: str) -> dict[str, RedfishResource]:
        """Every zone whose members include ``endpoint``, as read now (retried). A zone
        deleted between the listing and its read holds nothing and is left out."""
        found: dict[str, RedfishResource] = {}
        for zone in self.zone_ids():
            try:
                current = self.retrying(partial(self.read, zone))
            except RedfishStatusError as error:
                if error.status == HTTPStatus.NOT_FOUND:
                    continue
                raise
            if endpoint in members(current):
                found[zone] = current
        return found

    def endpoint(self, endpoint: str) -> dict[str, Any]:
        """The endpoint resource's JSON (retried)."""
        return self.retrying(lambda: self.session.get(f"{self.path}/Endpoints/{endpoint}")).body

    def collection(self, name: str) -> dict[str, dict[str, Any]]:
        """Every member of ``Fabrics/{fabric}/{name}``, by id (retried)."""
        listing = self.retrying(lambda: self.session.get(f"{self.path}/{name}"))
        found: dict[str, dict[str, Any]] = {}
        for link in listing.body.get("Members", []):
            member_path = odata_id(link)
            if member_path:
                body = self.retrying(partial(self.session.get, member_path)).body
                found[last_segment(member_path)] = body
        return found

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
    "BOTH",
    "INITIATOR",
    "TARGET",
    "FabricZones",
    "last_segment",
    "members",
    "odata_id",
    "retry_safe",
    "roles",
]
