"""A JSON document shared by several processes, like a piece of hardware they all see.

Every access holds ``fcntl.flock`` on a separate lock file (exclusive to change, shared to
read), and every change is written to a temporary file in the same directory and moved
into place with ``os.replace``, so a reader never sees a half-written document and a
process killed mid-write leaves the previous document intact.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class LockedJsonFile:
    """``path`` holds the document, ``lock_path`` the lock (created on first use).

    Locks are taken per call on a fresh file description, so threads of one process
    exclude each other as well as other processes.
    """

    def __init__(self, path: Path, lock_path: Path) -> None:
        self.path = path
        self.lock_path = lock_path

    def exists(self) -> bool:
        return self.path.is_file()

    @contextlib.contextmanager
    def locked(self, *, exclusive: bool = True) -> Iterator[None]:
        """Hold the lock for the duration of the block."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing the description releases the lock

    def load(self) -> Any:
        """The document; raises FileNotFoundError if there is none. Call under the lock."""
        with self.path.open(encoding="utf-8") as handle:
            return json.load(handle)

    def store(self, document: Any) -> None:
        """Replace the document atomically. Call under the exclusive lock."""
        fd, temp = tempfile.mkstemp(
            dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
        )
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(document, handle, indent=1, sort_keys=True)
            os.replace(temp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
