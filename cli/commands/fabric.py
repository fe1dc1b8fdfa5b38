"""``dxpool fabric``: what the fabric model says about a host-box path (``latency``), and the
simulated fabric (``sim``)."""

from __future__ import annotations

import click

from dxpool.cli.commands.fabric_sim import sim
from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.output import DOCUMENT_FORMATS, OutputFormat, output_option, print_one
from dxpool.cli.params import BOX, HOST
from dxpool.cli.views import LATENCY_VIEW


@click.group()
def fabric() -> None:
    """Inspect the fabric latency model; set up a simulated fabric."""


fabric.add_command(sim)


@fabric.command("latency")
@click.option("--host", "host_name", type=HOST, required=True, help="Host id or hosts/{host}.")
@click.option("--box", "box_name", type=BOX, required=True, help="Box id or boxes/{box}.")
@output_option(DOCUMENT_FORMATS)
@pass_cli
def latency(cli: CliContext, host_name: str, box_name: str, output: OutputFormat) -> None:
    """Round-trip latency of a PCIe transaction between HOST and BOX."""
    print_one(cli.client().get_latency(host_name, box_name), LATENCY_VIEW, output)
