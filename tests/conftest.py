"""Fixtures shared by the whole suite: a real etcd, a real broker, real host agents.

One etcd server runs per test session; every test gets its own key prefix in it, so tests
are isolated without paying for an etcd start each. Brokers listen on free loopback
ports (the public port and the agent port); host agents run as separate processes
(``python -m dxpool.hostagent``) over a simulated fabric whose state lives in the test's
temporary directory, and talk to the test's brokers only, never to etcd.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import tenacity

from dxpool.api.v1 import inventory_pb2, inventory_pb2_grpc, nodes_pb2_grpc, resources_pb2
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, EtcdCluster
from tests.patience import patient

if TYPE_CHECKING:  # imported lazily so one broken component does not hide every test
    from dxpool.broker.api.server import BrokerServer
    from dxpool.fabric.sim import SimFabric


@pytest.fixture(scope="session", autouse=True)
def _children_take_ctrl_c() -> Iterator[None]:
    """Tests press Ctrl-C (SIGINT) on the CLI processes they start, as a terminal would.
    A suite started in the background by a non-interactive shell ignores SIGINT, and a
    child inherits an ignored signal (Python then installs no KeyboardInterrupt), so
    give the suite a handler for the session: a handled signal is reset at exec."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(scope="session", autouse=True)
def _no_user_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Clients built without TLS arguments read the config file; point them at an empty
    one, so a developer's ~/.config/dxpool or a local pool's ./.dxpool/config.yaml (which
    would turn on TLS) cannot change what the suite does. Tests of the config file set
    their own."""
    empty = tmp_path_factory.mktemp("config") / "config.yaml"
    empty.write_text("")
    saved = {name: os.environ.pop(name, None) for name in _CLIENT_ENV}
    os.environ["DXPOOL_CONFIG"] = str(empty)
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


_CLIENT_ENV = ("DXPOOL_CONFIG", "DXPOOL_ENDPOINT", "DXPOOL_CA", "DXPOOL_CERT", "DXPOOL_KEY",
               "DXPOOL_SERVER_NAME", "DXPOOL_TOKEN_FILE")  # fmt: skip


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd(unsafe_no_fsync=True) as server:
        yield server


@pytest.fixture
def key_prefix() -> str:
    return f"/dxpool-test-{uuid.uuid4().hex[:12]}/"


def answering(client: Any) -> Any:
    """``client`` once etcd has answered it, retried for up to the test patience.

    The first call also opens the client's connection; on a loaded machine that can take
    longer than one call's timeout, which is the machine's fault, not the test's.
    """
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(patient(30.0)),
        wait=tenacity.wait_fixed(0.5),
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            client.status()
    return client


@pytest.fixture
def etcd_client(etcd_server: EmbeddedEtcd):  # type: ignore[no-untyped-def]
    client = answering(connect(etcd_server.endpoint))
    yield client
    client.close()


# -- etcd processes a test may kill, pause and restart ---------------------------------


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """A single etcd member of the test's own: kill/pause it, then ``start`` it again on
    the same data directory and port."""
    server = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True).start()
    yield server
    server.kill()  # its data dies with tmp_path


@pytest.fixture(scope="session")
def _etcd_cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3, unsafe_no_fsync=True) as cluster:
        yield cluster


def _heal(cluster: EtcdCluster) -> None:
    for member in cluster.members:
        member.resume()
    for member in cluster.members:
        if not member.running:
            member.start(wait=False)
    for member in cluster.members:
        member.wait_ready()
    cluster.leader()


@pytest.fixture
def etcd_cluster(_etcd_cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    """Three etcd members on loopback, all running with a leader when the test starts;
    members the test killed or paused are brought back afterwards."""
    _heal(_etcd_cluster)
    yield _etcd_cluster
    _heal(_etcd_cluster)


# The agents' reconnect grace of test brokers: long enough for an agent that reconnects
# to another broker, short enough not to slow tests of host loss. Tests of the grace
# itself set their own.
TEST_RECONNECT_GRACE_S = 1.0


@pytest.fixture
def started_brokers() -> list[BrokerServer]:
    """The brokers ``broker_factory`` started in this test, in order."""
    return []


@pytest.fixture
def broker_factory(
    etcd_server: EmbeddedEtcd, key_prefix: str, started_brokers: list[BrokerServer]
) -> Iterator[Callable[..., BrokerServer]]:
    from dxpool.broker.api.server import BrokerConfig, BrokerServer

    def start(**overrides: object) -> BrokerServer:
        config = BrokerConfig(
            etcd_endpoints=etcd_server.endpoint,
            key_prefix=key_prefix,
            listen="127.0.0.1:0",
            agent_listen="127.0.0.1:0",
            controller_sweep_s=0.2,
            host_reconnect_grace_s=TEST_RECONNECT_GRACE_S,
            # etcd on a loaded machine may take seconds to answer; a test that wants
            # failover within a second says so itself
            etcd_timeout_s=5.0,
        )
        config = BrokerConfig(**{**config.__dict__, **overrides})  # type: ignore[arg-type]
        server = BrokerServer(config).start()
        started_brokers.append(server)
        return server

    yield start
    for server in started_brokers:
        server.stop(grace_s=0)


@pytest.fixture
def broker(broker_factory: Callable[..., BrokerServer]) -> BrokerServer:
    return broker_factory()


@dataclass
class Stubs:
    """Raw gRPC stubs on one channel to a broker."""

    channel: grpc.Channel
    inventory: inventory_pb2_grpc.InventoryServiceStub = field(init=False)
    nodes: nodes_pb2_grpc.NodeServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.inventory = inventory_pb2_grpc.InventoryServiceStub(self.channel)
        self.nodes = nodes_pb2_grpc.NodeServiceStub(self.channel)


@pytest.fixture
def stubs(broker: BrokerServer) -> Iterator[Stubs]:
    channel = grpc.insecure_channel(broker.endpoint)
    yield Stubs(channel)
    channel.close()


def add_box(
    stubs: Stubs, box_id: str, *, gpus: int = 8, model: str = "H100", rack: str = "r1"
) -> resources_pb2.Box:
    """Register a uniform box through the API."""
    return stubs.inventory.CreateBox(
        inventory_pb2.CreateBoxRequest(
            box_id=box_id,
            box=resources_pb2.Box(
                gpu_count=gpus, location=resources_pb2.Location(site="s1", pod="p1", rack=rack)
            ),
            gpu_model=model,
            gpu_memory_mib=81920,
        )
    )


@dataclass
class AgentProcess:
    """``python -m dxpool.hostagent`` running in its own process."""

    process: subprocess.Popen[bytes]
    log_path: Path
    host: str = ""

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    def terminate(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class SimPool:
    """A simulated fabric plus a launcher for host agents over it. Agents connect to
    ``broker_endpoints()``: the agent ports of the brokers the test started, unless
    ``brokers`` is given to :meth:`start_agent`."""

    state_dir: Path
    fabric: SimFabric
    broker_endpoints: Callable[[], list[str]]
    agents: list[AgentProcess] = field(default_factory=list)

    def brokers(self) -> str:
        endpoints = self.broker_endpoints()
        if not endpoints:
            raise RuntimeError("start a broker before its agents: agents talk to brokers only")
        return ",".join(endpoints)

    def start_agent(
        self,
        host: str,
        *,
        slots: int = 8,
        rack: str = "r1",
        map_delay_s: float = 0.0,
        lease_ttl_s: float = 3.0,
        extra: tuple[str, ...] = (),
        brokers: str | None = None,
    ) -> AgentProcess:
        self.fabric.add_host(host, slots)
        log_path = self.state_dir / f"agent-{host}-{len(self.agents)}.log"
        args = [
            sys.executable,
            "-m",
            "dxpool.hostagent",
            "--host",
            host,
            "--broker",
            brokers or self.brokers(),
            "--driver",
            "sim",
            "--sim-state",
            str(self.state_dir / "fabric"),
            "--slots",
            str(slots),
            "--site",
            "s1",
            "--pod",
            "p1",
            "--rack",
            rack,
            "--lease-ttl",
            str(lease_ttl_s),
            "--map-delay",
            str(map_delay_s),
            "--resync-interval",
            "2",
            "--state-dir",
            str(self.state_dir / f"agent-state-{host}"),
            *extra,
        ]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        agent = AgentProcess(process, log_path, host)
        self.agents.append(agent)
        return agent


@pytest.fixture
def sim_pool(tmp_path: Path, started_brokers: list[BrokerServer]) -> Iterator[SimPool]:
    from dxpool.fabric.sim import SimFabric

    fabric = SimFabric.create(tmp_path / "fabric", boxes={}, hosts={})
    pool = SimPool(tmp_path, fabric, lambda: [b.agent_endpoint for b in started_brokers])
    yield pool
    for agent in pool.agents:
        agent.kill()


def register_sim_box(
    pool: SimPool,
    stubs: Stubs,
    box_id: str,
    *,
    gpus: int = 8,
    model: str = "H100",
    rack: str = "r1",
) -> None:
    """A box in the simulated fabric and in the broker's inventory."""
    from dxpool.fabric.sim import SimGpuSpec

    pool.fabric.add_box(box_id, [SimGpuSpec(model, 81920) for _ in range(gpus)])
    add_box(stubs, box_id, gpus=gpus, model=model, rack=rack)


