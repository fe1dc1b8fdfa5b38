"""Launching a pool's processes for the Redfish end-to-end test: a broker fencing through
``--fabric redfish:MAP`` and host agents mapping through the Redfish mapper.

This is the one place that says how a broker and an agent are started and how an agent
reaches its broker's pool (today: the etcd endpoints and key prefix), so a change in how
agents connect is an edit here. Every process is stopped by its own process id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.redfish.mockup import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


@dataclass
class Process:
    """A child process with its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def kill(self) -> None:
        """SIGKILL and reap: a host or broker lost without a word."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class RedfishPool:
    """The processes of one pool: their etcd, key prefix and fabric map."""

    root: Path
    etcd: str
    prefix: str
    fabric_map: Path
    processes: list[Process] = field(default_factory=list)

    def start_broker(self) -> str:
        """A broker fencing at the map's fabric manager; returns its endpoint once it
        serves."""
        port = free_port()
        process = self._spawn(
            "broker",
            [sys.executable, "-m", "dxpool.broker", "--etcd", self.etcd, "--prefix",
             self.prefix, "--listen", f"127.0.0.1:{port}", "--insecure",
             "--fabric", f"redfish:{self.fabric_map}", "--attach-timeout", "60s"],
        )  # fmt: skip
        endpoint = f"127.0.0.1:{port}"
        _wait_serving(process, endpoint)
        return endpoint

    def start_agent(self, host: str, *, slots: int, store: str, lease_ttl_s: float) -> Process:
        """Host ``host``'s agent with the Redfish mapper, on a fake Linux host whose cards
        follow the zones at ``store`` (the Mockup Server, read straight)."""
        return self._spawn(
            f"agent-{host}",
            [sys.executable, "-m", "tests.redfish.host_agent", "--host", host, "--etcd",
             self.etcd, "--prefix", self.prefix, "--redfish-map", str(self.fabric_map),
             "--slots", str(slots), "--root", str(self.root / host), "--store", store,
             "--lease-ttl", str(lease_ttl_s)],
        )  # fmt: skip

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log()[-4000:]}" for p in self.processes)

    def _spawn(self, name: str, args: list[str]) -> Process:
        log_path = self.root / f"{name}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                args,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        started = Process(name, process, log_path)
        self.processes.append(started)
        return started


def _wait_serving(process: Process, endpoint: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(endpoint) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.process.poll() is not None:
                raise RuntimeError(f"the broker exited:\n{process.log()}")
            try:
                answer = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"the broker did not serve within {START_TIMEOUT_S:g}s:\n{process.log()}")


__all__ = ["Process", "RedfishPool"]
