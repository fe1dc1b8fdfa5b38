"""``dxpool status``: the pool at a glance, as a table or a picture (``--picture``),
refreshed in place with ``--watch`` (rich's Live), or saved as SVG (``--svg``)."""

from __future__ import annotations

import time

import click
from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from dxpool.api.v1 import inventory_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli import picture
from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.output import OutputFormat, dump, format_table, output_option, to_dict
from dxpool.cli.params import SECONDS
from dxpool.cli.sharing_view import status_lines
from dxpool.cli.views import enum_label
from dxpool.client import Client

_FORMATS = (OutputFormat.TABLE, OutputFormat.JSON, OutputFormat.YAML)


@click.command("status")
@output_option(_FORMATS)
@click.option(
    "--picture",
    "draw",
    is_flag=True,
    help="Draw the pool: per rack, per box, one glyph per GPU (free, attaching, attached, "
    "detaching, fencing, failing), with a legend.",
)
@click.option(
    "-w",
    "--watch",
    is_flag=True,
    help="Redraw in place every --interval until Ctrl-C (to a pipe: every frame in turn).",
)
@click.option(
    "--interval",
    type=SECONDS,
    default="2s",
    show_default=True,
    help="How often --watch redraws.",
)
@click.option(
    "--svg",
    "svg_path",
    metavar="FILE",
    default=None,
    help="Save the picture as SVG to FILE (implies --picture).",
)
@pass_cli
def status(
    cli: CliContext,
    output: OutputFormat,
    draw: bool,
    watch: bool,
    interval: float,
    svg_path: str | None,
) -> None:
    """The pool at a glance: GPUs by model and state, nodes by state, hosts, and how many
    nodes of 1, 2, 4 and 8 GPUs fit now (any model, no latency bound); or, with
    --picture, every GPU as a glyph in its box and rack."""
    draw = draw or svg_path is not None
    if output is not OutputFormat.TABLE and (draw or watch):
        raise click.UsageError(
            "-o json/yaml prints the status once, as data: drop -o, or drop --picture, "
            "--svg and --watch"
        )
    if svg_path is not None and watch:
        raise click.UsageError("--svg saves one picture: drop --watch")
    if interval <= 0:
        raise click.BadParameter("must be positive", param_hint="--interval")
    client = cli.client()
    if svg_path is not None:
        drawn = _draw(client)
        try:
            picture.save_svg(drawn, svg_path)
        except OSError as error:
            raise click.FileError(svg_path, hint=error.strerror or str(error)) from None
        click.echo(f"picture saved to {svg_path}", err=True)
        return
    if output is not OutputFormat.TABLE:
        click.echo(dump(to_dict(client.pool_status()), output).rstrip("\n"))
        return

    def view() -> RenderableType:
        return _draw(client) if draw else Text(render(client.pool_status()))

    if not watch:
        if draw:
            Console(highlight=False).print(view())
        else:
            click.echo(render(client.pool_status()))
        return
    console = Console(highlight=False)
    if not console.is_terminal:  # a pipe or a file: every frame, one after the other
        while True:
            console.print(view())
            console.print()
            console.file.flush()
            time.sleep(interval)
    with Live(view(), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            live.update(view(), refresh=True)


def _draw(client: Client) -> RenderableType:
    return picture.render(client.list_boxes(), client.list_gpus())


def render(pool: inventory_pb2.PoolStatus) -> str:
    """The status as the table form prints it."""
    models = format_table(
        ["MODEL", "TOTAL", "FREE", "IN USE", "FENCING", "QUARANTINED", "UNAVAILABLE", "USED"],
        [
            [
                m.model or "(all)",
                str(m.total),
                str(m.free),
                str(m.in_use),
                str(m.fencing),
                str(m.quarantined),
                str(m.unavailable),
                f"{100 * m.in_use / m.total:.0f}%" if m.total else "-",
            ]
            for m in pool.models
        ],
    )
    nodes = ", ".join(
        f"{enum_label(state, 'NODE_STATE_')} {count}"
        for state, count in sorted(
            pool.nodes_by_state.items(), key=lambda item: pb.NodeState.Value(item[0])
        )
    )
    fits = ", ".join(f"{fit.gpus}-GPU {fit.nodes}" for fit in pool.fits)
    return "\n".join(
        [
            models,
            "",
            f"Nodes:  {nodes or 'none'}",
            f"Hosts:  {pool.hosts_alive} alive, {pool.hosts_dead} dead, "
            f"{pool.free_host_slots} free proxy slots on live hosts",
            f"Fit now (nodes that could still be composed, one after another): {fits}",
            *status_lines(pool),
        ]
    )
