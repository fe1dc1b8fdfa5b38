"""Host registration and liveness.

``hosts/{host}`` holds the Host record; it is persistent (no lease) so the inventory
remembers a host while its agent is down. ``hostleases/{host}`` is an empty key attached
to an etcd lease the agent keeps alive: the host is alive exactly while that key exists.

* A keep-alive thread refreshes the lease every ``ttl / 3`` seconds. When it finds the
  lease expired (etcd unreachable for longer than the TTL), it grants a new lease and puts
  the key again.
* :meth:`HostRegistration.stop` revokes the lease, so the host shows as gone at once; a
  crashed agent's key disappears when the lease expires, within the TTL.
* The liveness key is created only if absent (one transaction), so exactly one agent
  holds a host: a second agent for the same host - or a restarted one while its crashed
  predecessor's lease lives - gets :class:`HostHeldError` until that lease is gone. The
  agent's status writes compare this lease, so only the holder can write status.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import etcd3
import etcd3.exceptions
import grpc
from etcd3 import transactions

from dxpool.api.v1 import resources_pb2
from dxpool.errors import Unavailable
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.status import now_timestamp
from dxpool.names import host_name
from dxpool.store.typed import Store, Txn, key_holder

log = logging.getLogger(__name__)

ETCD_ERRORS: tuple[type[BaseException], ...] = (
    etcd3.exceptions.Etcd3Exception,
    grpc.RpcError,
    Unavailable,
)


class HostHeldError(Exception):
    """Another live lease holds the host's liveness key."""


def host_record(config: AgentConfig) -> resources_pb2.Host:
    """The Host record an agent registers (output-only fields left unset)."""
    return resources_pb2.Host(
        name=host_name(config.host_id),
        location=resources_pb2.Location(site=config.site, pod=config.pod, rack=config.rack),
        agent_endpoint=config.agent_endpoint,
        slot_capacity=config.slot_capacity,
        labels=dict(config.labels),
        driver=config.driver,
        cpu_cores=config.cpu_cores,
        memory_mib=config.memory_mib,
        register_time=now_timestamp(),
    )


class HostRegistration:
    """Registers one host and keeps its liveness lease alive from a daemon thread."""

    def __init__(self, store: Store | Any, config: AgentConfig, token: str = "") -> None:
        """``store``: the agent's :class:`Store` (or an etcd client to build one on); every
        etcd call goes through it, so failures are :class:`Unavailable` and fail over
        between members like the broker's."""
        self._store = store if isinstance(store, Store) else Store(store, config.keys)
        self._client = self._store.client
        self._config = config
        self._token = token.encode()
        self._keys = config.keys
        self._lease: Any = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lease_id(self) -> int | None:
        with self._lock:
            return int(self._lease.id) if self._lease is not None else None

    def register(self) -> None:
        """Put the Host record and the liveness key. Raises etcd client errors.

        Safe to repeat (a retried startup): a lease already held is refreshed, or replaced
        if it expired, rather than granted again.
        """
        record = host_record(self._config)
        self._store.commit(Txn().put(self._keys.host(self._config.host_id), record))
        self.keep_alive_once()
        log.info(
            "host registered",
            extra={"host": self._config.host_id, "lease_ttl_s": self._config.lease_ttl_s},
        )

    def _renew_lease(self) -> None:
        """Grant a lease and create the liveness key on it, only if no one holds it.

        Raises :class:`HostHeldError` (after revoking the new lease) when it is held."""
        ttl = math.ceil(self._config.lease_ttl_s)
        lease = self._store.call(lambda: self._client.lease(ttl), write=True)
        key = self._keys.host_lease(self._config.host_id)
        # Raw, not a Txn: the failure branch needs the holder's lease id, which typed
        # records do not carry.
        created, responses = self._store.call(
            lambda: self._client.transaction(
                compare=[transactions.Create(key) == 0],
                success=[transactions.Put(key, self._token, lease=lease)],
                failure=[transactions.Get(key)],
            ),
            write=True,
        )
        if not created:
            self._store.call(lease.revoke, write=True)
            holder, value = key_holder(responses)
            if self._token and value == self._token and self._adopt(holder, ttl):
                return
            raise HostHeldError(
                f"host {self._config.host_id} is held by another live agent (lease "
                f"{holder:x}); stop that agent, or wait up to {ttl}s for its lease to expire"
            )
        with self._lock:
            self._lease = lease

    def _adopt(self, lease_id: int, ttl: int) -> bool:
        """Take over our own previous incarnation's lease, if it is still alive."""
        lease = etcd3.Lease(lease_id, ttl, etcd_client=self._client)
        responses = self._store.call(lease.refresh, write=False)
        if not responses or responses[0].TTL <= 0:
            return False
        with self._lock:
            self._lease = lease
        log.info(
            "adopted the live lease of this agent's previous run",
            extra={"host": self._config.host_id, "lease": f"{lease_id:x}"},
        )
        return True

    def start_keepalive(self) -> None:
        """Start the keep-alive thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._keepalive_loop, name="dxpool-lease-keepalive", daemon=True
        )
        self._thread.start()

    def _keepalive_loop(self) -> None:
        interval = self._config.lease_ttl_s / 3
        while not self._stopping.wait(interval):
            try:
                self.keep_alive_once()
            except ETCD_ERRORS as error:
                log.warning("lease keep-alive failed", extra={"error": repr(error)})
            except HostHeldError as error:
                log.error("host taken over by another agent", extra={"error": str(error)})

    def keep_alive_once(self) -> bool:
        """Refresh the lease; when there is none or it expired, grant a new one and put the
        liveness key again. True if the lease was alive."""
        with self._lock:
            lease = self._lease
        if lease is None:
            self._renew_lease()
            return False
        # A keepalive changes nothing a second one would not: safe to resend elsewhere.
        responses = self._store.call(lease.refresh, write=False)
        if responses and responses[0].TTL > 0:
            return True
        log.warning("host lease expired; granting a new one", extra={"host": self._config.host_id})
        self._renew_lease()
        return False

    def stop(self, *, revoke: bool = True) -> None:
        """Stop the keep-alive thread and (by default) revoke the lease so the host shows
        as gone at once. Idempotent; etcd errors on revoke are logged, not raised."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            lease, self._lease = self._lease, None
        if revoke and lease is not None:
            try:
                self._store.call(lease.revoke, write=True)
            except ETCD_ERRORS as error:
                log.warning("lease revoke failed", extra={"error": repr(error)})


__all__ = ["ETCD_ERRORS", "HostHeldError", "HostRegistration", "host_record"]
