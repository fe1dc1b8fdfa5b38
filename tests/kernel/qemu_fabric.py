"""An emulated PCIe fabric whose box side is QMP: what a DxPU-style proxy does, on guests.

Each host is a QEMU guest; each of its proxy slots is one hot-plug capable root port.
Mapping a GPU to a host slot presents the GPU's stand-in card there (``device_add``);
unmapping or fencing withdraws it (``device_del``, then waiting until QEMU has let it go,
which under pciehp takes the guest's 5-second attention-button wait). It serves the
command-hook verbs over loopback TCP to :mod:`tests.kernel.fabric_hook`: ``map``,
``unmap``, ``status`` and ``fence`` for agents, ``fence-gpu`` and ``scrub-gpu`` for the
broker, keeping the contract of ``dxpool/hooks.py``: exit 3 for a conflict or a scrub
while mapped, 4 for a refusal for good (a fenced generation), 1 for a transient failure.
Generations are recorded: a map of a fenced generation is refused.

What QEMU 7.2 cannot emulate: a surprise link-down (``device_del`` is always an orderly
request the guest must answer), and withdrawing a card from a port without a power
controller under pciehp (the guest lets the device go, QEMU waits for a power-off that
never comes). A withdrawal from a guest that is gone (killed: the host lost power) is
immediate. Powering a slot off from the guest makes QEMU drop the card at once, unlike
hardware, where it stays in the unpowered slot; a later map presents it again.
"""

from __future__ import annotations

import json
import socketserver
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.kernel import box
from tests.kernel.box import Card
from tests.kernel.qemu_guest import REPO_ROOT, Guest

EXIT_CONFLICT = 3
EXIT_REFUSED = 4
EXIT_TRANSIENT = 1


@dataclass
class _Host:
    guest: Guest
    ports: dict[int, str]  # host slot -> QEMU id of the root port


@dataclass
class _Mapping:
    box: str
    slot: int
    generation: int


