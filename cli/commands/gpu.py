"""``dxpool gpu list|get|reclaim|clear-health``: the GPUs of every box."""

from __future__ import annotations

import click

from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.help import SummaryGroup
from dxpool.cli.output import OutputFormat, output_option, print_many, print_one
from dxpool.cli.params import BOX, GPU, GPU_STATE
from dxpool.cli.views import GPU_VIEW


@click.group(cls=SummaryGroup)
def gpu() -> None:
    """List GPUs and their state; reclaim quarantined ones, clear unhealthy ones."""


@gpu.command("list")
@click.option("--box", "parent", type=BOX, default=None, help="Only the GPUs of this box.")
@click.option("--state", type=GPU_STATE, default=None, help="Only GPUs in this state (free...).")
@click.option("--model", default="", help="Only GPUs of this model.")
@output_option()
@pass_cli
def list_(
    cli: CliContext, parent: str | None, state: int | None, model: str, output: OutputFormat
) -> None:
    """List GPUs, e.g. the free ones: `dxpool gpu list --state free`."""
    print_many(cli.client().list_gpus(parent=parent, state=state, model=model), GPU_VIEW, output)


@gpu.command("get")
@click.argument("name", metavar="GPU", type=GPU)
@output_option()
@pass_cli
def get(cli: CliContext, name: str, output: OutputFormat) -> None:
    """Show one GPU: BOX/SLOT (e.g. box1/3)."""
    print_one(cli.client().get_gpu(name), GPU_VIEW, output)


@gpu.command("reclaim")
@click.argument("name", metavar="GPU", type=GPU)
@click.option("--reason", default="", help="Why it is safe now, for the next operator.")
@pass_cli
def reclaim(cli: CliContext, name: str, reason: str) -> None:
    """Put a QUARANTINED GPU (BOX/SLOT) back into service.

    It is fenced at the box side and scrubbed before it is FREE again, so a host that may
    still map it loses access first. Watch it with `dxpool gpu get BOX/SLOT`.
    """
    gpu = cli.client().reclaim_gpu(name, reason)
    click.echo(f"{gpu.name} reclaimed: fencing, then free")


@gpu.command("clear-health")
@click.argument("name", metavar="GPU", type=GPU)
@click.option("--reason", default="", help="What was checked, for the next operator.")
@pass_cli
def clear_health(cli: CliContext, name: str, reason: str) -> None:
    """Mark an unhealthy GPU (BOX/SLOT) healthy again, so it can be handed out.

    Refused while its host's agent still reports it unhealthy: release its node first.
    """
    gpu = cli.client().clear_gpu_health(name, reason)
    click.echo(f"{gpu.name} healthy")
