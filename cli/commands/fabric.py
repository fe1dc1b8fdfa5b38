"""``dxpool fabric latency``: what the fabric model says about a host-box path."""

from __future__ import annotations

import click

from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.output import DOCUMENT_FORMATS, OutputFormat, output_option, print_one
from dxpool.cli.params import BOX, HOST
from dxpool.cli.views import LATENCY_VIEW


@click.group()
def fabric() -> None:
    """Inspect the fabric latency model."""


@fabric.command("latency")
@click.option("--host", "host_name", type=HOST, required=True, help="Host id or hosts/{host}.")
@click.option("--box", "box_name", type=BOX, required=True, help="Box id or boxes/{box}.")
@output_option(DOCUMENT_FORMATS)
@pass_cli
def latency(cli: CliContext, host_name: str, box_name: str, output: OutputFormat) -> None:
    """Round-trip latency of a PCIe transaction between HOST and BOX."""
    print_one(cli.client().get_latency(host_name, box_name), LATENCY_VIEW, output)
