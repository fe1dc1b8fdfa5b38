"""``python -m dxpool.broker`` (what ``dxpool broker`` runs) as a process."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from dxpool.api.v1 import fabric_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.commands.broker import broker_command
from dxpool.cli.main import cli
from dxpool.client import Client
from dxpool.errors import NotFound
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, free_port
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn
from tests.conftest import wait_until


def test_metrics_are_served_on_the_address_and_port_given(
    etcd_server: EmbeddedEtcd, key_prefix: str, tmp_path: Path
) -> None:
    port, metrics_port = free_port(), free_port()
    log = (tmp_path / "broker.log").open("wb")
    broker = subprocess.Popen(
        [sys.executable, "-m", "dxpool.broker", "--etcd", etcd_server.endpoint,
         "--prefix", key_prefix, "--listen", f"127.0.0.1:{port}",
         "--agent-listen", "127.0.0.1:0",
         "--metrics-port", str(metrics_port), "--metrics-address", "127.0.0.1",
         "--log-level", "WARNING", "--insecure"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_until(lambda: _get(url) is not None, timeout_s=10, message="metrics served")
        body = _get(url) or ""
        assert "dxpool_release_total 0.0" in body
    finally:
        broker.terminate()
        broker.wait(30)
        log.close()


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None


def test_a_latency_matrix_flag_is_used_and_a_bad_one_is_a_usage_error(
    etcd_server: EmbeddedEtcd, key_prefix: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("round_trips: [{hosts: s1/p1/r1, boxes: s1/p1/r2, round_trip: soon}]\n")
    refused = subprocess.run(
        [sys.executable, "-m", "dxpool.broker", "--etcd", etcd_server.endpoint,
         "--prefix", key_prefix, "--listen", "127.0.0.1:0", "--agent-listen", "127.0.0.1:0",
         "--latency-matrix", str(bad),
         "--insecure"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert f"{bad}: round_trips[0].round_trip: cannot parse duration 'soon'" in refused.stderr
    assert "Traceback" not in refused.stderr

    good = tmp_path / "rtt.csv"
    good.write_text("hosts,boxes,round_trip\ns1/p1/r1,s1/p1/r2,3.3us\n")
    port = free_port()
    log = (tmp_path / "broker.log").open("wb")
    broker = subprocess.Popen(
        [sys.executable, "-m", "dxpool.broker", "--etcd", etcd_server.endpoint,
         "--prefix", key_prefix, "--listen", f"127.0.0.1:{port}",
         "--agent-listen", "127.0.0.1:0",
         "--latency-matrix", str(good), "--log-level", "WARNING", "--insecure"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    keys = KeySchema(key_prefix)
    host = pb.Host(
        name="hosts/h1", location=pb.Location(site="s1", pod="p1", rack="r1"), slot_capacity=8
    )
    etcd = connect(etcd_server.endpoint)
    Store(etcd, keys).commit(Txn().put(keys.host("h1"), host))
    etcd.close()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        with Client(f"127.0.0.1:{port}") as client:
            client.create_box(
                "box2",
                gpus=1,
                model="H100",
                memory_mib=81920,
                location=("s1", "p1", "r2"),
            )
            latency = wait_until(
                lambda: _latency_or_none(client), message="the broker sees h1 and box2"
            )
        assert latency.round_trip_ns == 3_300
        assert list(latency.path) == [
            "proxy:hosts/h1",
            "matrix:s1/p1/r1->s1/p1/r2",
            "proxy:boxes/box2",
        ]
    finally:
        broker.terminate()
        broker.wait(30)
        log.close()


def _latency_or_none(client: Client) -> fabric_pb2.Latency | None:
    try:
        return client.get_latency("h1", "box2")
    except NotFound:
        return None


def _parsed(*args: str) -> dict[str, object]:
    """The broker command's options as click parses them (nothing is started)."""
    context = broker_command.make_context("broker", ["--etcd", "127.0.0.1:2379", *args])
    return dict(context.params)


@pytest.mark.parametrize(
    ("flag", "value", "seconds"),
    [
        ("--attach-timeout", "120s", 120.0),
        ("--attach-timeout", "2m", 120.0),
        ("--attach-timeout", "3600", 3600.0),  # a bare number is seconds, as before
        ("--host-loss-grace", "500ms", 0.5),
        ("--retention", "1.5h", 5400.0),
    ],
)
def test_durations_take_units_or_bare_seconds(flag: str, value: str, seconds: float) -> None:
    assert _parsed(flag, value)[flag.lstrip("-").replace("-", "_")] == seconds


