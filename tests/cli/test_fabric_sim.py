"""``dxpool fabric sim create``: install or complete a simulated fabric, idempotently."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner, Result

from dxpool.cli.main import cli
from dxpool.fabric.sim import SimFabric, SimGpuSpec

H100 = SimGpuSpec("H100", 81920)


def fabric_args(state: Path, *extra: str) -> list[str]:
    return ["--state", str(state), "--box", "box1", "--box", "box2", "--gpus", "H100:4",
            "--memory", "80GiB", "--host", "h1", "--slots", "4", *extra]  # fmt: skip


def invoke(args: list[str]) -> Result:
    return CliRunner().invoke(cli, ["fabric", "sim", "create", *args])


def test_create_installs_boxes_and_hosts(tmp_path: Path) -> None:
    result = invoke(fabric_args(tmp_path / "fabric"))
    assert result.exit_code == 0, result.output
    fabric = SimFabric(tmp_path / "fabric")
    assert fabric.boxes() == {"box1": [H100] * 4, "box2": [H100] * 4}
    assert fabric.hosts() == {"h1": 4}


def test_create_again_keeps_mappings_and_adds_what_is_missing(tmp_path: Path) -> None:
    state = tmp_path / "fabric"
    assert invoke(fabric_args(state)).exit_code == 0
    SimFabric(state).map("box1", 2, "h1", 0)

    again = invoke(fabric_args(state, "--host", "h2"))

    assert again.exit_code == 0, again.output
    fabric = SimFabric(state)
    assert fabric.mapping("box1", 2) == ("h1", 0)
    assert fabric.hosts() == {"h1": 4, "h2": 4}


def test_create_refuses_to_change_an_installed_host(tmp_path: Path) -> None:
    state = tmp_path / "fabric"
    assert invoke(fabric_args(state)).exit_code == 0
    changed = [*fabric_args(state)[:-2], "--slots", "8"]

    result = invoke(changed)

    assert result.exit_code == 1
    assert "host 'h1' is already installed with 4 proxy slots, not 8" in result.output
    assert SimFabric(state).hosts() == {"h1": 4}


def test_create_needs_a_gpu_model(tmp_path: Path) -> None:
    args = fabric_args(tmp_path / "fabric")
    args[args.index("H100:4")] = "4"
    result = invoke(args)
    assert result.exit_code == 2
    assert "name the GPU model, e.g. H100:8" in result.output
    assert not (tmp_path / "fabric").exists()


def test_a_malformed_id_is_a_usage_error(tmp_path: Path) -> None:
    args = fabric_args(tmp_path / "fabric")
    args[args.index("box1")] = "Box_1"
    result = invoke(args)
    assert result.exit_code == 2
    assert "invalid box id 'Box_1'" in result.stderr
