"""A recording proxy in front of DMTF's Mockup Server, enforcing what the standard
requires where the Mockup Server is too lenient.

The Mockup Server stays the store: every resource is read from it and every change is
made in its memory. The proxy records each exchange (:attr:`RecordingProxy.log`) and,
per :class:`Rules`, adds the behaviour a conforming service has and the Mockup Server
lacks. Each rule names where the requirement comes from:

``etags``
    Resources carry an ETag - in the ``ETag`` header (``"header"``) or only as
    ``@odata.etag`` in the payload (``"payload"``); a PATCH whose ``If-Match`` does not
    match is refused with 412. DSP0266, "ETags" and "Modification requests"
    (``If-Match``); RFC 9110 13.1.1. The Mockup Server sends none and ignores
    ``If-Match``.
``read_only_links``
    A PATCH of ``Links`` (``Zone.Links.Endpoints`` is read-only in every version of
    DMTF's Zone schema) is refused with 400 ``PropertyNotWritable``. DSP0266, "PATCH
    (update)": a request whose properties are all read-only is a 400. The Mockup Server
    merges any PATCH.
``zone_actions``
    Zones offer ``#Zone.AddEndpoint`` and ``#Zone.RemoveEndpoint`` (Zone schema v1.5+:
    ``Endpoint``, optional ``ZoneETag`` and ``EndpointETag``, a stale one refused with
    412), carried out in the Mockup Server's memory: the zone's ``Links.Endpoints`` and
    the endpoint's ``Links.Zones`` change together. The mockups' zones have no actions, and
    the Mockup Server answers a POST to an action without carrying it out.
``async_actions``
    A POST to an action the Mockup Server accepts is answered 202 with an empty body, a
    ``Location`` (task monitor) and ``Retry-After``; the monitor answers 202 with an empty
    body for ``task_polls`` polls, then the Mockup Server's own answer. DSP0266,
    "Asynchronous operations". The Mockup Server never answers 202.

:meth:`RecordingProxy.before_write` runs a change (as another client) between a client's
read and its write, to force an interleaving.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import requests

MONITORS = "/redfish/v1/TaskService/TaskMonitors"
ADD = "/Actions/Zone.AddEndpoint"
REMOVE = "/Actions/Zone.RemoveEndpoint"


@dataclass(frozen=True)
class Rules:
    """Which of the standard's requirements the proxy enforces (module docstring)."""

    etags: str | None = None  # "header" or "payload"; None: none, like the Mockup Server
    read_only_links: bool = False
    zone_actions: bool = False
    async_actions: bool = False
    task_polls: int = 2
    retry_after: int = 0


@dataclass
class Exchange:
    """One request through the proxy and the status it was answered."""

    method: str
    path: str
    query: str
    if_match: str
    body: Any
    at: float = field(default_factory=time.monotonic)
    status: int = 0
    location: str = ""  # the Location answered (a task monitor for a 202)


@dataclass
class _Task:
    polls_left: int
    status: int


