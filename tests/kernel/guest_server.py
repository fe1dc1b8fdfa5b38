"""The control channel's guest end: runs inside the QEMU guest as its one program.

It prepares the guest (loopback and the virtio network up, udev running so drivers load
on hot-add, ``vfio-pci`` loaded), then answers requests from the host on a virtio-serial
port, one JSON object per line each way::

    {"id": 7, "function": "tests.kernel.guest_ops:read", "kwargs": {"path": "..."}}
    {"id": 7, "result": ...}                          on success
    {"id": 7, "error": {"type": "module:Class", "message": "...", "errno": 19, ...}}

Requests run one at a time, in order. Standard library and dxpool only: the guest shares
the host's root filesystem (and its virtual environment) read-only.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PORT_NAME = "dxpool.control"


def find_port(name: str) -> Path:
    """The character device of the virtio-serial port called ``name``."""
    for entry in Path("/sys/class/virtio-ports").iterdir():
        if (entry / "name").read_text().strip() == name:
            return Path("/dev") / entry.name
    raise SystemExit(f"guest: no virtio-serial port named {name}")


def prepare_guest() -> None:
    """Bring up what the tests rely on; each step logs and goes on when it fails."""
    for argv in (
        ["ip", "link", "set", "lo", "up"],
        ["modprobe", "vfio-pci"],
    ):
        _run(argv)
    _run(["sh", "-c", "pgrep -x systemd-udevd >/dev/null || pgrep -x udevd >/dev/null || "
                      "(/lib/systemd/systemd-udevd --daemon || udevd --daemon)"])  # fmt: skip
    _run(["udevadm", "trigger", "--action=add"])
    _run(["udevadm", "settle", "--timeout=120"])
    address = os.environ.get("DXPOOL_GUEST_NET")
    if address:
        for interface in sorted(os.listdir("/sys/class/net")):
            if interface != "lo":
                _run(["ip", "addr", "add", address, "dev", interface])
                _run(["ip", "link", "set", interface, "up"])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"guest: {' '.join(argv)}: {done.returncode} {done.stderr.strip()}", file=sys.stderr)


def describe_error(error: BaseException) -> dict[str, Any]:
    described: dict[str, Any] = {
        "type": f"{type(error).__module__}:{type(error).__qualname__}",
        "message": str(getattr(error, "message", error)),
        "traceback": traceback.format_exc(limit=8),
    }
    if isinstance(error, OSError):
        described["errno"] = error.errno
        described["strerror"] = error.strerror
    if hasattr(error, "retryable"):
        described["retryable"] = error.retryable
    return described


def answer(request: dict[str, Any]) -> dict[str, Any]:
    module_name, _, function_name = request["function"].partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
        return {"id": request["id"], "result": function(**request.get("kwargs", {}))}
    except Exception as error:
        return {"id": request["id"], "error": describe_error(error)}


def write_all(channel: Any, data: bytes) -> None:
    """Write every byte: a raw write to a virtio port takes at most what fits its buffer."""
    view = memoryview(data)
    while view:
        written = channel.write(view)
        view = view[written or 0 :]


def serve(port: Path) -> None:
    # A virtio-serial port opens once; one descriptor carries both directions.
    with open(port, "r+b", buffering=0) as channel:
        incoming = outgoing = channel
        write_all(outgoing, json.dumps({"id": 0, "result": "ready"}).encode() + b"\n")
        buffer = b""
        while True:
            chunk = incoming.read(65536)
            if not chunk:  # nobody connected on the host: wait for the next one
                time.sleep(0.05)
                continue
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if not line.strip():
                    continue
                reply = answer(json.loads(line))
                write_all(outgoing, json.dumps(reply, default=str).encode() + b"\n")


def main() -> None:
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    prepare_guest()
    serve(find_port(PORT_NAME))


if __name__ == "__main__":
    main()
