"""Endpoint resolution: flag > $DXPOOL_ENDPOINT > config file > default."""

from __future__ import annotations

from pathlib import Path

import pytest

from dxpool.config import (
    DEFAULT_ENDPOINT,
    config_path,
    load_config,
    resolve_connection,
    resolve_endpoint,
    resolve_endpoint_setting,
)
from dxpool.errors import InvalidArgument
from dxpool.tls import ClientTls


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("endpoint: file-host:7000\n")
    return path


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # no ./.dxpool/config.yaml of a local pool
    monkeypatch.delenv("DXPOOL_ENDPOINT", raising=False)
    monkeypatch.delenv("DXPOOL_CONFIG", raising=False)


def test_flag_beats_environment_and_file(config_file: Path) -> None:
    env = {"DXPOOL_ENDPOINT": "env-host:6000", "DXPOOL_CONFIG": str(config_file)}
    assert resolve_endpoint_setting("flag-host:5000", env=env) == ("flag-host:5000", "--endpoint")


def test_environment_beats_file(config_file: Path) -> None:
    env = {"DXPOOL_ENDPOINT": "env-host:6000", "DXPOOL_CONFIG": str(config_file)}
    assert resolve_endpoint_setting(None, env=env) == ("env-host:6000", "$DXPOOL_ENDPOINT")


def test_file_beats_default(config_file: Path) -> None:
    setting = resolve_endpoint_setting(None, env={"DXPOOL_CONFIG": str(config_file)})
    assert setting.value == "file-host:7000"
    assert str(config_file) in setting.source


def test_default_file_under_home_is_read(tmp_path: Path) -> None:
    default = tmp_path / "home" / ".config" / "dxpool" / "config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("endpoint: home-host:9000\n")
    assert config_path({}) == default
    assert resolve_endpoint(env={}) == "home-host:9000"


def test_default_when_nothing_is_configured() -> None:
    assert resolve_endpoint(env={}) == DEFAULT_ENDPOINT == "127.0.0.1:8470"


def test_empty_values_fall_through(config_file: Path) -> None:
    env = {"DXPOOL_ENDPOINT": "", "DXPOOL_CONFIG": str(config_file)}
    assert resolve_endpoint("", env=env) == "file-host:7000"


def test_process_environment_is_the_default_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DXPOOL_ENDPOINT", "env-host:6000")
    assert resolve_endpoint() == "env-host:6000"


def test_empty_config_file_means_no_settings(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config({"DXPOOL_CONFIG": str(path)}) == {}
    assert resolve_endpoint(env={"DXPOOL_CONFIG": str(path)}) == DEFAULT_ENDPOINT


def test_missing_explicit_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"does not exist.*DXPOOL_CONFIG"):
        resolve_endpoint(env={"DXPOOL_CONFIG": str(tmp_path / "nope.yaml")})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("endpoint: [unclosed", "not valid YAML"),
        ("- a\n- b\n", "must hold a mapping"),
        ("endpont: h:1\n", r"unknown key\(s\) \['endpont'\]"),
        ("endpoint: 8470\n", "must be a string"),
        ("endpoint: nohostport\n", "expected host:port"),
    ],
)
def test_bad_config_file_names_the_file(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=expected) as error:
        resolve_endpoint(env={"DXPOOL_CONFIG": str(path)})
    assert str(path) in error.value.message


@pytest.mark.parametrize("value", ["localhost", "a b:1", " host:1"])
def test_bad_endpoint_names_its_source(value: str) -> None:
    with pytest.raises(InvalidArgument, match=r"\$DXPOOL_ENDPOINT: expected host:port"):
        resolve_endpoint(env={"DXPOOL_ENDPOINT": value})


