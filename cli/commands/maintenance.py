"""Maintenance commands: ``host cordon|uncordon|drain`` and ``box drain``. They are
mounted on the ``host`` and ``box`` groups by those modules."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.errors import for_each
from dxpool.cli.output import OutputFormat, dump, info, output_option, to_dict
from dxpool.cli.params import BOX, HOST, SECONDS
from dxpool.cli.sharing_view import drain_progress

DRAIN_WAIT = "10m"


def _show(resource: Any, output: OutputFormat) -> None:
    if output in (OutputFormat.JSON, OutputFormat.YAML):
        click.echo(dump(to_dict(resource), output).rstrip("\n"))
    else:
        click.echo(resource.name)


@click.command("cordon")
@click.argument("names", metavar="HOST...", type=HOST, nargs=-1, required=True)
@click.option("--reason", default="", help="Why (shown by `host describe`).")
@pass_cli
def cordon(cli: CliContext, names: tuple[str, ...], reason: str) -> None:
    """Stop placing new nodes on hosts; the nodes on them stay."""
    client = cli.client()
    for_each(
        names,
        lambda name: click.echo(f"{client.cordon_host(name, reason).name} cordoned"),
        client.endpoint,
    )


@click.command("uncordon")
@click.argument("names", metavar="HOST...", type=HOST, nargs=-1, required=True)
@pass_cli
def uncordon(cli: CliContext, names: tuple[str, ...]) -> None:
    """Make hosts schedulable again (ends a drain; its pending notices are withdrawn)."""
    client = cli.client()
    for_each(
        names,
        lambda name: click.echo(f"{client.uncordon_host(name).name} uncordoned"),
        client.endpoint,
    )


def _wait_drained(
    fetch: Callable[[], Any], name: str, timeout: float, interval: float = 1.0
) -> Any:
    """Poll ``fetch()`` until its drain is DRAINED, printing progress when it changes."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        resource = fetch()
        line = drain_progress(name, resource.drain)
        if line != last:
            info(line)
            last = line
        if resource.drain.state == pb.DRAIN_STATE_DRAINED:
            return resource
        if time.monotonic() >= deadline:
            raise click.ClickException(f"{name} not drained after {timeout:g}s: {line}")
        time.sleep(interval)


@click.command("drain")
@click.argument("name", metavar="HOST", type=HOST)
@click.option("--reason", default="", help="Why (shown by `host describe`).")
@click.option("--wait", is_flag=True, help="Wait until no node uses the host, with progress.")
@click.option("--timeout", type=SECONDS, default=DRAIN_WAIT, show_default=True)
@output_option()
@pass_cli
def drain_host(
    cli: CliContext, name: str, reason: str, wait: bool, timeout: float, output: OutputFormat
) -> None:
    """Cordon a host and release its nodes, each after its preemption notice."""
    client = cli.client()
    drained = client.drain_host(name, reason)
    info(drain_progress(drained.name, drained.drain))
    if wait:
        drained = _wait_drained(lambda: client.get_host(name), drained.name, timeout)
    _show(drained, output)


@click.command("drain")
@click.argument("name", metavar="BOX", type=BOX)
@click.option("--reason", default="", help="Why (shown by `box describe`).")
@click.option(
    "--policy",
    type=click.Choice(["move", "release"]),
    default="move",
    show_default=True,
    help="move: replace each node's GPUs in the box by others on the node's own host; "
    "release: release the nodes after their notice.",
)
@click.option("--wait", is_flag=True, help="Wait until no node uses the box, with progress.")
@click.option("--timeout", type=SECONDS, default=DRAIN_WAIT, show_default=True)
@output_option()
@pass_cli
def drain_box(
    cli: CliContext,
    name: str,
    reason: str,
    policy: str,
    wait: bool,
    timeout: float,
    output: OutputFormat,
) -> None:
    """Cordon a box and move (or release) the GPUs nodes hold in it; `box uncordon`
    ends the drain."""
    client = cli.client()
    drained = client.drain_box(name, reason, policy=policy)
    info(drain_progress(drained.name, drained.drain))
    if wait:
        drained = _wait_drained(lambda: client.get_box(name), drained.name, timeout)
    _show(drained, output)


__all__ = ["cordon", "drain_box", "drain_host", "uncordon"]
