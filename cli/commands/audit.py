"""``dxpool audit``: who changed what, from the broker's audit log."""

from __future__ import annotations

import datetime as dt

import click

from dxpool.api.v1 import audit_pb2
from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.output import Column, OutputFormat, View, output_option, print_many
from dxpool.cli.params import IDENTITY, NODE, SECONDS


def _target(record: audit_pb2.AuditRecord) -> str:
    """The resource the call named, or, for a name that was not one, its size and digest."""
    if record.target:
        return record.target
    for field in record.rejected_fields:
        if field.field == "target":
            return f"({field.size} bytes, sha256 {field.sha256[:12]})"
    return "-"


def _rejected(record: audit_pb2.AuditRecord) -> str:
    return ",".join(f"{f.field}:{f.size}B:{f.sha256[:12]}" for f in record.rejected_fields) or "-"


AUDIT_VIEW: View[audit_pb2.AuditRecord] = View(
    "audit records",
    [
        Column("time", lambda r: r.time.ToDatetime(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")),
        Column("identity", lambda r: r.identity or "-"),
        Column("rpc", lambda r: r.rpc),
        Column("target", _target),
        Column("code", lambda r: r.code),
        Column("request-id", lambda r: r.request_id or "-", wide_only=True),
        Column("peer", lambda r: r.peer or "-", wide_only=True),
        Column("message", lambda r: r.message or "-", wide_only=True),
        Column("rejected", _rejected, wide_only=True),
    ],
    name=lambda r: f"{r.rpc} {r.target}",
)


@click.command("audit")
@click.option("--since", type=SECONDS, default=None, help="Only the last DURATION, e.g. 15m or 2h.")
@click.option(
    "--identity",
    type=IDENTITY,
    default="",
    help="Only calls by this identity, e.g. tenant/team-a.",
)
@click.option("--node", type=NODE, default=None, help="Only calls naming this node.")
@click.option("--target", default="", help="Only calls naming this resource, e.g. boxes/box1.")
@output_option()
@pass_cli
def audit(
    cli: CliContext,
    since: float | None,
    identity: str,
    node: str | None,
    target: str,
    output: OutputFormat,
) -> None:
    """Show the audit log: every mutating call, who made it and how it ended."""
    if node and target:
        raise click.UsageError("give --node or --target, not both")
    start = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=since) if since else None
    records = cli.client().list_audit_records(since=start, identity=identity, target=node or target)
    print_many(records, AUDIT_VIEW, output)
