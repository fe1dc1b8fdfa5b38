"""A Linux guest under QEMU for the real-kernel lane: booted by virtme-ng, driven over QMP
and over a control channel.

The guest runs the distribution kernel installed on this machine (``/boot/vmlinuz-*``)
on the machine's own root filesystem, shared read-only, so it runs this checkout's code
with this checkout's virtual environment. What the tests need of the machine:

* ``q35`` with hot-plug capable ``pcie-root-port``s at fixed addresses (``PortSpec``),
  one of them optionally without a power controller, and an emulated ``intel-iommu``;
* PCIe native hot-plug (pciehp) or QEMU's default ACPI hot-plug (``hotplug=``);
* QMP on a UNIX socket: the test is the box-side proxy, presenting and withdrawing
  devices with ``device_add`` / ``device_del``;
* a virtio-serial port carrying :mod:`tests.kernel.guest_server`'s requests;
* user networking restricted to the host's loopback ports the test forwards (``forwards``:
  guest ``GUEST_HOST:port`` reaches ``127.0.0.1:port`` on this machine, nothing else).

Every wait has a deadline on a condition, because TCG on a loaded two-core machine is
slow: booting takes 30 s to several minutes.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
GUEST_NET = "10.0.2.15/24"  # QEMU user networking's guest address
GUEST_HOST = "10.0.2.100"  # where the guest reaches the forwarded host ports
BOOT_TIMEOUT_S = float(os.environ.get("DXPOOL_KERNEL_BOOT_TIMEOUT", "900"))
CALL_TIMEOUT_S = 600.0
KVM_PROBE_TIMEOUT_S = 20.0


# -- what the machine has ------------------------------------------------------------------


def kernel_image() -> Path | None:
    """The guest kernel: ``$DXPOOL_KERNEL_IMAGE``, else the newest ``/boot/vmlinuz-*``
    whose modules are installed."""
    override = os.environ.get("DXPOOL_KERNEL_IMAGE")
    if override:
        return Path(override)
    images = sorted(glob.glob("/boot/vmlinuz-*"), key=os.path.getmtime, reverse=True)
    for image in images:
        release = Path(image).name.removeprefix("vmlinuz-")
        if Path(f"/lib/modules/{release}/modules.dep").exists():
            return Path(image)
    return None


def vng_binary() -> Path | None:
    beside = Path(sys.executable).parent / "vng"
    if beside.exists():
        return beside
    found = shutil.which("vng")
    return Path(found) if found else None


def missing_tools() -> str | None:
    """Why the lane cannot run here, or None when everything it needs is installed."""
    problems = []
    if shutil.which("qemu-system-x86_64") is None:
        problems.append("qemu-system-x86_64 (Debian qemu-system-x86)")
    if kernel_image() is None:
        problems.append("a kernel image with its modules (Debian linux-image-amd64)")
    if not Path("/bin/busybox").exists():
        problems.append("busybox (Debian busybox-static)")
    if shutil.which("udevadm") is None:
        problems.append("udev (Debian udev)")
    if vng_binary() is None:
        problems.append("vng (PyPI virtme-ng)")
    try:
        import qemu.qmp  # noqa: F401
    except ImportError:
        problems.append("the qemu.qmp module (PyPI qemu.qmp)")
    if not problems:
        return None
    return (
        "the real-kernel lane needs "
        + ", ".join(problems)
        + "; install them with scripts/kernel-lane-setup.sh (as root)"
    )


@functools.cache
def use_kvm() -> bool:
    """Whether guests run under KVM: ``$DXPOOL_KERNEL_ACCEL`` = ``kvm`` or ``tcg``, else
    (``auto``) KVM only when a probe boot under KVM reaches the kernel's first panic
    (no root filesystem given) within a deadline. Machines whose ``/dev/kvm`` exists but
    hangs or aborts guests get TCG."""
    wanted = os.environ.get("DXPOOL_KERNEL_ACCEL", "auto")
    if wanted in ("kvm", "tcg"):
        return wanted == "kvm"
    return _probe_kvm()


def _probe_kvm() -> bool:
    image = kernel_image()
    if image is None or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    argv = ["qemu-system-x86_64", "-accel", "kvm", "-machine", "q35", "-m", "256M",
            "-display", "none", "-serial", "stdio", "-no-reboot", "-kernel", str(image),
            "-append", "console=ttyS0 panic=-1 root=/dev/nonexistent"]  # fmt: skip
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=KVM_PROBE_TIMEOUT_S, check=False, text=True
        )
    except subprocess.TimeoutExpired:
        return False
    return "Kernel panic" in done.stdout


# -- the machine ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PortSpec:
    """A ``pcie-root-port`` on the root bus at ``00:<slot>.0``; its chassis slot number is
    ``chassis_slot`` (the name of its hotplug slot in sysfs)."""

    qemu_id: str
    slot: int
    chassis_slot: int
    power_controller: bool = True

    @property
    def bridge(self) -> str:
        return f"0000:00:{self.slot:02x}.0"

    def qemu_device(self) -> str:
        power = "" if self.power_controller else ",power_controller_present=off"
        return (
            f"pcie-root-port,id={self.qemu_id},bus=pcie.0,addr={self.slot:#x},"
            f"chassis={self.chassis_slot},slot={self.chassis_slot}{power}"
        )


@dataclass(frozen=True)
class GuestSpec:
    """``hotplug``: ``"pciehp"`` (QEMU's ACPI hot-plug off, so the kernel's PCIe native
    hot-plug driver owns the ports) or ``"acpi"`` (QEMU's default: acpiphp does)."""

    name: str
    hotplug: str = "pciehp"
    ports: tuple[PortSpec, ...] = ()
    forwards: tuple[int, ...] = ()  # host loopback ports the guest may reach
    memory: str = "1G"


@dataclass
class Timings:
    """Seconds each phase took, in the order they ran."""

    phases: list[tuple[str, float]] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases.append((name, time.monotonic() - started))


class GuestError(Exception):
    """A request failed inside the guest with an exception that has no class here."""

    def __init__(self, described: dict[str, Any]) -> None:
        super().__init__(f"{described['type']}: {described['message']}")
        self.type = described["type"]
        self.message = described["message"]
        self.errno = described.get("errno")
        self.traceback = described.get("traceback", "")


class ChannelClosedError(RuntimeError):
    """The control channel's socket closed while QEMU still runs."""


class Guest:
    """One booted guest. Use :meth:`boot`; :meth:`close` (or :meth:`kill`) ends it."""

    def __init__(self, spec: GuestSpec, workdir: Path) -> None:
        self.spec = spec
        self.workdir = workdir
        self.share = workdir / "share"  # the same path inside the guest, read-write there
        self.share.mkdir(parents=True, exist_ok=True)
        self.console_log = workdir / "console.log"
        self._sockets = Path(tempfile.mkdtemp(prefix="dxk-"))  # short: UNIX path limit
        self.qmp_path = self._sockets / "qmp.sock"
        self._control_path = self._sockets / "control.sock"
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._buffer = b""
        self._next_id = 1
        self._lock = threading.Lock()
        self.qmp: Any = None  # qemu.qmp.legacy.QEMUMonitorProtocol once booted
        self.qmp_lock = threading.Lock()
        self.boot_s: float | None = None
        self._started = 0.0
        self.accelerator = "kvm" if use_kvm() else "tcg"

    # -- lifecycle --------------------------------------------------------------------------

    def command(self) -> list[str]:
        image = kernel_image()
        assert image is not None
        qemu_opts = [
            "-device", "intel-iommu",
            "-qmp", f"unix:{self.qmp_path},server=on,wait=off",
            "-chardev", f"socket,id=dxctl,path={self._control_path},server=on,wait=off",
            "-device", "virtio-serial-pci,id=dxser",
            "-device", "virtserialport,bus=dxser.0,chardev=dxctl,name=dxpool.control",
        ]  # fmt: skip
        if self.spec.hotplug == "pciehp":
            qemu_opts += ["-global", "ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off"]
        for port in self.spec.ports:
            qemu_opts += ["-device", port.qemu_device()]
        if self.spec.forwards:
            # A guestfwd to a tcp: chardev carries one connection for the guest's whole
            # life; cmd: runs the relay for each connection instead.
            forwards = ",".join(
                f"guestfwd=tcp:{GUEST_HOST}:{p}-cmd:{self._relay_script(p)}"
                for p in self.spec.forwards
            )
            qemu_opts += [
                "-netdev", f"user,id=dxnet,restrict=on,{forwards}",
                "-device", "virtio-net-pci,netdev=dxnet",
            ]  # fmt: skip
        network = GUEST_NET if self.spec.forwards else ""
        exec_line = (
            f"env PYTHONDONTWRITEBYTECODE=1 DXPOOL_GUEST_NET={network} "
            f"{sys.executable} -m tests.kernel.guest_server"
        )
        argv = [
            str(vng_binary()),
            "--run", str(image),
            "--name", self.spec.name,
            "--memory", self.spec.memory,
            "--cpus", "1",
            "--cwd", str(REPO_ROOT),
            "--rwdir", str(self.share),
            "--append=intel_iommu=on iommu=pt",
            "--qemu-opts=" + " ".join(qemu_opts),
            "--exec", exec_line,
        ]  # fmt: skip
        if self.accelerator == "tcg":
            argv.insert(1, "--disable-kvm")
        return argv

    def _relay_script(self, port: int) -> Path:
        """An executable that relays its stdio to ``127.0.0.1:port`` (a path without
        spaces: virtme-ng splits QEMU's options at whitespace)."""
        relay = Path(__file__).with_name("stdio_relay.py")
        script = self.workdir / f"relay-{port}"
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "{relay}" {port}\n')
        script.chmod(0o755)
        return script

    def boot(self) -> Guest:
        """Start QEMU and wait until the guest's control end says it is ready."""
        self.start()
        self.wait_ready()
        return self

    def start(self) -> None:
        """Start QEMU (the guest boots in the background; :meth:`wait_ready` waits)."""
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        self._started = time.monotonic()
        with open(self.console_log, "wb") as log:
            self._process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        """Wait (``BOOT_TIMEOUT_S`` from the start) for the control channel's ready line."""
        deadline = self._started + BOOT_TIMEOUT_S
        self._connect_qmp(deadline)
        while True:
            self._connect_control(deadline)
            try:
                ready = self._receive(deadline)
                break
            except ChannelClosedError:  # QEMU still runs: connect again and go on waiting
                self._close_control()
                time.sleep(0.5)
        if ready.get("result") != "ready":
            raise RuntimeError(f"guest {self.spec.name} sent {ready!r} instead of ready")
        self.boot_s = time.monotonic() - self._started

    def _connect_control(self, deadline: float) -> None:
        while True:
            self._check_running()
            try:
                control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                control.connect(str(self._control_path))
            except (FileNotFoundError, ConnectionRefusedError):
                control.close()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"QEMU of {self.spec.name} never opened its control socket"
                    ) from None
                time.sleep(0.1)
                continue
            self._control = control
            return

    def _connect_qmp(self, deadline: float) -> None:
        from qemu.qmp.legacy import QEMUMonitorProtocol

        while True:
            self._check_running()
            try:
                qmp = QEMUMonitorProtocol(str(self.qmp_path))
                qmp.connect()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
                continue
            self.qmp = qmp
            return

    def _check_running(self) -> None:
        assert self._process is not None
        if self._process.poll() is not None:
            raise RuntimeError(
                f"QEMU of guest {self.spec.name} exited with {self._process.returncode}; "
                f"console:\n{self.console_tail()}"
            )

    def console_tail(self, lines: int = 60) -> str:
        try:
            text = self.console_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """End the guest at once, as a host that loses power (SIGKILL to QEMU)."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(60)
        self._close_channels()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._sockets, ignore_errors=True)

    def _close_channels(self) -> None:
        if self.qmp is not None:
            with contextlib.suppress(Exception):
                self.qmp.close()
            self.qmp = None
        self._close_control()

    def _close_control(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        self._buffer = b""

    # -- the control channel ----------------------------------------------------------------

    def call(self, function: str, /, reply_within_s: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        """Run ``tests.kernel.guest_ops:<function>`` (or ``module:function``) in the guest
        with ``kwargs``; its result, or the exception it raised rebuilt here (the same
        class for OSError and dxpool's errors, else :class:`GuestError`)."""
        target = function if ":" in function else f"tests.kernel.guest_ops:{function}"
        with self._lock:
            assert self._control is not None, "the guest is not running"
            request_id = self._next_id
            self._next_id += 1
            line = json.dumps({"id": request_id, "function": target, "kwargs": kwargs})
            self._control.sendall(line.encode() + b"\n")
            reply = self._receive(time.monotonic() + reply_within_s)
        if reply.get("id") != request_id:
            raise RuntimeError(f"guest answered {reply!r} to request {request_id}")
        if "error" in reply:
            raise rebuild_error(reply["error"])
        return decode(reply["result"])

    def _receive(self, deadline: float) -> dict[str, Any]:
        assert self._control is not None
        while b"\n" not in self._buffer:
            self._control.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
            try:
                chunk = self._control.recv(65536)
            except TimeoutError:
                self._check_running()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"guest {self.spec.name} did not answer in time; console:\n"
                        f"{self.console_tail()}"
                    ) from None
                continue
            if not chunk:
                self._check_running()
                raise ChannelClosedError(f"the control channel of {self.spec.name} closed")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return dict(json.loads(line))

    def sh(self, command: str, timeout_s: float = 120.0) -> str:
        """Run a shell command in the guest; its stdout. RuntimeError on non-zero exit."""
        done = self.call("sh", reply_within_s=timeout_s + 30, command=command, timeout_s=timeout_s)
        if done["rc"] != 0:
            raise RuntimeError(f"guest: {command!r} exited {done['rc']}: {done['stderr']}")
        return str(done["stdout"])


