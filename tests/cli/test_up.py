"""``dxpool up`` as a real process: start, compose a node with the CLI, Ctrl-C, nothing left;
and supervision: children restarted, none outliving a killed ``dxpool up``, one pool per
data directory, leftovers of a killed run handled at once."""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dxpool.cli.main import cli
from dxpool.cli.statedir import ChildRecords
from dxpool.store.embedded import EmbeddedEtcd, free_port, free_ports
from tests.patience import patient

SMALL_POOL = ("--boxes", "2", "--gpus-per-box", "4", "--hosts", "2", "--slots", "4")


def processes_mentioning(text: str) -> list[str]:
    """Command lines of running processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


def read_until(process: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """Stdout of ``process`` up to the line containing ``marker``; fails on exit or timeout."""
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    seen = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if selector.select(timeout=0.2):
            line = process.stdout.readline()
            seen += line
            if marker in line:
                return seen
            if not line:
                break
    raise AssertionError(f"no {marker!r} from dxpool up (exit {process.poll()}); got {seen!r}")


def test_up_serves_a_pool_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    data_dir = tmp_path / "pool"
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        sys.executable, "-m", "dxpool.cli", "up",
        "--data-dir", str(data_dir), "--listen", endpoint,
        "--boxes", "2", "--gpus-per-box", "4", "--hosts", "2", "--slots", "4",
    ]  # fmt: skip
    with open(tmp_path / "up.err", "w") as stderr:
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        banner = read_until(process, "dxpool is up at", timeout_s=60)
        assert f"dxpool is up at {endpoint}: 2 hosts, 2 boxes of 4 H100" in banner
        assert process.stdout is not None
        assert "node create --gpus H100:2 --wait" in process.stdout.readline()  # the hint

        runner = CliRunner()
        # The config `dxpool up` wrote carries the endpoint and the operator's certificate.
        created = runner.invoke(
            cli,
            ["node", "create", "--gpus", "H100:2", "--wait", "-o", "json"],
            env={"DXPOOL_CONFIG": str(data_dir / "config.yaml")},
        )
        assert created.exit_code == 0, created.output
        assert json.loads(created.stdout)["state"] == "NODE_STATE_READY"
        assert len(processes_mentioning(str(data_dir))) == 4  # up itself, etcd, two agents
        assert_hosts_cannot_reach_etcd(data_dir)

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert processes_mentioning(str(data_dir)) == []
    assert "stopped" in (tmp_path / "up.err").read_text()
    assert (data_dir / "logs" / "agent-h1.log").exists()


def etcd_ports(data_dir: Path) -> tuple[str, int]:
    """The pool's etcd client endpoint and peer port, from its command line."""
    (etcd,) = [line for line in processes_mentioning("--client-cert-auth") if str(data_dir) in line]
    args = etcd.split()
    client = next(a for a in args if a.startswith("--listen-client-urls=")).split("=", 1)[1]
    peer = next(a for a in args if a.startswith("--listen-peer-urls=")).split("=", 1)[1]
    return client.removeprefix("https://"), int(peer.rpartition(":")[2])


