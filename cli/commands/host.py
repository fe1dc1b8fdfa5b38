"""``dxpool host list|get``: the hosts GPUs are attached to (registered by their agents)."""

from __future__ import annotations

import click

from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.output import OutputFormat, output_option, print_many, print_one
from dxpool.cli.params import HOST
from dxpool.cli.views import HOST_VIEW


@click.group()
def host() -> None:
    """List hosts and their free proxy slots."""


@host.command("list")
@output_option()
@pass_cli
def list_(cli: CliContext, output: OutputFormat) -> None:
    """List every registered host."""
    print_many(cli.client().list_hosts(), HOST_VIEW, output)


@host.command("get")
@click.argument("name", metavar="HOST", type=HOST)
@output_option()
@pass_cli
def get(cli: CliContext, name: str, output: OutputFormat) -> None:
    """Show one host."""
    print_one(cli.client().get_host(name), HOST_VIEW, output)
