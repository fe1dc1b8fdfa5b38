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
      auth: session                        # session (default) or basic (HTTP Basic)
      ca_bundle: /etc/dxpool/fabric-ca.pem # optional; default: the bundled public CAs
      verify: true                         # false only for a lab; never in production
      timeout_s: 10                        # per HTTP request
      attempts: 3                          # tries of an operation that failed safely
      membership: auto                     # auto, actions or patch (below)
      zone_lookup: auto                    # auto, endpoint or scan (below)
      task_timeout_s: 120                  # how long a task monitor is followed
    hosts:
      h1:                                  # zone per host slot
        endpoint: HostPort-h1              # the host port's Endpoint (EntityRole Initiator)
        zones: [Zone-h1-0, Zone-h1-1]      # host slot i -> the Zone that maps into slot i
      h2:                                  # zone per host port
        endpoint: HostPort-h2
        zone: Zone-h2                      # one zone holds the port and all its GPUs
        slots: 4                           # how many GPUs the port takes at once
    boxes:
      b1: [GPU-b1-0, GPU-b1-1]             # GPU slot i -> its Endpoint (EntityRole Target)
    scrub:                                 # the broker's reset of a fenced GPU (optional)
      actions:                             # looked for, in order, on the GPU's endpoint
        - "#Processor.Reset"               # and on the resources it links (the default)
        - name: "#Oem.Contoso.ResetGpu"    # a vendor's action, with the body it takes
          parameters: {Mode: Full}
      hook: /usr/local/libexec/dxpool-scrub  # HOOK scrub-gpu BOX SLOT GENERATION, used
      hook_timeout_s: 30                     # where the service offers none of them

**Zones.** A host reaches a GPU when one zone holds both the host's initiator endpoint
and the GPU's target endpoint. A fabric manager either gives each host slot a zone of its
own (one GPU per zone; ``zones:``) or gives each host port one zone holding all the
port's GPUs (``zone:`` and ``slots:``, H3 Platform's model). Either way a zone may hold
other endpoints too - DMTF's CXL mockups put the switch's endpoint in every zone: only
the endpoints listed under ``boxes:`` are GPUs, and dxpool never adds or removes any
other. Every host of the fabric is listed, not only the agent's own: fencing a host needs
its endpoint, and an endpoint is told apart as a host's or a GPU's by the map.

**membership** says how a zone's members are changed. ``Zone.Links.Endpoints`` is
read-only in DMTF's schema; the schema's way is the ``#Zone.AddEndpoint`` and
``#Zone.RemoveEndpoint`` actions (Zone v1.5+). ``auto`` uses the actions a zone offers
and, for a zone without them, a PATCH of ``Links.Endpoints`` (which older services
accept), remembering a service that refuses such a PATCH; ``actions`` never PATCHes;
``patch`` never uses the actions.

**zone_lookup** says how the zones holding an endpoint are found. ``endpoint`` trusts
the endpoint's own ``Links.Zones``; ``scan`` reads every zone of the fabric; ``auto``
scans until the service has shown, after a change dxpool made, that it keeps
``Links.Zones`` current, and trusts it from then on (a service seen otherwise is
scanned for good).

:func:`load_fabric_map` raises :class:`~dxpool.errors.InvalidArgument` naming the field
to fix.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from dxpool.errors import InvalidArgument
from dxpool.limits import MAX_HOST_SLOTS
from dxpool.names import GpuRef, check_id

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_ATTEMPTS = 3
MAX_ATTEMPTS = 10
DEFAULT_TASK_TIMEOUT_S = 120.0
DEFAULT_SCRUB_HOOK_TIMEOUT_S = 30.0
PROCESSOR_RESET = "#Processor.Reset"
REDFISH_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:~")
ACTION_NAME_CHARS = REDFISH_ID_CHARS | {"#"}
E = TypeVar("E", bound=enum.StrEnum)


class AuthMethod(enum.StrEnum):
    """How dxpool authenticates: a Redfish session (``X-Auth-Token``) or HTTP Basic."""

    SESSION = "session"
    BASIC = "basic"


class Membership(enum.StrEnum):
    """How zone membership is changed (see the module docstring)."""

    AUTO = "auto"
    ACTIONS = "actions"
    PATCH = "patch"


class ZoneLookup(enum.StrEnum):
    """How the zones holding an endpoint are found (see the module docstring)."""

    AUTO = "auto"
    ENDPOINT = "endpoint"
    SCAN = "scan"


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
    auth: AuthMethod = AuthMethod.SESSION
    membership: Membership = Membership.AUTO
    zone_lookup: ZoneLookup = ZoneLookup.AUTO
    task_timeout_s: float = DEFAULT_TASK_TIMEOUT_S

    def __repr__(self) -> str:  # never print the password
        return f"RedfishService(url={self.url!r}, fabric={self.fabric!r}, user={self.username!r})"


