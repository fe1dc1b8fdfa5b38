"""docker-compose integration run: etcd, a broker and three host agents in containers.

The pool of ``docker-compose.yml`` is built (base image, wheelhouse, image) and started
under a project name of its own with its broker on a free loopback port; the tests then
drive it from this machine the way an operator and an orchestrator would, with the real
``dxpool`` CLI and :class:`dxpool.client.Client`, and check the simulated fabric in the
shared volume (the "hardware") agrees with what the broker says. ``docker-compose down
-v`` removes everything at the end.

Skips, naming what is missing, where no container engine can be used; run
``docker/compose-test.sh`` as root to install and start one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.client import Client
from dxpool.errors import DxpoolError
from tests.compose.project import ComposeProject, Engine, build_image, find_engine

pytestmark = [pytest.mark.slow, pytest.mark.compose, pytest.mark.timeout(1500)]

BOXES = {"box1": "dc1/p1/r1", "box2": "dc1/p1/r2", "box3": "dc1/p2/r3"}
HOSTS = ("h1", "h2", "h3")
GPUS_PER_BOX = 8
STARTUP_TIMEOUT_S = 180.0
LEASE_EXPIRY_TIMEOUT_S = 60.0  # the agents' liveness TTL is 10 s
FABRIC_MAPPINGS = (
    "import json; from pathlib import Path; from dxpool.fabric.sim import SimFabric; "
    "f = SimFabric(Path('/fabric')); "
    "print(json.dumps({h: sorted(f'{b}/{s}' for b, s in f.mappings(h).values()) "
    "for h in sorted(f.hosts())}))"
)

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float) -> T:
    """Poll ``probe`` until it returns something other than None/False; fail naming
    ``what`` after ``timeout_s``. Broker errors while polling count as not yet."""
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while time.monotonic() < deadline:
        try:
            result = probe()
        except DxpoolError as error:
            last_error = f" (last error: {error})"
        else:
            if result is not None and result is not False:
                return result
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}{last_error}")


class Pool:
    """The running compose project, with the CLI and a client pointed at its broker."""

    def __init__(self, project: ComposeProject, client: Client) -> None:
        self.project = project
        self.client = client

    def cli(self, *args: str) -> str:
        """Run ``dxpool --endpoint BROKER ARGS``; its stdout, or a failure with stderr."""
        command = [sys.executable, "-m", "dxpool.cli", "--endpoint", self.project.endpoint]
        done = subprocess.run(
            [*command, *args], capture_output=True, text=True, timeout=180, check=False
        )
        assert done.returncode == 0, f"dxpool {' '.join(args)}: {done.stderr}"
        return done.stdout

    def cli_json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "-o", "json"))

    def alive_hosts(self) -> set[str]:
        return {h.name.removeprefix("hosts/") for h in self.client.list_hosts() if h.alive}

    def gpu_states(self) -> dict[str, int]:
        return {g.name: g.state for g in self.client.list_gpus()}

    def fabric_mappings(self) -> dict[str, list[str]]:
        """Host -> the GPUs (``box/slot``) its proxy maps, read from the shared volume."""
        mappings: dict[str, list[str]] = json.loads(
            self.project.python_in("agent-h2", FABRIC_MAPPINGS)
        )
        return mappings

    def all_free(self) -> bool:
        states = self.gpu_states()
        return len(states) == len(BOXES) * GPUS_PER_BOX and set(states.values()) == {
            pb.GPU_STATE_FREE
        }


@pytest.fixture(scope="module")
def engine() -> Engine:
    found = find_engine()
    if isinstance(found, str):
        if os.environ.get("DXPOOL_REQUIRE_COMPOSE") == "1":
            pytest.fail(f"DXPOOL_REQUIRE_COMPOSE=1 but {found}")
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def pool(engine: Engine) -> Iterator[Pool]:
    build_image(sys.executable)
    project = ComposeProject(engine)
    try:
        project.up()
        with Client(project.endpoint, timeout_s=5) as client:
            pool = Pool(project, client)
            wait_for(
                "3 registered boxes and 3 live hosts",
                lambda: len(client.list_boxes()) == len(BOXES) and pool.alive_hosts() == set(HOSTS),
                STARTUP_TIMEOUT_S,
            )
            yield pool
    except BaseException:
        print(project.logs())  # shown with the failure
        raise
    finally:
        project.down()
        leftovers = project.leftovers()
        assert not leftovers, f"docker-compose down -v left {leftovers}"


@pytest.fixture(autouse=True)
def compose_logs_on_failure(request: pytest.FixtureRequest, pool: Pool) -> Iterator[None]:
    """Print the containers' logs with a test that failed."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        print(pool.project.logs())


