"""``dxpool fabric sim create``: install the simulated fabric that the broker (for fencing)
and the host agents of a pool share, in a state directory::

    dxpool fabric sim create --state /var/lib/dxpool/fabric --box box1 --box box2 \\
        --gpus H100:8 --memory 80GiB --host h1 --host h2 --slots 8

The one-shot ``setup`` service of ``docker-compose.yml`` runs it on the ``/fabric`` volume;
``dxpool up`` makes its own.

Idempotent: on a volume that already holds a fabric (a second ``docker-compose up``) it
installs only what is missing and keeps every existing mapping, so attached GPUs stay
attached. A box or host already installed with other GPUs or another slot count is an
error (exit status 1) that names it; nothing is replaced implicitly.
"""

from __future__ import annotations

from pathlib import Path

import click

from dxpool.cli.exits import EXIT_API_ERROR
from dxpool.cli.help import SummaryGroup
from dxpool.cli.params import GPUS, MEMORY
from dxpool.errors import InvalidArgument
from dxpool.fabric.sim import SimFabric, SimFabricError, SimGpuSpec, UnknownTarget
from dxpool.names import check_id
from dxpool.request import GpuSpec


def install_fabric(
    state_dir: Path, boxes: dict[str, list[SimGpuSpec]], hosts: dict[str, int]
) -> SimFabric:
    """Create the fabric in ``state_dir``, or add the missing boxes and hosts to the one
    there. Raises :class:`SimFabricError` if an existing box or host differs."""
    try:
        fabric = SimFabric(state_dir)
    except UnknownTarget:
        return SimFabric.create(state_dir, boxes=boxes, hosts=hosts)
    for box, gpus in boxes.items():
        fabric.add_box(box, gpus)
    for host, slots in hosts.items():
        fabric.add_host(host, slots)
    return fabric


@click.group("sim", cls=SummaryGroup)
def sim() -> None:
    """The simulated fabric (driver `sim`): boxes and hosts in a state directory."""


@sim.command("create")
@click.option(
    "--state",
    "state_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="State directory of the simulated fabric (shared by the agents).",
)
@click.option("--box", "boxes", multiple=True, required=True, help="Box id; repeatable.")
@click.option("--gpus", type=GPUS, required=True, help="GPUs per box, MODEL:COUNT (H100:8).")
@click.option("--memory", "memory_mib", type=MEMORY, required=True, help="Memory per GPU: 80GiB.")
@click.option("--host", "hosts", multiple=True, required=True, help="Host id; repeatable.")
@click.option("--slots", type=click.IntRange(min=1), default=8, show_default=True)
def create(
    state_dir: Path,
    boxes: tuple[str, ...],
    gpus: GpuSpec,
    memory_mib: int,
    hosts: tuple[str, ...],
    slots: int,
) -> None:
    """Create (or complete) the simulated fabric in --state.

    Safe to run again: boxes and hosts already there are kept with their mappings, and
    missing ones are added. A box or host already installed differently is an error.
    """
    if not gpus.model:
        raise click.BadParameter("name the GPU model, e.g. H100:8", param_hint="--gpus")
    try:
        for box in boxes:
            check_id(box, "box")
        for host in hosts:
            check_id(host, "host")
    except InvalidArgument as error:
        raise click.UsageError(error.message) from None
    spec = [SimGpuSpec(gpus.model, memory_mib)] * gpus.count
    try:
        fabric = install_fabric(state_dir, dict.fromkeys(boxes, spec), dict.fromkeys(hosts, slots))
    except SimFabricError as error:
        click.echo(f"error: {error}", err=True)
        raise click.exceptions.Exit(EXIT_API_ERROR) from None
    click.echo(
        f"fabric in {fabric.state_dir}: boxes {', '.join(sorted(fabric.boxes()))}; "
        f"hosts {', '.join(sorted(fabric.hosts()))}",
        err=True,
    )
