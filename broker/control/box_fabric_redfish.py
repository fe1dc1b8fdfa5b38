"""The broker's box fabric over a DMTF Redfish fabric manager (``--fabric redfish:MAP``).

``MAP`` is the same YAML fabric map the host agents are given (``--redfish-map``,
:mod:`dxpool.redfish.fabric_map`): the service's URL, fabric id, credentials, TLS,
per-request timeout and attempts, which Redfish endpoint is which GPU, and how a GPU is
reset. The broker logs in on its first fence, not at start, so a fabric manager that is
down when the broker starts delays fencing, not the broker.

**fence(gpu, generation)** reads the GPU's endpoint and checks that the service has it as
a device (``Target``) - a map naming a wrong id would otherwise find the GPU in no zone
and "fence" nothing. It then takes the endpoint out of every zone that holds it - the
host's slot or port zones, a zone shared by several hosts, one made by hand - and nothing
else: host ports, a switch's endpoint, other devices stay where they are. Each zone is
changed through ``#Zone.RemoveEndpoint`` where the zone offers it, else by a PATCH of
``Links.Endpoints``, conditional on the zone's ETag (:mod:`dxpool.redfish.zones`): a zone
that changed underneath (412) is read and decided again; 429, 5xx and no answer are
retried the same way, up to the map's ``attempts``; a zone deleted meanwhile (404) holds
nothing. Then the zones holding the endpoint are looked up again, and the fence returns
only when there are none: a map that slipped in meanwhile is removed in another round,
and one that keeps coming back fails the fence. An endpoint in no zone is a fence without
a write. The zones holding an endpoint are read from the endpoint's own ``Links.Zones``
where the service keeps it current (learned, or pinned by ``zone_lookup``), so a fence
costs a handful of requests whatever the fabric's size; otherwise every zone is read, in
one request where the service takes ``$expand``.

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
manager - but the next host's agent checks the GPU's zones itself before and after its
own map and never shares it, so such a late map makes that compose fail, not two hosts
reach one GPU.

**scrub(gpu, generation)** refuses while any zone holds the endpoint, then resets the GPU
with the first of the map's ``scrub.actions`` (default ``#Processor.Reset``) found on the
GPU's endpoint or on a resource the endpoint links (``ConnectedEntities[].EntityLink``),
in ``Actions`` or ``Actions.Oem``. A ``Reset`` action gets a ``ResetType`` it allows
(``ForceRestart``, else ``PowerCycle``, ``GracefulRestart``); an action named with
parameters in the map gets those. A 202 is followed to the operation's end as DSP0266
says (:mod:`dxpool.redfish.tasks`, bounded by ``task_timeout_s``). Where the service
offers none of the actions, the map's ``scrub.hook`` runs (``HOOK scrub-gpu BOX SLOT
GENERATION``, the command-hook contract); without one, scrub fails and says what it
looked for and where - ``PCIeDevice`` has no ``Reset`` action in DMTF's schema, so a
fabric manager that only models PCIe devices needs the hook or a vendor action. The
broker does not pretend a GPU of a lost host was cleared: such GPUs are quarantined after
repeated failures.

Errors are :class:`~dxpool.broker.control.box_fabric.BoxFabricError` naming the GPU, its
endpoint, the zone and what the service said.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from functools import partial
from http import HTTPStatus
from typing import Any

from dxpool.broker.control.box_fabric import BoxFabricError
from dxpool.hooks import HookError, run_hook
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import RedfishFabricMap, RedfishService, ResetAction
from dxpool.redfish.session import (
    RedfishError,
    RedfishResource,
    RedfishSession,
    RedfishStatusError,
)
from dxpool.redfish.tasks import await_operation
from dxpool.redfish.zones import (
    BOTH,
    RETRY_WAIT_MIN_S,
    TARGET,
    FabricZones,
    action,
    odata_id,
    roles,
)

log = logging.getLogger(__name__)

RESET_TYPES = ("ForceRestart", "PowerCycle", "GracefulRestart")
SCRUB_VERB = "scrub-gpu"


class RedfishBoxFabric:
    """:class:`~dxpool.broker.control.box_fabric.BoxFabric` over the fabric manager of
    ``fabric_map``.

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

    @property
    def zones(self) -> FabricZones | None:
        """The zone access in use once connected (tests read what it learned)."""
        return self._zones

    # -- BoxFabric -----------------------------------------------------------------------

    def fence(self, gpu: GpuRef, generation: int) -> None:
        endpoint = self._endpoint(gpu)
        zones = self._connected()
        rounds = self._map.service.attempts
        removed_from: list[str] = []
        try:
            current: RedfishResource | None = self._check_endpoint(zones, gpu, endpoint)
            changed = False
            for round_ in itertools.count():
                holding = zones.holding(endpoint, endpoint_now=current, after_change=changed)
                current, changed = None, False
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
                    if zones.retrying(partial(zones.remove, zone, [endpoint])):
                        removed_from.append(zone)
                        changed = True
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
            found = self._reset_action(zones, gpu, endpoint)
            if found is None:
                self._scrub_by_hook(gpu, generation, endpoint)
                return
            name, target, body = found
            reply = zones.session.post(target, body)
            await_operation(
                zones.session,
                reply,
                what=f"the reset of {gpu.name} ({name} at {target})",
                timeout_s=self._map.service.task_timeout_s,
            )
        except RedfishError as error:
            raise BoxFabricError(
                f"scrubbing {gpu.name} (endpoint {endpoint}) at {self.url} failed: {error.message}"
            ) from error
        log.info(
            "gpu reset at the box side",
            extra={"gpu": gpu.name, "generation": generation, "action": name},
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
                    membership=service.membership,
                    zone_lookup=service.zone_lookup,
                    task_timeout_s=service.task_timeout_s,
                )
            return self._zones

    def _check_endpoint(self, zones: FabricZones, gpu: GpuRef, endpoint: str) -> RedfishResource:
        """The endpoint as read now, once checked to be a device (Target): a map naming a
        wrong id would otherwise make every fence find the GPU in no zone and succeed."""
        try:
            current = zones.retrying(lambda: zones.read_endpoint(endpoint))
        except RedfishStatusError as error:
            if error.status != HTTPStatus.NOT_FOUND:
                raise
            raise BoxFabricError(
                f"the Redfish fabric map names endpoint {endpoint} for {gpu.name}, which "
                f"{self.url} fabric {zones.fabric} does not have; correct boxes.{gpu.box} in "
                "the map (until then the GPU cannot be fenced and is not reused)"
            ) from error
        found = roles(current.body)
        if TARGET not in found and BOTH not in found:
            raise BoxFabricError(
                f"the Redfish fabric map names endpoint {endpoint} for {gpu.name}, but at "
                f"{self.url} it has EntityRole {', '.join(sorted(found)) or 'none'}, not "
                f"{TARGET}; correct boxes.{gpu.box} in the map"
            )
        return current

    def _reset_action(
        self, zones: FabricZones, gpu: GpuRef, endpoint: str
    ) -> tuple[str, str, dict[str, Any]] | None:
        """(name, target, body) of the first of the map's reset actions offered by the
        endpoint or a resource it links; None when none is."""
        endpoint_path = zones.endpoint_path(endpoint)
        body = zones.endpoint(endpoint)
        resources: list[tuple[str, dict[str, Any]]] = [(endpoint_path, body)]
        for entity in body.get("ConnectedEntities", []):
            link = odata_id(entity.get("EntityLink")) if isinstance(entity, dict) else ""
            if link and link not in (path for path, _ in resources):
                resources.append((link, zones.retrying(partial(zones.session.get, link)).body))
        for wanted in self._map.scrub.actions:
            for _, resource in resources:
                offered = action(resource, wanted.name)
                target = offered.get("target") if offered else None
                if offered is not None and isinstance(target, str) and target:
                    return wanted.name, target, self._reset_body(zones, gpu, wanted, offered)
        if self._map.scrub.hook is None:
            names = " or ".join(a.name for a in self._map.scrub.actions) or "no action"
            raise BoxFabricError(
                f"{gpu.name} cannot be reset at the box side: looked for {names} on its "
                f"endpoint {endpoint} and the resources it links "
                f"({', '.join(path for path, _ in resources[1:]) or 'none'}) at {self.url} and "
                "found none, so the memory of its last tenant cannot be cleared before it is "
                "reused (PCIeDevice has no Reset action in DMTF's schema). Name the device's "
                "reset action under scrub.actions in the fabric map, or give scrub.hook (or "
                "fence with --fabric hook:PATH). The GPU is quarantined after repeated failures"
            )
        return None

    def _reset_body(
        self, zones: FabricZones, gpu: GpuRef, wanted: ResetAction, offered: dict[str, Any]
    ) -> dict[str, Any]:
        if wanted.parameters is not None:
            return dict(wanted.parameters)
        allowed = offered.get("ResetType@Redfish.AllowableValues")
        info = odata_id({"@odata.id": offered.get("@Redfish.ActionInfo")})
        if allowed is None and info:
            parameters = zones.retrying(partial(zones.session.get, info)).body.get("Parameters")
            for parameter in parameters if isinstance(parameters, list) else []:
                if isinstance(parameter, dict) and parameter.get("Name") == "ResetType":
                    allowed = parameter.get("AllowableValues")
        if allowed is None:
            return {"ResetType": RESET_TYPES[0]} if wanted.name.endswith(".Reset") else {}
        offered_types = [str(value) for value in allowed] if isinstance(allowed, list) else []
        for reset_type in RESET_TYPES:
            if reset_type in offered_types:
                return {"ResetType": reset_type}
        raise BoxFabricError(
            f"{gpu.name}'s {wanted.name} at {self.url} allows ResetType "
            f"{', '.join(offered_types) or 'none'}, none of which restarts the device "
            f"({', '.join(RESET_TYPES)})"
        )

    def _scrub_by_hook(self, gpu: GpuRef, generation: int, endpoint: str) -> None:
        hook = self._map.scrub.hook
        assert hook is not None
        what = f"scrub hook {hook} for {gpu.name} generation {generation}"
        try:
            run_hook(
                hook,
                [SCRUB_VERB, gpu.box, str(gpu.slot), str(generation)],
                timeout_s=self._map.scrub.hook_timeout_s,
                what=what,
            )
        except HookError as error:
            raise BoxFabricError(
                f"{gpu.name} (endpoint {endpoint}): the service offers no reset action and "
                f"the scrub hook failed: {error.message}"
            ) from error
        log.info(
            "gpu reset by the scrub hook",
            extra={"gpu": gpu.name, "generation": generation, "hook": str(hook)},
        )


__all__ = ["RedfishBoxFabric"]