def wait_until(
    predicate: Callable[[], object],
    timeout_s: float = 15.0,
    interval_s: float = 0.05,
    message: str = "condition",
) -> object:
    """Poll ``predicate`` until it returns a truthy value; fail the test once
    ``timeout_s`` (at least :data:`tests.patience.PATIENCE_S`) has passed."""
    timeout_s = patient(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {message}")


def wait_hosts_alive(stubs: Stubs, count: int = 1, timeout_s: float = 20.0) -> None:
    """Wait until ``count`` hosts are registered and alive in the broker's view."""
    wait_until(
        lambda: (
            sum(h.alive for h in stubs.inventory.ListHosts(inventory_pb2.ListHostsRequest()).hosts)
            >= count
        ),
        timeout_s,
        message=f"{count} alive host(s)",
    )


def pool_records(etcd_client: object, prefix: str) -> dict[bytes, bytes]:
    """Every key and value of the pool under ``prefix``, byte for byte - leaving out
    ``elections/``, the brokers' leadership bookkeeping, which is not pool state."""
    elections = f"{prefix}elections/".encode()
    return {
        meta.key: value
        for value, meta in etcd_client.get_prefix(prefix)  # type: ignore[attr-defined]
        if not meta.key.startswith(elections)
    }


# -- TLS material: a private CA and certificates for the secure fixtures -----------------


@dataclass
class Pki:
    """Certificates under ``root``: ``ca`` signs everything but ``rogue``, a second CA's
    client certificate; ``server`` is good for 127.0.0.1 and localhost."""

    root: Path

    def path(self, name: str, kind: str = "crt") -> Path:
        return self.root / f"{name}.{kind}"

    def client_identity(self, role: str, name: str) -> str:
        """Issue (once) a client certificate for ``dxpool://role/name``; returns its file
        stem, so ``path(stem)`` and ``path(stem, "key")`` are its files."""
        from dxpool.identity import Identity
        from dxpool.pki import issue, load_pair, write_pair

        stem = f"{role}-{name}"
        if not self.path(stem).exists():
            pair = issue(load_pair(self.root, "ca"), identity=Identity.make(role, name))
            write_pair(self.root, stem, pair)
        return stem

    def agent_args(self, host: str) -> tuple[str, ...]:
        """The agent flags that connect host ``host``'s agent to an mTLS broker with its
        own certificate (``dxpool://agent/host``)."""
        stem = self.client_identity("agent", host)
        return (
            "--tls-ca",
            str(self.path("ca")),
            "--tls-cert",
            str(self.path(stem)),
            "--tls-key",
            str(self.path(stem, "key")),
        )


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    import datetime as dt

    from dxpool.identity import Identity
    from dxpool.pki import create_ca, issue, write_pair

    root = tmp_path_factory.mktemp("pki")
    ca, rogue_ca = create_ca("test CA"), create_ca("rogue CA")
    write_pair(root, "ca", ca)
    write_pair(root, "rogue-ca", rogue_ca)
    write_pair(root, "server", issue(ca, dns_names=["localhost"], ip_addresses=["127.0.0.1"]))
    write_pair(root, "elsewhere", issue(ca, dns_names=["broker.elsewhere.example"]))
    alice = Identity.make("operator", "alice")
    write_pair(root, "operator-alice", issue(ca, identity=alice))
    write_pair(root, "rogue", issue(rogue_ca, identity=alice))
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    write_pair(root, "expired", issue(ca, identity=alice, valid_days=1, not_before=long_ago))
    return Pki(root)
