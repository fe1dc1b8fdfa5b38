"""scripts/venv.sh: `scripts/up.sh` and `scripts/test.sh` install into .venv once, and
again only when what the install depends on changed. Run against a stand-in for
.venv/bin/python that records what it is asked to do."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "venv.sh"
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../../calls.log"
if [ "$1" = "-VV" ]; then echo "Python 3.11.7 (fake)"; fi
exit 0
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "dxpool"\n')
    (tmp_path / "setup.py").write_text("from setuptools import setup\nsetup()\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def installs(project: Path, extras: str = "server", **env: str) -> int:
    """Run ensure_venv; how many pip installs of the project it made."""
    log = project / "calls.log"
    before = log.read_text().count("install --quiet -e") if log.exists() else 0
    subprocess.run(
        ["bash", "-c", f". {SCRIPT}; ensure_venv {extras}"],
        cwd=project,
        env={"PATH": "/usr/bin:/bin", **env},
        check=True,
        capture_output=True,
        timeout=60,
    )
    return log.read_text().count("install --quiet -e") - before


def test_a_second_start_installs_nothing(project: Path) -> None:
    assert installs(project) == 1
    assert installs(project) == 0
    assert installs(project) == 0


def test_a_changed_dependency_list_extra_or_request_installs_again(project: Path) -> None:
    assert installs(project) == 1
    (project / "pyproject.toml").write_text('[project]\nname = "dxpool"\nversion = "2"\n')
    assert installs(project) == 1
    assert installs(project) == 0
    assert installs(project, "dev") == 1  # another extra: its own stamp
    assert installs(project, DXPOOL_REINSTALL="1") == 1
