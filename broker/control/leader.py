"""Leader election through etcd, for the broker's singleton duties.

Leadership is a key, ``elections/{duty}``, created on a lease only if absent (one
transaction comparing ``create_revision == 0``) and kept while the lease is kept alive.
A broker that cannot refresh its lease within ``ttl_s / 3`` steps down at once (before
the lease can expire), and the others take over when the key goes (the lease expires,
or the leader revokes it when it stops).

Leadership here is for efficiency, not safety: every duty commits compare-and-swap
transactions and every fabric action carries a fencing token (the GPU's generation), so
two brokers that both believe they lead for a moment still cannot corrupt anything.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import etcd3
from etcd3 import transactions

from dxpool.broker.state import metrics
from dxpool.errors import Unavailable
from dxpool.store.typed import Store, key_holder

log = logging.getLogger(__name__)


class LeaderElection:
    """Campaigns for ``key`` as ``identity`` in a daemon thread; ``is_leader()`` any time."""

    def __init__(self, store: Store, key: str, identity: str, *, ttl_s: float = 5.0) -> None:
        self._store = store
        self._client = store.client
        self._key = key
        self._identity = identity
        self._ttl = max(2, math.ceil(ttl_s))
        self._leading = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease: Any = None

    @property
    def identity(self) -> str:
        return self._identity

    def is_leader(self) -> bool:
        return self._leading.is_set()

    def wait_until_leader(self, timeout_s: float) -> bool:
        return self._leading.wait(timeout_s)

    def start(self) -> None:
        """Campaign once now (so a lone broker leads as soon as it serves), then keep
        campaigning or refreshing in a daemon thread."""
        try:
            self._campaign()
        except Exception as error:
            log.warning("first leader campaign failed", extra={"error": repr(error)})
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; a leader resigns (revokes its lease) so another takes over
        at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._step_down(resign=True)

    def _run(self) -> None:
        interval = self._ttl / 3
        while not self._stop.is_set():
            try:
                if self._leading.is_set():
                    self._refresh()
                else:
                    self._campaign()
            except (Unavailable, Exception) as error:
                if self._leading.is_set():
                    log.warning("leadership lost", extra={"error": repr(error)})
                self._step_down(resign=False)
            self._stop.wait(interval)

    def _campaign(self) -> None:
        lease = self._store.call(lambda: self._client.lease(self._ttl), write=True)
        won, responses = self._store.call(
            lambda: self._client.transaction(
                compare=[transactions.Create(self._key) == 0],
                success=[transactions.Put(self._key, self._identity, lease=lease)],
                failure=[transactions.Get(self._key)],
            ),
            write=True,
        )
        if won:
            self._lead(lease, "elected leader")
            return
        self._store.call(lease.revoke, write=True)
        holder, value = key_holder(responses)
        if holder and value == self._identity.encode():
            self._reclaim(holder)

    def _reclaim(self, lease_id: int) -> None:
        """The key is still ours, on a lease we stepped down from while etcd was away:
        lead again at once if that lease lives, rather than leave every duty idle until
        it expires (etcd extends leases when it restarts)."""
        lease = etcd3.Lease(lease_id, self._ttl, etcd_client=self._client)
        responses = self._store.call(lease.refresh, write=False)
        if responses and responses[0].TTL > 0:
            self._lead(lease, "leadership resumed on its own lease")

    def _lead(self, lease: Any, message: str) -> None:
        self._lease = lease
        self._deadline = time.monotonic() + self._ttl * 2 / 3
        self._leading.set()
        metrics.LEADER.set(1)
        log.info(message, extra={"key": self._key, "identity": self._identity})

    def _refresh(self) -> None:
        if time.monotonic() > self._deadline:
            raise Unavailable("leader lease not refreshed in time", reason="LEASE_LOST")
        # A keepalive changes nothing a second one would not: safe to resend elsewhere.
        responses = self._store.call(self._lease.refresh, write=False)
        if not responses or responses[0].TTL <= 0:
            raise Unavailable("leader lease expired", reason="LEASE_LOST")
        self._deadline = time.monotonic() + self._ttl * 2 / 3

    def _step_down(self, *, resign: bool) -> None:
        was_leading = self._leading.is_set()
        self._leading.clear()
        if was_leading:
            metrics.LEADER.set(0)
        lease, self._lease = self._lease, None
        if lease is not None and resign:
            try:
                lease.revoke()
            except Exception:
                log.debug("lease revoke failed", exc_info=True)
        if was_leading:
            log.info("stepped down", extra={"key": self._key})


__all__ = ["LeaderElection"]
