"""A mutation's audit record, committed in the mutation's own transaction.

For each audited call the :class:`~dxpool.broker.api.audit.AuditRecorder` opens a pending
record in a context variable (gRPC's sync server runs the interceptor and the servicer
in one thread, so the servicer sees it). Code that commits the call's mutation puts the
record of a successful answer into its transaction with :func:`record_in` and calls
what that returns once the transaction committed; the recorder then writes nothing
more for a call that ends OK. The record is then stored if and only if the mutation
is, and the call's path holds no second etcd round trip for it.

A transaction that fails its compares stores neither, and a later attempt puts a new
record in. A call whose mutation committed but that then ends with an error (nothing in
the broker does so today) gets a second record saying how it ended.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from dxpool.store.typed import Txn


@dataclass(slots=True)
class PendingRecord:
    """The current call's record, not stored yet. ``prepare(response)`` gives the etcd
    key and bytes of the record of the call answered OK with ``response``."""

    prepare: Callable[[Any], tuple[str, bytes]]
    committed: bool = False


CURRENT: ContextVar[PendingRecord | None] = ContextVar("dxpool_audit_pending", default=None)
"""The pending record of the audited call this thread serves, if any."""


def record_in(txn: Txn, response: Any) -> Callable[[], None] | None:
    """Puts the current call's record, as answered OK with ``response``, into ``txn``.
    Returns what to call once ``txn`` committed; None (``txn`` untouched) when no
    audited call is being served or its record is stored already."""
    pending = CURRENT.get()
    if pending is None or pending.committed:
        return None
    key, data = pending.prepare(response)
    txn.put(key, data)

    def stored() -> None:
        pending.committed = True

    return stored


__all__ = ["CURRENT", "PendingRecord", "record_in"]
