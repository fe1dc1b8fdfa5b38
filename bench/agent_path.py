"""Compose→READY through the agent path, against an earlier version, in one run.

For each variant - *after*, this checkout, and *before*, another dxpool install named by
its Python - a private etcd (fsync on), a broker process and four host agent processes on
a simulated fabric of two 8-GPU boxes (each variant its own, of the same shape; agents of
the before version talk to etcd with ``--etcd``, those of this one to the broker's agent
port with ``--broker``). Then rounds alternate between the variants (after, before,
after, ...), each ``--samples`` 1-GPU composes, so both see the same machine over the same
minutes. One sample: ComposeNode, then the time until a WatchNodes stream opened before
the round reports the node READY (the agent attached the GPU and reported it, and the
broker's controller made the node READY); then ReleaseNode and wait for RELEASED, then a
pause.

Prints compose→READY p50/p90/p99 per variant and the ratio after/before of p50. Everything
shares the machine, and the idle variant's processes keep running while the other is
measured; compare the ratio, not absolute times.

``--build-before COMMIT`` makes the before install first: ``git archive COMMIT`` of this
repository into ``--into`` (outside the repository, e.g. /tmp/dxpool-before), a venv
there, and ``pip install DIR[server,agent]`` into it.

Usage:
  python bench/agent_path.py --build-before 886beb4 --into /tmp/dxpool-before
  python bench/agent_path.py --before /tmp/dxpool-before/.venv/bin/python [--samples 50]
      [--rounds 6] [--pause-ms 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too

from dxpool.api.v1 import nodes_pb2, nodes_pb2_grpc
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.client import Client
from dxpool.fabric.sim import SimFabric, SimGpuSpec
from dxpool.store.embedded import EmbeddedEtcd, free_ports

REPO = Path(__file__).resolve().parent.parent
HOSTS = 4
BOXES = 2
GPUS_PER_BOX = 8
SLOTS = 8
ONE_GPU = nodes_pb2.ComposeNodeRequest(spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)))


def build_before(commit: str, into: Path) -> Path:
    """Export ``commit`` into ``into`` and install it in a venv there; its Python."""
    if into.resolve().is_relative_to(REPO):
        raise SystemExit(f"--into {into} is inside the repository: choose a scratch directory")
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    python = into / ".venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(into / ".venv")], check=True)
    install = [str(python), "-m", "pip", "install", "--quiet", f"{into}[server,agent]"]
    subprocess.run(install, check=True)
    return python


def talks_to_brokers(python: str) -> bool:
    """Whether that install's agent takes --broker (this design) or --etcd (before it).
    Run outside the repository, whose ``dxpool`` folder would shadow the install's."""
    help_text = subprocess.run(
        [python, "-m", "dxpool.hostagent", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    ).stdout
    return "--broker" in help_text


@dataclass
class Stack:
    """One variant's etcd, broker and agents. Its processes run in ``work``, outside the
    repository, so each imports its own install."""

    name: str
    python: str
    work: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    etcd: EmbeddedEtcd | None = None
    endpoint: str = ""

    def start(self) -> Stack:
        self.work.mkdir(parents=True, exist_ok=True)
        self.etcd = EmbeddedEtcd(self.work / "etcd").start()
        port, agent_port = free_ports(2)
        self.endpoint = f"127.0.0.1:{port}"
        brokers = talks_to_brokers(self.python)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = open(self.work / "processes.log", "ab")  # noqa: SIM115 - shared by the children
        fabric = self.work / "fabric"
        SimFabric.create(
            fabric,
            boxes={f"box{i}": [SimGpuSpec("H100", 81920)] * GPUS_PER_BOX for i in range(BOXES)},
            hosts={f"h{i}": SLOTS for i in range(HOSTS)},
        )
        broker = [self.python, "-m", "dxpool.broker", "--etcd", self.etcd.endpoint,
                  "--listen", self.endpoint, "--insecure", "--log-level", "WARNING"]  # fmt: skip
        if brokers:
            broker += ["--agent-listen", f"127.0.0.1:{agent_port}"]
        self.processes.append(
            subprocess.Popen(broker, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.work)
        )
        with Client(self.endpoint, insecure=True, timeout_s=30) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.list_boxes()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            for index in range(BOXES):
                client.create_box(
                    f"box{index}",
                    gpus=GPUS_PER_BOX,
                    model="H100",
                    memory_mib=81920,
                    location=("s1", "p1", f"r{index}"),
                )
            for index in range(HOSTS):
                link = (
                    ["--broker", f"127.0.0.1:{agent_port}"]
                    if brokers
                    else ["--etcd", self.etcd.endpoint]
                )
                agent = [self.python, "-m", "dxpool.hostagent", "--host", f"h{index}", *link,
                         "--driver", "sim", "--sim-state", str(fabric), "--slots", str(SLOTS),
                         "--site", "s1", "--pod", "p1", "--rack", f"r{index % BOXES}",
                         "--log-level", "WARNING"]  # fmt: skip
                self.processes.append(
                    subprocess.Popen(
                        agent, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.work
                    )
                )
            while sum(h.alive for h in client.list_hosts()) < HOSTS:
                if time.monotonic() > deadline + 60:
                    raise RuntimeError(f"{self.name}: agents did not register; see {self.work}")
                time.sleep(0.2)
        log.close()
        return self

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
        if self.etcd is not None:
            self.etcd.stop()


class NodeStates:
    """One WatchNodes stream of every node: when each node was first seen in each state."""

    def __init__(self, endpoint: str) -> None:
        self._channel = grpc.insecure_channel(endpoint)
        self._stream = nodes_pb2_grpc.NodeServiceStub(self._channel).WatchNodes(
            nodes_pb2.WatchNodesRequest()
        )
        self._seen: dict[tuple[str, int], float] = {}
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._stream:
                if event.type == nodes_pb2.NodeEvent.TYPE_SYNCED:
                    continue
                now = time.perf_counter()
                with self._changed:
                    self._seen.setdefault((event.node.name, event.node.state), now)
                    self._changed.notify_all()
        except grpc.RpcError:
            pass

    def wait(self, name: str, state: int, timeout_s: float = 60.0) -> float:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while (name, state) not in self._seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{name} not {pb.NodeState.Name(state)} in {timeout_s}s")
                self._changed.wait(left)
            return self._seen[(name, state)]

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()


def one_round(stack: Stack, samples: int, pause_s: float) -> list[float]:
    """``samples`` compose→READY times (seconds) on ``stack``."""
    states = NodeStates(stack.endpoint)
    channel = grpc.insecure_channel(stack.endpoint)
    stub = nodes_pb2_grpc.NodeServiceStub(channel)
    times = []
    try:
        for _ in range(samples):
            time.sleep(pause_s)
            started = time.perf_counter()
            node = stub.ComposeNode(ONE_GPU, timeout=30)
            ready = states.wait(node.name, pb.NODE_STATE_READY)
            times.append(ready - started)
            stub.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name), timeout=30)
            states.wait(node.name, pb.NODE_STATE_RELEASED)
    finally:
        states.close()
        channel.close()
    return times


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="Python of the earlier install to compare with")
    parser.add_argument("--build-before", metavar="COMMIT", help="make the earlier install")
    parser.add_argument("--into", type=Path, default=Path("/tmp/dxpool-before"))
    parser.add_argument("--samples", type=int, default=50, help="composes per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, alternating variants")
    parser.add_argument("--pause-ms", type=float, default=20.0)
    args = parser.parse_args()
    if args.build_before:
        python = build_before(args.build_before, args.into)
        print(f"before: {python}")
        if not args.before:
            return
    if not args.before:
        parser.error("give --before PYTHON (or --build-before COMMIT to make one)")
    work = Path(tempfile.mkdtemp(prefix="dxpool-agent-path-"))
    stacks = {
        "after": Stack("after", sys.executable, work / "after"),
        "before": Stack("before", args.before, work / "before"),
    }
    times: dict[str, list[float]] = {name: [] for name in stacks}
    try:
        for stack in stacks.values():
            stack.start()
            path = "brokers" if talks_to_brokers(stack.python) else "etcd"
            print(f"{stack.name}: up, agents talk to {path}", flush=True)
        for stack in stacks.values():  # warm-up: first composes pay for imports and caches
            one_round(stack, 5, args.pause_ms / 1000)
        for number in range(args.rounds):
            stack = list(stacks.values())[number % 2]
            measured = one_round(stack, args.samples, args.pause_ms / 1000)
            times[stack.name] += measured
            print(
                f"round {number + 1}: {stack.name} p50 {statistics.median(measured) * 1000:.1f} ms",
                flush=True,
            )
    finally:
        for stack in stacks.values():
            stack.stop()
    print(f"compose->READY, 1 GPU, {args.rounds} rounds of {args.samples}, alternating:")
    for name, values in times.items():
        print(
            f"  {name:6}  n={len(values)}  p50 {quantile(values, 0.5) * 1000:.1f} ms  "
            f"p90 {quantile(values, 0.9) * 1000:.1f} ms  p99 {quantile(values, 0.99) * 1000:.1f} ms"
        )
    ratio = quantile(times["after"], 0.5) / quantile(times["before"], 0.5)
    print(f"  p50 after/before: {ratio:.2f}")
    print(f"  logs: {work}")


if __name__ == "__main__":
    main()
