"""A local Redfish fabric service for tests: the Fabrics/Zones/Endpoints/SessionService
subset a PCIe fabric manager serves, shaped like DMTF's public mockups (``@odata.id``,
``Members``, ``Links.Endpoints``, ``ConnectedEntities[].EntityRole``), on 127.0.0.1.

It behaves like the services it stands for, errors included:

* every resource but the service root and session creation needs ``X-Auth-Token`` (401
  otherwise); :meth:`RedfishFabricService.expire_sessions` ends every session;
* zones carry an ETag; a PATCH whose ``If-Match`` differs is refused with 412;
* a target endpoint belongs to one zone at a time: adding it to a second one is 409;
* unknown endpoints in a PATCH are 400, unknown resources 404;
* :meth:`fail` answers the next matching requests with a status (5xx), :meth:`delay`
  answers them late (timeouts), :meth:`before_patch` runs a change between a client's
  read and its write, :meth:`hold` keeps matching requests waiting until released;
* each target endpoint links (``ConnectedEntities[].EntityLink``) the GPU's
  ``Processor`` resource, which offers ``#Processor.Reset`` unless the service was made
  with ``resets=False``; a reset is answered 204, or 202 with a task monitor that runs
  for a few polls when ``async_resets`` is set. :attr:`resets` records them.

TLS: :func:`self_signed_cert` makes a certificate for 127.0.0.1 with ``cryptography``.
"""

from __future__ import annotations

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

FABRIC = "PCIe"
ROOT = "/redfish/v1"
FABRIC_PATH = f"{ROOT}/Fabrics/{FABRIC}"
SESSIONS = f"{ROOT}/SessionService/Sessions"
PROCESSORS = f"{ROOT}/Systems/GpuBox/Processors"
TASKS = f"{ROOT}/TaskService/Tasks"
RESET_ACTION = "Actions/Processor.Reset"
USERNAME = "dxpool"
PASSWORD = "s3cret"


@dataclass
class _Fault:
    method: str
    path: str
    count: int
    status: int = 0
    delay_s: float = 0.0


@dataclass
class FabricState:
    endpoints: dict[str, str] = field(default_factory=dict)  # id -> EntityRole
    zones: dict[str, list[str]] = field(default_factory=dict)  # id -> endpoint ids
    etags: dict[str, int] = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)  # token -> session id


