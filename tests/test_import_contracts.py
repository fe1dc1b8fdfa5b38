"""The import layout that ``lint-imports`` (pyproject.toml ``[tool.importlinter]``) and
every other tool rely on: the import path is the folder path.

``dxpool/broker``, ``dxpool/hostagent``, ``dxpool/fabric`` and ``dxpool/cli`` are links to
the top-level folders and ``dxpool/api`` one to ``proto/python``; the contract that keeps
dxpool's core free of the broker, the agent and the CLI lists every other module of
``dxpool/``, so a new core module must be added there to be covered.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LINKS = {
    "broker": "../broker",
    "hostagent": "../hostagent",
    "fabric": "../fabric",
    "cli": "../cli",
    "api": "../proto/python",
}


def _contract(contract_id: str) -> dict[str, Any]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c.get("id") == contract_id]
    return contract


def test_the_subpackages_are_links_to_the_top_level_folders() -> None:
    for name, target in LINKS.items():
        link = REPO / "dxpool" / name
        assert link.is_symlink(), f"dxpool/{name} must be a link to {target}"
        assert os.readlink(link) == target
        assert (link / "__init__.py").is_file()


def test_the_core_contract_names_every_core_module() -> None:
    on_disk = {
        f"dxpool.{entry.name.removesuffix('.py')}"
        for entry in (REPO / "dxpool").iterdir()
        if entry.name not in LINKS
        and not entry.name.startswith("_")
        and (entry.suffix == ".py" or (entry.is_dir() and (entry / "__init__.py").is_file()))
    }
    listed = set(_contract("core")["source_modules"])
    assert listed == on_disk, (
        "pyproject.toml's `core` import contract must list every module of dxpool/: "
        f"add {sorted(on_disk - listed)}, drop {sorted(listed - on_disk)}"
    )
