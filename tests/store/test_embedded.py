"""The etcd test helpers themselves: a member keeps its data across kill and restart, a
cluster can name and move its leader, and a stop is bounded."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, EtcdCluster


def test_killed_member_restarts_on_its_data_and_port(private_etcd: EmbeddedEtcd) -> None:
    client = connect(private_etcd.endpoint, timeout_s=2)
    try:
        client.put("/kept", b"v")
        endpoint = private_etcd.endpoint
        private_etcd.kill()
        assert not private_etcd.running
        private_etcd.start()
        assert private_etcd.endpoint == endpoint
        value, _ = client.get("/kept")
        assert value == b"v"
    finally:
        client.close()


def test_stop_ends_etcd_and_says_so(private_etcd: EmbeddedEtcd) -> None:
    assert private_etcd.stop(timeout_s=10) is True
    assert not private_etcd.running


def test_stop_is_bounded_when_etcd_outlives_its_sigkill(
    private_etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    process = private_etcd._process
    assert process is not None
    real_wait = process.wait

    def held_in_the_kernel(timeout: float | None = None) -> int:
        """A process blocked in an uninterruptible wait: no signal ends it for now."""
        raise subprocess.TimeoutExpired(process.args, timeout or 0)

    monkeypatch.setattr(process, "wait", held_in_the_kernel)
    with caplog.at_level(logging.WARNING, logger="dxpool.store.embedded"):
        assert private_etcd.stop(timeout_s=0.1) is False
    assert "did not end after SIGKILL" in caplog.text
    assert [getattr(record, "pid", None) for record in caplog.records] == [process.pid]
    monkeypatch.undo()
    # the signals were sent: once the kernel lets it go, it ends
    assert real_wait(30) in (-signal.SIGTERM, -signal.SIGKILL)


def test_cluster_names_and_moves_its_leader(etcd_cluster: EtcdCluster) -> None:
    leader = etcd_cluster.leader()
    target = next(m for m in etcd_cluster.members if m is not leader)
    etcd_cluster.move_leader(target)
    assert etcd_cluster.leader() is target
    assert len(etcd_cluster.endpoints.split(",")) == 3


def test_first_start_picks_other_ports_when_its_own_are_taken(tmp_path: Path) -> None:
    server = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True)
    taken = server.client_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
        try:
            assert server.client_port != taken
            client = connect(server.endpoint, timeout_s=2)
            client.put("/k", b"v")
            client.close()
        finally:
            server.kill()


def test_restart_keeps_its_port_and_says_when_it_is_taken(private_etcd: EmbeddedEtcd) -> None:
    private_etcd.kill()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        squatter.bind(("127.0.0.1", private_etcd.client_port))
        squatter.listen()
        with pytest.raises(RuntimeError, match="etcd exited"):
            private_etcd.start(timeout_s=5)


def test_never_mistakes_another_etcd_on_its_port_for_itself(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    impostor = EmbeddedEtcd(tmp_path / "etcd", client_port=etcd_server.client_port)
    with pytest.raises(RuntimeError, match=r"another etcd answers|etcd exited"):
        impostor.start(timeout_s=5)
    assert not impostor.running
