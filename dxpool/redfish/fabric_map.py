"""The Redfish fabric map: where a fabric manager is and which Redfish ids are ours.

dxpool names GPUs ``{box}/{slot}`` and host proxy slots by number; a fabric manager that
speaks DMTF Redfish names Endpoints and Zones by its own ids. The map says which is
which, in one YAML file for the whole fabric: host agents are given it with
``--redfish-map``, the broker (the fencer) with ``--fabric redfish:FILE``::

    service:
      url: https://falcon.example.net      # the fabric manager's Redfish service
      fabric: PCIe                         # /redfish/v1/Fabrics/PCIe
      username: dxpool
      password_file: /etc/dxpool/redfish.password
      ca_bundle: /etc/dxpool/fabric-ca.pem # optional; default: the bundled public CAs
      verify: true                         # false only for a lab; never in production
      timeout_s: 10                        # per HTTP request
      attempts: 3                          # tries of an operation that failed safely
    hosts:
      h1:
        endpoint: HostPort-h1              # the host port's Endpoint (EntityRole Initiator)
        zones: [Zone-h1-0, Zone-h1-1]      # host slot i -> the Zone that maps into slot i
    boxes:
      b1: [GPU-b1-0, GPU-b1-1]             # GPU slot i -> its Endpoint (EntityRole Target)

One Zone per host slot: the zone holds the host's initiator endpoint and, while the slot
is mapped, exactly one GPU's target endpoint. A GPU is mapped into a slot by adding its
endpoint to the slot's zone (``PATCH .../Zones/{zone}`` with ``Links.Endpoints``) and
unmapped by removing it. Every host of the fabric is listed, not only the agent's own:
fencing a host needs its endpoint, and an endpoint is told apart as a host's or a GPU's
by the map. :func:`load_fabric_map` raises :class:`~dxpool.errors.InvalidArgument`
naming the field to fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import yaml

from dxpool.errors import InvalidArgument
from dxpool.limits import MAX_HOST_SLOTS
from dxpool.names import GpuRef, check_id

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_ATTEMPTS = 3
MAX_ATTEMPTS = 10
REDFISH_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:~")


@dataclass(frozen=True)
class RedfishService:
    """Where the Redfish service is and how to talk to it."""

    url: str
    fabric: str
    username: str
    password: str
    ca_bundle: Path | None = None
    verify: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    attempts: int = DEFAULT_ATTEMPTS

    def __repr__(self) -> str:  # never print the password
        return f"RedfishService(url={self.url!r}, fabric={self.fabric!r}, user={self.username!r})"


@dataclass(frozen=True)
class RedfishHost:
    """A host port: its initiator endpoint and the zone of each of its host slots."""

    endpoint: str
    zones: tuple[str, ...]


@dataclass(frozen=True)
class RedfishFabricMap:
    """The whole map; read-only, built by :func:`load_fabric_map` or directly (tests)."""

    service: RedfishService
    hosts: Mapping[str, RedfishHost]
    boxes: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", MappingProxyType(dict(self.hosts)))
        object.__setattr__(self, "boxes", MappingProxyType(dict(self.boxes)))
        owners: dict[str, str] = {}
        for host, entry in self.hosts.items():
            _claim(owners, entry.endpoint, f"host {host}")
            for slot, zone in enumerate(entry.zones):
                _claim(owners, f"zone:{zone}", f"slot {slot} of host {host}")
        for box, endpoints in self.boxes.items():
            for slot, endpoint in enumerate(endpoints):
                _claim(owners, endpoint, f"GPU {box}/{slot}")

    def gpu_endpoint(self, gpu: GpuRef) -> str | None:
        """The target endpoint id of ``gpu``, or None when the map does not list it."""
        endpoints = self.boxes.get(gpu.box, ())
        return endpoints[gpu.slot] if 0 <= gpu.slot < len(endpoints) else None

    def gpu_of(self, endpoint: str) -> GpuRef | None:
        """The GPU whose target endpoint is ``endpoint``, or None."""
        for box, endpoints in self.boxes.items():
            if endpoint in endpoints:
                return GpuRef(box, endpoints.index(endpoint))
        return None

    def host_endpoints(self) -> frozenset[str]:
        """Every host's initiator endpoint id."""
        return frozenset(entry.endpoint for entry in self.hosts.values())


def _claim(owners: dict[str, str], key: str, owner: str) -> None:
    if key in owners:
        name = key.removeprefix("zone:")
        raise InvalidArgument(
            f"Redfish id {name!r} is given to both {owners[key]} and {owner}; every endpoint "
            "and every zone belongs to one host slot, host or GPU"
        )
    owners[key] = owner


