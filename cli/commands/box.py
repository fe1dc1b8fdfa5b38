"""``dxpool box add|list|get|describe|cordon|uncordon|delete``: the GPU boxes of the pool."""

from __future__ import annotations

import click

from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.describe import describe_box
from dxpool.cli.errors import for_each
from dxpool.cli.help import SummaryGroup
from dxpool.cli.output import OutputFormat, output_option, print_many, print_one
from dxpool.cli.params import (
    BOX,
    GPUS,
    LABEL,
    MEMORY,
    ignore_not_found_option,
    labels_dict,
    selector_option,
)
from dxpool.cli.views import BOX_VIEW
from dxpool.request import GpuSpec


@click.group(cls=SummaryGroup)
def box() -> None:
    """Register, list, cordon and delete GPU boxes."""


@box.command("add")
@click.argument("box_id", metavar="BOX")
@click.option(
    "--gpus",
    "gpus",
    type=GPUS,
    required=True,
    help="GPUs in the box: COUNT with --model, or MODEL:COUNT (e.g. H100:8).",
)
@click.option("--model", default="", help="GPU model in every slot, e.g. H100.")
@click.option("--memory", "memory_mib", type=MEMORY, required=True, help="Memory per GPU: 80GiB.")
@click.option("--site", default="", help="Site of the box (for the latency model).")
@click.option("--pod", default="", help="Pod of the box.")
@click.option("--rack", default="", help="Rack of the box.")
@click.option("--fabric-endpoint", default="", help="Address of the box-side proxy.")
@click.option("--label", "labels", type=LABEL, multiple=True, help="KEY=VALUE; repeatable.")
@click.option("--request-id", default=None, help="Idempotency key; a retry returns the box.")
@output_option()
@pass_cli
def add(
    cli: CliContext,
    *,
    box_id: str,
    gpus: GpuSpec,
    model: str,
    memory_mib: int,
    site: str,
    pod: str,
    rack: str,
    fabric_endpoint: str,
    labels: tuple[tuple[str, str], ...],
    request_id: str | None,
    output: OutputFormat,
) -> None:
    """Register BOX with its GPUs, e.g. `dxpool box add box1 --gpus H100:8 --memory 80GiB`."""
    if gpus.model and model and gpus.model != model:
        raise click.BadParameter(
            f"--gpus says {gpus.model} but --model says {model}; give the model once",
            param_hint="--model",
        )
    if not (gpus.model or model):
        raise click.BadParameter(
            "the GPU model is missing: use --gpus MODEL:COUNT (e.g. H100:8) or --model",
            param_hint="--gpus",
        )
    created = cli.client().create_box(
        box_id,
        gpus=gpus.count,
        model=gpus.model or model,
        memory_mib=memory_mib,
        location=(site, pod, rack),
        labels=labels_dict(labels),
        fabric_endpoint=fabric_endpoint,
        request_id=request_id,
    )
    print_one(created, BOX_VIEW, output)


@box.command("list")
@selector_option
@output_option()
@pass_cli
def list_(cli: CliContext, selector: str, output: OutputFormat) -> None:
    """List boxes with their free and total GPUs (free: what a compose may take now)."""
    print_many(cli.client().list_boxes(label_selector=selector), BOX_VIEW, output)


@box.command("describe")
@click.argument("names", metavar="BOX...", type=BOX, nargs=-1, required=True)
@pass_cli
def describe(cli: CliContext, names: tuple[str, ...]) -> None:
    """Show boxes in detail: their GPUs, and the recent events of the nodes using them."""
    client = cli.client()
    texts = []
    for name in names:
        found = client.get_box(name)
        gpus = client.list_gpus(parent=name)
        owners = sorted({gpu.node for gpu in gpus if gpu.node})
        nodes = [client.get_node(owner) for owner in owners]
        texts.append(describe_box(found, gpus, nodes))
    click.echo("\n\n".join(texts))


@box.command("get")
@click.argument("names", metavar="BOX...", type=BOX, nargs=-1, required=True)
@output_option()
@pass_cli
def get(cli: CliContext, names: tuple[str, ...], output: OutputFormat) -> None:
    """Show one or more boxes."""
    found = [cli.client().get_box(name) for name in names]
    if len(found) == 1:
        print_one(found[0], BOX_VIEW, output)
    else:
        print_many(found, BOX_VIEW, output)


@box.command("cordon")
@click.argument("name", metavar="BOX", type=BOX)
@click.option("--reason", default="", help="Why, for the next operator.")
@pass_cli
def cordon(cli: CliContext, name: str, reason: str) -> None:
    """Stop placing new nodes on BOX's GPUs (attached GPUs stay). Idempotent."""
    cli.client().cordon_box(name, reason)
    click.echo(f"{name} cordoned")


@box.command("uncordon")
@click.argument("name", metavar="BOX", type=BOX)
@pass_cli
def uncordon(cli: CliContext, name: str) -> None:
    """Make BOX schedulable again. Idempotent."""
    cli.client().uncordon_box(name)
    click.echo(f"{name} uncordoned")


@box.command("delete")
@click.argument("names", metavar="BOX...", type=BOX, nargs=-1, required=True)
@ignore_not_found_option
@pass_cli
def delete(cli: CliContext, names: tuple[str, ...], ignore_not_found: bool) -> None:
    """Remove boxes and their GPUs; refused while any of their GPUs is in use. Every name
    is tried; each failure is reported and the command then exits 1."""
    client = cli.client()

    def remove(name: str) -> str:
        client.delete_box(name)
        return f"{name} deleted"

    for_each(names, remove, client.endpoint, ignore_not_found=ignore_not_found)
