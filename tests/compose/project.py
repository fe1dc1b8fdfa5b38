"""Drive a docker-compose project of ``docker-compose.yml`` (with etcd from the local image)
from a test.

:func:`find_engine` says whether a container engine and compose are usable here, and if
not, exactly what is missing (the test skips with that message). :class:`ComposeProject`
runs ``docker-compose`` with a project name of its own and a broker port of its own, so
several runs can share one engine without touching each other's containers or volumes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The override runs etcd from the locally built image: the suite runs where no registry
# can be reached, so it must not pull etcd's official image.
COMPOSE_FILES = (REPO / "docker-compose.yml", REPO / "docker-compose.local-etcd.yml")
BUILD_SCRIPT = REPO / "docker" / "build-image.sh"
BASE_IMAGE = os.environ.get("DXPOOL_BASE_IMAGE", "dxpool-base:bookworm")
SETUP_HINT = "run docker/compose-test.sh as root, which installs and starts what is missing"


@dataclass(frozen=True)
class Engine:
    """A usable engine: ``compose`` is the compose command line (``docker-compose`` or
    ``docker compose``)."""

    docker: str
    compose: tuple[str, ...]


def _run_quietly(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def find_engine() -> Engine | str:
    """The engine to use, or a sentence naming what is missing and how to get it."""
    docker = shutil.which("docker")
    if docker is None:
        return f"no `docker` binary on PATH: install docker.io ({SETUP_HINT})"
    info = _run_quietly([docker, "info", "--format", "{{.ServerVersion}}"])
    if info.returncode != 0:
        detail = (info.stderr.strip().splitlines() or ["no output"])[-1]
        return (
            f"the Docker engine does not answer `docker info` ({detail}): "
            f"start dockerd ({SETUP_HINT})"
        )
    compose_v1 = shutil.which("docker-compose")
    if compose_v1 is not None:
        compose: tuple[str, ...] = (compose_v1,)
    elif _run_quietly([docker, "compose", "version"]).returncode == 0:
        compose = (docker, "compose")
    else:
        return (
            "neither `docker-compose` nor `docker compose` is available: "
            f"install docker-compose ({SETUP_HINT})"
        )
    if _run_quietly([docker, "image", "inspect", BASE_IMAGE]).returncode != 0:
        missing = [tool for tool in ("debootstrap",) if shutil.which(tool) is None]
        if os.geteuid() != 0 or missing:
            needs = "root" if os.geteuid() != 0 else ", ".join(missing)
            return (
                f"the base image {BASE_IMAGE} is missing and cannot be built here "
                f"(needs {needs}): run docker/base-image.sh as root ({SETUP_HINT})"
            )
    return Engine(docker, compose)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class ComposeProject:
    """One ``docker-compose`` project of the repository's compose file.

    ``down`` is idempotent and removes the project's containers, network and volumes.
    """

    engine: Engine
    name: str = field(default_factory=lambda: f"dxpoolct{uuid.uuid4().hex[:10]}")
    broker_port: int = field(default_factory=free_port)

    @property
    def endpoint(self) -> str:
        """The broker as published on the machine's loopback."""
        return f"127.0.0.1:{self.broker_port}"

    def compose(
        self, *args: str, timeout_s: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``docker-compose -p NAME -f FILE... ARGS`` over :data:`COMPOSE_FILES`; raises
        with the command's output if it fails and ``check`` is set."""
        files = [arg for path in COMPOSE_FILES for arg in ("-f", str(path))]
        command = [*self.engine.compose, "-p", self.name, *files, *args]
        env = {**os.environ, "DXPOOL_BROKER_PORT": str(self.broker_port)}
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=REPO,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited with {done.returncode}\n"
                f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
            )
        return done

    def up(self) -> None:
        """Start every service in the background (the image must exist)."""
        self.compose("up", "-d", "--no-build")

    def logs(self, tail: int = 200) -> str:
        done = self.compose("logs", "--no-color", f"--tail={tail}", check=False)
        return done.stdout + done.stderr

    def exited_with(self, service: str) -> int | None:
        """Exit status of the service's container, or None while it runs."""
        container_ids = self.compose("ps", "-q", service).stdout.split()
        if not container_ids:
            raise AssertionError(f"service {service} has no container")
        state = subprocess.run(
            [self.engine.docker, "inspect", "--format", "{{json .State}}", container_ids[0]],
            capture_output=True,
            text=True,
            check=True,
        )
        parsed = json.loads(state.stdout)
        return None if parsed["Running"] else int(parsed["ExitCode"])

    def python_in(self, service: str, code: str) -> str:
        """Run ``python -c CODE`` in the running container of ``service``; its stdout."""
        return self.compose("exec", "-T", service, "python", "-c", code).stdout

    def leftovers(self) -> list[str]:
        """Containers and volumes of this project that still exist."""
        label = f"label=com.docker.compose.project={self.name}"
        found: list[str] = []
        for kind in ("container", "volume"):
            args = [self.engine.docker, kind, "ls", "-q", "--filter", label]
            if kind == "container":
                args.insert(3, "-a")
            listed = subprocess.run(args, capture_output=True, text=True, check=True)
            found += [f"{kind} {item}" for item in listed.stdout.split()]
        return found

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False)


def build_image(python: str) -> None:
    """Build the base image (once), the wheelhouse and the dxpool image."""
    done = subprocess.run(
        [str(BUILD_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHON": python},
        cwd=REPO,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"{BUILD_SCRIPT} failed:\n{done.stdout}\n{done.stderr}")
