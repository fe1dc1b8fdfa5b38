"""``python -m dxpool.broker`` (what ``dxpool broker`` runs) as a process."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc

from dxpool.store.embedded import EmbeddedEtcd, free_port
from tests.conftest import wait_until


def test_metrics_are_served_on_the_address_and_port_given(
    etcd_server: EmbeddedEtcd, key_prefix: str, tmp_path: Path
) -> None:
    port, metrics_port = free_port(), free_port()
    log = (tmp_path / "broker.log").open("wb")
    broker = subprocess.Popen(
        [sys.executable, "-m", "dxpool.broker", "--etcd", etcd_server.endpoint,
         "--prefix", key_prefix, "--listen", f"127.0.0.1:{port}",
         "--metrics-port", str(metrics_port), "--metrics-address", "127.0.0.1",
         "--log-level", "WARNING", "--insecure"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_until(lambda: _get(url) is not None, timeout_s=10, message="metrics served")
        body = _get(url) or ""
        assert "dxpool_release_total 0.0" in body
    finally:
        broker.terminate()
        broker.wait(30)
        log.close()


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None
