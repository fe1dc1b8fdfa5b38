"""File access to sysfs under one configurable root.

Every read and write the Linux driver makes goes through :class:`Sysfs`, with paths
relative to the root (``"bus/pci/rescan"``). On a host the root is ``/sys``; tests build a
tree in a temporary directory and give a subclass that acts like the kernel on writes.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_SYSFS_ROOT = Path("/sys")


class Sysfs:
    """Reads and writes sysfs attributes below ``root``.

    Reads answer None for an attribute that does not exist; writes raise ``OSError`` as
    the kernel reports it (``EINVAL``, ``ENODEV``, ``EBUSY`` ...).
    """

    def __init__(self, root: Path = DEFAULT_SYSFS_ROOT) -> None:
        self.root = Path(root)

    def path(self, relative: str) -> Path:
        return self.root / relative

    def exists(self, relative: str) -> bool:
        return self.path(relative).exists()

    def read_text(self, relative: str) -> str | None:
        """The attribute's text without surrounding whitespace, or None when absent."""
        try:
            return self.path(relative).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def read_bytes(self, relative: str) -> bytes | None:
        """The attribute's bytes (e.g. ``config``), or None when absent or unreadable."""
        try:
            return self.path(relative).read_bytes()
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return None

    def write(self, relative: str, value: str) -> None:
        """Write ``value`` to the attribute in one ``write`` call, as the kernel expects."""
        with open(self.path(relative), "w") as attribute:
            attribute.write(value)

    def listdir(self, relative: str) -> list[str]:
        """Entry names of a directory, sorted; empty when it does not exist."""
        try:
            return sorted(os.listdir(self.path(relative)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def link_name(self, relative: str) -> str | None:
        """The last component of a symlink's target (a ``driver`` link names its driver,
        an ``iommu_group`` link its group), or None when there is no such link."""
        try:
            return os.path.basename(os.readlink(self.path(relative)))
        except (FileNotFoundError, NotADirectoryError, OSError):
            return None


__all__ = ["DEFAULT_SYSFS_ROOT", "Sysfs"]
