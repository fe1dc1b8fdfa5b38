"""Files that hold secrets or configuration: written mode 0600, refused when others may read them.

Every secret and configuration file dxpool writes (private keys, the agent's identity
token, the local pool's ``config.yaml``) is created with mode 0600 (never readable by
others, not even between create and chmod) and replaced by rename, so a reader sees the
old file or the new one, never half of one. A file dxpool reads a secret from (a bearer
token, the broker's token table) must not be open to group or others: one that is is
refused with the ``chmod`` that fixes it, as ssh refuses a private key others can read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dxpool.errors import InvalidArgument

__all__ = ["PRIVATE_MODE", "check_private", "write_atomic"]

PRIVATE_MODE = 0o600


def write_atomic(path: Path, data: bytes | str, mode: int = PRIVATE_MODE) -> None:
    """Write ``data`` to a temporary file made with ``mode`` beside ``path``, then rename
    it into place (``mode`` exactly, whatever the umask)."""
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits away; set exactly ``mode``
        os.write(fd, payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)


def check_private(path: Path, what: str, reason: str) -> None:
    """InvalidArgument (``reason``) when ``path`` is open to group or others."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return  # reading it will say what is wrong
    if mode & 0o077:
        raise InvalidArgument(
            f"{what} {path} may be read by other users (mode {mode:04o}); it holds secrets: "
            f"run `chmod 600 {path}` and start again",
            reason=reason,
        )
