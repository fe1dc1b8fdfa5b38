"""AgentConfig validation and the ``python -m dxpool.hostagent`` command line."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dxpool.cli.commands.agent import agent_command
from dxpool.errors import InvalidArgument
from dxpool.hostagent.config import AgentConfig


@pytest.fixture(autouse=True)
def keep_root_logging() -> Iterator[None]:
    """The command configures the root logger; put it back after each test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_defaults() -> None:
    config = AgentConfig(host_id="h1")

    assert config.lease_ttl_s == 10
    assert config.resync_interval_s == 30
    assert config.attach_attempts == 3
    assert (config.backoff_base_s, config.backoff_max_s) == (0.2, 10)
    assert config.driver == "sim"
    assert config.broker_endpoints == ("127.0.0.1:8471",)
    assert config.broker_tls is None  # plaintext unless TLS or a token is given


def test_brokers_are_a_list_and_tls_comes_with_a_token() -> None:
    config = AgentConfig(host_id="h1", brokers="10.0.0.5:8471, 10.0.0.6:8471", token_file=Path("t"))
    assert config.broker_endpoints == ("10.0.0.5:8471", "10.0.0.6:8471")
    assert config.broker_tls is not None  # a token never travels in plaintext


def test_labels_are_read_only_copies() -> None:
    labels = {"zone": "a"}
    config = AgentConfig(host_id="h1", labels=labels)
    labels["zone"] = "b"

    assert config.labels == {"zone": "a"}
    with pytest.raises(TypeError):
        config.labels["zone"] = "c"  # type: ignore[index]


@pytest.mark.parametrize(
    "args",
    [
        ["--etcd", "127.0.0.1:2379"],
        ["--etcd-endpoints", "127.0.0.1:2379"],
        ["--etcd-ca", "ca.crt"],
        ["--etcd-cert", "a.crt"],
        ["--etcd-key", "a.key"],
        ["--prefix", "/dxpool/v1/"],
    ],
)
def test_the_etcd_options_of_older_versions_say_what_replaced_them(args: list[str]) -> None:
    result = CliRunner().invoke(agent_command, ["--host", "h1", *args])

    assert result.exit_code == 2
    assert "host agents no longer talk to etcd" in result.output
    assert "--broker HOST:PORT" in result.output and "--tls-cert" in result.output


def test_an_etcd_setting_left_in_the_environment_is_a_usage_error_too() -> None:
    result = CliRunner().invoke(
        agent_command, [], env={"DXPOOL_AGENT_HOST": "h1", "DXPOOL_AGENT_ETCD_ENDPOINTS": "e:2379"}
    )

    assert result.exit_code == 2
    assert "$DXPOOL_AGENT_ETCD_ENDPOINTS: host agents no longer talk to etcd" in result.output


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"host_id": "Host_1"}, "invalid host id 'Host_1'"),
        ({"brokers": "localhost"}, "invalid broker endpoint 'localhost'"),
        ({"brokers": " , "}, "no broker endpoint"),
        ({"brokers": "https://b:8471"}, "cannot ask for TLS"),
        ({"tls_cert": Path("c.crt")}, "a client certificate needs its key"),
        ({"slot_capacity": 0}, "slot_capacity must be >= 1"),
        ({"lease_ttl_s": 0.5}, "lease_ttl_s must be >= 1"),
        ({"attach_attempts": 0}, "attach_attempts must be >= 1"),
        ({"backoff_base_s": 0}, "backoff_base_s must be > 0"),
        ({"backoff_base_s": 2, "backoff_max_s": 1}, "backoff_max_s (1) must be >= backoff_base_s"),
        ({"sim_map_delay_s": -1}, "sim_map_delay_s must be >= 0"),
        ({"drain_timeout_s": -1}, "drain_timeout_s must be >= 0"),
        ({"labels": {"": "x"}}, "invalid label key"),
        ({"slot_capacity": 257}, "slot_capacity 257 is over the limit of 256"),
        ({"labels": {"zone": "a\nb"}}, "labels['zone'] contains the non-printable character"),
        ({"labels": {"z\u202e": "a"}}, "contains the non-printable character U+202E"),
        ({"labels": {"zone": "x" * 257}}, "the limit is 256"),
        ({"labels": {f"k{i}": "v" for i in range(33)}}, "the limit is 32"),
        ({"cpu_cores": -1}, "cpu_cores -1 is out of range"),
        ({"memory_mib": 2**62}, "memory_mib 4611686018427387904 is out of range"),
    ],
)
def test_bad_values_name_what_to_fix(fields: dict[str, object], message: str) -> None:
    values: dict[str, object] = {"host_id": "h1", **fields}
    with pytest.raises(InvalidArgument) as caught:
        AgentConfig(**values)  # type: ignore[arg-type]
    assert message in caught.value.message


