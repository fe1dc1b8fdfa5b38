"""TLS material for the broker's gRPC endpoint, on both ends: PEM files to credentials.

* :class:`ServerTls` is what a broker serves with: its certificate and key, and
  optionally a client CA. With a client CA every client must present a certificate that
  CA signed (mutual TLS); the handshake fails otherwise, before any call is seen.
* :class:`ClientTls` is what a client (the CLI, :class:`dxpool.client.Client`) connects
  with: the CA that signed the broker's certificate, and its own certificate and key for
  mutual TLS. ``server_name`` overrides the name checked against the broker's
  certificate (by default the host of the endpoint).

Files are read when credentials are built; a missing or unreadable file raises
:class:`~dxpool.errors.InvalidArgument` naming the file and what it was for.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

from dxpool.errors import InvalidArgument

__all__ = ["ClientTls", "ServerTls", "is_loopback_listen", "read_pem"]


def read_pem(path: Path, what: str) -> bytes:
    """The bytes of a PEM file, or InvalidArgument saying which file could not be read."""
    try:
        data = Path(path).expanduser().read_bytes()
    except FileNotFoundError:
        raise InvalidArgument(
            f"{what} file {path} does not exist: check the path", reason="INVALID_TLS_FILE"
        ) from None
    except OSError as error:
        raise InvalidArgument(
            f"cannot read {what} file {path}: {error.strerror}", reason="INVALID_TLS_FILE"
        ) from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(
            f"{what} file {path} is not PEM (no '-----BEGIN' line)", reason="INVALID_TLS_FILE"
        )
    return data


@dataclass(frozen=True)
class ServerTls:
    """The broker's TLS: ``cert``/``key`` always, ``client_ca`` for mutual TLS."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        pair = (read_pem(self.key, "server key"), read_pem(self.cert, "server certificate"))
        if self.client_ca is None:
            return grpc.ssl_server_credentials([pair])
        return grpc.ssl_server_credentials(
            [pair],
            root_certificates=read_pem(self.client_ca, "client CA"),
            require_client_auth=True,
        )


@dataclass(frozen=True)
class ClientTls:
    """A client's TLS: ``ca`` verifies the broker (None: the system's roots), ``cert`` and
    ``key`` (both or neither) identify the client for mutual TLS."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgument(
                "a client certificate needs its key and a key its certificate: give both "
                "(--tls-cert and --tls-key, or 'cert' and 'key' in the config file)",
                reason="INVALID_TLS_CONFIG",
            )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "CA") if self.ca else None,
            private_key=read_pem(self.key, "client key") if self.key else None,
            certificate_chain=read_pem(self.cert, "client certificate") if self.cert else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


def is_loopback_listen(listen: str) -> bool:
    """Whether a listen address (``host:port``) binds loopback only."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, "", or "0.0.0.0"-style wildcard written oddly
        return False
