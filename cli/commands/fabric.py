"""``dxpool fabric``: what the fabric model says about a host-box path (``latency``), how
much slower a workload would run over it (``predict``), and the simulated fabric (``sim``)."""

from __future__ import annotations

import click

from dxpool.api.v1 import fabric_pb2
from dxpool.cli.commands.fabric_sim import sim
from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.help import SummaryGroup
from dxpool.cli.output import (
    DOCUMENT_FORMATS,
    OutputFormat,
    dump,
    format_table,
    output_option,
    print_one,
    to_dict,
)
from dxpool.cli.params import BOX, GPUS, HOST, WORKLOAD
from dxpool.cli.views import LATENCY_VIEW, latency, short
from dxpool.request import GpuSpec


@click.group(cls=SummaryGroup)
def fabric() -> None:
    """Inspect the fabric latency model; set up a simulated fabric."""


fabric.add_command(sim)


@fabric.command("latency")
@click.option("--host", "host_name", type=HOST, required=True, help="Host id or hosts/{host}.")
@click.option("--box", "box_name", type=BOX, required=True, help="Box id or boxes/{box}.")
@output_option(DOCUMENT_FORMATS)
@pass_cli
def latency_command(cli: CliContext, host_name: str, box_name: str, output: OutputFormat) -> None:
    """Round-trip latency of a PCIe transaction between HOST and BOX."""
    print_one(cli.client().get_latency(host_name, box_name), LATENCY_VIEW, output)


@fabric.command("predict")
@click.option("--host", "host_name", type=HOST, required=True, help="Host id or hosts/{host}.")
@click.option("--box", "box_name", type=BOX, default=None, help="Predict for this box.")
@click.option(
    "--gpus",
    type=GPUS,
    default=None,
    help="Predict for the boxes placement would give the host for MODEL:COUNT.",
)
@click.option(
    "--workload",
    type=WORKLOAD,
    default=None,
    help="A profile name or ROUND_TRIPS@STEP_TIME (e.g. 400@5ms); default: every profile.",
)
@output_option(DOCUMENT_FORMATS)
@pass_cli
def predict(
    cli: CliContext,
    host_name: str,
    box_name: str | None,
    gpus: GpuSpec | None,
    workload: str | None,
    output: OutputFormat,
) -> None:
    """Round trip, path and predicted slowdown of a workload between HOST and a box (--box)
    or the boxes a GPU request would get on HOST (--gpus), e.g.
    `dxpool fabric predict --host h1 --gpus H100:4 --workload training`."""
    if (box_name is None) == (gpus is None):
        raise click.UsageError("give exactly one of --box and --gpus")
    result = cli.client().predict(host_name, box=box_name, gpus=gpus, workload=workload or "")
    if output in (OutputFormat.JSON, OutputFormat.YAML):
        click.echo(dump(to_dict(result), output).rstrip("\n"))
        return
    click.echo(_prediction_text(result, wide=output is OutputFormat.WIDE))


def _prediction_text(result: fabric_pb2.Prediction, *, wide: bool) -> str:
    head = (
        f"host: {short(result.host)}  farthest: {short(result.box)} at "
        f"{latency(result.round_trip_ns)} ({result.latency_model} model)"
    )
    link_headers = ["BOX", "GPUS", "ROUND-TRIP"] + (["PATH"] if wide else [])
    links = format_table(
        link_headers,
        (
            [short(link.box), str(link.gpus), latency(link.round_trip_ns)]
            + ([" > ".join(link.path)] if wide else [])
            for link in result.links
        ),
    )
    slowdowns = format_table(
        ["WORKLOAD", "SLOWDOWN", "PROFILE"],
        ([s.workload, f"{s.slowdown:.3f}", s.profile] for s in result.slowdowns),
    )
    return "\n\n".join([head, links, slowdowns])
