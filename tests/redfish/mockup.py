"""DMTF's Redfish Mockup Server, run from the reference material next to the checkout.

The Mockup Server and DMTF's published mockups are third-party material: they are not
part of dxpool and are not copied into it. They are found at ``<repo>/../shared/redfish``
(``mockup-server/redfishMockupServer.py``, ``mockups/<name>/``), or wherever
``DXPOOL_REDFISH_MOCKUPS`` points; :func:`locate` says why not when they are absent, and
the tests that need them skip with that reason.

What the Mockup Server (1.2.6) does, read from its source and checked against it: it
serves a mockup folder (``-S``: without the ``/redfish/v1`` folders); keeps PATCH, POST
and DELETE in memory, for as long as the process runs; merges a PATCH into the resource
(lists replaced whole) whatever the property - read-only ones included - and answers
204; ignores ``If-Match`` and sends no ``ETag`` (its ``-E`` flag is unimplemented);
answers a POST to a target listed in the resource's ``Actions`` with 204 and changes
nothing (it has no mode that carries out actions, nor one that answers 202); creates a
session for any credentials (a fixed token) and authenticates nothing. Where a test needs
a behaviour the standard requires and the Mockup Server lacks, it puts
:mod:`tests.redfish.proxy` in front.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
ENVIRONMENT = "DXPOOL_REDFISH_MOCKUPS"
SERVER = "mockup-server/redfishMockupServer.py"
MOCKUPS = ("public-cxl", "public-cxl-multiswitch", "public-expansion-box")
START_TIMEOUT_S = 60.0


def locate() -> tuple[Path | None, str]:
    """The folder holding ``mockup-server/`` and ``mockups/``, or None and why not."""
    configured = os.environ.get(ENVIRONMENT)
    root = Path(configured) if configured else REPO.parent / "shared" / "redfish"
    where = f"${ENVIRONMENT}={configured}" if configured else str(root)
    if not (root / SERVER).is_file():
        return None, (
            f"DMTF's Redfish Mockup Server is not at {where} ({SERVER} missing); set "
            f"{ENVIRONMENT} to the folder holding mockup-server/ and mockups/"
        )
    missing = [name for name in MOCKUPS if not (root / "mockups" / name / "index.json").is_file()]
    if missing:
        return None, f"DMTF's mockups {', '.join(missing)} are not under {root / 'mockups'}"
    needs = [name for name in ("requests", "grequests") if importlib.util.find_spec(name) is None]
    if needs:
        return None, (
            f"the Mockup Server needs {' and '.join(needs)}: pip install -e '.[dev]' brings them"
        )
    return root, ""


@dataclass
class MockupServer:
    """One running Mockup Server serving ``mockup``."""

    mockup: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> dict[str, object]:
        """A resource as the Mockup Server holds it (straight, past any proxy)."""
        response = requests.get(f"{self.url}{path}", timeout=10)
        response.raise_for_status()
        body = response.json()
        assert isinstance(body, dict)
        return body

    def patch(self, path: str, body: dict[str, object]) -> None:
        """Change a resource in the Mockup Server's memory, as another client would."""
        requests.patch(f"{self.url}{path}", json=body, timeout=10).raise_for_status()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def mockup_server(root: Path, mockup: str, log_dir: Path) -> Iterator[MockupServer]:
    """Run the Mockup Server on a free loopback port serving ``mockup``; it is stopped
    (by its process id) on exit. Tries another port if the chosen one was taken."""
    server = root / SERVER
    for attempt in range(3):
        port = free_port()
        log_path = log_dir / f"mockup-{mockup}-{port}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, str(server), "-D", str(root / "mockups" / mockup), "-S",
                 "-H", "127.0.0.1", "-p", str(port)],
                cwd=server.parent,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        running = MockupServer(mockup, f"http://127.0.0.1:{port}", process, log_path)
        try:
            if _wait_ready(running):
                yield running
                return
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        if attempt == 2:
            raise RuntimeError(f"the Mockup Server did not start:\n{running.log()}")


def _wait_ready(server: MockupServer) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False  # it exited: the port was taken, or the mockup is bad
        try:
            if requests.get(f"{server.url}/redfish/v1/", timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the Mockup Server did not answer in {START_TIMEOUT_S:g}s:\n{server.log()}")


__all__ = ["MOCKUPS", "MockupServer", "locate", "mockup_server"]