def test_cli_rejects_a_bad_host_with_usage_exit_status() -> None:
    result = CliRunner().invoke(agent_command, ["--host", "Bad_Host"])

    assert result.exit_code == 2
    assert "invalid host id 'Bad_Host'" in result.output


def test_cli_reads_options_from_the_environment() -> None:
    result = CliRunner().invoke(
        agent_command, [], env={"DXPOOL_AGENT_HOST": "h1", "DXPOOL_AGENT_ATTACH_ATTEMPTS": "0"}
    )

    assert result.exit_code == 2
    assert "attach_attempts must be >= 1" in result.output


def test_cli_rejects_a_label_without_a_value() -> None:
    result = CliRunner().invoke(agent_command, ["--host", "h1", "--label", "zone"])

    assert result.exit_code == 2
    assert "'zone' is not KEY=VALUE" in result.output


def test_cli_exits_1_when_the_simulated_fabric_is_missing(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        agent_command, ["--host", "h1", "--sim-state-dir", str(tmp_path / "nowhere")]
    )

    assert result.exit_code == 1


def test_cli_help_lists_every_option_with_its_environment_variable() -> None:
    result = CliRunner().invoke(agent_command, ["--help"])

    assert result.exit_code == 0
    assert "etcd" not in result.output  # agents hold no etcd settings
    for option, env in [
        ("--host", "DXPOOL_AGENT_HOST"),
        ("--broker", "DXPOOL_AGENT_BROKER"),
        ("--tls-cert", "DXPOOL_AGENT_TLS_CERT"),
        ("--sim-state-dir", "DXPOOL_AGENT_SIM_STATE_DIR"),
        ("--lease-ttl", "DXPOOL_AGENT_LEASE_TTL"),
        ("--resync-interval", "DXPOOL_AGENT_RESYNC_INTERVAL"),
    ]:
        assert option in result.output
        assert env in result.output


def test_cli_accepts_the_short_aliases_other_launchers_use() -> None:
    args = ["--host", "h1", "--broker", "127.0.0.1:8471", "--sim-state", "/x"]
    args += ["--slots", "4", "--map-delay", "0", "--hotplug-delay", "0.5", "--bind-delay", "0"]
    args += ["--lease-ttl", "3.0", "--attach-attempts", "0"]  # the last one is invalid

    result = CliRunner().invoke(agent_command, args)

    assert result.exit_code == 2
    assert "attach_attempts must be >= 1" in result.output  # every alias parsed


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"linux_ports": {4: "0000:40:01.0"}}, "host slot 4 is outside the host's slots 0-3"),
        ({"linux_ports": {0: "40:01.0"}}, "the bridge must be a PCI address"),
        ({"proxy_hook_timeout_s": 0}, "proxy_hook_timeout_s must be > 0"),
    ],
)
def test_bad_linux_settings_name_what_to_fix(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        AgentConfig(host_id="h1", slot_capacity=4, driver="linux", **fields)  # type: ignore[arg-type]
    assert message in caught.value.message


def test_cli_parses_linux_ports_and_rejects_a_bad_one() -> None:
    bad = CliRunner().invoke(agent_command, ["--host", "h1", "--linux-port", "zero=0000:40:01.0"])
    twice = CliRunner().invoke(
        agent_command,
        ["--host", "h1", "--linux-port", "0=0000:40:01.0", "--linux-port", "0=0000:40:02.0"],
    )

    assert bad.exit_code == 2
    assert "'zero=0000:40:01.0' is not SLOT=BRIDGE" in bad.output
    assert twice.exit_code == 2
    assert "host slot 0 is given twice" in twice.output


def test_cli_exits_1_when_the_linux_driver_has_no_pci_bus(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    args = ["--host", "h1", "--driver", "linux", "--proxy-hook", str(hook)]
    args += ["--linux-port", "0=0000:40:01.0", "--sysfs-root", str(tmp_path / "nosys")]

    result = CliRunner().invoke(agent_command, args)

    assert result.exit_code == 1
