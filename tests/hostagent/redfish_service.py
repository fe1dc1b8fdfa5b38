"""A local Redfish fabric service for tests: the Fabrics/Zones/Endpoints/SessionService/
TaskService subset a PCIe fabric manager serves, shaped like DMTF's public mockups
(``@odata.id``, ``Members``, ``Links.Endpoints``, ``ConnectedEntities[].EntityRole``), on
127.0.0.1.

By default it behaves as DMTF's standard allows and no more:

* ``Zone.Links.Endpoints`` is read-only (DMTF's Zone schema, every version): a PATCH of
  it is **400** ``PropertyNotWritable`` (DSP0266, "PATCH (update)": a request whose
  properties are all read-only is a 400). Membership changes through the zone's
  ``#Zone.AddEndpoint`` / ``#Zone.RemoveEndpoint`` actions (Zone v1.5+), whose optional
  ``ZoneETag`` and ``EndpointETag`` parameters are checked (412 when stale);
* nothing stops a target endpoint from being in two zones (``Endpoint.Links.Zones`` is
  an array): **no 409**;
* each endpoint's ``Links.Zones`` lists the zones holding it, kept current;
* zones and endpoints carry an ETag (a header by default), and a PATCH whose
  ``If-Match`` differs is 412;
* each target endpoint links (``ConnectedEntities[].EntityLink``) the GPU's
  ``Processor``, which offers ``#Processor.Reset``; a reset is answered **202 with an
  empty body** and a task monitor (``Location``, ``Retry-After``) that answers 202,
  again with an empty body, for ``task_polls`` polls and then the operation's own
  response - a 200 without ``TaskState`` (DSP0266, "Asynchronous operations");
* every resource but the service root and session creation needs ``X-Auth-Token`` or
  HTTP Basic credentials (401 otherwise); :meth:`RedfishFabricService.expire_sessions`
  ends every session.

The stricter or older behaviours are options: ``patchable_zones`` (a PATCH of
``Links.Endpoints`` is applied), ``zone_actions=False`` (zones offer no actions),
``exclusive_targets`` (a target in a second zone is 409), ``reverse_links`` ``"stale"``
(``Links.Zones`` as first set, never updated, as DMTF's Mockup Server does) or
``"absent"``, ``etags`` ``"payload"`` (only ``@odata.etag``) or ``"none"``,
``async_resets=False`` (a reset is 204 at once), ``async_actions`` (zone actions answer
202 too, the change applied when the task ends), ``task_outcome`` (how a task ends),
``expand`` (the root advertises ``$expand`` and collections honour it).
:meth:`RedfishFabricService.legacy` is the service dxpool was first written against.

Faults: :meth:`fail` answers the next matching requests with a status, :meth:`delay`
answers them late (timeouts), :meth:`before_write` runs a change between a client's read
and its write, :meth:`hold` keeps matching requests waiting until released. Every request
is logged in :attr:`requests` with its status; :meth:`writes` lists membership changes.

TLS: :func:`self_signed_cert` makes a certificate for 127.0.0.1 with ``cryptography``.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

FABRIC = "PCIe"
ROOT = "/redfish/v1"
FABRIC_PATH = f"{ROOT}/Fabrics/{FABRIC}"
ZONES = f"{FABRIC_PATH}/Zones"
ENDPOINTS = f"{FABRIC_PATH}/Endpoints"
SESSIONS = f"{ROOT}/SessionService/Sessions"
PROCESSORS = f"{ROOT}/Systems/GpuBox/Processors"
MONITORS = f"{ROOT}/TaskService/TaskMonitors"
TASKS = f"{ROOT}/TaskService/Tasks"
RESET_ACTION = "Actions/Processor.Reset"
ADD_ACTION = "Actions/Zone.AddEndpoint"
REMOVE_ACTION = "Actions/Zone.RemoveEndpoint"
USERNAME = "dxpool"
PASSWORD = "s3cret"
RESET_TYPES = ("On", "ForceOff", "ForceRestart")
SUCCESS = {
    "@Message.ExtendedInfo": [
        {
            "MessageId": "Base.1.16.Success",
            "Message": "The request completed successfully.",
            "Severity": "OK",
        }
    ]
}


@dataclass
class Request:
    """One request as the service received it, and the status it answered."""

    method: str
    path: str
    if_match: str
    body: Any
    query: str = ""
    at: float = field(default_factory=time.monotonic)
    status: int = 0


@dataclass(frozen=True)
class Write:
    """A membership change the service received: ``kind`` is add, remove (actions) or
    patch; ``etag`` the ZoneETag or If-Match it carried ("" none)."""

    zone: str
    kind: str
    endpoint: str
    etag: str
    endpoint_etag: str = ""


@dataclass
class _Fault:
    method: str
    path: str
    count: int
    status: int = 0
    delay_s: float = 0.0


@dataclass
class _Task:
    """An operation running behind a task monitor."""

    polls_left: int
    finish: Callable[[], tuple[int, dict[str, Any] | None]]
    outcome: tuple[int, dict[str, Any] | None] | None = None
    finished_at: float | None = None


@dataclass
class FabricState:
    endpoints: dict[str, str] = field(default_factory=dict)  # id -> EntityRole
    zones: dict[str, list[str]] = field(default_factory=dict)  # id -> endpoint ids
    etags: dict[str, int] = field(default_factory=dict)  # zone or endpoint id -> version
    stale_links: dict[str, list[str]] = field(default_factory=dict)  # endpoint -> zones
    sessions: dict[str, str] = field(default_factory=dict)  # token -> session id


class RedfishFabricService:
    """The service; use :func:`running_service`. Methods are safe from any thread."""

    def __init__(
        self,
        *,
        etags: str = "header",
        zone_actions: bool = True,
        patchable_zones: bool = False,
        exclusive_targets: bool = False,
        reverse_links: str = "current",
        expand: bool = False,
        resets: bool = True,
        async_resets: bool = True,
        async_actions: bool = False,
        task_polls: int = 2,
        retry_after: int | None = 0,
        task_outcome: str = "success",
        task_style: str = "monitor",
    ) -> None:
        assert etags in ("header", "payload", "none"), etags
        assert reverse_links in ("current", "stale", "absent"), reverse_links
        assert task_outcome in ("success", "failure", "exception", "never", "gone"), task_outcome
        assert task_style in ("monitor", "task"), task_style
        self.state = FabricState()
        self.etag_style = etags
        self.zone_actions = zone_actions
        self.patchable_zones = patchable_zones
        self.exclusive_targets = exclusive_targets
        self.reverse_links = reverse_links
        self.expand = expand
        self.offer_resets = resets
        self.async_resets = async_resets
        self.async_actions = async_actions
        self.task_polls = task_polls
        self.retry_after = retry_after
        self.task_outcome = task_outcome
        self.task_style = task_style
        self.resets: list[tuple[str, str]] = []  # (endpoint, ResetType), when accepted
        self.resets_done: list[tuple[str, float]] = []  # (endpoint, when the reset ended)
        self._tasks: dict[str, _Task] = {}
        self._holds: list[tuple[str, str, threading.Event]] = []
        self.lock = threading.RLock()
        self.requests: list[Request] = []
        self._faults: list[_Fault] = []
        self._before_write: list[Callable[[], None]] = []
        self._next_session = 0
        self.url = ""

    @classmethod
    def legacy(cls, **overrides: Any) -> RedfishFabricService:
        """The service dxpool was first written against: zones changed by PATCH, a target
        in a second zone refused with 409, resets answered at once."""
        options: dict[str, Any] = {
            "zone_actions": False,
            "patchable_zones": True,
            "exclusive_targets": True,
            "async_resets": False,
        }
        return cls(**{**options, **overrides})

    # -- setup ---------------------------------------------------------------------------

    def add_endpoint(self, endpoint: str, role: str) -> None:
        with self.lock:
            self.state.endpoints[endpoint] = role
            self.state.etags.setdefault(f"endpoint:{endpoint}", 1)
            self.state.stale_links.setdefault(endpoint, [])

    def add_zone(self, zone: str, endpoints: list[str]) -> None:
        with self.lock:
            self.state.zones[zone] = list(endpoints)
            self.state.etags[f"zone:{zone}"] = 1
            for endpoint in endpoints:
                self._touch_endpoint(endpoint)
                self.state.stale_links.setdefault(endpoint, []).append(zone)

    def set_zone(self, zone: str, endpoints: list[str]) -> None:
        """Change a zone as another client of the service would (its ETag changes, and
        the ETags of the endpoints that joined or left it)."""
        with self.lock:
            before = set(self.state.zones[zone])
            self.state.zones[zone] = list(endpoints)
            self.state.etags[f"zone:{zone}"] += 1
            for endpoint in before ^ set(endpoints):
                self._touch_endpoint(endpoint)

    def remove_zone(self, zone: str) -> None:
        """Delete a zone as another client of the service would."""
        with self.lock:
            for endpoint in self.state.zones.pop(zone):
                self._touch_endpoint(endpoint)
            del self.state.etags[f"zone:{zone}"]

    def zone(self, zone: str) -> list[str]:
        with self.lock:
            return list(self.state.zones[zone])

    def zones_of(self, endpoint: str) -> list[str]:
        """Every zone holding ``endpoint``, in the service's order."""
        with self.lock:
            return [z for z, m in sorted(self.state.zones.items()) if endpoint in m]

    def _touch_endpoint(self, endpoint: str) -> None:
        key = f"endpoint:{endpoint}"
        if key in self.state.etags:
            self.state.etags[key] += 1

    # -- faults --------------------------------------------------------------------------

    def fail(self, method: str, path: str, status: int, count: int = 1) -> None:
        """Answer the next ``count`` requests of ``method`` on a path ending in ``path``
        with ``status``, doing nothing else."""
        with self.lock:
            self._faults.append(_Fault(method, path, count, status=status))

    def delay(self, method: str, path: str, seconds: float, count: int = 1) -> None:
        """Carry out the next ``count`` matching requests, but answer them only after
        ``seconds`` (a client with a shorter timeout sees no answer)."""
        with self.lock:
            self._faults.append(_Fault(method, path, count, delay_s=seconds))

    def before_write(self, change: Callable[[], None]) -> None:
        """Run ``change`` when the next membership write (a zone PATCH or a zone action)
        arrives, before it is judged (one change per write, in the order given)."""
        with self.lock:
            self._before_write.append(change)

    before_patch = before_write

    def hold(self, method: str, path: str) -> threading.Event:
        """Keep every ``method`` request on a path ending in ``path`` waiting, before it is
        judged, until the returned event is set."""
        gate = threading.Event()
        with self.lock:
            self._holds.append((method, path, gate))
        return gate

    def _wait_for_holds(self, method: str, path: str) -> None:
        with self.lock:
            gates = [g for m, p, g in self._holds if m == method and path.endswith(p)]
        for gate in gates:
            gate.wait(timeout=60)

    def expire_sessions(self) -> None:
        with self.lock:
            self.state.sessions.clear()

    def patches(self) -> list[tuple[str, str]]:
        """(path, If-Match) of every PATCH received."""
        with self.lock:
            return [(r.path, r.if_match) for r in self.requests if r.method == "PATCH"]

    def writes(self) -> list[Write]:
        """Every membership change received (zone PATCHes and zone actions), in order."""
        found: list[Write] = []
        with self.lock:
            logged = list(self.requests)
        for r in logged:
            if r.method == "PATCH" and r.path.startswith(f"{ZONES}/"):
                found.append(Write(r.path.rpartition("/")[2], "patch", "", r.if_match))
            elif r.method == "POST" and r.path.startswith(f"{ZONES}/"):
                zone = r.path.removeprefix(f"{ZONES}/").split("/")[0]
                kind = "add" if r.path.endswith(ADD_ACTION) else "remove"
                body = r.body if isinstance(r.body, dict) else {}
                endpoint = str((body.get("Endpoint") or {}).get("@odata.id", "")).rpartition("/")
                found.append(
                    Write(
                        zone,
                        kind,
                        endpoint[2],
                        str(body.get("ZoneETag", "")),
                        str(body.get("EndpointETag", "")),
                    )
                )
        return found

    def count(self, method: str | None = None) -> int:
        """How many requests were received (of ``method``), session handling excluded."""
        with self.lock:
            return sum(
                1
                for r in self.requests
                if (method is None or r.method == method) and not r.path.startswith(SESSIONS)
            )

    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self.lock:
            for fault in self._faults:
                if fault.method == method and path.endswith(fault.path):
                    fault.count -= 1
                    if fault.count <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    # -- resources -----------------------------------------------------------------------

    def root(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "@odata.type": "#ServiceRoot.v1_15_0.ServiceRoot",
            "@odata.id": f"{ROOT}/",
            "Id": "RootService",
            "Name": "Root Service",
            "RedfishVersion": "1.15.0",
            "Fabrics": {"@odata.id": f"{ROOT}/Fabrics"},
            "SessionService": {"@odata.id": f"{ROOT}/SessionService"},
            "Links": {"Sessions": {"@odata.id": SESSIONS}},
        }
        if self.expand:
            body["ProtocolFeaturesSupported"] = {
                "ExpandQuery": {"ExpandAll": True, "NoLinks": True, "Levels": True, "MaxLevels": 1}
            }
        return body

    def resource(self, path: str) -> dict[str, Any] | None:
        with self.lock:
            if path == f"{ROOT}/Fabrics":
                return _collection(path, "FabricCollection", [FABRIC_PATH])
            if path == FABRIC_PATH:
                return {
                    "@odata.type": "#Fabric.v1_3_0.Fabric",
                    "@odata.id": path,
                    "Id": FABRIC,
                    "Name": "PCIe Fabric",
                    "FabricType": "PCIe",
                    "Endpoints": {"@odata.id": ENDPOINTS},
                    "Zones": {"@odata.id": ZONES},
                }
            if path == ENDPOINTS:
                members = [f"{path}/{e}" for e in sorted(self.state.endpoints)]
                return _collection(path, "EndpointCollection", members)
            if path == ZONES:
                members = [f"{path}/{z}" for z in sorted(self.state.zones)]
                return _collection(path, "ZoneCollection", members)
            prefix, _, name = path.rpartition("/")
            if prefix == PROCESSORS and self.state.endpoints.get(name) == "Target":
                return self._processor(path, name)
            if prefix == TASKS and name in self._tasks:
                return self._task_resource(path, name)
            if prefix == ENDPOINTS and name in self.state.endpoints:
                return self._endpoint(path, name)
            if prefix == ZONES and name in self.state.zones:
                return self._zone(path, name)
        return None

    def _endpoint(self, path: str, name: str) -> dict[str, Any]:
        role = self.state.endpoints[name]
        entity: dict[str, Any] = {
            "EntityType": "RootComplex" if role == "Initiator" else "Processor",
            "EntityRole": role,
        }
        if role == "Target":
            entity["EntityLink"] = {"@odata.id": f"{PROCESSORS}/{name}"}
        body: dict[str, Any] = {
            "@odata.type": "#Endpoint.v1_8_0.Endpoint",
            "@odata.id": path,
            "Id": name,
            "Name": f"Endpoint {name}",
            "EndpointProtocol": "PCIe",
            "ConnectedEntities": [entity],
        }
        if self.reverse_links != "absent":
            zones = (
                self.state.stale_links.get(name, [])
                if self.reverse_links == "stale"
                else [z for z, m in sorted(self.state.zones.items()) if name in m]
            )
            body["Links"] = {"Zones": [{"@odata.id": f"{ZONES}/{z}"} for z in zones]}
        return self._annotated(body, f"endpoint:{name}")

    def _zone(self, path: str, name: str) -> dict[str, Any]:
        links = [{"@odata.id": f"{ENDPOINTS}/{e}"} for e in self.state.zones[name]]
        body: dict[str, Any] = {
            "@odata.type": "#Zone.v1_6_1.Zone",
            "@odata.id": path,
            "Id": name,
            "Name": f"Zone {name}",
            "ZoneType": "ZoneOfEndpoints",
            "Links": {"Endpoints": links, "Endpoints@odata.count": len(links)},
            "Status": {"State": "Enabled", "Health": "OK"},
        }
        if self.zone_actions:
            body["Actions"] = {
                "#Zone.AddEndpoint": {"target": f"{path}/{ADD_ACTION}"},
                "#Zone.RemoveEndpoint": {"target": f"{path}/{REMOVE_ACTION}"},
            }
        return self._annotated(body, f"zone:{name}")

    def _annotated(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        if self.etag_style == "payload":
            body["@odata.etag"] = self._etag_of(key)
        return body

    def _etag_of(self, key: str) -> str:
        return f'"{key.partition(":")[2]}-{self.state.etags.get(key, 0)}"'

    def _processor(self, path: str, name: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "@odata.type": "#Processor.v1_18_0.Processor",
            "@odata.id": path,
            "Id": name,
            "Name": f"GPU {name}",
            "ProcessorType": "GPU",
        }
        if self.offer_resets:
            body["Actions"] = {
                "#Processor.Reset": {
                    "target": f"{path}/{RESET_ACTION}",
                    "ResetType@Redfish.AllowableValues": list(RESET_TYPES),
                }
            }
        return body

    def _task_resource(self, path: str, task: str) -> dict[str, Any]:
        state = self._tasks[task]
        body: dict[str, Any] = {
            "@odata.type": "#Task.v1_7_0.Task",
            "@odata.id": path,
            "Id": task,
            "TaskState": "Running",
        }
        if state.polls_left > 0:
            state.polls_left -= 1
            return body
        status, _ = self._finish(state)
        body["TaskState"] = "Completed" if status < 400 else "Exception"
        return body

    def etag(self, path: str) -> str:
        """The ETag header for the resource at ``path`` ("" none)."""
        with self.lock:
            if self.etag_style != "header":
                return ""
            prefix, _, name = path.rpartition("/")
            if prefix == ZONES and name in self.state.zones:
                return self._etag_of(f"zone:{name}")
            if prefix == ENDPOINTS and name in self.state.endpoints:
                return self._etag_of(f"endpoint:{name}")
            return ""

    def _current_etag(self, key: str) -> str:
        return self._etag_of(key) if self.etag_style != "none" else ""

    # -- membership ----------------------------------------------------------------------

    def _run_before_write(self) -> None:
        with self.lock:
            change = self._before_write.pop(0) if self._before_write else None
        if change is not None:
            change()

    def patch_zone(self, path: str, body: Any, if_match: str) -> tuple[int, dict[str, Any] | None]:
        self._run_before_write()
        with self.lock:
            zone = path.rpartition("/")[2]
            if not path.startswith(f"{ZONES}/") or zone not in self.state.zones:
                return HTTPStatus.NOT_FOUND, _error("ResourceNotFound", f"no resource {path}")
            current = self._current_etag(f"zone:{zone}")
            if if_match and if_match != current:
                return HTTPStatus.PRECONDITION_FAILED, _error(
                    "PreconditionFailed", f"the ETag of zone {zone} is {current}"
                )
            try:
                links = body["Links"]["Endpoints"]
                wanted = [str(link["@odata.id"]).rpartition("/")[2] for link in links]
            except (KeyError, TypeError) as error:
                return HTTPStatus.BAD_REQUEST, _error("MalformedJSON", f"bad zone body: {error}")
            if not self.patchable_zones:
                return HTTPStatus.BAD_REQUEST, _error(
                    "PropertyNotWritable",
                    "The property Links/Endpoints is a read only property and cannot be "
                    "assigned a value.",
                )
            unknown = [e for e in wanted if e not in self.state.endpoints]
            if unknown:
                return HTTPStatus.BAD_REQUEST, _error(
                    "ResourceNotFound", f"unknown endpoints {unknown}"
                )
            for endpoint in wanted:
                refusal = self._refuse_second_zone(zone, endpoint)
                if refusal is not None:
                    return refusal
            self.set_zone(zone, wanted)
        return HTTPStatus.OK, self.resource(path) or {}

    def _refuse_second_zone(self, zone: str, endpoint: str) -> tuple[int, dict[str, Any]] | None:
        if not self.exclusive_targets or self.state.endpoints.get(endpoint) != "Target":
            return None
        holder = next((z for z, m in self.state.zones.items() if z != zone and endpoint in m), None)
        if holder is None:
            return None
        return HTTPStatus.CONFLICT, _error(
            "ResourceInUse", f"endpoint {endpoint} is already assigned to zone {holder}"
        )

    def zone_action(
        self, path: str, body: Any
    ) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        """A POST to a zone's AddEndpoint or RemoveEndpoint action."""
        self._run_before_write()
        add = path.endswith(ADD_ACTION)
        zone = path.removeprefix(f"{ZONES}/").split("/")[0]
        with self.lock:
            if not self.zone_actions or zone not in self.state.zones:
                return HTTPStatus.NOT_FOUND, _error("ResourceNotFound", path), {}
            target = body.get("Endpoint") if isinstance(body, dict) else None
            link = target.get("@odata.id") if isinstance(target, dict) else None
            if not isinstance(link, str):
                return HTTPStatus.BAD_REQUEST, _error("ActionParameterMissing", "Endpoint"), {}
            endpoint = link.rpartition("/")[2]
            if endpoint not in self.state.endpoints:
                return (
                    HTTPStatus.BAD_REQUEST,
                    _error("ActionParameterValueError", f"no endpoint {link}"),
                    {},
                )
            for parameter, key in (
                ("ZoneETag", f"zone:{zone}"),
                ("EndpointETag", f"endpoint:{endpoint}"),
            ):
                given = body.get(parameter)
                if given is not None and given != self._current_etag(key):
                    return (
                        HTTPStatus.PRECONDITION_FAILED,
                        _error("PreconditionFailed", f"{parameter} {given} is stale"),
                        {},
                    )
            if add:
                refusal = self._refuse_second_zone(zone, endpoint)
                if refusal is not None:
                    return refusal[0], refusal[1], {}

            def apply() -> tuple[int, dict[str, Any] | None]:
                with self.lock:
                    if zone not in self.state.zones:
                        return HTTPStatus.NOT_FOUND, _error("ResourceNotFound", path)
                    held = self.state.zones[zone]
                    if add and endpoint not in held:
                        self.set_zone(zone, [*held, endpoint])
                    elif not add and endpoint in held:
                        self.set_zone(zone, [m for m in held if m != endpoint])
                return HTTPStatus.NO_CONTENT, None

            if not self.async_actions:
                return (*apply(), {})
            return self._start_task(apply)

    # -- resets and tasks ------------------------------------------------------------------

    def reset(self, path: str, body: Any) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        """A POST to a processor's Reset action."""
        name = path.removesuffix(f"/{RESET_ACTION}").rpartition("/")[2]
        with self.lock:
            if not self.offer_resets or self.state.endpoints.get(name) != "Target":
                return HTTPStatus.NOT_FOUND, _error("ActionNotSupported", path), {}
            reset_type = body.get("ResetType") if isinstance(body, dict) else None
            if reset_type not in RESET_TYPES:
                return HTTPStatus.BAD_REQUEST, _error("ActionParameterNotSupported", path), {}
            self.resets.append((name, str(reset_type)))

            def finish() -> tuple[int, dict[str, Any] | None]:
                with self.lock:
                    self.resets_done.append((name, time.monotonic()))
                return HTTPStatus.OK, dict(SUCCESS)

            if not self.async_resets:
                finish()
                return HTTPStatus.NO_CONTENT, None, {}
            return self._start_task(finish)

    def _start_task(
        self, finish: Callable[[], tuple[int, dict[str, Any] | None]]
    ) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        with self.lock:
            task = str(len(self._tasks) + 1)
            self._tasks[task] = _Task(self.task_polls, finish)
        where = f"{TASKS}/{task}" if self.task_style == "task" else f"{MONITORS}/{task}"
        headers = {"Location": where}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return HTTPStatus.ACCEPTED, None, headers

    def monitor(self, path: str) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        """A GET of a task monitor: 202 with an empty body while the task runs, then the
        operation's own response."""
        task = path.rpartition("/")[2]
        with self.lock:
            state = self._tasks.get(task)
            if state is None:
                return HTTPStatus.NOT_FOUND, _error("ResourceNotFound", path), {}
            if self.task_outcome == "never" or state.polls_left > 0:
                state.polls_left -= 1
                headers = {"Location": path}
                if self.retry_after is not None:
                    headers["Retry-After"] = str(self.retry_after)
                return HTTPStatus.ACCEPTED, None, headers
            if self.task_outcome == "gone" and state.outcome is None:
                self._finish(state)
                return HTTPStatus.NOT_FOUND, _error("ResourceNotFound", path), {}
            status, body = self._finish(state)
        return status, body, {}

    def _finish(self, state: _Task) -> tuple[int, dict[str, Any] | None]:
        if state.outcome is None:
            status, body = state.finish()
            if self.task_outcome == "failure":
                status, body = (
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    _error("InternalError", "the device did not come back from its reset"),
                )
            elif self.task_outcome == "exception":
                status, body = (
                    HTTPStatus.OK,
                    {
                        "TaskState": "Exception",
                        "TaskStatus": "Critical",
                        "Messages": [{"Message": "reset failed", "Severity": "Critical"}],
                    },
                )
            state.outcome = (status, body)
            state.finished_at = time.monotonic()
        return state.outcome

    # -- sessions ------------------------------------------------------------------------

    def open_session(self, body: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
        if not isinstance(body, dict) or (body.get("UserName"), body.get("Password")) != (
            USERNAME,
            PASSWORD,
        ):
            return HTTPStatus.UNAUTHORIZED, _error("NoValidSession", "bad credentials"), {}
        with self.lock:
            self._next_session += 1
            session = str(self._next_session)
            token = f"token-{session}-{time.monotonic_ns()}"
            self.state.sessions[token] = session
        location = f"{SESSIONS}/{session}"
        headers = {"X-Auth-Token": token, "Location": location}
        return HTTPStatus.CREATED, {"@odata.id": location, "Id": session}, headers

    def close_session(self, path: str, token: str) -> int:
        with self.lock:
            if self.state.sessions.get(token) == path.rpartition("/")[2]:
                del self.state.sessions[token]
                return HTTPStatus.NO_CONTENT
        return HTTPStatus.NOT_FOUND

    def authorized(self, token: str | None, authorization: str | None) -> bool:
        if authorization and authorization.startswith("Basic "):
            try:
                user, _, password = base64.b64decode(authorization[6:]).decode().partition(":")
            except ValueError:
                return False
            return (user, password) == (USERNAME, PASSWORD)
        with self.lock:
            return token is not None and token in self.state.sessions


def install(service: RedfishFabricService) -> None:
    """Host ports h1 (zones h1-s0, h1-s1) and h2 (zone h2-s0), box b1's four GPUs
    (endpoints GPU-b1-0..3); nothing mapped."""
    for host in ("h1", "h2"):
        service.add_endpoint(f"HostPort-{host}", "Initiator")
    for slot in range(4):
        service.add_endpoint(f"GPU-b1-{slot}", "Target")
    service.add_zone("h1-s0", ["HostPort-h1"])
    service.add_zone("h1-s1", ["HostPort-h1"])
    service.add_zone("h2-s0", ["HostPort-h2"])


def _collection(path: str, kind: str, members: list[str]) -> dict[str, Any]:
    return {
        "@odata.type": f"#{kind}.{kind}",
        "@odata.id": path,
        "Name": kind,
        "Members": [{"@odata.id": m} for m in members],
        "Members@odata.count": len(members),
    }


def _error(message_id: str, message: str) -> dict[str, Any]:
    return {
        "error": {
            "code": f"Base.1.16.{message_id}",
            "message": message,
            "@Message.ExtendedInfo": [
                {"MessageId": f"Base.1.16.{message_id}", "Message": message, "Severity": "Warning"}
            ],
        }
    }


def _handler(service: RedfishFabricService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        _late_by = 0.0
        _logged: Request | None = None

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def _serve(self, method: str) -> None:
            parts = urlsplit(self.path)
            path = parts.path.rstrip("/") or "/"
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            if_match = self.headers.get("If-Match") or ""
            self._logged = Request(method, path, if_match, body, parts.query)
            with service.lock:
                service.requests.append(self._logged)
            service._wait_for_holds(method, path)
            fault = service._take_fault(method, path)
            self._late_by = fault.delay_s if fault is not None else 0.0
            if fault is not None and fault.status:
                self._send(fault.status, _error("InternalError", "injected failure"))
                return
            if path == ROOT and method == "GET":
                self._send(HTTPStatus.OK, service.root())
                return
            if path == SESSIONS and method == "POST":
                status, payload, headers = service.open_session(body)
                self._send(status, payload, headers)
                return
            token = self.headers.get("X-Auth-Token")
            if not service.authorized(token, self.headers.get("Authorization")):
                self._send(HTTPStatus.UNAUTHORIZED, _error("NoValidSession", "no valid session"))
                return
            if method == "GET" and path.startswith(f"{MONITORS}/"):
                self._send(*service.monitor(path))
            elif method == "GET":
                resource = service.resource(path)
                if resource is None:
                    self._send(HTTPStatus.NOT_FOUND, _error("ResourceNotFound", path))
                    return
                if service.expand and "$expand" in parse_qs(parts.query) and "Members" in resource:
                    resource["Members"] = [
                        service.resource(m["@odata.id"]) or m for m in resource["Members"]
                    ]
                etag = service.etag(path)
                self._send(HTTPStatus.OK, resource, {"ETag": etag} if etag else {})
            elif method == "PATCH":
                status, payload = service.patch_zone(path, body, if_match)
                etag = service.etag(path) if status == HTTPStatus.OK else ""
                self._send(status, payload, {"ETag": etag} if etag else {})
            elif method == "POST" and path.endswith(f"/{RESET_ACTION}"):
                self._send(*service.reset(path, body))
            elif method == "POST" and path.endswith((f"/{ADD_ACTION}", f"/{REMOVE_ACTION}")):
                self._send(*service.zone_action(path, body))
            elif method == "DELETE" and path.startswith(SESSIONS + "/"):
                self._send(service.close_session(path, str(token)), None)
            else:
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, _error("OperationNotAllowed", path))

        def _send(
            self, status: int, payload: dict[str, Any] | None, headers: dict[str, str] | None = None
        ) -> None:
            if self._logged is not None:
                self._logged.status = int(status)
            data = json.dumps(payload).encode() if payload is not None else b""
            time.sleep(self._late_by)  # the request is done; only the answer is late
            try:
                self.send_response(status)
                if data:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("OData-Version", "4.0")
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # ssl.SSLError included
                pass  # the client gave up (a timeout test)

    return Handler


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate and key for 127.0.0.1, valid for a day; returns (cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dxpool test fabric manager")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path = directory / "fabric-manager.pem"
    key_path = directory / "fabric-manager.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@contextmanager
def running_service(
    service: RedfishFabricService, *, tls: tuple[Path, Path] | None = None
) -> Iterator[RedfishFabricService]:
    """Serve ``service`` on 127.0.0.1 (HTTPS with ``tls`` = (cert, key)) until exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(service))
    server.daemon_threads = True
    scheme = "http"
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(tls[0]), str(tls[1]))
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    service.url = f"{scheme}://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="redfish-service", daemon=True)
    thread.start()
    try:
        yield service
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