def assert_hosts_cannot_reach_etcd(data_dir: Path, host: str = "h1") -> None:
    """A host's certificate (the agent's, of the broker's CA) fails the TLS handshake of
    etcd's client port, whatever it asks (a read, renewing a lease, compacting), and of
    its peer port; so does a client without a certificate. The broker's certificate of
    etcd's own CA gets in."""
    import ssl

    import etcd3

    from dxpool.store.client import connect
    from dxpool.tls import ClientTls

    endpoint, peer_port = etcd_ports(data_dir)
    pki = data_dir / "pki"
    agent_tls = ClientTls(pki / "etcd-ca.crt", pki / f"agent-{host}.crt", pki / f"agent-{host}.key")
    anonymous = connect(endpoint, timeout_s=2, tls=ClientTls(ca=pki / "etcd-ca.crt"))
    agent = connect(endpoint, timeout_s=2, tls=agent_tls)
    broker = connect(endpoint, timeout_s=2, tls=ClientTls(
        pki / "etcd-ca.crt", pki / "broker-etcd.crt", pki / "broker-etcd.key"
    ))  # fmt: skip
    try:
        lease = broker.lease(30)
        for attempt in (
            lambda: anonymous.get("/"),
            lambda: agent.get(f"/dxpool/v1/hostalloc/{host}"),
            lambda: etcd3.Lease(lease.id, 30, etcd_client=agent).refresh(),
            lambda: agent.compact(1),
        ):
            with pytest.raises(Exception) as refused:
                attempt()
            assert "PERMISSION_DENIED" not in str(refused.value)  # never got that far
        assert broker.get(f"/dxpool/v1/hosts/{host}")[0] is not None
        lease.revoke()
    finally:
        anonymous.close()
        agent.close()
        broker.close()
    peer = ssl.create_default_context(cafile=str(pki / "etcd-ca.crt"))
    peer.load_cert_chain(pki / "etcd.crt", pki / "etcd.key")  # what a member shows
    with (
        socket.create_connection(("127.0.0.1", peer_port), timeout=5) as raw,
        peer.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(b"GET /members HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert tls.recv(12).startswith(b"HTTP/1.1 200")
    context = ssl.create_default_context(cafile=str(pki / "etcd-ca.crt"))
    context.load_cert_chain(pki / f"agent-{host}.crt", pki / f"agent-{host}.key")
    with (
        socket.create_connection(("127.0.0.1", peer_port), timeout=5) as raw,
        pytest.raises((ssl.SSLError, ConnectionError)),
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(b"GET /members HTTP/1.1\r\nHost: localhost\r\n\r\n")
        if not tls.recv(1):  # TLS 1.3 reports a refused client certificate here
            raise ConnectionError("the peer port closed the connection")


def pid_gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie nobody reaped yet counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def cmdline_of(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``condition`` held; fails after ``timeout_s`` (at least
    :data:`tests.patience.PATIENCE_S`)."""
    timeout_s = patient(timeout_s)
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.05)
    return time.monotonic() - started


class Up:
    """One `dxpool up` process on ``data_dir``; stdout is read by the test, stderr goes to
    ``<tmp>/up-<n>.err``. It runs with Python's fault handler on, so that one that does
    not stop can be made to write every thread's stack there (:meth:`kill_stuck`)."""

    count = 0

    def __init__(self, tmp_path: Path, data_dir: Path, endpoint: str, *extra: str) -> None:
        Up.count += 1
        self.data_dir = data_dir
        self.endpoint = endpoint
        self.err_path = tmp_path / f"up-{Up.count}.err"
        args = [
            sys.executable, "-m", "dxpool.cli", "up",
            "--data-dir", str(data_dir), "--listen", endpoint, *SMALL_POOL, *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # SIGABRT dumps every thread
        with open(self.err_path, "w") as stderr:
            self.process = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
            )
        self.pid = self.process.pid
        self.seen: set[int] = set()

    def wait_up(self, timeout_s: float = 60) -> float:
        """Seconds until the banner."""
        started = time.monotonic()
        read_until(self.process, "dxpool is up at", patient(timeout_s))
        return time.monotonic() - started

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def children(self) -> dict[str, int]:
        """Pids of the running children of this `dxpool up` that work in its data
        directory, by name (etcd, host agent h1, ...); read from /proc, so it does not
        depend on how `dxpool up` keeps track of them."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or pid_gone(int(entry.name)):
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            args = cmdline_of(int(entry.name))
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            if parent != self.pid or not any(str(self.data_dir) in arg for arg in args):
                continue
            if Path(args[0]).name == "etcd":
                name = "etcd"
            elif "--host" in args:
                name = f"host agent {args[args.index('--host') + 1]}"
            else:
                continue
            found[name] = int(entry.name)
        self.seen |= set(found.values())
        return found

    def cli(self, *args: str) -> Any:
        result = CliRunner().invoke(cli, [*args, "-o", "json"], env=self.cli_env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    @property
    def cli_env(self) -> dict[str, str]:
        """Where the CLI finds the config this pool wrote (endpoint, certificates)."""
        return {"DXPOOL_CONFIG": str(self.data_dir / "config.yaml")}

    def hosts(self) -> dict[str, dict[str, Any]]:
        return {h["name"]: h for h in self.cli("host", "list")}

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def kill_stuck(self) -> str:
        """Ends a `dxpool up` that did not stop when asked: SIGABRT first, so that it
        writes where each of its threads was, then SIGKILL. Returns its stderr, for the
        report of the test that left it running."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
        self.kill()
        return f"`dxpool up` (pid {self.pid}) did not stop; its stderr:\n{self.stderr}"


@pytest.fixture
def up_factory(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def start(*extra: str, data_dir: Path | None = None, endpoint: str = "") -> Up:
        up = Up(
            tmp_path,
            data_dir or tmp_path / "pool",
            endpoint or f"127.0.0.1:{free_port()}",
            *extra,
        )
        started.append(up)
        return up

    yield start
    for up in started:  # a failed test must not leave a pool behind
        up.children()
        if up.process.poll() is None:
            up.process.send_signal(signal.SIGTERM)
            try:
                up.process.wait(30)
            except subprocess.TimeoutExpired:
                print(up.kill_stuck())
        for pid in up.seen:
            if not pid_gone(pid) and str(up.data_dir) in " ".join(cmdline_of(pid)):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_agent_is_restarted_and_its_host_registers_again(
    up_factory: Callable[..., Up],
) -> None:
    up = up_factory()
    up.wait_up()
    before = up.children()
    registered = up.hosts()["hosts/h1"]["registerTime"]

    os.kill(before["host agent h1"], signal.SIGKILL)

    def registered_again() -> bool:
        host = up.hosts()["hosts/h1"]
        return bool(host.get("alive")) and host["registerTime"] > registered

    took = wait_until(registered_again, 20, "host h1 registered by a new agent")
    after = up.children()
    assert after["host agent h1"] != before["host agent h1"]
    assert not pid_gone(after["host agent h1"])
    assert pid_gone(before["host agent h1"])
    assert after["etcd"] == before["etcd"]
    assert after["host agent h2"] == before["host agent h2"]
    assert "warning: host agent h1 was killed by SIGKILL; restarting in 0.5s" in up.stderr
    assert "host agent h1 restarted" in up.stderr
    assert took > 0

    up.process.send_signal(signal.SIGTERM)  # SIGTERM, like Ctrl-C, stops everything
    assert up.process.wait(timeout=30) == 0
    assert all(pid_gone(pid) for pid in after.values())
    assert processes_mentioning(str(up.data_dir)) == []


def test_killing_up_leaves_no_child_and_the_next_up_starts_at_once(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    data_dir = tmp_path / "pool"
    first = up_factory(data_dir=data_dir)
    first.wait_up()
    children = first.children()
    assert set(children) == {"etcd", "host agent h1", "host agent h2"}

    first.kill()  # SIGKILL: no chance to stop anything itself
    wait_until(
        lambda: all(pid_gone(pid) for pid in children.values()),
        10,
        f"children {children} gone after `dxpool up` was killed",
    )

    second = up_factory(data_dir=data_dir, endpoint=first.endpoint)
    second.wait_up(timeout_s=60)
    # up, not failed on a data directory the killed pool's etcd still held
    assert second.process.poll() is None
    assert "left by an earlier run" not in second.stderr  # nothing was left
    hosts = second.hosts()
    assert {name for name, host in hosts.items() if host.get("alive")} == {"hosts/h1", "hosts/h2"}
    assert sorted(b["name"] for b in second.cli("box", "list")) == ["boxes/box1", "boxes/box2"]
    second.process.send_signal(signal.SIGINT)
    assert second.process.wait(timeout=30) == 0
    assert processes_mentioning(str(data_dir)) == []


def test_a_second_up_on_the_same_directory_fails_at_once_naming_the_first(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    data_dir = tmp_path / "pool"
    first = up_factory(data_dir=data_dir)
    first.wait_up()
    children = first.children()

    started = time.monotonic()
    second = up_factory(data_dir=data_dir)
    assert second.process.wait(timeout=patient(30)) == 1
    assert time.monotonic() - started < patient(30)  # refused: not waiting for the first
    assert (
        f"error: dxpool up failed: another `dxpool up` (pid {first.pid}) is already running "
        f"on {data_dir}; stop it first (Ctrl-C in its terminal, or `kill {first.pid}`)"
    ) in second.stderr

    assert first.process.poll() is None  # the first pool is untouched
    assert first.children() == children
    assert all(host.get("alive") for host in first.hosts().values())
    first.process.send_signal(signal.SIGINT)
    assert first.process.wait(timeout=30) == 0


def test_up_refuses_to_start_beside_an_etcd_it_cannot_prove_is_its_own(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    data_dir = tmp_path / "pool"
    # What an older `dxpool up` (without child records) left running when it was killed.
    with EmbeddedEtcd(data_dir / "etcd") as orphan:
        started = time.monotonic()
        up = up_factory(data_dir=data_dir)
        assert up.process.wait(timeout=patient(30)) == 1
        assert time.monotonic() - started < patient(30)
        assert (
            f"etcd (pid {orphan.pid}) still running on {data_dir}, most likely left behind "
            f"by an older `dxpool up` that was killed; stop them with `kill {orphan.pid}` "
            "and run `dxpool up` again"
        ) in up.stderr
        assert orphan.poll() is None  # not signalled: nothing proves it is ours
        assert not (data_dir / "fabric").exists()  # nothing was started


def test_up_stops_a_child_that_a_killed_run_recorded_and_starts(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    data_dir = tmp_path / "pool"
    # A child that outlived a killed run (where no death signal reached it): its record
    # proves it is this pool's own.
    leftover = EmbeddedEtcd(data_dir / "etcd").start()
    try:
        assert leftover.pid is not None
        ChildRecords(data_dir).save("etcd", "etcd", leftover.pid)
        up = up_factory(data_dir=data_dir)
        up.wait_up()
        assert f"stopping processes left by an earlier run: etcd (pid {leftover.pid})" in (
            up.stderr
        )
        assert leftover.poll() is not None
        assert up.children()["etcd"] != leftover.pid
        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(timeout=30) == 0
    finally:
        leftover.stop()


def test_an_agent_that_keeps_dying_stops_the_pool_with_a_clear_error(
    up_factory: Callable[..., Up],
) -> None:
    up = up_factory("--max-restarts", "1", "--restart-window", "60s")
    up.wait_up()
    first = up.children()
    os.kill(first["host agent h2"], signal.SIGKILL)
    wait_until(
        lambda: up.children().get("host agent h2") not in (None, first["host agent h2"]),
        10,
        "host agent h2 restarted",
    )
    restarted = up.children()
    os.kill(restarted["host agent h2"], signal.SIGKILL)

    assert up.process.wait(timeout=30) == 1
    assert (
        "error: dxpool up failed: host agent h2 was killed by SIGKILL after 1 restarts within "
        f"60s; giving up (see {up.data_dir}/logs/agent-h2.log)"
    ) in up.stderr
    assert all(pid_gone(pid) for pid in [*first.values(), *restarted.values()])
    assert processes_mentioning(str(up.data_dir)) == []


def test_a_box_deleted_by_hand_is_registered_again_by_the_next_up(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    # The broker remembers request ids; a fixed one per box would tie the id to the
    # deleted box and make the next registration fail.
    data_dir = tmp_path / "pool"
    first = up_factory(data_dir=data_dir)
    first.wait_up()
    deleted = CliRunner().invoke(cli, ["box", "delete", "box2"], env=first.cli_env)
    assert deleted.exit_code == 0, deleted.output
    first.process.send_signal(signal.SIGINT)
    assert first.process.wait(timeout=30) == 0

    second = up_factory(data_dir=data_dir, endpoint=first.endpoint)
    second.wait_up()
    boxes = {b["name"]: b for b in second.cli("box", "list")}
    assert sorted(boxes) == ["boxes/box1", "boxes/box2"]
    assert boxes["boxes/box2"]["gpuCount"] == 4
    second.process.send_signal(signal.SIGINT)
    assert second.process.wait(timeout=30) == 0


def test_a_later_up_with_more_hosts_gives_the_new_agent_its_certificate(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    data_dir = tmp_path / "pool"
    first = up_factory(data_dir=data_dir)
    first.wait_up()
    first.process.send_signal(signal.SIGINT)
    assert first.process.wait(timeout=30) == 0

    # The new host's agent registers through the broker with a certificate of its own,
    # which etcd refuses like the others'.
    second = up_factory("--hosts", "3", data_dir=data_dir, endpoint=first.endpoint)
    second.wait_up()
    assert sorted(h["name"] for h in second.cli("host", "list")) == [
        "hosts/h1",
        "hosts/h2",
        "hosts/h3",
    ]
    assert_hosts_cannot_reach_etcd(data_dir, host="h3")
    second.process.send_signal(signal.SIGINT)
    assert second.process.wait(timeout=30) == 0


def test_a_killed_etcd_is_restarted_on_its_data_and_the_pool_serves_again(
    up_factory: Callable[..., Up],
) -> None:
    up = up_factory()
    up.wait_up()
    before = up.children()
    os.kill(before["etcd"], signal.SIGKILL)
    wait_until(
        lambda: up.children().get("etcd") not in (None, before["etcd"]),
        30,
        "etcd restarted",
    )
    assert "warning: etcd was killed by SIGKILL; restarting in 0.5s" in up.stderr
    # Same data (the boxes are there) and the broker and agents found it again.
    assert sorted(b["name"] for b in up.cli("box", "list")) == ["boxes/box1", "boxes/box2"]
    # The broker's etcd client may fail a call or two while it reconnects; the same
    # request id makes the retry safe.
    create = ["node", "create", "--gpus", "H100:2", "--wait",
              "--timeout", "30s", "--request-id", "after-etcd-restart", "-o", "json"]  # fmt: skip
    results = []

    def composed() -> bool:
        results.append(CliRunner().invoke(cli, create, env=up.cli_env))
        return results[-1].exit_code == 0

    wait_until(composed, 30, "a node composed after the etcd restart")
    assert json.loads(results[-1].stdout)["state"] == "NODE_STATE_READY"
    after = up.children()
    assert {k: v for k, v in after.items() if k != "etcd"} == {
        k: v for k, v in before.items() if k != "etcd"
    }  # the agents rode it out
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(timeout=30) == 0
    assert processes_mentioning(str(up.data_dir)) == []


def test_up_serves_pool_metrics_on_the_metrics_port(up_factory: Callable[..., Up]) -> None:
    port = free_port()
    up = up_factory("--metrics-port", str(port))
    up.wait_up()
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read().decode()
    # SMALL_POOL's GPUs, all free; the pool gauges come from the broker's cache.
    free = re.search(r'^dxpool_gpus\{model="H100",state="FREE"\} (\S+)$', body, re.MULTILINE)
    assert free is not None, body[:2000]
    assert float(free.group(1)) > 0
    assert 'dxpool_hosts{liveness="alive"}' in body
    assert f"metrics on {url}" in up.stderr


def test_up_with_a_taken_metrics_port_fails_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(
            cli, ["up", "--data-dir", str(tmp_path / "pool"), "--metrics-port", str(port)]
        )
    assert result.exit_code == 1, result.output
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr
    assert "choose another --metrics-port" in result.stderr
    assert not (tmp_path / "pool").exists()


def test_a_restarted_up_gives_slow_agents_time_to_return_and_loses_no_node(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    """A restart on a loaded machine: the new run's agents come back only after their
    hosts' liveness records (left on the old broker's lease) are gone. The new broker,
    leading since it started, gives them its reconnect grace (30 s): no node is LOST."""
    data_dir = tmp_path / "pool"
    first = up_factory(data_dir=data_dir)
    first.wait_up()
    node = first.cli("node", "create", "--gpus", "H100:2", "--wait")
    assert node["state"] == "NODE_STATE_READY"
    first.process.send_signal(signal.SIGINT)
    assert first.process.wait(timeout=30) == 0

    second = up_factory(data_dir=data_dir, endpoint=first.endpoint)
    started = time.monotonic()
    frozen: set[int] = set()

    def agents_frozen() -> bool:  # as slow as a loaded machine could make them
        for name, pid in second.children().items():
            if name.startswith("host agent") and pid not in frozen:
                os.kill(pid, signal.SIGSTOP)
                frozen.add(pid)
        return len(frozen) == 2

    wait_until(agents_frozen, 30, "the new agents, to freeze them")
    states: list[str] = []
    try:
        second.wait_up()

        def hosts_gone() -> bool:
            states.append(second.cli("node", "get", node["name"])["state"])
            return not any(h.get("alive") for h in second.hosts().values())

        wait_until(hosts_gone, 40, "the hosts' old liveness records to go")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)

    def hosts_back() -> bool:
        states.append(second.cli("node", "get", node["name"])["state"])
        return all(h.get("alive") for h in second.hosts().values())

    wait_until(hosts_back, 30, "the agents to take their hosts back")
    while time.monotonic() - started < 40:  # past the grace: the leader still loses nothing
        states.append(second.cli("node", "get", node["name"])["state"])
        time.sleep(0.5)
    assert set(states) == {"NODE_STATE_READY"}
    events = second.cli("node", "get", node["name"]).get("events", [])
    assert "Lost" not in {event.get("reason") for event in events}
    second.process.send_signal(signal.SIGINT)
    assert second.process.wait(timeout=30) == 0


@pytest.mark.skipif(
    not os.access("/usr/bin/etcd", os.X_OK),
    reason="Debian's etcd-server is not installed (scripts/test-etcd-line.sh installs it)",
)
def test_up_runs_the_etcd_it_is_given_with_corruption_checks_on(
    up_factory: Callable[..., Up],
) -> None:
    """Debian's etcd 3.4 behind a secure pool (TLS, client certificates, etcd users):
    named at start with its advisories, run with its own flags, and a node composes."""
    up = up_factory("--etcd-binary", "/usr/bin/etcd")
    up.wait_up()
    args = cmdline_of(up.children()["etcd"])
    assert args[0] == "/usr/bin/etcd"
    assert "--experimental-initial-corrupt-check=true" in args
    assert "--logger=zap" in args
    assert re.search(r"etcd 3\.4\.\d+ \(/usr/bin/etcd\)", up.stderr), up.stderr
    assert "CVE-2023-32082" in up.stderr
    node = up.cli("node", "create", "--gpus", "H100:2", "--wait", "--timeout", "60s")
    assert node["state"] == "NODE_STATE_READY"
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(timeout=30) == 0


def test_up_labels_hosts_fixes_etcds_ports_and_serves_agent_metrics(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    etcd_port, peer_port, metrics_port = free_ports(3, "127.0.0.1")
    up = up_factory(
        "--host-label", "env=prod", "--host-label", "h1:tier=fast",
        "--etcd-port", str(etcd_port), "--etcd-peer-port", str(peer_port),
        "--agent-metrics-port", str(metrics_port),
    )  # fmt: skip
    up.wait_up()
    hosts = up.hosts()
    assert hosts["hosts/h1"]["labels"] == {"env": "prod", "tier": "fast"}
    assert hosts["hosts/h2"]["labels"] == {"env": "prod"}
    # the README's --host-selector line works on the pool `dxpool up` starts
    node = up.cli("node", "create", "--gpus", "H100:2", "--host-selector", "tier=fast")
    assert node["host"] == "hosts/h1"
    etcd = up.children()["etcd"]
    assert f"--listen-client-urls=https://127.0.0.1:{etcd_port}" in cmdline_of(etcd)
    for port in (metrics_port, metrics_port + 1):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as page:
            assert b"dxpool_agent" in page.read()
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(timeout=patient(30)) == 0


def test_a_host_label_for_a_host_the_pool_lacks_is_a_usage_error(
    up_factory: Callable[..., Up],
) -> None:
    up = up_factory("--host-label", "h9:env=prod")
    assert up.process.wait(timeout=patient(30)) == 2
    assert "names host 'h9', which this pool does not have" in up.stderr
