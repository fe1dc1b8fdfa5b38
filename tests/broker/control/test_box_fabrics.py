"""open_box_fabric: the one place box fabric backends are chosen (``--fabric``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dxpool.broker.control.box_fabric import SimBoxFabric
from dxpool.broker.control.box_fabric_hook import HookBoxFabric
from dxpool.broker.control.box_fabric_redfish import RedfishBoxFabric
from dxpool.broker.control.box_fabrics import open_box_fabric
from dxpool.cli.main import cli
from dxpool.errors import InvalidArgument
from tests.hostagent.proxy_hook import write_proxy_hook
from tests.hostagent.test_redfish_config import document, write


def test_no_spec_is_no_fabric() -> None:
    assert open_box_fabric(None) is None
    assert open_box_fabric("") is None


def test_each_kind_builds_its_backend(tmp_path: Path) -> None:
    assert isinstance(open_box_fabric(f"sim:{tmp_path}"), SimBoxFabric)
    redfish = open_box_fabric(f"redfish:{write(tmp_path, document())}")
    assert isinstance(redfish, RedfishBoxFabric)
    assert redfish.url == "https://127.0.0.1:8443"  # read, not connected
    hook = write_proxy_hook(tmp_path / "proxy")
    built = open_box_fabric(f"hook:{hook}", hook_timeout_s=5)
    assert isinstance(built, HookBoxFabric)
    assert built.hook == hook


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("nfs:/x", r"unknown box fabric 'nfs:/x': expected sim:DIR .* redfish:FILE .* hook:PATH"),
        ("redfish", "unknown box fabric 'redfish'"),
        ("hook:", "unknown box fabric 'hook:'"),
        ("redfish:/nonexistent/map.yaml", "cannot read the Redfish fabric map"),
        ("hook:/nonexistent/hook", "is not an executable file"),
    ],
)
def test_bad_specs_say_what_is_expected(spec: str, expected: str) -> None:
    with pytest.raises(InvalidArgument, match=expected):
        open_box_fabric(spec)


def test_a_malformed_map_names_the_field(tmp_path: Path) -> None:
    broken = document()
    broken["service"]["timeout_s"] = -1
    with pytest.raises(InvalidArgument, match=r"service\.timeout_s must be a number > 0"):
        open_box_fabric(f"redfish:{write(tmp_path, broken)}")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"service": {}}))
    with pytest.raises(InvalidArgument, match=r"service\.url"):
        open_box_fabric(f"redfish:{tmp_path / 'bad.yaml'}")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--fabric", "vendor:x"], "unknown box fabric 'vendor:x'"),
        (["--fabric", "redfish:/nonexistent.yaml"], "cannot read the Redfish fabric map"),
        (["--fabric", "hook:/nonexistent"], "is not an executable file"),
        (["--fabric-hook-timeout", "soon"], "cannot parse duration 'soon'"),
    ],
)
def test_bad_fabric_flags_are_usage_errors(args: list[str], expected: str) -> None:
    result = CliRunner().invoke(
        cli, ["broker", "--etcd", "127.0.0.1:1", "--insecure", "--log-level", "error", *args]
    )
    assert result.exit_code == 2, result.output
    assert expected in result.stderr
    assert "Traceback" not in result.output
