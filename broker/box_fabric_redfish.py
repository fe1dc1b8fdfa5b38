"""The broker's box fabric over a DMTF Redfish fabric manager (``--fabric redfish:MAP``).

``MAP`` is the same YAML fabric map the host agents are given (``--redfish-map``,
:mod:`dxpool.redfish.fabric_map`): the service's URL, fabric id, user and password file,
CA bundle or ``verify: false``, per-request timeout and attempts, and which Redfish
endpoint is which GPU. The broker logs in on its first fence, not at start, so a fabric
manager that is down when the broker starts delays fencing, not the broker.

**fence(gpu, generation)** checks that the service has the GPU's endpoint as a device
(``Target``) - a map naming a wrong id would otherwise find the GPU in no zone and
"fence" nothing - then removes the endpoint from every zone of the fabric that
holds it - the host's slot zones, a zone shared by several hosts, one made by hand -
and nothing else (the host ports stay in their zones). Each zone is changed by a
read-modify-write conditional on its ETag, so a zone that changed underneath (412) is
read and decided again; 429, 5xx and no answer are retried the same way, up to the map's
``attempts``; a zone deleted meanwhile (404) holds nothing and is passed over. Then
every zone is read again, and the fence returns only when none holds the endpoint: a
map that slipped in meanwhile is removed in another round, and one that keeps coming
back fails the fence. An endpoint already in no zone is a fence that succeeds without
a write.

**What the generation guarantees here.** Redfish zones carry no dxpool generation, so
this backend can neither refuse a map made later for a fenced generation nor tell an
older assignment's mapping from a newer one. It holds the :class:`BoxFabric` contract
through the broker's use of it instead: ``fence`` is only called for a GPU in FENCING
for ``generation``, and a FENCING GPU is handed to no one until the fence (and scrub)
succeeded and a transaction comparing that generation freed it - so when the fence
runs, no newer assignment can hold a mapping, and every mapping it removes belongs to
``generation`` or older. Not guaranteed: (1) a deposed leader's fence that arrives after
the GPU was freed and given to a new node removes the new node's mapping too - that
fails safe (the new host loses the device; no one else gains it) and is reported by
that host's agent; (2) an agent of the lost host that wrote its attach intent before
its session ended and sends its map after the fence is not refused by the fabric
manager. Services that keep a target endpoint in one zone at a time (as the ones dxpool
was written against do) then refuse the next host's map as a conflict rather than
share the GPU, until the returning agent drops what it no longer owns.

**scrub(gpu, generation)** resets the GPU through the service when the GPU's endpoint
links (``ConnectedEntities[].EntityLink``) a resource with a Reset action
(``#Processor.Reset``, ``#PCIeDevice.Reset``, ...): it POSTs ``ResetType``
``ForceRestart`` (or ``PowerCycle``, ``GracefulRestart``: the first the action allows)
and follows a 202's task monitor to its end. It refuses while any zone still holds the
endpoint. A service that offers no such action makes scrub fail with a message saying
so - the broker does not pretend a GPU of a lost host was cleared: the lost host's
agent, which scrubs on an ordinary release, cannot be asked, and an attach does not
reset. Such GPUs are quarantined after repeated failures; a hook (``--fabric
hook:PATH``) whose ``scrub-gpu`` resets the box through the vendor's own tool is the
way to reclaim them on such a fabric.

Errors are :class:`~dxpool.broker.box_fabric.BoxFabricError` naming the GPU, its
endpoint, the zone and what the service said.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from http import HTTPStatus
from typing import Any

from dxpool.broker.box_fabric import BoxFabricError
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import RedfishFabricMap, RedfishService
from dxpool.redfish.session import RedfishError, RedfishSession, RedfishStatusError
from dxpool.redfish.zones import (
    BOTH,
    RETRY_WAIT_MIN_S,
    TARGET,
    FabricZones,
    members,
    odata_id,
    roles,
)

log = logging.getLogger(__name__)

RESET_TYPES = ("ForceRestart", "PowerCycle", "GracefulRestart")
TASK_DONE = "Completed"
TASK_FAILED = frozenset({"Exception", "Killed", "Cancelled", "Interrupted"})
TASK_POLL_S = 0.2


class RedfishBoxFabric:
    """:class:`~dxpool.broker.box_fabric.BoxFabric` over the fabric manager of ``fabric_map``.

    ``connect`` opens a session (tests pass their own); ``retry_wait_s`` is the first
    pause between tries of one zone change (tests pass 0). Safe for several threads.
    """

    def __init__(
        self,
        fabric_map: RedfishFabricMap,
        *,
        connect: Callable[[RedfishService], RedfishSession] = RedfishSession,
        retry_wait_s: float = RETRY_WAIT_MIN_S,
    ) -> None:
        self._map = fabric_map
        self._connect = connect
        self._retry_wait_s = retry_wait_s
        self._lock = threading.Lock()
        self._zones: FabricZones | None = None

    @property
    def url(self) -> str:
        return self._map.service.url

    # -- BoxFabric -----------------------------------------------------------------------

    def fence(self, gpu: GpuRef, generation: int) -> None:
        endpoint = self._endpoint(gpu)
        zones = self._connected()
        rounds = self._map.service.attempts
        removed_from: list[str] = []
        try:
            self._check_endpoint(zones, gpu, endpoint)
            for round_ in itertools.count():
                holding = zones.holding(endpoint)  # the read-back of the round before
                if not holding:
                    break
                if round_ == rounds:
                    raise BoxFabricError(
                        f"{gpu.name} (endpoint {endpoint}) is still in zone(s) "
                        f"{', '.join(sorted(holding))} at {self.url} after {rounds} rounds of "
                        "removal: something keeps mapping it (an agent of the lost host still "
                        "running?); retrying"
                    )
                for zone in holding:
                    zones.retrying(partial(_remove, zones, zone, endpoint))
                    removed_from.append(zone)
        except RedfishError as error:
            raise BoxFabricError(
                f"fencing {gpu.name} (endpoint {endpoint}) at {self.url} failed: {error.message}"
            ) from error
        log.warning(
            "gpu fenced at the box side",
            extra={
                "gpu": gpu.name,
                "generation": generation,
                "endpoint": endpoint,
                "zones": removed_from,
            },
        )

    def scrub(self, gpu: GpuRef, generation: int) -> None:
        endpoint = self._endpoint(gpu)
        zones = self._connected()
        try:
            holding = zones.holding(endpoint)
            if holding:
                raise BoxFabricError(
                    f"{gpu.name} (endpoint {endpoint}) is still in zone(s) "
                    f"{', '.join(sorted(holding))} at {self.url}; it is fenced before it is "
                    "scrubbed"
                )
            target, reset_type = self._reset_action(zones, gpu, endpoint)
            reply = zones.session.post(target, {"ResetType": reset_type})
            if reply.status == HTTPStatus.ACCEPTED and reply.location:
                self._wait_for_task(zones.session, gpu, reply.location)
            elif reply.status == HTTPStatus.ACCEPTED:
                log.warning(  # Redfish requires a task monitor with a 202; nothing to follow
                    "gpu reset accepted without a task monitor; not waiting for it",
                    extra={"gpu": gpu.name, "url": self.url},
                )
        except RedfishError as error:
            raise BoxFabricError(
                f"scrubbing {gpu.name} (endpoint {endpoint}) at {self.url} failed: {error.message}"
            ) from error
        log.info(
            "gpu reset at the box side",
            extra={"gpu": gpu.name, "generation": generation, "reset_type": reset_type},
        )

    def close(self) -> None:
        """End the Redfish session, if one was opened."""
        with self._lock:
            zones, self._zones = self._zones, None
        if zones is not None:
            zones.session.close()

    # -- helpers -------------------------------------------------------------------------

    def _endpoint(self, gpu: GpuRef) -> str:
        endpoint = self._map.gpu_endpoint(gpu)
        if endpoint is None:
            raise BoxFabricError(
                f"{gpu.name} has no endpoint in the broker's Redfish fabric map; list it under "
                f"boxes.{gpu.box} (slot {gpu.slot}) so the box side can revoke its mappings"
            )
        return endpoint

    def _connected(self) -> FabricZones:
        with self._lock:
            if self._zones is None:
                service = self._map.service
                try:
                    session = self._connect(service)
                except RedfishError as error:
                    raise BoxFabricError(
                        f"cannot log in to the Redfish service {service.url}: {error.message}"
                    ) from error
                self._zones = FabricZones(
                    session,
                    service.fabric,
                    attempts=service.attempts,
                    retry_wait_s=self._retry_wait_s,
                )
            return self._zones

    def _check_endpoint(self, zones: FabricZones, gpu: GpuRef, endpoint: str) -> None:
        """The service has ``endpoint`` as a device (Target): a map naming a wrong id would
        otherwise make every fence find the GPU in no zone and succeed."""
        try:
            found = roles(zones.endpoint(endpoint))
        except RedfishStatusError as error:
            if error.status != HTTPStatus.NOT_FOUND:
                raise
            raise BoxFabricError(
                f"the Redfish fabric map names endpoint {endpoint} for {gpu.name}, which "
                f"{self.url} fabric {zones.fabric} does not have; correct boxes.{gpu.box} in "
                "the map (until then the GPU cannot be fenced and is not reused)"
            ) from error
        if TARGET not in found and BOTH not in found:
            raise BoxFabricError(
                f"the Redfish fabric map names endpoint {endpoint} for {gpu.name}, but at "
                f"{self.url} it has EntityRole {', '.join(sorted(found)) or 'none'}, not "
                f"{TARGET}; correct boxes.{gpu.box} in the map"
            )

    def _reset_action(self, zones: FabricZones, gpu: GpuRef, endpoint: str) -> tuple[str, str]:
        """The target and ResetType of a Reset action on a resource the endpoint links."""
        looked_at: list[str] = []
        for entity in zones.endpoint(endpoint).get("ConnectedEntities", []):
            link = odata_id(entity.get("EntityLink")) if isinstance(entity, dict) else ""
            if not link:
                continue
            looked_at.append(link)
            resource = zones.retrying(partial(zones.session.get, link)).body
            actions = resource.get("Actions", {})
            if not isinstance(actions, dict):
                continue
            for name, action in sorted(actions.items()):
                if name.startswith("#") and name.endswith(".Reset") and isinstance(action, dict):
                    target = action.get("target")
                    if isinstance(target, str) and target:
                        return target, self._reset_type(zones, gpu, name, action)
        where = f"the resources it links ({', '.join(looked_at)})" if looked_at else "no resource"
        raise BoxFabricError(
            f"{gpu.name} cannot be reset at the box side: its endpoint {endpoint} at {self.url} "
            f"links {where} with a Reset action, so the memory of its last tenant cannot be "
            "cleared before it is reused; give the fabric manager a device Reset action, or "
            "fence with a hook (--fabric hook:PATH) whose scrub-gpu resets it. The GPU is "
            "quarantined after repeated failures"
        )

    def _reset_type(
        self, zones: FabricZones, gpu: GpuRef, name: str, action: dict[str, Any]
    ) -> str:
        allowed = action.get("ResetType@Redfish.AllowableValues")
        info = odata_id({"@odata.id": action.get("@Redfish.ActionInfo")})
        if allowed is None and info:
            parameters = zones.retrying(partial(zones.session.get, info)).body.get("Parameters")
            for parameter in parameters if isinstance(parameters, list) else []:
                if isinstance(parameter, dict) and parameter.get("Name") == "ResetType":
                    allowed = parameter.get("AllowableValues")
        if allowed is None:
            return RESET_TYPES[0]
        offered = [str(value) for value in allowed] if isinstance(allowed, list) else []
        for reset_type in RESET_TYPES:
            if reset_type in offered:
                return reset_type
        raise BoxFabricError(
            f"{gpu.name}'s {name} at {self.url} allows ResetType {', '.join(offered) or 'none'}, "
            f"none of which restarts the device ({', '.join(RESET_TYPES)})"
        )

    def _wait_for_task(self, session: RedfishSession, gpu: GpuRef, monitor: str) -> None:
        """Poll a task monitor until the task ends; raise if it did not complete."""
        service = self._map.service
        deadline = time.monotonic() + service.timeout_s * service.attempts
        while True:
            try:
                state = str(session.get(monitor).body.get("TaskState", ""))
            except RedfishStatusError as error:
                if error.status < HTTPStatus.BAD_REQUEST:
                    return  # the monitor answered the action's own empty result: done
                raise
            if state == TASK_DONE:
                return
            if state in TASK_FAILED:
                raise BoxFabricError(
                    f"the reset of {gpu.name} at {self.url} ended {state} (task {monitor})"
                )
            if time.monotonic() >= deadline:
                waited = service.timeout_s * service.attempts
                raise BoxFabricError(
                    f"the reset of {gpu.name} at {self.url} did not finish within {waited:g}s "
                    f"(task {monitor}, {state or 'no state'})"
                )
            time.sleep(TASK_POLL_S)


def _remove(zones: FabricZones, zone: str, endpoint: str) -> None:
    """Take ``endpoint`` out of ``zone`` if it is there (a read, then a conditional write).
    A zone deleted meanwhile (404) holds nothing any more: done."""
    try:
        current = zones.read(zone)
        held = members(current)
        if endpoint in held:
            zones.write(zone, [m for m in held if m != endpoint], current.etag)
    except RedfishStatusError as error:
        if error.status != HTTPStatus.NOT_FOUND:
            raise


__all__ = ["RedfishBoxFabric"]
