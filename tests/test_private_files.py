"""Secret and configuration files: written 0600 from creation, refused when open to others."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dxpool.errors import InvalidArgument
from dxpool.private_files import check_private, write_atomic


def test_written_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("old")
    path.chmod(0o644)
    previous = os.umask(0)
    try:
        write_atomic(path, "new")
    finally:
        os.umask(previous)
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]  # no temporary file left


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700])
def test_a_private_file_passes(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "token"
    path.write_text("t")
    path.chmod(mode)
    check_private(path, "token file", reason="INVALID_CONFIG")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_a_file_open_to_others_is_refused_with_the_chmod_that_fixes_it(
    tmp_path: Path, mode: int
) -> None:
    path = tmp_path / "token"
    path.write_text("t")
    path.chmod(mode)
    with pytest.raises(InvalidArgument) as refused:
        check_private(path, "token file", reason="INVALID_CONFIG")
    assert f"(mode {mode:04o})" in refused.value.message
    assert f"run `chmod 600 {path}`" in refused.value.message
    assert refused.value.reason == "INVALID_CONFIG"
