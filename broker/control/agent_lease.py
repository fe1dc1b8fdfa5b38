"""The broker's own etcd lease, which carries the liveness records of the agents it serves.

One lease per broker process, whatever the number of agents: granted when the first
session needs it, refreshed every ``ttl_s / 3`` by :meth:`BrokerLease.tick`. When etcd
says the lease expired, or no refresh has succeeded for its whole TTL (so by etcd's clock
it has expired, unless etcd itself was down and extends it when it comes back), the lease
is *lost*: :attr:`on_lost` is called once, so the sessions whose records it carried end
and their agents move to a broker that reaches etcd, and the next session grants a new
lease. A slow etcd that fails refreshes for a while, but less than the TTL, costs
nothing: the lease lives, and ending thousands of sessions for it would only make every
agent reconnect at once.

The lease is never revoked on purpose, not even when the broker stops: its records then
outlive the broker by up to the TTL, time for its agents to reconnect to another broker,
which takes each record over in a transaction (a revoke would make every one of those
hosts look lost at once).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from dxpool.errors import Unavailable
from dxpool.store.typed import Store

log = logging.getLogger(__name__)

DEFAULT_BROKER_LEASE_TTL_S = 15.0


class BrokerLease:
    """Grants, refreshes and notices the loss of one etcd lease; thread-safe."""

    def __init__(
        self,
        store: Store,
        ttl_s: float = DEFAULT_BROKER_LEASE_TTL_S,
        *,
        on_lost: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._ttl = max(2, math.ceil(ttl_s))
        self._on_lost = on_lost
        self._clock = clock
        self._lock = threading.Lock()
        self._grant_lock = threading.Lock()
        self._lease: Any = None
        self._refreshed_at = 0.0

    @property
    def ttl_s(self) -> int:
        return self._ttl

    def current(self) -> Any:
        """The lease (an ``etcd3.Lease``), granted now if there is none. Raises
        :class:`~dxpool.errors.Unavailable` when etcd cannot grant one."""
        with self._grant_lock:  # one grant at a time: the others wait and share it
            with self._lock:
                lease = self._lease
            if lease is not None:
                return lease
            lease = self._store.call(lambda: self._store.client.lease(self._ttl), write=True)
            with self._lock:
                self._lease, self._refreshed_at = lease, self._clock()
            log.info("broker lease granted", extra={"lease": f"{int(lease.id):x}"})
            return lease

    @property
    def lease_id(self) -> int | None:
        with self._lock:
            return int(self._lease.id) if self._lease is not None else None

    def tick(self) -> None:
        """Refresh the lease when a third of its TTL has passed since the last refresh;
        declare it lost when etcd says it expired or refreshes have failed for too
        long. Call it often (every fraction of a second)."""
        with self._lock:
            lease, refreshed_at = self._lease, self._refreshed_at
        if lease is None:
            return
        now = self._clock()
        if now - refreshed_at < self._ttl / 3:
            return
        try:
            # A keepalive changes nothing a second one would not: safe to resend elsewhere.
            responses = self._store.call(lease.refresh, write=False)
        except Unavailable as error:
            if now - refreshed_at >= self._ttl:
                self._lose(lease, f"not refreshed for {now - refreshed_at:.1f}s ({error.message})")
            return
        if not responses or responses[0].TTL <= 0:
            self._lose(lease, "etcd says it expired")
            return
        with self._lock:
            if self._lease is lease:
                self._refreshed_at = now

    def _lose(self, lease: Any, reason: str) -> None:
        with self._lock:
            if self._lease is not lease:
                return
            self._lease = None
        log.warning("broker lease lost", extra={"lease": f"{int(lease.id):x}", "reason": reason})
        self._on_lost(reason)


__all__ = ["DEFAULT_BROKER_LEASE_TTL_S", "BrokerLease"]
