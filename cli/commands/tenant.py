"""``dxpool tenant set-quota|show|list|delete``: tenants' quotas and what they hold now."""

from __future__ import annotations

import click

from dxpool.cli.context import CliContext, pass_cli
from dxpool.cli.errors import for_each
from dxpool.cli.help import SummaryGroup
from dxpool.cli.output import OutputFormat, output_option, print_many, print_one
from dxpool.cli.params import MODEL_LIMIT, TENANT
from dxpool.cli.views import TENANT_VIEW


@click.group(cls=SummaryGroup)
def tenant() -> None:
    """Set and show tenants' quotas (GPUs, GPUs per model, nodes) and usage."""


@tenant.command("set-quota")
@click.argument("name", metavar="TENANT", type=TENANT)
@click.option("--gpus", type=click.IntRange(0), help="GPUs of all models together.")
@click.option(
    "--gpus-model",
    "gpus_model",
    type=MODEL_LIMIT,
    multiple=True,
    help="GPUs of one model, MODEL=COUNT (e.g. H100=8); repeat for more models.",
)
@click.option("--nodes", type=click.IntRange(0), help="Nodes.")
@output_option()
@pass_cli
def set_quota(
    cli: CliContext,
    name: str,
    gpus: int | None,
    gpus_model: tuple[tuple[str, int], ...],
    nodes: int | None,
    output: OutputFormat,
) -> None:
    """Replace a tenant's quota.

    Limits left out are no limits (a quota with none lifts every limit); 0 allows
    nothing. A quota below what the tenant holds stops its new nodes until it is
    under the quota again; its running nodes are not touched.
    """
    by_model = dict(gpus_model)
    if len(by_model) != len(gpus_model):
        raise click.UsageError("--gpus-model names a model more than once")
    updated = cli.client().set_tenant_quota(name, gpus=gpus, gpus_by_model=by_model, nodes=nodes)
    print_one(updated, TENANT_VIEW, output)


@tenant.command("show")
@click.argument("name", metavar="TENANT", type=TENANT)
@output_option()
@pass_cli
def show(cli: CliContext, name: str, output: OutputFormat) -> None:
    """Show a tenant's limits and what its nodes hold now (used/limit)."""
    print_one(cli.client().get_tenant(name), TENANT_VIEW, output)


@tenant.command("list")
@output_option()
@pass_cli
def list_(cli: CliContext, output: OutputFormat) -> None:
    """List every tenant with a quota or a charged node."""
    print_many(cli.client().list_tenants(), TENANT_VIEW, output)


@tenant.command("delete")
@click.argument("names", metavar="TENANT...", type=TENANT, nargs=-1, required=True)
@pass_cli
def delete(cli: CliContext, names: tuple[str, ...]) -> None:
    """Delete tenants' records (quota and usage); refused while a tenant still holds
    nodes. Every name is tried; each failure is reported and the command then exits 1."""
    client = cli.client()

    def remove(name: str) -> str:
        client.delete_tenant(name)
        return f"{name} deleted"

    for_each(names, remove, client.endpoint)