@dataclass(frozen=True)
class RedfishHost:
    """A host port: its initiator endpoint and its zones.

    Zone per host slot (``port_slots`` 0): ``zones[i]`` maps into host slot ``i`` and
    holds at most one GPU. Zone per host port (``port_slots`` > 0): ``zones`` is the
    port's one zone, holding up to ``port_slots`` GPUs at once.
    """

    endpoint: str
    zones: tuple[str, ...]
    port_slots: int = 0

    def __post_init__(self) -> None:
        if not self.zones:
            raise InvalidArgument(f"host endpoint {self.endpoint} needs at least one zone")
        if self.port_slots < 0 or (self.port_slots > 0 and len(self.zones) != 1):
            raise InvalidArgument(
                f"host endpoint {self.endpoint}: a zone per host port is one zone with slots >= 1"
            )

    @property
    def per_port(self) -> bool:
        """True for a zone per host port (several GPUs in one zone)."""
        return self.port_slots > 0

    @property
    def slots(self) -> int:
        """How many GPUs the host can hold at once."""
        return self.port_slots if self.per_port else len(self.zones)

    def zone_for_slot(self, host_slot: int) -> str | None:
        """The zone that maps GPUs into ``host_slot``, or None for a slot out of range."""
        if not 0 <= host_slot < self.slots:
            return None
        return self.zones[0] if self.per_port else self.zones[host_slot]


@dataclass(frozen=True)
class ResetAction:
    """An action that resets (clears) a GPU: its name as the ``Actions`` object keys it
    (``#Processor.Reset``; an OEM action under ``Actions.Oem`` the same way), and the body
    to POST - None lets dxpool pick a ``ResetType`` the action allows."""

    name: str
    parameters: Mapping[str, Any] | None = None

    def __repr__(self) -> str:  # parameters may carry a secret (a passphrase): names only
        shown = sorted(self.parameters) if self.parameters is not None else None
        return f"ResetAction(name={self.name!r}, parameters={shown!r})"


@dataclass(frozen=True)
class RedfishScrub:
    """How the broker resets a fenced GPU: the actions looked for, in order, and the hook
    run where the service offers none of them."""

    actions: tuple[ResetAction, ...] = (ResetAction(PROCESSOR_RESET),)
    hook: Path | None = None
    hook_timeout_s: float = DEFAULT_SCRUB_HOOK_TIMEOUT_S


@dataclass(frozen=True)
class RedfishFabricMap:
    """The whole map; read-only, built by :func:`load_fabric_map` or directly (tests)."""

    service: RedfishService
    hosts: Mapping[str, RedfishHost]
    boxes: Mapping[str, tuple[str, ...]]
    scrub: RedfishScrub = field(default_factory=RedfishScrub)
    _gpus: Mapping[str, GpuRef] = field(init=False, repr=False, compare=False, default_factory=dict)
    _zone_hosts: Mapping[str, str] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", MappingProxyType(dict(self.hosts)))
        object.__setattr__(self, "boxes", MappingProxyType(dict(self.boxes)))
        owners: dict[str, str] = {}
        gpus: dict[str, GpuRef] = {}
        zone_hosts: dict[str, str] = {}
        for host, entry in self.hosts.items():
            _claim(owners, entry.endpoint, f"host {host}")
            for slot, zone in enumerate(entry.zones):
                where = (
                    f"the port of host {host}" if entry.per_port else f"slot {slot} of host {host}"
                )
                _claim(owners, f"zone:{zone}", where)
                zone_hosts[zone] = host
        for box, endpoints in self.boxes.items():
            for slot, endpoint in enumerate(endpoints):
                _claim(owners, endpoint, f"GPU {box}/{slot}")
                gpus[endpoint] = GpuRef(box, slot)
        object.__setattr__(self, "_gpus", MappingProxyType(gpus))
        object.__setattr__(self, "_zone_hosts", MappingProxyType(zone_hosts))

    def gpu_endpoint(self, gpu: GpuRef) -> str | None:
        """The target endpoint id of ``gpu``, or None when the map does not list it."""
        endpoints = self.boxes.get(gpu.box, ())
        return endpoints[gpu.slot] if 0 <= gpu.slot < len(endpoints) else None

    def gpu_of(self, endpoint: str) -> GpuRef | None:
        """The GPU whose target endpoint is ``endpoint``, or None (a host port, a switch,
        any endpoint the map does not list as a GPU)."""
        return self._gpus.get(endpoint)

    def host_of_zone(self, zone: str) -> str | None:
        """The host whose zone ``zone`` is in the map, or None."""
        return self._zone_hosts.get(zone)

    def host_endpoints(self) -> frozenset[str]:
        """Every host's initiator endpoint id."""
        return frozenset(entry.endpoint for entry in self.hosts.values())


