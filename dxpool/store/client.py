"""etcd client construction with the settings dxpool relies on.

``python3-etcd3`` has pitfalls this module handles once for everyone:

* ``etcd3.client()`` marks its endpoint failed for 300 s after a single error; we build a
  ``MultiEndpointEtcd3Client`` whose endpoints are retried after ``retry_after`` seconds.
* Without a client timeout a write that lacks quorum blocks for ~7 s; we always set one,
  and every call carries etcd's *require leader* metadata (what Go's
  ``clientv3.WithRequireLeader`` sends), so a member without a leader refuses at once
  ("etcdserver: no leader") instead of holding the call, and cancels watch streams when it
  loses its leader instead of leaving them silently stale.
* gRPC's default reconnect backoff grows to two minutes, so after an etcd restart a client
  could wait many seconds before it even tries again; our channels retry the connection
  at least every :data:`MAX_RECONNECT_BACKOFF_MS` and probe idle streams with keepalives.
* ``transaction()`` needs an explicit ``failure=[]`` (callers pass it).
* A watch that ends kills its thread with a NameError; see ``_etcd3_compat``.
* Failover does not retry the failed call; callers retry (``dxpool/store/typed.py``), and a
  watch that must survive member loss uses :mod:`dxpool.store.watch`.
* A failed call pauses the member the client is *using* when the failure comes back, not
  the member the call went to, so a slow call that fails late (a read begun before an
  election) pauses a healthy member; with every member paused the client refuses calls
  outright. :func:`pause_left_s` says how long such a refusal would last, so callers can
  wait it out (``retry_after_s`` at most) instead of failing.

TLS: an :class:`EtcdAddress` may carry a :class:`~dxpool.tls.ClientTls` (the CA that
signed etcd's certificate, and the client certificate etcd's ``--client-cert-auth``
asks for). Every channel to that member, the client's and the watch's alike, is then a
TLS channel; a client made by :func:`connect` keeps its addresses, TLS included, so
:func:`addresses_of` hands them on unchanged.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Final

import etcd3
import grpc

from dxpool.errors import InvalidArgument
from dxpool.store import _etcd3_compat  # noqa: F401 - patches a watch defect on import
from dxpool.tls import ClientTls

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRY_AFTER_S = 0.25
# ASCII digits only: str.isdigit() also accepts '³', which int() then rejects.
_PORT = re.compile(r"[0-9]{1,5}")

MAX_RECONNECT_BACKOFF_MS: Final = 500
# etcd refuses (GOAWAY "too_many_pings") clients that ping more often than its
# --grpc-keepalive-min-time, 5 s by default; 6 s stays clear of it.
KEEPALIVE_TIME_MS: Final = 6000
KEEPALIVE_TIMEOUT_MS: Final = 2000

CHANNEL_OPTIONS: Final[list[tuple[str, int]]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]

# etcd's rpctypes.MetadataRequireLeaderKey / MetadataHasLeader.
REQUIRE_LEADER: Final[tuple[tuple[str, str], ...]] = (("hasleader", "true"),)


@dataclass(frozen=True)
class EtcdAddress:
    host: str
    port: int
    # None: plaintext. Not part of the address's identity (two equal addresses are one
    # member), so it takes no part in equality.
    tls: ClientTls | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(value: str, tls: ClientTls | None = None) -> list[EtcdAddress]:
    """Parse ``"host:port[,host:port...]"`` (an ``http://`` or ``https://`` scheme is
    accepted; TLS is what ``tls`` says, not the scheme)."""
    addresses = []
    for raw in value.split(","):
        item = raw.strip().removeprefix("http://").removeprefix("https://")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
            raise InvalidArgument(
                f"invalid etcd endpoint {raw.strip()!r}: expected host:port, "
                "e.g. 127.0.0.1:2379 (separate several with commas)"
            )
        addresses.append(EtcdAddress(host, int(port), tls))
    return addresses


def addresses_of(
    source: etcd3.MultiEndpointEtcd3Client | str | list[EtcdAddress],
) -> list[EtcdAddress]:
    """The endpoints of a client built by :func:`connect`, of an endpoint string, or a list."""
    if isinstance(source, str):
        return parse_endpoints(source)
    if isinstance(source, list):
        return list(source)
    kept: list[EtcdAddress] | None = getattr(source, "dxpool_addresses", None)
    if kept is not None:
        return list(kept)
    return parse_endpoints(",".join(source.endpoints))


def channel(address: EtcdAddress) -> grpc.Channel:
    """A gRPC channel to one member (TLS when the address says so), with the reconnect
    and keepalive settings."""
    if address.tls is None:
        return grpc.insecure_channel(str(address), options=CHANNEL_OPTIONS)
    return grpc.secure_channel(
        str(address),
        address.tls.credentials(),
        options=[*CHANNEL_OPTIONS, *address.tls.channel_options()],
    )


def connect(
    endpoints: str | list[EtcdAddress],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry_after_s: float = DEFAULT_RETRY_AFTER_S,
    tls: ClientTls | None = None,
) -> etcd3.MultiEndpointEtcd3Client:
    """Return a client over every endpoint, failing over between them.

    Every call gives up after ``timeout_s``; a member that failed a call is skipped for
    ``retry_after_s`` while others are tried. ``tls`` applies to endpoints given as a
    string; addresses bring their own. A TLS file that cannot be read raises
    InvalidArgument naming it.
    """
    addresses = parse_endpoints(endpoints, tls) if isinstance(endpoints, str) else endpoints
    client = etcd3.MultiEndpointEtcd3Client(
        endpoints=[_endpoint(a, retry_after_s) for a in addresses],
        timeout=timeout_s,
        failover=True,
    )
    # python3-etcd3 sends ``metadata`` with every call (it exists for auth tokens).
    client.metadata = REQUIRE_LEADER
    client.dxpool_addresses = list(addresses)  # for addresses_of: TLS included
    return client


def pause_left_s(client: etcd3.MultiEndpointEtcd3Client) -> float:
    """Seconds until the first member of ``client`` leaves its after-failure pause; 0 when
    one can be called now. Never more than the ``retry_after_s`` the client was made with."""
    now = time.time()  # python3-etcd3 stamps failures with the wall clock
    members = client.endpoints.values()
    left = min((member.last_failed + member.time_retry - now for member in members), default=0.0)
    return max(0.0, left)


def _endpoint(address: EtcdAddress, retry_after_s: float) -> etcd3.Endpoint:
    tls = address.tls
    # python3-etcd3 annotates ``opts`` as a dict, but grpc wants (name, value) pairs.
    options = [*CHANNEL_OPTIONS, *(tls.channel_options() if tls else [])]
    return etcd3.Endpoint(
        address.host,
        address.port,
        secure=tls is not None,
        creds=tls.credentials() if tls is not None else None,
        time_retry=retry_after_s,
        opts=options,
    )
