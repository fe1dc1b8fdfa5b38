"""Where the broker is: the one place that resolves the endpoint.

Precedence, highest first:

1. an explicit value (the ``--endpoint`` flag, or ``Client(endpoint=...)``);
2. the environment variable ``DXPOOL_ENDPOINT``;
3. the key ``endpoint`` in the config file: ``$DXPOOL_CONFIG`` if set, otherwise
   ``~/.config/dxpool/config.yaml``, otherwise ``./.dxpool/config.yaml`` (the file
   ``dxpool up`` writes into its default data directory), whichever exists first (a
   missing default file is fine; a missing file that ``DXPOOL_CONFIG`` names is an error);
4. ``127.0.0.1:8470``, which is also where ``dxpool up`` listens, so a local pool needs no
   configuration at all.

The TLS settings and the bearer token (``ca``, ``cert``, ``key``, ``server_name``,
``token_file``) resolve the same way, each on its own: flag, then ``DXPOOL_CA``,
``DXPOOL_CERT``, ``DXPOOL_KEY``, ``DXPOOL_SERVER_NAME``, ``DXPOOL_TOKEN_FILE``, then the
config file, where relative paths are taken from the file's directory. With none of
them the connection is plaintext, as before.

Every bad value raises :class:`~dxpool.errors.InvalidArgument` naming where it came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from dxpool.defaults import DEFAULT_ENDPOINT
from dxpool.errors import InvalidArgument
from dxpool.private_files import check_private
from dxpool.tls import ClientTls

ENDPOINT_ENV = "DXPOOL_ENDPOINT"
CONFIG_ENV = "DXPOOL_CONFIG"
DEFAULT_CONFIG_PATH = Path("~/.config/dxpool/config.yaml")
# What `dxpool up` writes into its default data directory, read when no other file is.
LOCAL_POOL_CONFIG_PATH = Path(".dxpool/config.yaml")
CONFIG_KEYS = frozenset({"endpoint", "ca", "cert", "key", "server_name", "token_file"})


class Setting(NamedTuple):
    """A resolved value and where it came from (for messages and ``--verbose`` logs)."""

    value: str
    source: str


def config_path(env: Mapping[str, str] | None = None) -> Path:
    """The config file to read: ``$DXPOOL_CONFIG``, else the default path, else a local
    pool's ``./.dxpool/config.yaml`` if only that one exists; user-expanded."""
    env = os.environ if env is None else env
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]).expanduser()
    default = DEFAULT_CONFIG_PATH.expanduser()
    if not default.exists() and LOCAL_POOL_CONFIG_PATH.is_file():
        return LOCAL_POOL_CONFIG_PATH.absolute()
    return default