class RecordingProxy:
    """The proxy for the Mockup Server at ``backend`` with ``rules``; use :func:`running`."""

    def __init__(self, backend: str, rules: Rules) -> None:
        self.backend = backend
        self.rules = rules
        self.log: list[Exchange] = []
        self.url = ""
        self._http = requests.Session()
        self._lock = threading.RLock()  # one exchange at a time, as one store
        self._before_write: list[Callable[[], None]] = []
        self._tasks: dict[str, _Task] = {}

    # -- for tests -------------------------------------------------------------------------

    def before_write(self, change: Callable[[], None]) -> None:
        """Run ``change`` when the next PATCH or action POST arrives, before it is judged."""
        with self._lock:
            self._before_write.append(change)

    def writes(self) -> list[Exchange]:
        """Every PATCH and POST (sessions left out), in order."""
        with self._lock:
            return [
                e
                for e in self.log
                if e.method in ("PATCH", "POST") and "/SessionService/" not in e.path
            ]

    def get(self, path: str) -> dict[str, Any]:
        """A resource as the store holds it (no rules applied)."""
        response = self._http.get(f"{self.backend}{path}", timeout=10)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    # -- serving ---------------------------------------------------------------------------

    def serve(
        self, method: str, path: str, query: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        body = json.loads(raw) if raw else None
        exchange = Exchange(method, path, query, headers.get("if-match", ""), body)
        with self._lock:
            self.log.append(exchange)
        if method in ("PATCH", "POST") and "/SessionService/" not in path:
            with self._lock:
                change = self._before_write.pop(0) if self._before_write else None
            if change is not None:
                change()
        with self._lock:
            status, payload, extra = self._answer(method, path, query, headers, body, raw)
            exchange.status = status
            exchange.location = extra.get("Location", "")
        return status, payload, extra

    def _answer(
        self,
        method: str,
        path: str,
        query: str,
        headers: dict[str, str],
        body: Any,
        raw: bytes,
    ) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        rules = self.rules
        if method == "GET" and path.startswith(f"{MONITORS}/"):
            return self._monitor(path)
        if (
            method == "PATCH"
            and rules.read_only_links
            and isinstance(body, dict)
            and "Links" in body
        ):
            return (
                HTTPStatus.BAD_REQUEST,
                _error(
                    "PropertyNotWritable",
                    "The property Links is a read only property and cannot be assigned a value.",
                ),
                {},
            )
        if method == "PATCH" and rules.etags and headers.get("if-match"):
            current = self._resource(path)
            if current is not None and headers["if-match"] != etag_of(current):
                return (
                    HTTPStatus.PRECONDITION_FAILED,
                    _error("PreconditionFailed", f"the ETag of {path} is {etag_of(current)}"),
                    {},
                )
        if method == "POST" and rules.zone_actions and path.endswith((ADD, REMOVE)):
            return self._zone_action(path, body)
        status, payload, answer_headers = self._forward(method, path, query, headers, raw)
        if method == "GET" and isinstance(payload, dict) and status == HTTPStatus.OK:
            payload = self._decorate(path, payload, answer_headers)
        if (
            method == "POST"
            and rules.async_actions
            and "/Actions/" in path
            and status < HTTPStatus.BAD_REQUEST
        ):
            return self._start_task(status)
        return status, payload, answer_headers

    def _forward(
        self, method: str, path: str, query: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        passed = {k: v for k, v in headers.items() if k in ("content-type", "x-auth-token")}
        url = f"{self.backend}{path}" + (f"?{query}" if query else "")
        response = self._http.request(method, url, data=raw or None, headers=passed, timeout=10)
        try:
            payload = response.json() if response.content else None
        except ValueError:
            payload = None
        kept = {
            k: v
            for k, v in response.headers.items()
            if k.lower() in ("location", "x-auth-token", "etag", "retry-after")
        }
        return response.status_code, payload if isinstance(payload, dict) else None, kept

    def _resource(self, path: str) -> dict[str, Any] | None:
        response = self._http.get(f"{self.backend}{path}", timeout=10)
        if response.status_code != HTTPStatus.OK:
            return None
        body: dict[str, Any] = response.json()
        return body

    def _decorate(
        self, path: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        rules = self.rules
        tag = etag_of(payload)  # of the resource as stored, before anything is added
        if rules.zone_actions and _is_zone(payload):
            payload.setdefault("Actions", {}).update(
                {
                    "#Zone.AddEndpoint": {"target": f"{path}{ADD}"},
                    "#Zone.RemoveEndpoint": {"target": f"{path}{REMOVE}"},
                }
            )
        if rules.etags and "Members" not in payload:
            if rules.etags == "header":
                headers["ETag"] = tag
            else:
                payload["@odata.etag"] = tag
        return payload

    def _zone_action(
        self, path: str, body: Any
    ) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        zone_path = path.rsplit("/Actions/", 1)[0]
        zone = self._resource(zone_path)
        if zone is None or not _is_zone(zone):
            return HTTPStatus.NOT_FOUND, _error("ResourceNotFound", zone_path), {}
        link = body.get("Endpoint", {}).get("@odata.id") if isinstance(body, dict) else None
        if not isinstance(link, str):
            return HTTPStatus.BAD_REQUEST, _error("ActionParameterMissing", "Endpoint"), {}
        endpoint = self._resource(link)
        if endpoint is None:
            return HTTPStatus.BAD_REQUEST, _error("ActionParameterValueError", link), {}
        for parameter, current in (("ZoneETag", zone), ("EndpointETag", endpoint)):
            given = body.get(parameter)
            if self.rules.etags and given is not None and given != etag_of(current):
                return (
                    HTTPStatus.PRECONDITION_FAILED,
                    _error("PreconditionFailed", f"{parameter} {given} is stale"),
                    {},
                )
        add = path.endswith(ADD)
        held = [m["@odata.id"] for m in zone.get("Links", {}).get("Endpoints", [])]
        zones = [z["@odata.id"] for z in endpoint.get("Links", {}).get("Zones", [])]
        if add:
            held = held if link in held else [*held, link]
            zones = zones if zone_path in zones else [*zones, zone_path]
        else:
            held = [m for m in held if m != link]
            zones = [z for z in zones if z != zone_path]
        self._store(zone_path, {"Links": {"Endpoints": [{"@odata.id": m} for m in held]}})
        self._store(link, {"Links": {"Zones": [{"@odata.id": z} for z in zones]}})
        if self.rules.async_actions:
            return self._start_task(HTTPStatus.NO_CONTENT)
        return HTTPStatus.NO_CONTENT, None, {}

    def _store(self, path: str, change: dict[str, Any]) -> None:
        self._http.patch(f"{self.backend}{path}", json=change, timeout=10).raise_for_status()

    def _start_task(self, status: int) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        task = str(len(self._tasks) + 1)
        self._tasks[task] = _Task(self.rules.task_polls, status)
        return HTTPStatus.ACCEPTED, None, self._running(f"{MONITORS}/{task}")

    def _monitor(self, path: str) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        task = self._tasks.get(path.rpartition("/")[2])
        if task is None:
            return HTTPStatus.NOT_FOUND, _error("ResourceNotFound", path), {}
        if task.polls_left > 0:
            task.polls_left -= 1
            return HTTPStatus.ACCEPTED, None, self._running(path)
        return task.status, None, {}

    def _running(self, monitor: str) -> dict[str, str]:
        return {"Location": monitor, "Retry-After": str(self.rules.retry_after)}


def etag_of(resource: dict[str, Any]) -> str:
    """A strong ETag of a resource: a digest of its JSON (annotations left out)."""
    kept = {k: v for k, v in resource.items() if k not in ("@odata.etag", "@Redfish.Copyright")}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]
    return f'"{digest}"'


def _is_zone(resource: dict[str, Any]) -> bool:
    return str(resource.get("@odata.type", "")).startswith("#Zone.")


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


def _handler(proxy: RecordingProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._relay("GET")

        def do_POST(self) -> None:
            self._relay("POST")

        def do_PATCH(self) -> None:
            self._relay("PATCH")

        def do_DELETE(self) -> None:
            self._relay("DELETE")

        def _relay(self, method: str) -> None:
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, payload, extra = proxy.serve(method, parts.path, parts.query, headers, raw)
            data = json.dumps(payload).encode() if payload is not None else b""
            self.send_response(status)
            if data:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("OData-Version", "4.0")
            for name, value in extra.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

    return Handler


@contextmanager
def running(backend: str, rules: Rules) -> Iterator[RecordingProxy]:
    """A proxy for ``backend`` on a free loopback port until exit."""
    proxy = RecordingProxy(backend, rules)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    server.daemon_threads = True
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="redfish-proxy", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        proxy._http.close()


__all__ = ["Exchange", "RecordingProxy", "Rules", "etag_of", "running"]
