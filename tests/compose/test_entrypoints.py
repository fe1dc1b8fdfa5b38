"""The container entrypoints, run here without a container engine (fast).

``agent.sh``'s wait for the fabric, and ``setup.sh`` against a real broker on loopback
(real etcd), run twice to show it is idempotent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dxpool.client import Client
from dxpool.fabric.sim import SimFabric, SimGpuSpec
from tests.compose.project import REPO

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer

ENTRYPOINTS = REPO / "docker" / "entrypoints"
H100 = SimGpuSpec("H100", 81920)


def script_env(**extra: str) -> dict[str, str]:
    """This environment with the running interpreter's `python` and `dxpool` first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **extra}


def test_agent_script_gives_up_when_no_fabric_appears(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(ENTRYPOINTS / "agent.sh"), "--host=h1", f"--sim-state={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=30,
        env=script_env(DXPOOL_FABRIC_WAIT_S="1"),
        check=False,
    )
    assert done.returncode == 1
    assert f"no simulated fabric in {tmp_path} after 1s" in done.stderr


def test_agent_script_starts_the_agent_once_the_fabric_exists(tmp_path: Path) -> None:
    SimFabric.create(tmp_path, boxes={"box1": [H100]}, hosts={"h1": 8})
    done = subprocess.run(
        [str(ENTRYPOINTS / "agent.sh"), "--sim-state", str(tmp_path), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=script_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Run a dxpool host agent" in done.stdout
    assert "waiting for the simulated fabric" not in done.stderr


def run_setup(broker: BrokerServer, fabric_dir: Path) -> subprocess.CompletedProcess[str]:
    env = script_env(
        DXPOOL_ENDPOINT=broker.endpoint,
        DXPOOL_FABRIC_DIR=str(fabric_dir),
        DXPOOL_BOXES="box1 box2 box3",
        DXPOOL_HOSTS="h1 h2",
        DXPOOL_GPUS="H100:2",
        DXPOOL_GPU_MEMORY="80GiB",
        DXPOOL_SLOTS="4",
        DXPOOL_BROKER_WAIT_S="30",
    )
    return subprocess.run(
        [str(ENTRYPOINTS / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_setup_installs_the_fabric_and_registers_boxes_once(
    broker_factory: Callable[..., BrokerServer], tmp_path: Path
) -> None:
    broker = broker_factory()
    first = run_setup(broker, tmp_path / "fabric")
    assert first.returncode == 0, first.stderr

    fabric = SimFabric(tmp_path / "fabric")
    assert set(fabric.boxes()) == {"box1", "box2", "box3"}
    assert fabric.hosts() == {"h1": 4, "h2": 4}
    with Client(broker.endpoint) as client:
        boxes = {b.name: b for b in client.list_boxes()}
        assert sorted(boxes) == ["boxes/box1", "boxes/box2", "boxes/box3"]
        places = {n: (b.location.pod, b.location.rack) for n, b in boxes.items()}
        assert places == {
            "boxes/box1": ("p1", "r1"),
            "boxes/box2": ("p1", "r2"),
            "boxes/box3": ("p2", "r3"),
        }
        assert len(client.list_gpus()) == 6

        second = run_setup(broker, tmp_path / "fabric")
        assert second.returncode == 0, second.stderr
        assert second.stderr.count("is already registered") == 3
        assert len(client.list_boxes()) == 3
