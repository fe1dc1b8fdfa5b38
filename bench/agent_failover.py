"""Host loss and broker loss with agents behind brokers, with the default settings.

Starts a private etcd (fsync on), two broker processes (A and B, on a simulated fabric's
box side, so lost hosts are fenced) and four host agents that know both brokers (each
agent picks its first by its host's order). Two scenarios, ``--trials`` times each:

* **host loss**: a node READY on a host, then its agent SIGKILLed (or SIGSTOPped with
  ``--freeze``): seconds until the host's liveness record is gone (the broker heard no
  heartbeat for the liveness TTL), until the node is LOST, and until its GPU is fenced
  and FREE. The agent is started again (resumed) afterwards.
* **broker kill**: one client thread composes and releases 1-GPU nodes on the broker
  that stays, in a loop, each on a host whose agent holds its session on the other
  broker and each waited on until READY; that other broker is SIGKILLed. The *write
  gap* is the longest time between two nodes becoming READY around the kill (a READY
  needs the agent's status writes, which go through a broker); also how long until the
  killed broker's agents hold sessions on the one that stays, whether any host's
  liveness record went missing, and what the client saw. The killed broker is started
  again; the next trial kills the other one (a trial needs an agent on the broker it
  kills: agents spread over both by their hosts' orders, and move when one is killed).

The host-loss trials start ``--settle`` seconds (35) after the brokers: a broker that
just became the leader gives agents its reconnect grace (30 s) before it declares any host
lost, which would otherwise be measured instead of the liveness TTL.

Usage: python bench/agent_failover.py [--trials 3] [--freeze] [--settle 35]
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.agent_sessions import parse_liveness
from dxpool.client import Client
from dxpool.fabric.sim import SimFabric, SimGpuSpec
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, free_ports
from dxpool.store.keys import KeySchema

PREFIX = "/dxpool-failover/"
KEYS = KeySchema(PREFIX)
HOSTS = 4


def one_gpu(host: str) -> nodes_pb2.ComposeNodeRequest:
    gpus = pb.GpuRequest(model="H100", count=1)
    return nodes_pb2.ComposeNodeRequest(spec=pb.NodeSpec(gpus=gpus, host=f"hosts/{host}"))


@dataclass
class Process:
    args: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        return self

    def signal(self, signum: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(signum)
        if signum == signal.SIGKILL:
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()


@dataclass
class Pool:
    work: Path
    etcd: EmbeddedEtcd
    brokers: list[tuple[Process, str, str]] = field(default_factory=list)  # process, api, agents
    agents: list[Process] = field(default_factory=list)

    def start_broker(self, index: int) -> None:
        process, _, _ = self.brokers[index]
        process.start()
        wait_serving(self.brokers[index][1])


def wait_serving(endpoint: str) -> None:
    with Client(endpoint, insecure=True, timeout_s=5) as client:
        deadline = time.monotonic() + 60
        while True:
            try:
                client.list_boxes()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def start_pool(work: Path) -> Pool:
    etcd = EmbeddedEtcd(work / "etcd").start()
    pool = Pool(work, etcd)
    fabric = work / "fabric"
    SimFabric.create(
        fabric,
        boxes={"box0": [SimGpuSpec("H100", 81920)] * 8},
        hosts={f"h{i}": 8 for i in range(HOSTS)},
    )
    for index in range(2):
        port, agent_port = free_ports(2)
        api, agents = f"127.0.0.1:{port}", f"127.0.0.1:{agent_port}"
        args = [sys.executable, "-m", "dxpool.broker", "--etcd", etcd.endpoint, "--prefix",
                PREFIX, "--listen", api, "--agent-listen", agents, "--insecure",
                "--fabric", f"sim:{fabric}", "--log-level", "WARNING"]  # fmt: skip
        pool.brokers.append((Process(args, work / f"broker{index}.log"), api, agents))
        pool.start_broker(index)
    with Client(pool.brokers[0][1], insecure=True) as client:
        client.create_box("box0", gpus=8, model="H100", memory_mib=81920, location=("s", "p", "r"))
    order = ",".join(agents for _, _, agents in pool.brokers)
    for index in range(HOSTS):
        args = [sys.executable, "-m", "dxpool.hostagent", "--host", f"h{index}", "--broker",
                order, "--driver", "sim", "--sim-state", str(fabric), "--slots", "8",
                "--site", "s", "--pod", "p", "--rack", "r",
                "--state-dir", str(work / f"agent-{index}"), "--log-level", "WARNING"]  # fmt: skip
        pool.agents.append(Process(args, work / f"agent{index}.log").start())
    with Client(pool.brokers[0][1], insecure=True) as client:
        wait(lambda: sum(h.alive for h in client.list_hosts()) == HOSTS, 120)
    return pool


def wait(condition: Any, timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"not within {timeout_s}s")
        time.sleep(0.02)
    return time.monotonic()


def host_loss(pool: Pool, client: Client, etcd: Any, freeze: bool) -> dict[str, float]:
    node = client.wait_for_node(client.compose_node("H100:1", host="h0").name, timeout_s=60)
    gpu = node.gpus[0].gpu
    agent = pool.agents[0]
    stopped = time.monotonic()
    agent.signal(signal.SIGSTOP if freeze else signal.SIGKILL)
    gone = wait(lambda: etcd.get(KEYS.host_lease("h0"))[0] is None, 120)
    lost = wait(lambda: client.get_node(node.name).state == pb.NODE_STATE_LOST, 120)
    free = wait(lambda: client.get_gpu(gpu).state == pb.GPU_STATE_FREE, 120)
    if freeze:
        agent.signal(signal.SIGCONT)
    else:
        agent.start()
    client.release_node(node.name)
    wait(lambda: any(h.name == "hosts/h0" and h.alive for h in client.list_hosts()), 120)
    return {
        "liveness_gone_s": gone - stopped,
        "lost_s": lost - stopped,
        "fenced_free_s": free - stopped,
    }


def sessions_on(etcd: Any) -> dict[str, str]:
    """host -> the broker holding its session, from the liveness records."""
    return {
        meta.key.decode().rsplit("/", 1)[1]: parse_liveness(value).broker
        for value, meta in etcd.get_prefix(KEYS.collection("hostleases"))
    }


@dataclass
class ComposeLoop:
    """Composes and releases 1-GPU nodes on ``hosts`` in turn through ``api``, each
    waited on until READY, until stopped; when each became READY, and the errors seen."""

    api: str
    hosts: list[str]
    readies: list[float] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        targets = itertools.cycle(self.hosts)
        with grpc.insecure_channel(self.api) as channel:
            stub = nodes_pb2_grpc.NodeServiceStub(channel)
            while not self.stop.is_set():
                try:
                    node = stub.ComposeNode(one_gpu(next(targets)), timeout=10)
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        state = stub.GetNode(
                            nodes_pb2.GetNodeRequest(name=node.name), timeout=5
                        ).state
                        if state == pb.NODE_STATE_READY:
                            self.readies.append(time.monotonic())
                            break
                        time.sleep(0.005)
                    stub.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name), timeout=10)
                except grpc.RpcError as error:
                    self.codes[error.code().name] = self.codes.get(error.code().name, 0) + 1
                    time.sleep(0.05)


def broker_kill(pool: Pool, victim: int, etcd: Any) -> dict[str, Any]:
    victim_process = pool.brokers[victim][0].popen
    assert victim_process is not None
    victim_id = f"/{victim_process.pid}/"  # a broker's id is host/pid/random
    on_victim = {h for h, b in sessions_on(etcd).items() if victim_id in b}
    if not on_victim:
        raise RuntimeError(f"no agent holds a session on broker {victim} to measure")
    loop = ComposeLoop(pool.brokers[1 - victim][1], sorted(on_victim))
    readies, codes, stop = loop.readies, loop.codes, loop.stop
    worker = threading.Thread(target=loop.run)
    worker.start()
    time.sleep(5)
    missing: list[str] = []
    killed = time.monotonic()
    pool.brokers[victim][0].signal(signal.SIGKILL)
    moved_at = None
    deadline = killed + 120
    while time.monotonic() < deadline:
        held = sessions_on(etcd)
        missing += [f"h{i}" for i in range(HOSTS) if f"h{i}" not in held]
        if len(held) == HOSTS and not any(victim_id in held[h] for h in on_victim):
            moved_at = time.monotonic()
            break
        time.sleep(0.05)
    time.sleep(5)
    stop.set()
    worker.join(30)
    pairs = list(itertools.pairwise(readies))
    across = [b - a for a, b in pairs if b > killed]  # the gap the kill falls in, and after
    before = [b - a for a, b in pairs if b < killed]
    pool.start_broker(victim)
    return {
        "write_gap_s": max(across, default=float("nan")),
        "typical_gap_s": statistics.median(before) if before else float("nan"),
        "agents_moved_s": (moved_at - killed) if moved_at else float("nan"),
        "agents_on_victim": len(on_victim),
        "hosts_missing": sorted(set(missing)),
        "client_errors": codes,
        "readies_after_kill": sum(1 for t in readies if t > killed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--freeze", action="store_true", help="SIGSTOP agents, not SIGKILL")
    parser.add_argument("--settle", type=float, default=35.0, help="seconds before host loss")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dxpool-failover-"))
    started = time.monotonic()
    pool = start_pool(work)
    etcd = connect(pool.etcd.endpoint, timeout_s=10)
    time.sleep(max(0.0, args.settle - (time.monotonic() - started)))
    try:
        with Client(pool.brokers[0][1], insecure=True, timeout_s=10) as client:
            losses = [host_loss(pool, client, etcd, args.freeze) for _ in range(args.trials)]
        kills = [broker_kill(pool, trial % 2, etcd) for trial in range(args.trials)]
    finally:
        etcd.close()
        for agent in pool.agents:
            agent.stop()
        for process, _, _ in pool.brokers:
            process.stop()
        pool.etcd.stop()
    how = "SIGSTOP" if args.freeze else "SIGKILL"
    print(f"host loss ({how} of the agent), default liveness TTL 10 s, {args.trials} trials:")
    for key in ("liveness_gone_s", "lost_s", "fenced_free_s"):
        values = [loss[key] for loss in losses]
        print(f"  {key:16} " + "  ".join(f"{v:5.2f}" for v in values))
    print(f"broker kill (a broker holding agents' sessions), {args.trials} trials:")
    for kill in kills:
        print(
            f"  write gap {kill['write_gap_s']:.2f} s (typical {kill['typical_gap_s']:.2f} s); "
            f"its {kill['agents_on_victim']} agents moved in {kill['agents_moved_s']:.2f} s; "
            "hosts missing "
            f"{kill['hosts_missing'] or 'none'}; READY after the kill "
            f"{kill['readies_after_kill']}; client errors {kill['client_errors'] or 'none'}"
        )
    print(f"logs: {work}")


if __name__ == "__main__":
    main()
