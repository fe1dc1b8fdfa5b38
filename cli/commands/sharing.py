"""The CLI of the pool's sharing: queue and preemption options of ``node create`` and
``gang create``, ``dxpool queue list``, ``dxpool host cordon|uncordon|drain`` and
``dxpool box drain``.

The options are decorators the create commands wear (:func:`node_queue_options`,
:func:`gang_queue_options`); their values reach the client through
:func:`sharing_kwargs`. The maintenance commands join the ``host`` and ``box`` groups
when this module is imported (``cli/main.py`` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import click

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.commands.box import box as box_group
from dxpool.cli.commands.host import host as host_group
from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.errors import for_each
from dxpool.cli.output import OutputFormat, dump, info, output_option, to_dict
from dxpool.cli.params import BOX, HOST, SECONDS, TENANT
from dxpool.cli.sharing_view import drain_progress, queue_table
from dxpool.limits import MAX_GRACE_S, MAX_PRIORITY, MAX_QUEUE_TIMEOUT_S

_F = TypeVar("_F", bound=Callable[..., Any])
DRAIN_WAIT = "10m"


def _apply(command: _F, options: list[Callable[[_F], _F]]) -> _F:
    for option in reversed(options):
        command = option(command)
    return command


def _common() -> list[Any]:
    return [
        click.option(
            "--queue",
            "queue",
            is_flag=True,
            help="Wait in the queue when it does not fit now, instead of being refused.",
        ),
        click.option(
            "--queue-timeout",
            type=SECONDS,
            default=None,
            help="With --queue: give up waiting after this long (default: until deleted).",
        ),
        click.option(
            "--priority",
            type=click.IntRange(0, MAX_PRIORITY),
            default=0,
            show_default=True,
            help="Higher is served first, and may preempt borrowed nodes of lower priority.",
        ),
        click.option(
            "--preemption-grace",
            type=SECONDS,
            default=None,
            help="The notice this node gets before a preemption or drain takes its GPUs "
            "(default: the broker's).",
        ),
    ]


def node_queue_options(command: _F) -> _F:
    """``--queue``, ``--queue-timeout``, ``--priority``, ``--preemption-grace`` and
    ``--min-gpus`` (an elastic node)."""
    return _apply(
        command,
        [
            *_common(),
            click.option(
                "--min-gpus",
                type=click.IntRange(0),
                default=0,
                help="Elastic: when the lent capacity it holds is reclaimed, shrink it down "
                "to this many GPUs instead of preempting it.",
            ),
        ],
    )


def gang_queue_options(command: _F) -> _F:
    """The node options but ``--min-gpus``, plus ``--distinct-hosts`` and ``--same-switch``."""
    return _apply(
        command,
        [
            *_common(),
            click.option(
                "--distinct-hosts", is_flag=True, help="Every member on a host of its own."
            ),
            click.option(
                "--same-switch",
                is_flag=True,
                help="Every member's GPUs under one top-of-rack switch (the same for all).",
            ),
        ],
    )


def sharing_kwargs(
    *,
    queue: bool,
    queue_timeout: float | None,
    priority: int,
    preemption_grace: float | None,
    **extra: Any,
) -> dict[str, Any]:
    """The client's keyword arguments for the options above (``extra``: ``min_gpus``,
    ``distinct_hosts``, ``same_switch``, passed on)."""
    if queue_timeout is not None and not queue:
        raise click.UsageError("--queue-timeout needs --queue")
    if queue_timeout is not None and not 0 < queue_timeout <= MAX_QUEUE_TIMEOUT_S:
        raise click.UsageError("--queue-timeout must be more than 0 and at most 7 days")
    if preemption_grace is not None and not 0 <= preemption_grace <= MAX_GRACE_S:
        raise click.UsageError(f"--preemption-grace must be 0 to {MAX_GRACE_S}s")
    kwargs: dict[str, Any] = {
        "queue": queue,
        "queue_timeout_s": int(queue_timeout or 0),
        "priority": priority,
        "preemption_grace_s": None if preemption_grace is None else int(preemption_grace),
    }
    kwargs.update(extra)
    return kwargs


# -- dxpool queue ---------------------------------------------------------------------------


@click.group()
def queue() -> None:
    """The requests waiting for capacity, in the order they will be served."""


@queue.command("list")
@click.option("--tenant", type=TENANT, default=None, help="Only this tenant's requests.")
@output_option()
@pass_cli
def list_(cli: CliContext, tenant: str | None, output: OutputFormat) -> None:
    """List waiting requests: position, name, tenant, priority, GPUs, wait and reason."""
    entries = cli.client().list_queue(tenant=tenant or "")
    if output in (OutputFormat.JSON, OutputFormat.YAML):
        click.echo(dump([to_dict(e) for e in entries], output).rstrip("\n"))
    elif output is OutputFormat.NAME:
        for entry in entries:
            click.echo(entry.name)
    else:
        click.echo(queue_table(entries))


# -- dxpool host cordon|uncordon|drain, dxpool box drain --------------------------------------


def _show(resource: Any, output: OutputFormat) -> None:
    if output in (OutputFormat.JSON, OutputFormat.YAML):
        click.echo(dump(to_dict(resource), output).rstrip("\n"))
    else:
        click.echo(resource.name)


@host_group.command("cordon")
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


@host_group.command("uncordon")
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


@host_group.command("drain")
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


@box_group.command("drain")
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


__all__ = [
    "gang_queue_options",
    "node_queue_options",
    "queue",
    "sharing_kwargs",
]