def load_fabric_map(path: Path) -> RedfishFabricMap:
    """Read and check the YAML fabric map at ``path``, and the password file it names."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise InvalidArgument(f"cannot read the Redfish fabric map {path}: {error}") from error
    except yaml.YAMLError as error:
        raise InvalidArgument(f"the Redfish fabric map {path} is not YAML: {error}") from error
    document = _mapping(document, "the fabric map")
    _only(document, {"service", "hosts", "boxes"}, "the fabric map")
    service = _service(_mapping(document.get("service"), "service"), path.parent)
    hosts = {
        check_id(str(host), "host"): _host(str(host), entry)
        for host, entry in _mapping(document.get("hosts"), "hosts").items()
    }
    boxes = {
        check_id(str(box), "box"): _id_list(entries, f"boxes.{box}")
        for box, entries in _mapping(document.get("boxes"), "boxes").items()
    }
    if not hosts or not boxes:
        raise InvalidArgument("the Redfish fabric map needs at least one host and one box")
    return RedfishFabricMap(service=service, hosts=hosts, boxes=boxes)


def _service(section: Mapping[str, Any], base: Path) -> RedfishService:
    _only(
        section,
        {
            "url",
            "fabric",
            "username",
            "password_file",
            "ca_bundle",
            "verify",
            "timeout_s",
            "attempts",
        },
        "service",
    )
    url = _text(section.get("url"), "service.url").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.path not in ("", "/"):
        raise InvalidArgument(
            f"service.url {url!r} must be the service's address, e.g. https://falcon.example.net"
        )
    password_file = base / _text(section.get("password_file"), "service.password_file")
    try:
        password = password_file.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise InvalidArgument(f"cannot read service.password_file: {error}") from error
    ca_bundle = section.get("ca_bundle")
    verify = section.get("verify", True)
    if not isinstance(verify, bool):
        raise InvalidArgument(f"service.verify must be true or false, got {verify!r}")
    timeout_s = section.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise InvalidArgument(f"service.timeout_s must be a number > 0, got {timeout_s!r}")
    attempts = section.get("attempts", DEFAULT_ATTEMPTS)
    if (
        isinstance(attempts, bool)
        or not isinstance(attempts, int)
        or not (1 <= attempts <= MAX_ATTEMPTS)
    ):
        raise InvalidArgument(f"service.attempts must be 1..{MAX_ATTEMPTS}, got {attempts!r}")
    return RedfishService(
        url=url,
        fabric=_redfish_id(section.get("fabric"), "service.fabric"),
        username=_text(section.get("username"), "service.username"),
        password=password,
        ca_bundle=base / _text(ca_bundle, "service.ca_bundle") if ca_bundle is not None else None,
        verify=verify,
        timeout_s=float(timeout_s),
        attempts=attempts,
    )


def _host(host: str, entry: object) -> RedfishHost:
    section = _mapping(entry, f"hosts.{host}")
    _only(section, {"endpoint", "zones"}, f"hosts.{host}")
    zones = _id_list(section.get("zones"), f"hosts.{host}.zones")
    if len(zones) > MAX_HOST_SLOTS:
        raise InvalidArgument(
            f"hosts.{host}.zones lists {len(zones)} zones; a host has at most {MAX_HOST_SLOTS} "
            "slots"
        )
    return RedfishHost(
        endpoint=_redfish_id(section.get("endpoint"), f"hosts.{host}.endpoint"), zones=zones
    )


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{where} must be a mapping of names to entries")
    return value


def _only(section: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(str(key) for key in section if key not in allowed)
    if unknown:
        raise InvalidArgument(
            f"unknown key(s) {', '.join(unknown)} in {where}: use {', '.join(sorted(allowed))}"
        )


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or not value.isprintable():
        raise InvalidArgument(f"{where} must be a non-empty string of printable characters")
    return value


def _redfish_id(value: object, where: str) -> str:
    text = _text(value, where)
    if not set(text) <= REDFISH_ID_CHARS:
        raise InvalidArgument(
            f"{where} {text!r} is not a Redfish id: use letters, digits and -_.:~ (the last "
            "segment of the resource's @odata.id)"
        )
    return text


def _id_list(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidArgument(f"{where} must be a non-empty list of Redfish ids, slot 0 first")
    return tuple(_redfish_id(item, f"{where}[{index}]") for index, item in enumerate(value))


__all__ = [
    "RedfishFabricMap",
    "RedfishHost",
    "RedfishService",
    "load_fabric_map",
]
