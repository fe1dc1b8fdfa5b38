"""What the host may ask of the guest over the control channel (:mod:`guest_server`).

Plain functions with JSON arguments and results. Buses are kept by name between calls,
because :class:`SysfsPciBus` remembers what each rescan did for the timeout that may
follow. Results that are dataclasses travel as ``{"__dataclass__": "module:Class", ...}``
so the host rebuilds them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from typing import Any

from dxpool.hostagent.drivers.linux_pci import SysfsPciBus
from dxpool.hostagent.drivers.sysfs import Sysfs

_buses: dict[str, SysfsPciBus] = {}
_processes: dict[int, subprocess.Popen[bytes]] = {}


def encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        kind = type(value)
        return {"__dataclass__": f"{kind.__module__}:{kind.__qualname__}", **fields}
    if isinstance(value, list | tuple):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    return value


def ping() -> dict[str, Any]:
    with open("/proc/uptime") as uptime:
        return {"uptime_s": float(uptime.read().split()[0]), "kernel": os.uname().release}


def sh(command: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run ``command`` with ``sh -c``; its exit status and output."""
    done = subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def read(path: str) -> str | None:
    """A sysfs attribute's text (stripped), or None when it does not exist."""
    return Sysfs().read_text(path)


def write(path: str, value: str) -> None:
    """Write ``value`` to a sysfs attribute in one write; OSError travels back with errno."""
    Sysfs().write(path, value)


def exists(path: str) -> bool:
    return Sysfs().exists(path)


def wait_for(path: str, present: bool, timeout_s: float) -> float:
    """Wait until ``path`` under /sys exists (or is gone); seconds waited. TimeoutError."""
    started = time.monotonic()
    while Sysfs().exists(path) != present:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{path} still {'absent' if present else 'present'}")
        time.sleep(0.02)
    return time.monotonic() - started


def make_bus(name: str, ports: dict[str, str], **options: Any) -> None:
    """A :class:`SysfsPciBus` over the guest's /sys, kept as ``name``."""
    if "vendors" in options:
        options["vendors"] = frozenset(options["vendors"])
    _buses[name] = SysfsPciBus({int(k): v for k, v in ports.items()}, sysfs=Sysfs(), **options)


def bus_call(name: str, method: str, args: list[Any] | None = None, **kwargs: Any) -> Any:
    """Call ``method`` of the bus ``name``; an ExpectedDevice travels as a dict."""
    from dxpool.hostagent.driver import ExpectedDevice

    if isinstance(kwargs.get("expected"), dict):
        kwargs["expected"] = ExpectedDevice(**kwargs["expected"])
    return encode(getattr(_buses[name], method)(*(args or []), **kwargs))


def spawn(argv: list[str], log_path: str, env: dict[str, str] | None = None) -> int:
    """Start ``argv`` in a session of its own, output to ``log_path``; its pid."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    _processes[process.pid] = process
    return process.pid


def poll(pid: int) -> int | None:
    """Exit status of a spawned process, or None while it runs."""
    return _processes[pid].poll()


def stop(pid: int, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
    """Signal a spawned process and wait for it; its exit status (None: still running)."""
    process = _processes[pid]
    if process.poll() is None:
        process.send_signal(sig)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None
