"""Configuration of one host agent."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from dxpool.config import check_endpoint
from dxpool.errors import InvalidArgument
from dxpool.hostagent.driver import BDF_PATTERN
from dxpool.limits import MAX_HOST_SLOTS
from dxpool.names import check_id
from dxpool.request import check_host_resources
from dxpool.text import check_labels
from dxpool.tls import ClientTls

# Where a broker serves agents by default (``dxpool broker --agent-listen``).
DEFAULT_BROKERS = "127.0.0.1:8471"


def parse_brokers(value: str) -> tuple[str, ...]:
    """``host:port[,host:port...]`` -> the endpoints, in order; InvalidArgument when one
    is not an endpoint or none is given."""
    endpoints = tuple(part.strip() for part in value.split(",") if part.strip())
    if not endpoints:
        raise InvalidArgument(
            f"no broker endpoint in {value!r}: give --broker HOST:PORT[,HOST:PORT...], the "
            f"agent ports of the pool's brokers (default port 8471)",
            reason="INVALID_ENDPOINT",
        )
    return tuple(check_endpoint(endpoint, "--broker") for endpoint in endpoints)


@dataclass(frozen=True)
class AgentConfig:
    """Everything one agent needs; validated on construction.

    Raises :class:`~dxpool.errors.InvalidArgument` naming the field to fix.

    ``labels`` is copied into a read-only mapping. ``cpu_cores`` and ``memory_mib`` are
    what the host offers to nodes (0: not declared). The ``sim_*`` fields configure the
    simulated fabric (``driver="sim"``): its state directory and per-operation delays.
    ``driver="linux"`` uses ``linux_ports`` (host slot -> the PCIe downstream port the
    proxy presents that slot behind, ``"0000:40:01.0"``; read-only copy),
    ``proxy_hook`` (the executable that programs the proxy), ``proxy_hook_timeout_s``,
    ``sysfs_root`` and ``fabric_p2p`` (the fabric carries GPU peer-to-peer traffic).
    ``brokers`` are the agent ports of the pool's brokers (``host:port[,host:port...]``;
    the agent holds a session with one at a time and fails over between them), reached
    over TLS when any of ``tls_ca``, ``tls_cert``, ``tls_key`` is given (mutual TLS with a
    certificate ``dxpool://agent/HOST``), with ``token_file``'s bearer token on brokers
    that take tokens.
    ``startup_timeout_s`` bounds how long the agent waits for a broker when it starts.
    ``drain_timeout_s`` is how long a released GPU that still runs compute processes is
    waited for before it is detached anyway.
    ``lease_ttl_s`` is the host's liveness TTL: the broker declares the host gone once no
    heartbeat of its agent has arrived for that long (the agent sends one every third).
    """

    host_id: str
    brokers: str = DEFAULT_BROKERS
    site: str = ""
    pod: str = ""
    rack: str = ""
    slot_capacity: int = 8
    labels: Mapping[str, str] = field(default_factory=dict)
    cpu_cores: int = 0
    memory_mib: int = 0
    driver: str = "sim"
    sim_state_dir: Path | None = None
    sim_map_delay_s: float = 0.0
    sim_hotplug_delay_s: float = 0.0
    sim_bind_delay_s: float = 0.0
    linux_ports: Mapping[int, str] = field(default_factory=dict)
    proxy_hook: Path | None = None
    proxy_hook_timeout_s: float = 30.0
    sysfs_root: Path = Path("/sys")
    fabric_p2p: bool = False
    lease_ttl_s: float = 10.0
    resync_interval_s: float = 30.0
    # How often a prober (if the driver has one) measures round trips to the boxes.
    probe_interval_s: float = 30.0
    attach_attempts: int = 3
    detach_attempts: int = 5
    drain_timeout_s: float = 300.0
    backoff_base_s: float = 0.2
    backoff_max_s: float = 10.0
    device_timeout_s: float = 30.0
    workers: int = 4
    startup_timeout_s: float = 60.0
    agent_endpoint: str = ""
    state_dir: Path | None = None
    # Redfish box-side mapping: the fabric map file (dxpool/redfish/fabric_map.py)
    # selects the Redfish proxy mapper in place of the driver's own.
    redfish_map: Path | None = None
    # TLS to the brokers: the CA that signed their certificates, and this agent's client
    # certificate (both or neither of cert and key); a bearer token file for brokers
    # that take tokens instead.
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_server_name: str | None = None
    token_file: Path | None = None

    @property
    def broker_endpoints(self) -> tuple[str, ...]:
        return parse_brokers(self.brokers)

    @property
    def broker_tls(self) -> ClientTls | None:
        """How to reach the brokers: TLS when any TLS setting or a token is given (a token
        never travels in plaintext), plaintext otherwise."""
        if (
            self.tls_ca is None
            and self.tls_cert is None
            and self.tls_key is None
            and self.token_file is None
        ):
            return None
        return ClientTls(
            ca=self.tls_ca, cert=self.tls_cert, key=self.tls_key, server_name=self.tls_server_name
        )

    def __post_init__(self) -> None:
        check_id(self.host_id, "host")
        _ = self.broker_endpoints
        _ = self.broker_tls  # a certificate without its key (or the reverse) is refused here
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))
        for key in self.labels:
            if not key or "=" in key:
                raise InvalidArgument(
                    f"invalid label key {key!r}: use a non-empty key without '=' (key=value)"
                )
        check_labels(self.labels)
        check_host_resources(self.cpu_cores, self.memory_mib)
        object.__setattr__(self, "linux_ports", MappingProxyType(dict(self.linux_ports)))
        for host_slot, bridge in self.linux_ports.items():
            if not 0 <= host_slot < self.slot_capacity:
                raise InvalidArgument(
                    f"linux port for host slot {host_slot} is outside the host's slots "
                    f"0-{self.slot_capacity - 1}; give a slot below slot_capacity"
                )
            if not BDF_PATTERN.match(bridge):
                raise InvalidArgument(
                    f"linux port {host_slot}={bridge!r}: the bridge must be a PCI address "
                    "domain:bus:device.function in lower-case hex, e.g. 0000:40:01.0"
                )
        _positive("proxy_hook_timeout_s", self.proxy_hook_timeout_s)
        _at_least("drain_timeout_s", self.drain_timeout_s, 0)
        _at_least("slot_capacity", self.slot_capacity, 1)
        if self.slot_capacity > MAX_HOST_SLOTS:
            raise InvalidArgument(
                f"slot_capacity {self.slot_capacity} is over the limit of {MAX_HOST_SLOTS} "
                "proxy slots per host; give the host's real number of slots"
            )
        _at_least("lease_ttl_s", self.lease_ttl_s, 1)
        _at_least("attach_attempts", self.attach_attempts, 1)
        _at_least("workers", self.workers, 1)
        for name in ("resync_interval_s", "probe_interval_s", "backoff_base_s", "device_timeout_s"):
            _positive(name, getattr(self, name))
        _positive("startup_timeout_s", self.startup_timeout_s)
        for name in ("sim_map_delay_s", "sim_hotplug_delay_s", "sim_bind_delay_s"):
            _at_least(name, getattr(self, name), 0)
        if self.backoff_max_s < self.backoff_base_s:
            raise InvalidArgument(
                f"backoff_max_s ({self.backoff_max_s:g}) must be >= backoff_base_s "
                f"({self.backoff_base_s:g})"
            )


def _at_least(name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum:g}, got {value:g}")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise InvalidArgument(f"{name} must be > 0, got {value:g}")


__all__ = ["DEFAULT_BROKERS", "AgentConfig", "parse_brokers"]
