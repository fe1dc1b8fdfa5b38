"""Forcing a commit to race another writer: the broker's commit is held after the change
read what it relies on, another writer (straight to etcd, as another broker or agent
would) changes one of those records, then the commit goes on and must lose its compare.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn


def meddle_before_commits(
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    races: Callable[[set[str]], bool],
    meddle: Callable[[], None],
    *,
    times: int,
) -> list[int]:
    """Have ``meddle`` run just before each of ``store``'s first ``times`` commits whose
    written keys ``races`` picks; returns the list that counts every such commit."""
    real_commit: Callable[[Txn], Any] = store.commit
    seen: list[int] = []

    def commit(txn: Txn) -> Any:
        if races({key for key, _ in txn.writes}):
            seen.append(len(seen))
            if len(seen) <= times:
                meddle()
        return real_commit(txn)

    monkeypatch.setattr(store, "commit", commit)
    return seen


def writing(key: str) -> Callable[[set[str]], bool]:
    """Picks the commits that write ``key``."""
    return lambda written: key in written


def rewrite_allocations(etcd_client: Any, schema: KeySchema, hosts: Collection[str]) -> None:
    """Write the hosts' allocations again as they are (an empty one where none is), so
    their revisions move and every compare on them fails."""
    for host in sorted(hosts):
        key = schema.host_allocation(host)
        raw, _ = etcd_client.get(key)
        empty = pb.HostAllocation(host=f"hosts/{host}").SerializeToString()
        etcd_client.put(key, raw if raw is not None else empty)
