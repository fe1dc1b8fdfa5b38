"""Configuration of one host agent."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from dxpool.errors import InvalidArgument
from dxpool.hostagent.driver import BDF_PATTERN
from dxpool.limits import MAX_HOST_SLOTS
from dxpool.names import check_id
from dxpool.request import check_host_resources
from dxpool.store.client import parse_endpoints
from dxpool.store.keys import DEFAULT_PREFIX, KeySchema
from dxpool.text import check_labels
from dxpool.tls import ClientTls

DEFAULT_ETCD_ENDPOINTS = "127.0.0.1:2379"


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
    ``startup_timeout_s`` bounds how long the agent waits for etcd when it starts.
    ``drain_timeout_s`` is how long a released GPU that still runs compute processes is
    waited for before it is detached anyway.
    ``lease_ttl_s`` is rounded up to whole seconds, the unit of etcd leases.
    """

    host_id: str
    etcd_endpoints: str = DEFAULT_ETCD_ENDPOINTS
    key_prefix: str = DEFAULT_PREFIX
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
    # TLS to etcd: the CA that signed etcd's certificate, and a client certificate for
    # etcd's --client-cert-auth (both or neither of cert and key).
    etcd_ca: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None

    @property
    def etcd_tls(self) -> ClientTls | None:
        """How to reach etcd: TLS when any etcd TLS file is given, plaintext otherwise."""
        if self.etcd_ca is None and self.etcd_cert is None and self.etcd_key is None:
            return None
        return ClientTls(ca=self.etcd_ca, cert=self.etcd_cert, key=self.etcd_key)

    def __post_init__(self) -> None:
        check_id(self.host_id, "host")
        parse_endpoints(self.etcd_endpoints)
        _ = self.etcd_tls  # a certificate without its key (or the reverse) is refused here
        try:
            KeySchema(self.key_prefix)
        except ValueError as error:
            raise InvalidArgument(f"invalid key_prefix: {error}") from error
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
        _at_least("lease_ttl_s", self.lease_ttl_s, 2)
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

    @property
    def keys(self) -> KeySchema:
        return KeySchema(self.key_prefix)


def _at_least(name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum:g}, got {value:g}")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise InvalidArgument(f"{name} must be > 0, got {value:g}")


__all__ = ["DEFAULT_ETCD_ENDPOINTS", "AgentConfig"]
