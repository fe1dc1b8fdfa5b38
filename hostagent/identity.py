"""The agent's identity for its host: a token that survives restarts on one machine.

The token is kept in ``{state_dir}/agent-{host}.token`` (mode 0600: it is the key to the
host's liveness) and the file is held under an exclusive ``flock`` for the agent's
lifetime, so two agent processes can never use the
same identity at once. The token is the value of the host's liveness key: a restarted
agent finds its own token there and adopts the live lease instead of waiting for it to
expire (its nodes are not lost across a restart), while any other agent - elsewhere, or
without the state - is refused the host. Without a state directory the token is new for
each process: a restart then waits for the previous lease to expire.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path
from typing import IO

from dxpool.errors import FailedPrecondition
from dxpool.private_files import PRIVATE_MODE


class AgentIdentity:
    """Holds the token (and, with a state directory, the lock on its file)."""

    def __init__(self, host_id: str, state_dir: Path | None) -> None:
        self._file: IO[str] | None = None
        if state_dir is None:
            self.token = secrets.token_hex(16)
            return
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / f"agent-{host_id}.token"
        # Made 0600 from creation; one an older version left readable by others is fixed.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, PRIVATE_MODE)
        os.fchmod(fd, PRIVATE_MODE)
        handle = open(fd, "a+", encoding="ascii")  # noqa: SIM115 - held while running
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise FailedPrecondition(
                f"another agent for host {host_id} is running with state directory "
                f"{state_dir}; stop it first",
                reason="AGENT_RUNNING",
            ) from None
        handle.seek(0)
        token = handle.read().strip()
        if not token:
            token = secrets.token_hex(16)
            handle.seek(0)
            handle.truncate()
            handle.write(token)
            handle.flush()
            os.fsync(handle.fileno())
        self.token = token
        self._file = handle

    def close(self) -> None:
        """Release the lock on the token file (the token stays for the next start)."""
        if self._file is not None:
            self._file.close()
            self._file = None


__all__ = ["AgentIdentity"]