@pytest.mark.parametrize(
    ("value", "target"),
    [
        ("http://broker.example:8470", "broker.example:8470"),
        ("grpc://10.0.0.5:8470/", "10.0.0.5:8470"),
        ("HTTP://[::1]:8470", "[::1]:8470"),
        ("dns:///broker.example:8470", "dns:///broker.example:8470"),
        ("unix:///run/dxpool.sock", "unix:///run/dxpool.sock"),
        ("broker.example:8470", "broker.example:8470"),
    ],
)
def test_a_plaintext_url_gives_its_host_and_port(value: str, target: str) -> None:
    assert resolve_endpoint(value) == target
    assert resolve_endpoint(env={"DXPOOL_ENDPOINT": value}) == target


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("https://broker.example:8470", "cannot ask for TLS"),
        ("grpcs://broker.example:8470", "cannot ask for TLS"),
        ("ftp://broker.example:8470", "unknown scheme 'ftp'"),
        ("http://broker.example:8470/api", "has no path"),
        ("http://broker.example:8470?x=1", "has no path"),
        ("http://broker.example", "expected host:port"),
        ("http://", "expected host:port"),
    ],
)
def test_other_urls_are_refused_saying_what_to_write(value: str, expected: str) -> None:
    with pytest.raises(InvalidArgument, match=expected) as error:
        resolve_endpoint(value)
    assert error.value.reason == "INVALID_ENDPOINT"
    assert "--endpoint" in error.value.message


# -- TLS and token settings ---------------------------------------------------------------


def test_tls_paths_in_the_config_file_are_taken_from_its_directory(tmp_path: Path) -> None:
    config = tmp_path / "pool" / "config.yaml"
    config.parent.mkdir()
    config.write_text("endpoint: h:1\nca: pki/ca.crt\ncert: pki/me.crt\nkey: /abs/me.key\n")
    tls, token = resolve_connection(env={"DXPOOL_CONFIG": str(config)})
    assert tls == ClientTls(
        ca=config.parent / "pki/ca.crt", cert=config.parent / "pki/me.crt", key=Path("/abs/me.key")
    )
    assert token is None


def test_tls_flag_beats_environment_beats_file(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("ca: file-ca.crt\n")
    env = {"DXPOOL_CONFIG": str(config), "DXPOOL_CA": "/env/ca.crt"}
    assert resolve_connection(ca="/flag/ca.crt", env=env).tls == ClientTls(ca=Path("/flag/ca.crt"))
    assert resolve_connection(env=env).tls == ClientTls(ca=Path("/env/ca.crt"))
    del env["DXPOOL_CA"]
    assert resolve_connection(env=env).tls == ClientTls(ca=tmp_path / "file-ca.crt")


def test_no_tls_settings_mean_plaintext() -> None:
    assert resolve_connection(env={}) == (None, None)


def test_a_token_file_is_read_and_implies_tls(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "token").chmod(0o600)
    connection = resolve_connection(env={"DXPOOL_TOKEN_FILE": str(tmp_path / "token")})
    assert connection.token == "s3cret"
    assert connection.tls == ClientTls()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o602])
def test_a_token_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(mode)
    with pytest.raises(InvalidArgument, match=rf"run `chmod 600 {token}`"):
        resolve_connection(env={"DXPOOL_TOKEN_FILE": str(token)})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("ca: 5\n", "'ca' in config file .* must be a non-empty string"),
     ("cert: c.crt\n", "give both")],
)  # fmt: skip
def test_bad_tls_settings_say_what_to_fix(tmp_path: Path, text: str, expected: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(InvalidArgument, match=expected):
        resolve_connection(env={"DXPOOL_CONFIG": str(config)})


def test_local_pool_config_is_read_when_no_other_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert config_path({}) == (tmp_path / "home/.config/dxpool/config.yaml")
    (tmp_path / ".dxpool").mkdir()
    (tmp_path / ".dxpool/config.yaml").write_text("endpoint: local:1\n")
    assert config_path({}) == tmp_path / ".dxpool/config.yaml"
    assert resolve_endpoint(env={}) == "local:1"