class RedfishFabricService:
    """The service; use :func:`running_service`. Methods are safe from any thread."""

    def __init__(
        self, *, etags: bool = True, resets: bool = True, async_resets: bool = False
    ) -> None:
        self.state = FabricState()
        self.use_etags = etags
        self.offer_resets = resets
        self.async_resets = async_resets
        self.resets: list[tuple[str, str]] = []  # (endpoint, ResetType)
        self._tasks: dict[str, int] = {}  # task id -> polls left before it completes
        self._holds: list[tuple[str, str, threading.Event]] = []
        self.lock = threading.RLock()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, If-Match)
        self._faults: list[_Fault] = []
        self._before_patch: list[Callable[[], None]] = []
        self._next_session = 0
        self.url = ""

    # -- setup ---------------------------------------------------------------------------

    def add_endpoint(self, endpoint: str, role: str) -> None:
        with self.lock:
            self.state.endpoints[endpoint] = role

    def add_zone(self, zone: str, endpoints: list[str]) -> None:
        with self.lock:
            self.state.zones[zone] = list(endpoints)
            self.state.etags[zone] = 1

    def set_zone(self, zone: str, endpoints: list[str]) -> None:
        """Change a zone as another client of the service would (its ETag changes)."""
        with self.lock:
            self.state.zones[zone] = list(endpoints)
            self.state.etags[zone] += 1

    def remove_zone(self, zone: str) -> None:
        """Delete a zone as another client of the service would."""
        with self.lock:
            del self.state.zones[zone]
            del self.state.etags[zone]

    def zone(self, zone: str) -> list[str]:
        with self.lock:
            return list(self.state.zones[zone])

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

    def before_patch(self, change: Callable[[], None]) -> None:
        """Run ``change`` when the next PATCH arrives, before it is judged (one change
        per PATCH, in the order given)."""
        with self.lock:
            self._before_patch.append(change)

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
            return [(path, etag) for method, path, etag in self.requests if method == "PATCH"]

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
        return {
            "@odata.type": "#ServiceRoot.v1_15_0.ServiceRoot",
            "@odata.id": f"{ROOT}/",
            "Id": "RootService",
            "Name": "Root Service",
            "RedfishVersion": "1.15.0",
            "Fabrics": {"@odata.id": f"{ROOT}/Fabrics"},
            "SessionService": {"@odata.id": f"{ROOT}/SessionService"},
            "Links": {"Sessions": {"@odata.id": SESSIONS}},
        }

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
                    "Endpoints": {"@odata.id": f"{path}/Endpoints"},
                    "Zones": {"@odata.id": f"{path}/Zones"},
                }
            if path == f"{FABRIC_PATH}/Endpoints":
                members = [f"{path}/{e}" for e in sorted(self.state.endpoints)]
                return _collection(path, "EndpointCollection", members)
            if path == f"{FABRIC_PATH}/Zones":
                members = [f"{path}/{z}" for z in sorted(self.state.zones)]
                return _collection(path, "ZoneCollection", members)
            prefix, _, name = path.rpartition("/")
            if prefix == PROCESSORS and self.state.endpoints.get(name) == "Target":
                return self._processor(path, name)
            if prefix == TASKS and name in self._tasks:
                return self._task(path, name)
            if prefix == f"{FABRIC_PATH}/Endpoints" and name in self.state.endpoints:
                role = self.state.endpoints[name]
                entity: dict[str, Any] = {
                    "EntityType": "RootComplex" if role == "Initiator" else "Processor",
                    "EntityRole": role,
                }
                if role == "Target":
                    entity["EntityLink"] = {"@odata.id": f"{PROCESSORS}/{name}"}
                return {
                    "@odata.type": "#Endpoint.v1_8_0.Endpoint",
                    "@odata.id": path,
                    "Id": name,
                    "Name": f"Endpoint {name}",
                    "EndpointProtocol": "PCIe",
                    "ConnectedEntities": [entity],
                }
            if prefix == f"{FABRIC_PATH}/Zones" and name in self.state.zones:
                links = [
                    {"@odata.id": f"{FABRIC_PATH}/Endpoints/{e}"} for e in self.state.zones[name]
                ]
                return {
                    "@odata.type": "#Zone.v1_6_1.Zone",
                    "@odata.id": path,
                    "Id": name,
                    "Name": f"Zone {name}",
                    "ZoneType": "ZoneOfEndpoints",
                    "Links": {"Endpoints": links, "Endpoints@odata.count": len(links)},
                    "Status": {"State": "Enabled", "Health": "OK"},
                }
        return None

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
                    "ResetType@Redfish.AllowableValues": ["On", "ForceOff", "ForceRestart"],
                }
            }
        return body

    def _task(self, path: str, task: str) -> dict[str, Any]:
        left = self._tasks[task]
        if left > 0:
            self._tasks[task] = left - 1
        return {
            "@odata.type": "#Task.v1_7_0.Task",
            "@odata.id": path,
            "Id": task,
            "TaskState": "Running" if left > 0 else "Completed",
        }

    def reset(self, path: str, body: Any) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
        """A POST to a processor's Reset action."""
        name = path.removesuffix(f"/{RESET_ACTION}").rpartition("/")[2]
        with self.lock:
            if not self.offer_resets or self.state.endpoints.get(name) != "Target":
                return HTTPStatus.NOT_FOUND, _error("ActionNotSupported", path), {}
            reset_type = body.get("ResetType") if isinstance(body, dict) else None
            if reset_type not in ("On", "ForceOff", "ForceRestart"):
                return HTTPStatus.BAD_REQUEST, _error("ActionParameterNotSupported", path), {}
            self.resets.append((name, str(reset_type)))
            if not self.async_resets:
                return HTTPStatus.NO_CONTENT, None, {}
            task = str(len(self._tasks) + 1)
            self._tasks[task] = 2
        location = f"{TASKS}/{task}"
        return HTTPStatus.ACCEPTED, {"@odata.id": location}, {"Location": location}

    def etag(self, path: str) -> str:
        name = path.rpartition("/")[2]
        with self.lock:
            if not self.use_etags or not path.startswith(f"{FABRIC_PATH}/Zones/"):
                return ""
            return f'"{name}-{self.state.etags.get(name, 0)}"'

    def patch_zone(self, path: str, body: Any, if_match: str) -> tuple[int, dict[str, Any]]:
        with self.lock:
            change = self._before_patch.pop(0) if self._before_patch else None
        if change is not None:
            change()
        with self.lock:
            zone = path.rpartition("/")[2]
            if not path.startswith(f"{FABRIC_PATH}/Zones/") or zone not in self.state.zones:
                return HTTPStatus.NOT_FOUND, _error("ResourceNotFound", f"no resource {path}")
            if if_match and if_match != self.etag(path):
                return HTTPStatus.PRECONDITION_FAILED, _error(
                    "PreconditionFailed", f"the ETag of zone {zone} is {self.etag(path)}"
                )
            try:
                links = body["Links"]["Endpoints"]
                wanted = [str(link["@odata.id"]).rpartition("/")[2] for link in links]
            except (KeyError, TypeError) as error:
                return HTTPStatus.BAD_REQUEST, _error("MalformedJSON", f"bad zone body: {error}")
            unknown = [e for e in wanted if e not in self.state.endpoints]
            if unknown:
                return HTTPStatus.BAD_REQUEST, _error(
                    "ResourceNotFound", f"unknown endpoints {unknown}"
                )
            for endpoint in wanted:
                if self.state.endpoints[endpoint] != "Target":
                    continue
                holder = next(
                    (z for z, m in self.state.zones.items() if z != zone and endpoint in m), None
                )
                if holder is not None:
                    return HTTPStatus.CONFLICT, _error(
                        "ResourceInUse", f"endpoint {endpoint} is already assigned to zone {holder}"
                    )
            self.state.zones[zone] = wanted
            self.state.etags[zone] += 1
        return HTTPStatus.OK, self.resource(path) or {}

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

    def authorized(self, token: str | None) -> bool:
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
            path = self.path.split("?")[0].rstrip("/") or "/"
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if_match = self.headers.get("If-Match") or ""
            with service.lock:
                service.requests.append((method, path, if_match))
            service._wait_for_holds(method, path)
            fault = service._take_fault(method, path)
            self._late_by = fault.delay_s if fault is not None else 0.0
            if fault is not None and fault.status:
                self._send(fault.status, _error("InternalError", "injected failure"))
                return
            body = json.loads(raw) if raw else None
            if path == ROOT and method == "GET":
                self._send(HTTPStatus.OK, service.root())
                return
            if path == SESSIONS and method == "POST":
                status, payload, headers = service.open_session(body)
                self._send(status, payload, headers)
                return
            token = self.headers.get("X-Auth-Token")
            if not service.authorized(token):
                self._send(HTTPStatus.UNAUTHORIZED, _error("NoValidSession", "no valid session"))
                return
            if method == "GET":
                resource = service.resource(path)
                if resource is None:
                    self._send(HTTPStatus.NOT_FOUND, _error("ResourceNotFound", path))
                    return
                etag = service.etag(path)
                self._send(HTTPStatus.OK, resource, {"ETag": etag} if etag else {})
            elif method == "PATCH":
                status, payload = service.patch_zone(path, body, if_match)
                etag = service.etag(path) if status == HTTPStatus.OK else ""
                self._send(status, payload, {"ETag": etag} if etag else {})
            elif method == "POST" and path.endswith(f"/{RESET_ACTION}"):
                self._send(*service.reset(path, body))
            elif method == "DELETE" and path.startswith(SESSIONS + "/"):
                self._send(service.close_session(path, str(token)), None)
            else:
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, _error("OperationNotAllowed", path))

        def _send(
            self, status: int, payload: dict[str, Any] | None, headers: dict[str, str] | None = None
        ) -> None:
            data = json.dumps(payload).encode() if payload is not None else b""
            time.sleep(self._late_by)  # the request is done; only the answer is late
            try:
                self.send_response(status)
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
