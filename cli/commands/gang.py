"""``dxpool gang create|get|delete``: several nodes composed all or nothing."""

from __future__ import annotations

from typing import Any

import click

from dxpool.api.v1 import nodes_pb2, resources_pb2
from dxpool.cli.commands.node import DEFAULT_WAIT
from dxpool.cli.commands.sharing import gang_queue_options, with_sharing
from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.errors import MAX_CONCURRENT_WAITS, for_each
from dxpool.cli.help import SummaryGroup
from dxpool.cli.node_request_options import node_request_options
from dxpool.cli.output import (
    OutputFormat,
    dump,
    info,
    output_option,
    print_many,
    to_dict,
)
from dxpool.cli.params import GANG, GANG_ID, REQUEST_ID, SECONDS
from dxpool.cli.views import NODE_VIEW
from dxpool.client import node_state_name
from dxpool.node_request import NodeRequest

NodeState = resources_pb2.NodeState


def _print_gang(gang: nodes_pb2.Gang, output: OutputFormat) -> None:
    """The gang as one document (json, yaml) or its members as nodes (table, name)."""
    if output in (OutputFormat.JSON, OutputFormat.YAML):
        click.echo(dump(to_dict(gang), output).rstrip("\n"))
    else:
        print_many(list(gang.nodes), NODE_VIEW, output)


@click.group(cls=SummaryGroup)
def gang() -> None:
    """Compose several nodes all or nothing (a job larger than one host), inspect and
    release them together."""


@gang.command("create")
@node_request_options
@gang_queue_options
@click.option(
    "--count",
    type=click.IntRange(min=1),
    required=True,
    help="How many member nodes, each with the spec given.",
)
@click.option(
    "--name", "gang_id", type=GANG_ID, default=None, help="Gang id; generated when not given."
)
@click.option(
    "--request-id", type=REQUEST_ID, default=None, help="Idempotency key; a retry returns the gang."
)
@click.option("--wait", is_flag=True, help="Wait until every member is READY.")
@click.option(
    "--timeout",
    type=SECONDS,
    default=DEFAULT_WAIT,
    show_default=True,
    help="How long --wait waits for the whole gang.",
)
@output_option()
@pass_cli
def create(
    cli: CliContext,
    /,
    *,
    request: NodeRequest,
    count: int,
    gang_id: str | None,
    request_id: str | None,
    wait: bool,
    timeout: float,
    output: OutputFormat,
    **sharing: Any,
) -> None:
    """Compose COUNT nodes at once, all or none.

    Members are nodes named GANG-0 ... GANG-(COUNT-1), e.g.
    `dxpool gang create --count 4 --gpus H100:8 --wait`. A gang too large for one etcd
    transaction is committed in chunks and becomes valid at once; with --queue a gang
    that does not fit now waits as one."""
    client = cli.client()
    request, call = with_sharing(request, **sharing)
    created = client.compose_gang(request, count, gang_id=gang_id, request_id=request_id, **call)
    hosts = sorted({n.host.removeprefix("hosts/") for n in created.nodes})
    if created.state == resources_pb2.GANG_STATE_QUEUED:
        info(f"{created.name} queued (position {created.queue.position}): {created.queue.reason}")
    else:
        info(f"{created.name} created: {len(created.nodes)} nodes on {', '.join(hosts)}")
    if wait:
        info(f"waiting up to {timeout:g}s for every member of {created.name} to become READY")
        created = client.wait_for_gang(created.name, timeout_s=timeout)
    _print_gang(created, output)


@gang.command("get")
@click.argument("name", metavar="GANG", type=GANG)
@output_option()
@pass_cli
def get(cli: CliContext, name: str, output: OutputFormat) -> None:
    """Show a gang's members."""
    _print_gang(cli.client().get_gang(name), output)


@gang.command("delete")
@click.argument("names", metavar="GANG...", type=GANG, nargs=-1, required=True)
@click.option("--wait", is_flag=True, help="Wait until every member is RELEASED.")
@click.option(
    "--force",
    is_flag=True,
    help="Do not wait for the hosts' agents: fence the GPUs at the box side, scrub and "
    "free them (for members whose host is dead or hung).",
)
@click.option(
    "--timeout",
    type=SECONDS,
    default=DEFAULT_WAIT,
    show_default=True,
    help="How long --wait waits for each gang.",
)
@pass_cli
def delete(
    cli: CliContext, names: tuple[str, ...], wait: bool, force: bool, timeout: float
) -> None:
    """Release gangs: every member at once. Idempotent. Every name is tried; each
    failure is reported and the command then exits 1."""
    client = cli.client()

    def release(name: str) -> str:
        released = client.release_gang(name, force=force)
        if wait:
            released = client.wait_for_gang(
                released.name, until=(NodeState.NODE_STATE_RELEASED,), timeout_s=timeout
            )
        return "\n".join(f"{n.name} {node_state_name(n.state).lower()}" for n in released.nodes)

    if wait:
        what = names[0] if len(names) == 1 else f"{len(names)} gangs"
        info(f"waiting up to {timeout:g}s for {what} to be RELEASED")
    for_each(names, release, client.endpoint, concurrency=MAX_CONCURRENT_WAITS if wait else 1)
