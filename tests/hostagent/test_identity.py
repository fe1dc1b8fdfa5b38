"""The agent's identity token file: mode 0600 from creation, and made so if it was not."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dxpool.hostagent.identity import AgentIdentity


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_token_file_is_created_private_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        identity = AgentIdentity("h1", tmp_path)
    finally:
        os.umask(previous)
    try:
        path = tmp_path / "agent-h1.token"
        assert _mode(path) == 0o600
        assert path.read_text() == identity.token
    finally:
        identity.close()


def test_a_token_file_left_readable_is_made_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "agent-h1.token"
    path.write_text("0123456789abcdef0123456789abcdef")
    path.chmod(0o644)
    identity = AgentIdentity("h1", tmp_path)
    try:
        assert identity.token == "0123456789abcdef0123456789abcdef"
        assert _mode(path) == 0o600
    finally:
        identity.close()