def test_setup_registers_boxes_and_hosts(pool: Pool) -> None:
    assert pool.project.exited_with("setup") == 0
    boxes = {box["name"].removeprefix("boxes/"): box for box in pool.cli_json("box", "list")}
    assert set(boxes) == set(BOXES)
    for name, place in BOXES.items():
        location = boxes[name]["location"]
        assert "/".join((location["site"], location["pod"], location["rack"])) == place
    assert pool.alive_hosts() == set(HOSTS)
    assert pool.all_free()
    assert pool.fabric_mappings() == {host: [] for host in HOSTS}


REACH_ETCD = (
    "import socket\n"
    "try:\n"
    "    socket.create_connection(('etcd', 2379), timeout=5).close()\n"
    "    print('reached')\n"
    "except OSError as error:\n"
    "    print('unreachable', error)"
)


def test_a_host_agents_container_cannot_reach_etcd(pool: Pool) -> None:
    """etcd is on a network only the broker joins: from an agent's container its name
    does not even resolve, let alone connect."""
    assert pool.project.python_in("agent-h1", REACH_ETCD).startswith("unreachable")
    assert pool.project.python_in("broker", REACH_ETCD).startswith("reached")


def test_node_create_and_delete_through_the_cli(pool: Pool) -> None:
    node = pool.cli_json("node", "create", "--gpus", "H100:2", "--wait", "--timeout", "120s")
    assert node["state"] == "NODE_STATE_READY", node
    host = node["host"].removeprefix("hosts/")
    bound = sorted(b["gpu"].removeprefix("boxes/").replace("/gpus/", "/") for b in node["gpus"])
    assert len(bound) == 2
    assert all(b["uuid"] and b["bdf"] for b in node["gpus"]), node["gpus"]
    # The hardware agrees: the host's proxy maps exactly the node's GPUs.
    assert pool.fabric_mappings()[host] == bound

    pool.cli("node", "delete", node["name"], "--wait", "--timeout", "120s")
    assert pool.client.get_node(node["name"]).state == pb.NODE_STATE_RELEASED
    wait_for("every GPU FREE again", pool.all_free, 60)
    assert pool.fabric_mappings() == {h: [] for h in HOSTS}


def test_killed_agent_restarts_and_the_pool_converges(pool: Pool) -> None:
    project, client = pool.project, pool.client
    on_h1 = client.wait_for_node(
        client.compose_node("H100:2", host="h1", request_id="compose-on-h1").name, timeout_s=120
    )
    mapped = sorted(g.gpu.removeprefix("boxes/").replace("/gpus/", "/") for g in on_h1.gpus)

    # A crash and a quick restart: the agent finds its GPUs mapped and keeps them.
    project.compose("kill", "agent-h1")
    status = wait_for("agent-h1 to exit", lambda: project.exited_with("agent-h1"), 30)
    assert status == 137  # SIGKILL: no goodbye, the host lives until its liveness TTL
    project.compose("start", "agent-h1")
    wait_for("h1 alive after a restart", lambda: "h1" in pool.alive_hosts(), 60)
    wait_for(
        "the node on h1 READY again",
        lambda: client.get_node(on_h1.name).state == pb.NODE_STATE_READY,
        60,
    )
    assert pool.fabric_mappings()["h1"] == mapped

    # A crash longer than the liveness TTL: the broker sees h1 go, and the pool keeps
    # serving from the other hosts meanwhile.
    project.compose("kill", "agent-h1")
    wait_for("h1's liveness to expire", lambda: pool.alive_hosts() == {"h2", "h3"}, 60)
    elsewhere = client.wait_for_node(
        client.compose_node("H100:2", request_id="compose-while-h1-down").name, timeout_s=120
    )
    assert elsewhere.host in {"hosts/h2", "hosts/h3"}
    project.compose("start", "agent-h1")
    wait_for("h1 alive again", lambda: pool.alive_hosts() == set(HOSTS), 60)

    # Converged: both nodes release cleanly, every GPU is FREE and unmapped, and h1
    # serves a new node.
    for node in (on_h1, elsewhere):
        client.release_node(node.name)
        client.wait_for_node(node.name, until=[pb.NODE_STATE_RELEASED], timeout_s=120)
    wait_for("every GPU FREE again", pool.all_free, 60)
    assert pool.fabric_mappings() == {h: [] for h in HOSTS}
    again = client.wait_for_node(
        client.compose_node("H100:1", host="h1", request_id="compose-on-h1-again").name,
        timeout_s=120,
    )
    assert again.state == pb.NODE_STATE_READY
    client.release_node(again.name)
    client.wait_for_node(again.name, until=[pb.NODE_STATE_RELEASED], timeout_s=120)