def load_config(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read the config file as a mapping; ``{}`` when the default file does not exist."""
    env = os.environ if env is None else env
    path = config_path(env)
    explicit = bool(env.get(CONFIG_ENV))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise InvalidArgument(
                f"config file {path} (from ${CONFIG_ENV}) does not exist: create it or unset "
                f"{CONFIG_ENV}",
                reason="INVALID_CONFIG",
            ) from None
        return {}
    except OSError as error:
        raise InvalidArgument(
            f"cannot read config file {path}: {error.strerror}", reason="INVALID_CONFIG"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise InvalidArgument(
            f"config file {path} is not valid YAML: {error}", reason="INVALID_CONFIG"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidArgument(
            f"config file {path} must hold a mapping such as 'endpoint: 127.0.0.1:8470', "
            f"got a {type(data).__name__}",
            reason="INVALID_CONFIG",
        )
    unknown = sorted(str(key) for key in set(data) - CONFIG_KEYS)
    if unknown:
        raise InvalidArgument(
            f"config file {path} has unknown key(s) {unknown}: known keys are "
            f"{sorted(CONFIG_KEYS)}",
            reason="INVALID_CONFIG",
        )
    return data


# URL schemes that only say "plaintext gRPC" and can be dropped, and those that ask for TLS,
# which is configured on its own and never implied by how an endpoint is spelled.
_PLAINTEXT_SCHEMES = ("http", "grpc")
_TLS_SCHEMES = ("https", "grpcs")
# Target schemes gRPC itself resolves (https://grpc.github.io/grpc/core/md_doc_naming.html).
_GRPC_TARGET_PREFIXES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:")


def check_endpoint(value: str, source: str) -> str:
    """Return ``value`` as a gRPC target if it is one (``host:port``, ``dns:///host:port``).

    A URL that only says "plaintext", ``http://host:port`` or ``grpc://host:port`` (a
    trailing ``/`` allowed), gives ``host:port``. Anything else URL-shaped (``https://``, a
    path, another scheme) raises :class:`InvalidArgument` saying what to write instead.
    """
    example = f"e.g. {DEFAULT_ENDPOINT}"
    if value.startswith(_GRPC_TARGET_PREFIXES):
        target = value
    elif "://" in value:
        scheme, _, rest = value.partition("://")
        if scheme.lower() in _TLS_SCHEMES:
            raise InvalidArgument(
                f"invalid broker endpoint {value!r} from {source}: the scheme cannot ask for "
                f"TLS; give host:port ({example}) and configure TLS on its own",
                reason="INVALID_ENDPOINT",
            )
        if scheme.lower() not in _PLAINTEXT_SCHEMES:
            raise InvalidArgument(
                f"invalid broker endpoint {value!r} from {source}: unknown scheme "
                f"{scheme!r}; give host:port ({example})",
                reason="INVALID_ENDPOINT",
            )
        target = rest[:-1] if rest.endswith("/") else rest
        if "/" in target or "?" in target or "#" in target:
            raise InvalidArgument(
                f"invalid broker endpoint {value!r} from {source}: a gRPC endpoint has no "
                f"path; give host:port ({example})",
                reason="INVALID_ENDPOINT",
            )
    else:
        target = value
    if not target or target != target.strip() or " " in target or ":" not in target:
        raise InvalidArgument(
            f"invalid broker endpoint {value!r} from {source}: expected host:port, {example}",
            reason="INVALID_ENDPOINT",
        )
    return target


def resolve_endpoint_setting(
    explicit: str | None = None, *, env: Mapping[str, str] | None = None
) -> Setting:
    """Resolve the broker endpoint by the precedence above, with its source."""
    env = os.environ if env is None else env
    if explicit:
        return Setting(check_endpoint(explicit, "--endpoint"), "--endpoint")
    if env.get(ENDPOINT_ENV):
        source = f"${ENDPOINT_ENV}"
        return Setting(check_endpoint(env[ENDPOINT_ENV], source), source)
    config = load_config(env)
    if "endpoint" in config:
        source = f"config file {config_path(env)}"
        value = config["endpoint"]
        if not isinstance(value, str):
            raise InvalidArgument(
                f"'endpoint' in {source} must be a string such as {DEFAULT_ENDPOINT!r}, "
                f"got {value!r}",
                reason="INVALID_CONFIG",
            )
        return Setting(check_endpoint(value, source), source)
    return Setting(DEFAULT_ENDPOINT, "default")


def resolve_endpoint(explicit: str | None = None, *, env: Mapping[str, str] | None = None) -> str:
    """The broker endpoint to use; see the module docstring for the precedence."""
    return resolve_endpoint_setting(explicit, env=env).value


# -- TLS and token settings ---------------------------------------------------------------

TLS_ENV: Mapping[str, str] = {
    "ca": "DXPOOL_CA",
    "cert": "DXPOOL_CERT",
    "key": "DXPOOL_KEY",
    "server_name": "DXPOOL_SERVER_NAME",
    "token_file": "DXPOOL_TOKEN_FILE",
}
_PATH_SETTINGS = frozenset({"ca", "cert", "key", "token_file"})


class Connection(NamedTuple):
    """How to reach and authenticate to the broker, beyond its endpoint.

    ``tls`` None: plaintext. ``token``: a bearer token sent on every call (needs TLS)."""

    tls: ClientTls | None
    token: str | None


def _security_setting(
    name: str, explicit: str | None, env: Mapping[str, str], config: Mapping[str, Any] | None
) -> str | None:
    """One TLS/token setting by flag > environment > config file; paths from the file are
    taken relative to the file's directory."""
    if explicit:
        return explicit
    if env.get(TLS_ENV[name]):
        return env[TLS_ENV[name]]
    if config is None or name not in config:
        return None
    value = config[name]
    if not isinstance(value, str) or not value:
        raise InvalidArgument(
            f"{name!r} in config file {config_path(env)} must be a non-empty string, got {value!r}",
            reason="INVALID_CONFIG",
        )
    if name in _PATH_SETTINGS:
        return str(config_path(env).parent / Path(value).expanduser())
    return value


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (its first line, stripped); InvalidArgument when the
    file may be read by others (it must be mode 0600 or stricter)."""
    check_private(path.expanduser(), "token file", reason="INVALID_CONFIG")
    try:
        token = path.expanduser().read_text(encoding="utf-8").strip().splitlines()
    except OSError as error:
        raise InvalidArgument(
            f"cannot read token file {path}: {error.strerror}", reason="INVALID_CONFIG"
        ) from None
    if not token or not token[0].strip():
        raise InvalidArgument(f"token file {path} is empty", reason="INVALID_CONFIG")
    return token[0].strip()


def resolve_connection(
    *,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    server_name: str | None = None,
    token_file: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Connection:
    """TLS material and token by the precedence in the module docstring."""
    env = os.environ if env is None else env
    explicit = {
        "ca": ca,
        "cert": cert,
        "key": key,
        "server_name": server_name,
        "token_file": token_file,
    }
    # The file is read only when some setting is left to it.
    left_to_file = any(not explicit[name] and not env.get(TLS_ENV[name]) for name in TLS_ENV)
    config = load_config(env) if left_to_file else None
    found = {n: _security_setting(n, explicit[n], env, config) for n in TLS_ENV}
    tls: ClientTls | None = None
    if found["ca"] or found["cert"] or found["key"]:
        tls = ClientTls(
            ca=Path(found["ca"]) if found["ca"] else None,
            cert=Path(found["cert"]) if found["cert"] else None,
            key=Path(found["key"]) if found["key"] else None,
            server_name=found["server_name"],
        )
    token = read_token(Path(found["token_file"])) if found["token_file"] else None
    if token is not None and tls is None:
        tls = ClientTls(server_name=found["server_name"])  # tokens only travel over TLS
    return Connection(tls, token)


__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_ENDPOINT",
    "ENDPOINT_ENV",
    "TLS_ENV",
    "Connection",
    "Setting",
    "config_path",
    "load_config",
    "read_token",
    "resolve_connection",
    "resolve_endpoint",
    "resolve_endpoint_setting",
]
