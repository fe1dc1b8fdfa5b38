"""etcd client construction with the settings dxpool relies on.

``python3-etcd3`` has pitfalls this module handles once for everyone:

* ``etcd3.client()`` marks its endpoint failed for 300 s after a single error; we build a
  ``MultiEndpointEtcd3Client`` whose endpoints are retried after ``retry_after`` seconds.
* Without a client timeout a write that lacks quorum blocks for ~7 s; we always set one.
* ``transaction()`` needs an explicit ``failure=[]`` (callers pass it).
* A watch that ends kills its thread with a NameError; see ``_etcd3_compat``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import etcd3

from dxpool.errors import InvalidArgument
from dxpool.store import _etcd3_compat  # noqa: F401 - patches a watch defect on import

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRY_AFTER_S = 0.5
# ASCII digits only: str.isdigit() also accepts '³', which int() then rejects.
_PORT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True)
class EtcdAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(value: str) -> list[EtcdAddress]:
    """Parse ``"host:port[,host:port...]"`` (an ``http://`` scheme is accepted)."""
    addresses = []
    for raw in value.split(","):
        item = raw.strip().removeprefix("http://")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
            raise InvalidArgument(
                f"invalid etcd endpoint {raw.strip()!r}: expected host:port, "
                "e.g. 127.0.0.1:2379 (separate several with commas)"
            )
        addresses.append(EtcdAddress(host, int(port)))
    return addresses


def connect(
    endpoints: str | list[EtcdAddress],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry_after_s: float = DEFAULT_RETRY_AFTER_S,
) -> etcd3.MultiEndpointEtcd3Client:
    """Return a client over every endpoint, failing over between them."""
    addresses = parse_endpoints(endpoints) if isinstance(endpoints, str) else endpoints
    return etcd3.MultiEndpointEtcd3Client(
        endpoints=[
            etcd3.Endpoint(a.host, a.port, secure=False, time_retry=retry_after_s)
            for a in addresses
        ],
        timeout=timeout_s,
        failover=True,
    )
