"""``dxpool host list|get|describe``: the hosts GPUs are attached to (registered by their
agents)."""

from __future__ import annotations

import click

from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.describe import describe_host
from dxpool.cli.help import SummaryGroup
from dxpool.cli.output import OutputFormat, output_option, print_many, print_one
from dxpool.cli.params import HOST, selector_option
from dxpool.cli.views import HOST_VIEW


@click.group(cls=SummaryGroup)
def host() -> None:
    """List hosts and their proxy slots."""


@host.command("list")
@selector_option
@output_option()
@pass_cli
def list_(cli: CliContext, selector: str, output: OutputFormat) -> None:
    """List registered hosts with their used and total proxy slots (-o wide: which)."""
    print_many(cli.client().list_hosts(label_selector=selector), HOST_VIEW, output)


@host.command("get")
@click.argument("name", metavar="HOST", type=HOST)
@output_option()
@pass_cli
def get(cli: CliContext, name: str, output: OutputFormat) -> None:
    """Show one host."""
    print_one(cli.client().get_host(name), HOST_VIEW, output)


@host.command("describe")
@click.argument("names", metavar="HOST...", type=HOST, nargs=-1, required=True)
@pass_cli
def describe(cli: CliContext, names: tuple[str, ...]) -> None:
    """Show hosts in detail: the slots in use, the nodes on them and their recent events."""
    client = cli.client()
    texts = [describe_host(client.get_host(name), client.list_nodes(host=name)) for name in names]
    click.echo("\n\n".join(texts))