def _claim(owners: dict[str, str], key: str, owner: str) -> None:
    if key in owners:
        name = key.removeprefix("zone:")
        raise InvalidArgument(
            f"Redfish id {name!r} is given to both {owners[key]} and {owner}; every endpoint "
            "and every zone belongs to one host slot, host port, host or GPU"
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
    _only(document, {"service", "hosts", "boxes", "scrub"}, "the fabric map")
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
    scrub = document.get("scrub")
    return RedfishFabricMap(
        service=service,
        hosts=hosts,
        boxes=boxes,
        scrub=RedfishScrub() if scrub is None else _scrub(_mapping(scrub, "scrub"), path.parent),
    )


def _service(section: Mapping[str, Any], base: Path) -> RedfishService:
    _only(
        section,
        {
            "url",
            "fabric",
            "username",
            "password_file",
            "auth",
            "ca_bundle",
            "verify",
            "timeout_s",
            "attempts",
            "membership",
            "zone_lookup",
            "task_timeout_s",
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
        timeout_s=_seconds(section, "timeout_s", DEFAULT_TIMEOUT_S, "service"),
        attempts=attempts,
        auth=_choice(section, "auth", AuthMethod, AuthMethod.SESSION),
        membership=_choice(section, "membership", Membership, Membership.AUTO),
        zone_lookup=_choice(section, "zone_lookup", ZoneLookup, ZoneLookup.AUTO),
        task_timeout_s=_seconds(section, "task_timeout_s", DEFAULT_TASK_TIMEOUT_S, "service"),
    )


def _host(host: str, entry: object) -> RedfishHost:
    where = f"hosts.{host}"
    section = _mapping(entry, where)
    _only(section, {"endpoint", "zones", "zone", "slots"}, where)
    endpoint = _redfish_id(section.get("endpoint"), f"{where}.endpoint")
    if ("zones" in section) == ("zone" in section):
        raise InvalidArgument(
            f"{where} needs either zones: (one zone per host slot) or zone: with slots: (one "
            "zone for the host port, holding several GPUs)"
        )
    if "zones" in section:
        if "slots" in section:
            raise InvalidArgument(
                f"{where}.slots goes with zone: (a zone per host port); with zones: the host "
                "has one slot per zone"
            )
        zones = _id_list(section.get("zones"), f"{where}.zones")
        if len(zones) > MAX_HOST_SLOTS:
            raise InvalidArgument(
                f"{where}.zones lists {len(zones)} zones; a host has at most {MAX_HOST_SLOTS} slots"
            )
        return RedfishHost(endpoint=endpoint, zones=zones)
    slots = section.get("slots")
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_HOST_SLOTS:
        raise InvalidArgument(
            f"{where}.slots must be 1..{MAX_HOST_SLOTS} (how many GPUs the port's zone takes), "
            f"got {slots!r}"
        )
    zone = _redfish_id(section.get("zone"), f"{where}.zone")
    return RedfishHost(endpoint=endpoint, zones=(zone,), port_slots=slots)


def _scrub(section: Mapping[str, Any], base: Path) -> RedfishScrub:
    _only(section, {"actions", "hook", "hook_timeout_s"}, "scrub")
    listed = section.get("actions", [PROCESSOR_RESET])
    if not isinstance(listed, list):
        raise InvalidArgument("scrub.actions must be a list of action names or {name, parameters}")
    actions = tuple(_reset_action(item, f"scrub.actions[{i}]") for i, item in enumerate(listed))
    hook = section.get("hook")
    if not actions and hook is None:
        raise InvalidArgument("scrub needs at least one action or a hook")
    return RedfishScrub(
        actions=actions,
        hook=base / _text(hook, "scrub.hook") if hook is not None else None,
        hook_timeout_s=_seconds(section, "hook_timeout_s", DEFAULT_SCRUB_HOOK_TIMEOUT_S, "scrub"),
    )


def _reset_action(item: object, where: str) -> ResetAction:
    if isinstance(item, str):
        return ResetAction(_action_name(item, where))
    entry = _mapping(item, where)
    _only(entry, {"name", "parameters"}, where)
    parameters = entry.get("parameters")
    if parameters is not None:
        parameters = MappingProxyType(dict(_mapping(parameters, f"{where}.parameters")))
    return ResetAction(_action_name(entry.get("name"), f"{where}.name"), parameters)


def _action_name(value: object, where: str) -> str:
    text = _text(value, where)
    if not text.startswith("#") or "." not in text or not set(text) <= ACTION_NAME_CHARS:
        raise InvalidArgument(
            f"{where} {text!r} is not an action name: write it as the Actions object keys it, "
            "e.g. #Processor.Reset or #Contoso.ResetGpu"
        )
    return text


def _choice(section: Mapping[str, Any], key: str, kind: type[E], default: E) -> E:
    value = section.get(key, default.value)
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(member.value for member in kind)
        raise InvalidArgument(f"service.{key} must be one of {allowed}, got {value!r}") from None


def _seconds(section: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidArgument(f"{where}.{key} must be a number > 0, got {value!r}")
    return float(value)


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
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)  # DMTF's mockups number their zones: zone: 3
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
    "AuthMethod",
    "Membership",
    "RedfishFabricMap",
    "RedfishHost",
    "RedfishScrub",
    "RedfishService",
    "ResetAction",
    "ZoneLookup",
    "load_fabric_map",
]
