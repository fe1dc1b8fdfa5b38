from __future__ import annotations

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.store import MAX_TXN_OPS, Store, Txn
from dxpool.errors import InvalidArgument
from dxpool.store.keys import KeySchema


def test_txn_over_etcd_limit_is_refused_before_sending() -> None:
    txn = Txn()
    for index in range(MAX_TXN_OPS + 1):
        txn.expect_absent(f"/k/{index}")
    with pytest.raises(InvalidArgument, match="limit of 128"):
        txn.check_size()


def test_commit_compares_revisions(etcd_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    store = Store(etcd_client, KeySchema(key_prefix))
    key = store.keys.box("b1")
    first = store.commit(Txn().expect_absent(key).put(key, pb.Box(name="boxes/b1")))
    assert first.succeeded and first.revision > 0
    stale = store.commit(
        Txn().expect_absent(key).put(key, pb.Box(name="boxes/b1")).read_on_failure(key)
    )
    assert not stale.succeeded
    current = stale.current[key]
    assert current is not None and current.mod_revision == first.revision
    assert current.value.name == "boxes/b1"
    update = store.commit(Txn().expect_revision(key, first.revision).put(key, pb.Box(name="x")))
    assert update.succeeded and update.revision > first.revision
    record = store.get(key)
    assert record is not None and record.value.name == "x"
