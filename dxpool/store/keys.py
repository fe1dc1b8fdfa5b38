"""The etcd key schema. Every key dxpool writes is built here and nowhere else.

All keys sit under one prefix (default ``/dxpool/v1/``) so several pools, or several
test runs, can share an etcd cluster. Values are serialized protobuf messages of
``dxpool.api.v1.resources_pb2`` (the type is fixed per collection, see ``COLLECTIONS``).

=====================================  ====================  ===========  ===============
key (below the prefix)                 value                 written by   lifetime
=====================================  ====================  ===========  ===============
``boxes/{box}``                        Box                   broker       until deleted
``gpus/{box}/{slot}``                  Gpu (spec + state)    broker       with its box
``hosts/{host}``                       Host (registration)   broker, for  persistent
                                                             the agent
``hostleases/{host}``                  HostLiveness          broker       on the broker's etcd
                                                                          lease, while the host's
                                                                          agent holds a session:
                                                                          the host is alive while
                                                                          it exists
``hostalloc/{host}``                   HostAllocation        broker       spec: desired GPUs
``hoststatus/{host}``                  HostStatus            broker, for  status: observed GPUs
                                                             the agent
``nodes/{node}``                       VirtualNode           broker       until deleted
``requests/{request_id}``              node or box name      broker       with its node
                                       (utf-8)                            or box
``tenants/{tenant}``                   Tenant (quota +       broker       persistent
                                       usage)
``gangs/{gang}``                       GangRecord            broker       until its members
                                                                          are collected
``elections/{duty}``                   broker id (utf-8)     broker       etcd lease: the leader
                                                                          of a singleton duty
``brokers/{broker id}``                agent endpoint        broker       on the broker's agent
                                       (utf-8)                            lease: the broker holds
                                                                          agent sessions
=====================================  ====================  ===========  ===============

Spec and status are apart: ``hostalloc`` is the brokers' own; ``hoststatus`` holds only
what the host's agent reported, written by the broker that holds its session. Agents
never touch etcd.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "/dxpool/v1/"

BOXES = "boxes"
GPUS = "gpus"
HOSTS = "hosts"
HOST_LEASES = "hostleases"
HOST_ALLOCATIONS = "hostalloc"
HOST_STATUSES = "hoststatus"
NODES = "nodes"
REQUESTS = "requests"
ELECTIONS = "elections"
TENANTS = "tenants"
BROKERS = "brokers"
GANGS = "gangs"

COLLECTIONS = (
    BOXES,
    GPUS,
    HOSTS,
    HOST_LEASES,
    HOST_ALLOCATIONS,
    HOST_STATUSES,
    NODES,
    REQUESTS,
    TENANTS,
    BROKERS,
    GANGS,
)


@dataclass(frozen=True)
class KeySchema:
    """Builds and parses keys under one prefix. ``prefix`` must end with ``/``."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or not self.prefix.endswith("/"):
            raise ValueError(f"etcd key prefix {self.prefix!r} must start and end with '/'")

    def collection(self, name: str) -> str:
        """The prefix of one collection, e.g. ``/dxpool/v1/gpus/``."""
        return f"{self.prefix}{name}/"

    def key(self, collection: str, name: str) -> str:
        """The key of record ``name`` in ``collection`` (the inverse of :meth:`split`)."""
        return f"{self.prefix}{collection}/{name}"

    def box(self, box_id: str) -> str:
        return f"{self.prefix}{BOXES}/{box_id}"

    def gpu(self, box_id: str, slot: int) -> str:
        return f"{self.prefix}{GPUS}/{box_id}/{slot}"

    def box_gpus(self, box_id: str) -> str:
        return f"{self.prefix}{GPUS}/{box_id}/"

    def host(self, host_id: str) -> str:
        return f"{self.prefix}{HOSTS}/{host_id}"

    def host_lease(self, host_id: str) -> str:
        return f"{self.prefix}{HOST_LEASES}/{host_id}"

    def host_allocation(self, host_id: str) -> str:
        return f"{self.prefix}{HOST_ALLOCATIONS}/{host_id}"

    def host_status(self, host_id: str) -> str:
        return f"{self.prefix}{HOST_STATUSES}/{host_id}"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}{NODES}/{node_id}"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}{REQUESTS}/{request_id}"

    def tenant(self, tenant_id: str) -> str:
        return f"{self.prefix}{TENANTS}/{tenant_id}"

    def broker(self, broker_id: str) -> str:
        """A broker's registration while it holds agent sessions: on the same etcd lease
        as their liveness records, so both go together when the broker dies."""
        return f"{self.prefix}{BROKERS}/{broker_id}"

    def gang(self, gang_id: str) -> str:
        return f"{self.prefix}{GANGS}/{gang_id}"

    def election(self, duty: str) -> str:
        """The key a broker holds (on its lease) while it performs a singleton ``duty``.
        Outside the collections: the cache does not mirror it."""
        return f"{self.prefix}{ELECTIONS}/{duty}"

    @property
    def audit_prefix(self) -> str:
        """``/dxpool/v1/`` -> ``/dxpool/v1-audit/``: where the brokers keep the audit log,
        beside the pool's keys rather than under them (the cache never lists it)."""
        return self.prefix.rstrip("/") + "-audit/"

    def split(self, key: str) -> tuple[str, str]:
        """``/dxpool/v1/gpus/b1/3`` -> ``("gpus", "b1/3")``. ValueError if foreign."""
        if not key.startswith(self.prefix):
            raise ValueError(f"key {key!r} is not under prefix {self.prefix!r}")
        collection, _, rest = key[len(self.prefix) :].partition("/")
        if collection not in COLLECTIONS or not rest:
            raise ValueError(f"key {key!r} is not in a known collection")
        return collection, rest
