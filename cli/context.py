"""What every command shares: the resolved broker endpoint and one lazily opened client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import click

from dxpool.client import Client
from dxpool.config import Setting, resolve_connection, resolve_endpoint_setting
from dxpool.errors import InvalidArgument


class SecurityFlags(NamedTuple):
    """The root command's TLS and token flags (None: not given)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    token_file: str | None = None


@dataclass
class CliContext:
    """The root command's object (``ctx.obj``); the client opens on first use only, so
    commands that need no broker (``dxpool up``, ``--help``) never resolve the endpoint."""

    endpoint_flag: str | None = None
    request_timeout_s: float = 10.0
    security_flags: SecurityFlags = field(default_factory=SecurityFlags)
    _endpoint: Setting | None = field(default=None, init=False)
    _client: Client | None = field(default=None, init=False)

    @property
    def endpoint(self) -> Setting:
        """The broker endpoint and where it came from; a bad value is a usage error."""
        if self._endpoint is None:
            try:
                self._endpoint = resolve_endpoint_setting(self.endpoint_flag)
            except InvalidArgument as error:
                raise click.UsageError(error.message) from None
        return self._endpoint

    def client(self) -> Client:
        """The client for this invocation, closed when the root context closes."""
        if self._client is None:
            flags = self.security_flags
            try:
                tls, token = resolve_connection(
                    ca=flags.ca, cert=flags.cert, key=flags.key, token_file=flags.token_file
                )
                self._client = Client(
                    self.endpoint.value,
                    timeout_s=self.request_timeout_s,
                    tls=tls,
                    token=token,
                    insecure=tls is None and token is None,
                )
            except InvalidArgument as error:  # a TLS file that cannot be read
                raise click.UsageError(error.message) from None
            click.get_current_context().find_root().call_on_close(self._client.close)
        return self._client


pass_cli = click.make_pass_decorator(CliContext)
"""Decorator passing the :class:`CliContext` as a command's first argument."""
