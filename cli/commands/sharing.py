"""The CLI of the pool's sharing: queue and preemption options of ``node create`` and
``gang create``, and ``dxpool queue list`` (the maintenance commands are in
``maintenance.py``).

The options are decorators the create commands wear (:func:`node_queue_options`,
:func:`gang_queue_options`); their values reach the client through
:func:`with_sharing`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.output import OutputFormat, dump, output_option, to_dict
from dxpool.cli.params import SECONDS, TENANT
from dxpool.cli.sharing_view import queue_table
from dxpool.limits import MAX_GRACE_S, MAX_PRIORITY, MAX_QUEUE_TIMEOUT_S
from dxpool.node_request import NodeRequest

_F = TypeVar("_F", bound=Callable[..., Any])


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


_SPEC_TERMS = ("priority", "min_gpus", "preemption_grace_s")
"""The sharing options that are part of a node's request, not of the call."""


def with_sharing(request: NodeRequest, **sharing: Any) -> tuple[NodeRequest, dict[str, Any]]:
    """``request`` with the sharing options that belong to a node's request (priority,
    min_gpus, preemption grace), and the call's keyword arguments for the rest (queue,
    its timeout, a gang's placement); usage errors as :func:`sharing_kwargs` gives."""
    kwargs = sharing_kwargs(**sharing)
    terms = {name: kwargs.pop(name) for name in _SPEC_TERMS if name in kwargs}
    return request.copy(**terms), kwargs


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


__all__ = [
    "gang_queue_options",
    "node_queue_options",
    "queue",
    "sharing_kwargs",
]
