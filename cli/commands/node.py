"""``dxpool node create|plan|list|get|describe|hostdev|delete|watch``: virtual nodes (a
host plus GPUs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from dxpool.api.v1 import nodes_pb2, resources_pb2
from dxpool.cli.commands.sharing import node_queue_options, with_sharing
from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.describe import describe_node
from dxpool.cli.errors import MAX_CONCURRENT_WAITS, for_each
from dxpool.cli.help import SummaryGroup
from dxpool.cli.node_request_options import node_request_options
from dxpool.cli.output import (
    DOCUMENT_FORMATS,
    Output,
    OutputFormat,
    StreamPrinter,
    dump,
    format_table,
    info,
    output_option,
    print_many,
    print_one,
    to_dict,
)
from dxpool.cli.params import (
    GPU,
    HOST,
    NODE,
    NODE_ID,
    REQUEST_ID,
    SECONDS,
    SELECTOR,
    dry_run_option,
    ignore_not_found_option,
    selector_option,
)
from dxpool.cli.sharing_view import plan_preemptions
from dxpool.cli.views import (
    BINDING_VIEW,
    CANDIDATE_VIEW,
    NODE_STREAM_WIDTHS,
    NODE_VIEW,
    node_gpu_count,
    short,
)
from dxpool.client import Client, node_state_name
from dxpool.errors import FailedPrecondition, ResourceExhausted
from dxpool.node_request import NodeRequest
from dxpool.selector import parse_selector

_F = TypeVar("_F", bound=Callable[..., Any])
NodeState = resources_pb2.NodeState
DEFAULT_WAIT = "120s"


@click.group(cls=SummaryGroup)
def node() -> None:
    """Compose, inspect and release virtual nodes."""


@node.command("create")
@node_request_options
@node_queue_options
@click.option(
    "--name", "node_id", type=NODE_ID, default=None, help="Node id; generated when not given."
)
@click.option(
    "--request-id", type=REQUEST_ID, default=None, help="Idempotency key; a retry returns the node."
)
@click.option("--wait", is_flag=True, help="Wait until the node is READY.")
@click.option(
    "--timeout",
    type=SECONDS,
    default=DEFAULT_WAIT,
    show_default=True,
    help="How long --wait waits.",
)
@dry_run_option
@output_option()
@pass_cli
def create(
    cli: CliContext,
    /,
    *,
    request: NodeRequest,
    node_id: str | None,
    request_id: str | None,
    wait: bool,
    timeout: float,
    dry_run: bool,
    output: OutputFormat,
    **sharing: Any,
) -> None:
    """Compose a node, e.g. `dxpool node create --gpus H100:4 --max-latency 4us --wait`.

    With --queue a node that does not fit now waits (QUEUED, `node describe` shows its
    position and why) and is placed as capacity frees.

    With --dry-run, print where it would go (as `node plan` does) and create nothing;
    exit 1 when nothing fits now."""
    client = cli.client()
    if dry_run:
        planned = request.copy(priority=sharing["priority"], min_gpus=sharing["min_gpus"])
        _dry_run_create(client, planned, node_id)
        return
    request, call = with_sharing(request, **sharing)
    created = client.compose_node(request, node_id=node_id, request_id=request_id, **call)
    if created.state == NodeState.NODE_STATE_QUEUED:
        info(f"{created.name} queued: {created.queue.reason}")
    else:
        info(f"{created.name} created on {created.host or 'a host to be chosen'}")
    if wait:
        info(f"waiting up to {timeout:g}s for {created.name} to become READY")
        with _interrupted_wait(created.name, "is still being attached"):
            created = client.wait_for_node(created.name, timeout_s=timeout)
    print_one(created, NODE_VIEW, output)


def _dry_run_create(client: Client, request: NodeRequest, node_id: str | None) -> None:
    """``node create --dry-run``: the plan, told as what create would do."""
    result = client.plan_node(request)
    name = f"nodes/{node_id}" if node_id else "a new node"
    if not result.host:
        reasons = "; ".join(result.unsatisfied) or "no host can take the node"
        raise ResourceExhausted(
            f"{name} would not be created now: {reasons} (dry run: nothing was created)",
            reason="NO_CAPACITY",
        )
    bound = ", ".join(short(b.gpu) for b in result.gpus)
    click.echo(f"{name} would be created on {short(result.host)} with {bound} (dry run)")
    preemptions = plan_preemptions(result)
    if preemptions:
        click.echo(preemptions)


@contextmanager
def _interrupted_wait(name: str, going_on: str) -> Iterator[None]:
    """Ctrl-C during a ``--wait`` stops the wait, not the work: say so, and how to follow
    the node from here (the interrupt then ends the command with exit status 130)."""
    try:
        yield
    except KeyboardInterrupt:
        short_name = name.removeprefix("nodes/")
        info(
            f"\ninterrupted: stopped waiting; {name} {going_on} all the same. "
            f"`dxpool node get {short_name}` shows where it stands, `dxpool node delete "
            f"{short_name}` releases it"
        )
        raise


@node.command("plan")
@node_request_options
@output_option(DOCUMENT_FORMATS)
@pass_cli
def plan(cli: CliContext, /, *, request: NodeRequest, output: OutputFormat) -> None:
    """Show where `node create` with these flags would go, and why; commits nothing."""
    result = cli.client().plan_node(request)
    if output in (OutputFormat.JSON, OutputFormat.YAML):
        click.echo(dump(to_dict(result), output).rstrip("\n"))
        return
    _print_plan(result, wide=output is OutputFormat.WIDE)
    preemptions = plan_preemptions(result)
    if preemptions:
        click.echo("\n" + preemptions)


def _print_plan(result: nodes_pb2.NodePlan, *, wide: bool) -> None:
    sections: list[str] = []
    if result.host:
        bindings = format_table(
            BINDING_VIEW.headers(wide), (BINDING_VIEW.row(g, wide) for g in result.gpus)
        )
        sections.append(f"placement: {short(result.host)}\n{bindings}")
    else:
        missing = "\n".join(f"  - {line}" for line in result.unsatisfied) or "  - (no reason given)"
        sections.append(f"placement: nothing fits now\n{missing}")
    if result.hosts:
        sections.append(
            format_table(
                CANDIDATE_VIEW.headers(wide), (CANDIDATE_VIEW.row(c, wide) for c in result.hosts)
            )
        )
    click.echo("\n\n".join(sections))


@node.command("list")
@click.option("--host", "host_name", type=HOST, default=None, help="Only nodes on this host.")
@click.option("-a", "--all", "show_released", is_flag=True, help="Include RELEASED nodes.")
@selector_option
@click.option(
    "-w",
    "--watch",
    is_flag=True,
    help="After the list, print one line per change until Ctrl-C.",
)
@output_option()
@pass_cli
def list_(
    cli: CliContext,
    host_name: str | None,
    show_released: bool,
    selector: str,
    watch: bool,
    output: OutputFormat,
) -> None:
    """List nodes (RELEASED ones only with --all), e.g. `dxpool node list -l team=ml -w`."""
    if watch:
        _watch_list(cli, host_name, show_released, selector, _streamable(output))
        return
    found = cli.client().list_nodes(
        host=host_name, show_released=show_released, label_selector=selector
    )
    print_many(found, NODE_VIEW, output)


def _watch_list(
    cli: CliContext, host_name: str | None, show_released: bool, selector: str, output: OutputFormat
) -> None:
    """``node list --watch``: the matching nodes, then one line (or document) per change
    of a matching node, from one WatchNodes stream (so nothing between the list and the
    first change is lost). Filters apply on this side: WatchNodes streams every node.
    A node that stops matching (it was RELEASED, say) gets its last line; a deleted
    node that was shown gets a line with its name."""
    wanted = parse_selector(selector)
    printer = StreamPrinter(NODE_VIEW, output, NODE_STREAM_WIDTHS)
    shown: set[str] = set()
    listing: list[resources_pb2.VirtualNode] = []
    listed = False
    event_type = nodes_pb2.NodeEvent

    def matches(found: resources_pb2.VirtualNode) -> bool:
        return (not host_name or found.host == host_name) and wanted.matches(found.spec.labels)

    for event in cli.client().watch_nodes(include_synced=True):
        if event.type == event_type.TYPE_SYNCED:
            if not listed:
                listed = True
                for found in listing:
                    printer.emit(found)
                    shown.add(found.name)
                if not listing and output is not OutputFormat.NAME:
                    info("no nodes found; watching for changes")
            continue
        if event.type == event_type.TYPE_DELETED:
            if event.node.name in shown:
                shown.discard(event.node.name)
                printer.emit(event.node, event)
            continue
        current = event.node
        visible = matches(current) and (
            show_released or current.state != NodeState.NODE_STATE_RELEASED
        )
        if not listed:
            if visible:
                listing.append(current)
        elif visible or (current.name in shown and matches(current)):
            shown.add(current.name)
            printer.emit(current)


def _streamable(output: OutputFormat | Output) -> OutputFormat:
    """``output`` for a stream of changes, which prints each as it comes: no templates."""
    if isinstance(output, Output):
        raise click.UsageError(
            f"-o {output.format.value}=... prints a whole list; a watch prints one change "
            "at a time: use -o table, wide, json, yaml or name with it"
        )
    return output


@node.command("get")
@click.argument("names", metavar="NODE...", type=NODE, nargs=-1, required=True)
@output_option()
@pass_cli
def get(cli: CliContext, names: tuple[str, ...], output: OutputFormat) -> None:
    """Show one or more nodes."""
    found = [cli.client().get_node(name) for name in names]
    if len(found) == 1:
        print_one(found[0], NODE_VIEW, output)
    else:
        print_many(found, NODE_VIEW, output)


@node.command("describe")
@click.argument("names", metavar="NODE...", type=NODE, nargs=-1, required=True)
@pass_cli
def describe(cli: CliContext, names: tuple[str, ...]) -> None:
    """Show nodes in detail, with their recent events (state changes, attach errors,
    unhealthy GPUs), oldest first."""
    client = cli.client()
    click.echo("\n\n".join(describe_node(client.get_node(name)) for name in names))


@node.command("hostdev")
@click.argument("name", metavar="NODE", type=NODE)
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Choice(["xml", OutputFormat.JSON.value, OutputFormat.YAML.value]),
    default="xml",
    show_default=True,
    help="xml: the <hostdev> elements only; json/yaml: with the host and each GPU's address.",
)
@pass_cli
def hostdev(cli: CliContext, name: str, output: str) -> None:
    """Print libvirt <hostdev> XML that hands a READY node's GPUs to a VM on its host.

    The node must be composed with --vfio. Paste the elements into the VM's <devices>
    on the node's host, or attach each with `virsh attach-device`.
    """
    found = cli.client().get_node_hostdev(name)
    if output == "xml":
        click.echo(found.xml, nl=False)
        return
    click.echo(dump(to_dict(found), OutputFormat(output)).rstrip("\n"))


@node.command("delete")
@click.argument("names", metavar="[NODE...]", type=NODE, nargs=-1)
@click.option(
    "-l",
    "--selector",
    "selector",
    type=SELECTOR,
    default="",
    help="Delete the nodes whose labels match instead of naming them, e.g. -l team=ml "
    "(the grammar of `node list -l`).",
)
@click.option("--wait", is_flag=True, help="Wait until the nodes are RELEASED.")
@click.option(
    "--force",
    is_flag=True,
    help="Do not wait for the host's agent: fence the GPUs at the box side, scrub and "
    "free them (for a node whose host is dead or hung).",
)
@click.option(
    "--timeout",
    type=SECONDS,
    default=DEFAULT_WAIT,
    show_default=True,
    help="How long --wait waits (the nodes are waited for together).",
)
@dry_run_option
@ignore_not_found_option
@pass_cli
def delete(
    cli: CliContext,
    names: tuple[str, ...],
    selector: str,
    wait: bool,
    force: bool,
    timeout: float,
    dry_run: bool,
    ignore_not_found: bool,
) -> None:
    """Release nodes: detach their GPUs and return them to the pool. Idempotent.

    Name the nodes, or select them by label with -l. Every node is tried; each failure
    is reported and the command then exits 1. With --wait the nodes are released
    together and waited for together."""
    if bool(names) == bool(selector):
        raise click.UsageError("name the nodes to delete, or select them with -l (not both)")
    client = cli.client()
    if selector:
        names = tuple(n.name for n in client.list_nodes(label_selector=selector))
        if not names:
            info(f"no nodes match {selector}")
            return
    if dry_run:
        for_each(
            names,
            lambda name: _would_release(client, name),
            client.endpoint,
            ignore_not_found=ignore_not_found,
        )
        return

    def release(name: str) -> str:
        released = client.release_node(name, force=force)
        if wait and released.state != NodeState.NODE_STATE_RELEASED:
            released = client.wait_for_node(
                name, until=(NodeState.NODE_STATE_RELEASED,), timeout_s=timeout
            )
        return f"{name} {node_state_name(released.state).lower()}"

    if wait:
        what = names[0] if len(names) == 1 else f"{len(names)} nodes"
        info(f"waiting up to {timeout:g}s for {what} to be RELEASED")
    try:
        for_each(
            names,
            release,
            client.endpoint,
            ignore_not_found=ignore_not_found,
            concurrency=MAX_CONCURRENT_WAITS if wait else 1,
        )
    except KeyboardInterrupt:
        info(
            "\ninterrupted: stopped waiting; the releases already asked for go on all the "
            "same (`dxpool node list -a` shows them)"
        )
        raise


def _would_release(client: Client, name: str) -> str:
    """What ``node delete --dry-run`` prints for ``name``: the node is read, not changed."""
    found = client.get_node(name)
    if found.state == NodeState.NODE_STATE_RELEASED:
        return f"{name} released (dry run: already)"
    return f"{name} would be released (dry run)"


@node.command("resize")
@click.argument("name", metavar="NODE", type=NODE)
@click.option(
    "--gpus",
    "count",
    type=click.IntRange(min=1),
    default=None,
    help="How many GPUs the node should have: more grows it on its host, fewer shrinks "
    "it (the most recently added GPUs go).",
)
@click.option(
    "--remove",
    "removes",
    type=GPU,
    multiple=True,
    help="Shrink by this GPU (BOX/SLOT); repeatable.",
)
@click.option(
    "--request-id", type=REQUEST_ID, default=None, help="Idempotency key; a retry resizes once."
)
@click.option(
    "--wait", is_flag=True, help="Wait until the node is READY again (GPUs attached or freed)."
)
@click.option(
    "--timeout",
    type=SECONDS,
    default=DEFAULT_WAIT,
    show_default=True,
    help="How long --wait waits.",
)
@output_option()
@pass_cli
def resize(
    cli: CliContext,
    name: str,
    count: int | None,
    removes: tuple[str, ...],
    request_id: str | None,
    wait: bool,
    timeout: float,
    output: OutputFormat,
) -> None:
    """Grow or shrink a READY node's GPUs in place.

    A node grows on its own host only (it needs free slots there), e.g.
    `dxpool node resize n1 --gpus 8 --wait`; `--remove box1/3` shrinks by that GPU.
    With --wait, a grow whose new GPUs could not be attached exits 1 (the node is
    READY again with the GPUs it had)."""
    if count is None and not removes:
        raise click.UsageError("give --gpus N (the count wanted) or --remove GPU")
    client = cli.client()
    resized = client.resize_node(name, count or 0, remove=removes, request_id=request_id)
    info(
        f"{resized.name} {node_state_name(resized.state).lower()} to {node_gpu_count(resized)} GPUs"
    )
    if wait and resized.state != NodeState.NODE_STATE_READY:
        info(f"waiting up to {timeout:g}s for {resized.name} to be READY again")
        with _interrupted_wait(resized.name, "is still being resized"):
            resized = client.wait_for_node(resized.name, timeout_s=timeout)
        if count is not None and len(resized.gpus) != count:
            print_one(resized, NODE_VIEW, output)
            raise FailedPrecondition(
                f"{resized.name} did not grow to {count} GPUs: {resized.message}",
                reason="GROW_FAILED",
            )
    print_one(resized, NODE_VIEW, output)


@node.command("watch")
@click.argument("name", metavar="[NODE]", type=NODE, required=False)
@output_option()
@pass_cli
def watch(cli: CliContext, name: str | None, output: OutputFormat | Output) -> None:
    """Stream node changes until Ctrl-C: rows, or one JSON object (an event) per line."""
    printer = StreamPrinter(NODE_VIEW, _streamable(output), NODE_STREAM_WIDTHS)
    for event in cli.client().watch_nodes(name):
        printer.emit(event.node, event)