def test_defaults_are_the_documented_durations() -> None:
    params = _parsed()
    assert (params["attach_timeout"], params["host_loss_grace"], params["retention"]) == (
        120.0,
        0.0,
        3600.0,
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--log-level", "verbose"], "'verbose' is not one of"),
        (["--attach-timeout", "soon"], "cannot parse duration 'soon'"),
        (["--attach-timeout", "-5"], "out of range"),
        (["--retention", "nan"], "out of range"),
        (["--gc", "off"], "'off' is not one of"),
        (["--gc-young-batch", "0"], "not in the range x>=1"),
        (
            ["--insecure", "--gc-young-batch", "100", "--gc-threshold", "50"],
            "--gc-threshold (50) must be at least --gc-young-batch (100)",
        ),
    ],
)
def test_bad_values_are_usage_errors(args: list[str], expected: str) -> None:
    result = CliRunner().invoke(cli, ["broker", "--etcd", "127.0.0.1:2379", *args])
    assert result.exit_code == 2, result.output
    assert expected in result.stderr
    assert "Traceback" not in result.output


def test_the_collector_policy_is_on_by_default_with_its_documented_settings() -> None:
    params = _parsed()
    assert (
        params["gc_mode"],
        params["gc_young_batch"],
        params["gc_threshold"],
        params["gc_reclaim_interval"],
    ) == ("policy", 5000, 50_000, 3600.0)
    assert _parsed("--gc", "default", "--gc-reclaim-interval", "10m")["gc_reclaim_interval"] == 600


def test_log_level_is_case_insensitive() -> None:
    assert str(_parsed("--log-level", "debug")["log_level"]).upper() == "DEBUG"


def test_log_lines_carry_their_fields(
    etcd_server: EmbeddedEtcd, key_prefix: str, tmp_path: Path
) -> None:
    port = free_port()
    log_path = tmp_path / "broker.log"
    with log_path.open("wb") as log:
        broker = subprocess.Popen(
            [sys.executable, "-m", "dxpool.broker", "--etcd", etcd_server.endpoint,
             "--prefix", key_prefix, "--listen", f"127.0.0.1:{port}",
             "--agent-listen", "127.0.0.1:0", "--log-level", "info", "--insecure"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        wait_until(lambda: "broker serving" in log_path.read_text(), timeout_s=10, message="logged")
        line = next(x for x in log_path.read_text().splitlines() if "broker serving" in x)
        assert line.endswith(f"broker serving endpoint=127.0.0.1:{port}"), line
    finally:
        broker.terminate()
        broker.wait(30)


def test_unreachable_etcd_is_one_line_and_exit_1_after_the_deadline() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "dxpool.broker", "--etcd", f"127.0.0.1:{free_port()}",
         "--listen", "127.0.0.1:0", "--insecure", "--etcd-connect-timeout", "3s"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started >= 3  # it kept trying until the deadline
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("error: the broker cannot start: cannot list and watch etcd")
    assert "Connection refused" in errors[0]
    assert "etcd not reachable yet; retrying" in done.stderr


def test_a_broker_started_before_its_etcd_waits_for_it(tmp_path: Path) -> None:
    """The broker's first connection to etcd is retried with backoff: an etcd that comes
    up a few seconds after the broker is found, and the broker serves."""
    client_port, peer_port, port = free_port(), free_port(), free_port()
    log_path = tmp_path / "broker.log"
    with log_path.open("wb") as log:
        broker = subprocess.Popen(
            [sys.executable, "-m", "dxpool.broker", "--etcd", f"127.0.0.1:{client_port}",
             "--listen", f"127.0.0.1:{port}", "--insecure", "--etcd-connect-timeout", "120s"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    etcd = EmbeddedEtcd(tmp_path / "etcd", client_port=client_port, peer_port=peer_port)
    try:
        wait_until(lambda: "etcd not reachable yet" in log_path.read_text(), 60, message="waiting")
        assert broker.poll() is None
        etcd.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=120)
        assert broker.poll() is None
    finally:
        broker.terminate()
        broker.wait(30)
        etcd.stop()


def test_a_token_file_others_may_read_is_a_usage_error(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    from dxpool.pki import create_ca, issue, write_pair

    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("token-for-team-a-0123456789abcdef: tenant/team-a\n")
    tokens.chmod(0o644)
    ca = create_ca("test CA")
    write_pair(tmp_path, "server", issue(ca, ip_addresses=["127.0.0.1"]))
    result = CliRunner().invoke(
        cli,
        ["broker", "--etcd", etcd_server.endpoint, "--listen", "127.0.0.1:0",
         "--tls-cert", str(tmp_path / "server.crt"), "--tls-key", str(tmp_path / "server.key"),
         "--token-file", str(tokens)],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"run `chmod 600 {tokens}`" in result.stderr
    assert "Traceback" not in result.output


def test_help_shows_durations_as_an_operator_writes_them() -> None:
    shown = CliRunner().invoke(cli, ["broker", "--help"], terminal_width=200)
    assert shown.exit_code == 0
    assert "[default: 720h]" in shown.stdout and "e+" not in shown.stdout
