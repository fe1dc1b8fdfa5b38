"""The local pool's etcd child: its record in ``run/`` lasts exactly as long as etcd may
still run."""

from __future__ import annotations

from pathlib import Path

import pytest

from dxpool.cli.localpool import _EtcdChild
from dxpool.cli.statedir import ChildRecords
from dxpool.store.embedded import EmbeddedEtcd


def test_an_etcd_that_outlives_its_stop_keeps_its_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = ChildRecords(tmp_path)
    etcd = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True)
    child = _EtcdChild(etcd, records)
    record = tmp_path / "run" / "etcd.json"
    child.start()
    try:
        assert record.exists()
        # etcd blocked in the kernel outlives SIGKILL: stop gives up (see its test)
        monkeypatch.setattr(etcd, "stop", lambda timeout_s=10.0: False)
        child.stop()
        assert record.exists(), "the next `dxpool up` must still find it"
        monkeypatch.undo()
        child.stop()
        assert not record.exists()
    finally:
        etcd.kill()
