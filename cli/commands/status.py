"""``dxpool status``: the pool at a glance."""

from __future__ import annotations

import click

from dxpool.api.v1 import inventory_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.output import OutputFormat, dump, format_table, output_option, to_dict
from dxpool.cli.views import enum_label

_FORMATS = (OutputFormat.TABLE, OutputFormat.JSON, OutputFormat.YAML)


@click.command("status")
@output_option(_FORMATS)
@pass_cli
def status(cli: CliContext, output: OutputFormat) -> None:
    """The pool at a glance: GPUs by model and state, nodes by state, hosts, and how many
    nodes of 1, 2, 4 and 8 GPUs fit now (any model, no latency bound)."""
    pool = cli.client().pool_status()
    if output is not OutputFormat.TABLE:
        click.echo(dump(to_dict(pool), output).rstrip("\n"))
        return
    click.echo(render(pool))


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
        ]
    )
