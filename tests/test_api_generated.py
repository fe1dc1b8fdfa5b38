"""The committed generated API code matches proto/ (run proto/generate.py after edits)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_components_install_under_dxpool_only(tmp_path: Path) -> None:
    """Outside the checkout, no top-level broker/fabric/cli/hostagent is importable."""
    probe = (
        "import importlib.util as u, dxpool.broker, dxpool.fabric, dxpool.cli, dxpool.hostagent;"
        "print([n for n in ('broker', 'fabric', 'cli', 'hostagent') if u.find_spec(n)])"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
