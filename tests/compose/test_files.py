"""The compose files, read as YAML (no engine needed): etcd's image is pinned to a release
fit for production by default, and the offline override swaps only the image."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.compose.project import COMPOSE_FILES, REPO

BASE, OFFLINE = COMPOSE_FILES


def _load(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_etcd_defaults_to_a_pinned_official_release_past_the_bad_ones() -> None:
    image = _load(BASE)["services"]["etcd"]["image"]
    match = re.fullmatch(
        r"\$\{DXPOOL_ETCD_IMAGE:-gcr\.io/etcd-development/etcd:v3\.(\d+)\.(\d+)\}", image
    )
    assert match, image
    minor, patch = int(match[1]), int(match[2])
    # etcd advises against 3.5.0-3.5.2 in production; 3.6 and later are fine.
    assert (minor, patch) >= (5, 3), image


def test_the_offline_override_runs_etcd_from_the_local_image_and_nothing_else() -> None:
    override = _load(OFFLINE)
    assert override["services"] == {"etcd": {"image": "${DXPOOL_IMAGE:-dxpool:dev}"}}


def test_the_files_have_no_version_key() -> None:
    """The Compose Specification has none; Compose v2 warns on every command where one
    is left (docker-compose 1.27 and later read the files without it)."""
    assert "version" not in _load(BASE)
    assert "version" not in _load(OFFLINE)


def test_etcd_runs_from_paths_both_images_have() -> None:
    etcd = _load(BASE)["services"]["etcd"]
    assert etcd["command"][0] == "/usr/local/bin/etcd"
    assert etcd["healthcheck"]["test"][1] == "/usr/local/bin/etcdctl"
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert "ln -s /opt/etcd/etcd /usr/local/bin/etcd" in dockerfile
    assert "ln -s /opt/etcd/etcdctl /usr/local/bin/etcdctl" in dockerfile


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_both_files() -> None:
    for files in ((BASE,), COMPOSE_FILES):
        args = [arg for path in files for arg in ("-f", str(path))]
        checked = subprocess.run(
            ["docker-compose", *args, "config", "-q"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=False,
        )
        assert checked.returncode == 0, checked.stderr