def decode(value: Any) -> Any:
    """The inverse of :func:`tests.kernel.guest_ops.encode`."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if isinstance(value, dict):
        fields = {key: decode(item) for key, item in value.items() if key != "__dataclass__"}
        if "__dataclass__" in value:
            return _resolve(value["__dataclass__"])(**fields)
        return fields
    return value


def _resolve(qualified: str) -> Any:
    import importlib

    module, _, name = qualified.partition(":")
    return getattr(importlib.import_module(module), name)


def rebuild_error(described: dict[str, Any]) -> Exception:
    """The guest's exception as the same class here where it is OSError or dxpool's."""
    module, _, name = described["type"].partition(":")
    if module == "builtins" and described.get("errno") is not None:
        return OSError(described["errno"], described.get("strerror") or described["message"])
    if module.startswith("dxpool.hostagent.errors"):
        from dxpool.hostagent import errors

        kind = getattr(errors, name)
        if kind is errors.DriverError:
            return errors.DriverError(described["message"], retryable=described["retryable"])
        if kind is errors.GpuBusyError:
            return errors.GpuBusyError(described["message"], ())
        return kind(described["message"])  # type: ignore[no-any-return]
    return GuestError(described)


__all__ = [
    "GUEST_HOST",
    "Guest",
    "GuestError",
    "GuestSpec",
    "PortSpec",
    "Timings",
    "kernel_image",
    "missing_tools",
    "use_kvm",
]