@dataclass
class QemuFabric:
    """The fabric; a context manager serving hooks on ``127.0.0.1:port``."""

    hosts: dict[str, _Host] = field(default_factory=dict)
    table: dict[str, dict[int, _Mapping]] = field(default_factory=dict)
    fenced: dict[tuple[str, int], int] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: socketserver.ThreadingTCPServer | None = None

    # -- setup -----------------------------------------------------------------------------

    def __enter__(self) -> QemuFabric:
        fabric = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline()
                if not line.strip():
                    return  # a connection that asked nothing
                request = json.loads(line)
                rc, out, err = fabric.run(request["argv"])
                reply = {"rc": rc, "stdout": out, "stderr": err}
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        socketserver.ThreadingTCPServer.daemon_threads = True
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def add_host(self, host: str, guest: Guest, ports: dict[int, str]) -> None:
        with self._lock:
            self.hosts[host] = _Host(guest, dict(ports))
            self.table.setdefault(host, {})

    def write_hook(self, path: Path, address: str) -> Path:
        """An executable hook at ``path`` that reaches this fabric at ``address``."""
        script = REPO_ROOT / "tests" / "kernel" / "fabric_hook.py"
        # -I -S: the standard library only, no site packages to scan at start (a hook
        # runs once per operation, in a slow guest).
        path.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S {script} {address} "$@"\n')
        path.chmod(0o755)
        return path

    @staticmethod
    def card(box_id: str, slot: int) -> Card:
        """The stand-in card of GPU ``box_id/slot`` (its serial number is fixed by it)."""
        return Card(f"gpu-{box_id}-{slot}", (zlib.crc32(box_id.encode()) & 0xFF) << 8 | slot)

    def mapped(self, host: str) -> dict[int, tuple[str, int]]:
        with self._lock:
            return {s: (m.box, m.slot) for s, m in self.table.get(host, {}).items()}

    # -- the verbs -------------------------------------------------------------------------

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        verb = argv[0] if argv else ""
        handler = {
            "map": self._map,
            "unmap": self._unmap,
            "status": self._status,
            "fence": self._fence_host,
            "fence-gpu": self._fence_gpu,
            "scrub-gpu": self._scrub_gpu,
        }.get(verb)
        if handler is None:
            return EXIT_REFUSED, "", f"unknown verb {verb!r}\n"
        started = time.monotonic()
        with self._lock:
            try:
                rc, out, err = handler(*argv[1:])
            except (TimeoutError, OSError, RuntimeError) as error:
                rc, out, err = EXIT_TRANSIENT, "", f"{verb}: {error}\n"
        self.log.append(
            {"argv": argv, "rc": rc, "seconds": time.monotonic() - started, "at": time.time()}
        )
        return rc, out, err

    def _map(self, host: str, box_id: str, slot: str, host_slot: str, gen: str) -> Result:
        gpu, at, generation = (box_id, int(slot)), int(host_slot), int(gen)
        if generation <= self.fenced.get(gpu, -1):
            return EXIT_REFUSED, "", f"generation {generation} of {box_id}/{slot} is fenced\n"
        if host not in self.hosts or at not in self.hosts[host].ports:
            return EXIT_REFUSED, "", f"host {host} has no proxy slot {at}\n"
        for other_host, mappings in self.table.items():
            for other_slot, m in mappings.items():
                if (m.box, m.slot) == gpu and (other_host, other_slot) != (host, at):
                    return EXIT_CONFLICT, "", f"{box_id}/{slot} is mapped to {other_host}\n"
        held = self.table[host].get(at)
        if held is not None and (held.box, held.slot) != gpu:
            return EXIT_CONFLICT, "", f"host slot {at} holds {held.box}/{held.slot}\n"
        self.table[host][at] = _Mapping(box_id, int(slot), generation)
        target = self.hosts[host]
        card = self.card(box_id, int(slot))
        if target.guest.alive and card.qemu_id not in box.cards_in(target.guest):
            box.present(target.guest, card, target.ports[at])
        return 0, json.dumps({"message": "mapped"}), ""

    def _withdraw(self, host: str, host_slot: int) -> None:
        """Take the card of ``host``'s slot away; return once QEMU let it go."""
        mapping = self.table[host][host_slot]
        target = self.hosts[host]
        card = self.card(mapping.box, mapping.slot)
        if target.guest.alive and card.qemu_id in box.cards_in(target.guest):
            try:
                box.request_withdraw(target.guest, card.qemu_id)
            except Exception as error:  # "already in the process of unplug": wait for it
                if "process of unplug" not in str(error):
                    raise RuntimeError(str(error)) from error
            if target.guest.alive:
                box.wait_deleted(target.guest, card.qemu_id)
        del self.table[host][host_slot]

    def _unmap(self, host: str, box_id: str, slot: str) -> Result:
        for host_slot, m in list(self.table.get(host, {}).items()):
            if (m.box, m.slot) == (box_id, int(slot)):
                self._withdraw(host, host_slot)
        return 0, json.dumps({"message": "unmapped"}), ""

    def _status(self, host: str) -> Result:
        mappings = [
            {"host_slot": s, "box": m.box, "slot": m.slot}
            for s, m in sorted(self.table.get(host, {}).items())
        ]
        return 0, json.dumps({"mappings": mappings}), ""

    def _fence_host(self, host: str) -> Result:
        revoked = [{"box": m.box, "slot": m.slot} for m in self.table.get(host, {}).values()]
        for host_slot in list(self.table.get(host, {})):
            self._withdraw(host, host_slot)
        return 0, json.dumps({"revoked": revoked}), ""

    def _fence_gpu(self, box_id: str, slot: str, gen: str) -> Result:
        gpu, generation = (box_id, int(slot)), int(gen)
        for host, mappings in self.table.items():
            for host_slot, m in list(mappings.items()):
                if (m.box, m.slot) == gpu and m.generation <= generation:
                    self._withdraw(host, host_slot)
        self.fenced[gpu] = max(self.fenced.get(gpu, -1), generation)
        return 0, json.dumps({"message": "fenced"}), ""

    def _scrub_gpu(self, box_id: str, slot: str, gen: str) -> Result:
        for host, mappings in self.table.items():
            if any((m.box, m.slot) == (box_id, int(slot)) for m in mappings.values()):
                return EXIT_CONFLICT, "", f"{box_id}/{slot} is still mapped to {host}\n"
        return 0, json.dumps({"message": "reset"}), ""


Result = tuple[int, str, str]

__all__ = ["QemuFabric"]
