"""The options that describe a node on the command line, read into one
:class:`~dxpool.node_request.NodeRequest`.

``node create``, ``node plan`` and ``gang create`` wear :func:`node_request_options`:
the command gets the options' values as one ``request`` argument, parsed by
:func:`dxpool.node_request.parse_node_request` (the option types have already read each
string: ``--max-latency 4us`` is 4000 ns by then). Combinations that no request can
mean are usage errors (exit 2) here, before anything is sent: ``--max-slowdown``
without ``--workload``, ``--affinity box`` with ``--spread``, ``--mixed-models``
without a model set.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final, TypeVar

import click

from dxpool.cli.params import (
    CPUS,
    GPUS,
    HOST,
    HOST_MEMORY,
    LABEL,
    LATENCY,
    MEMORY,
    SLOWDOWN,
    SPREAD,
    TENANT_ID,
    WORKLOAD,
    labels_dict,
)
from dxpool.fabric.overhead import known_profiles
from dxpool.node_request import NodeRequest, parse_node_request
from dxpool.request import GpuSpec

_F = TypeVar("_F", bound=Callable[..., Any])

_OPTIONS: Final[list[Callable[[Any], Any]]] = [
    click.option(
        "--gpus",
        type=GPUS,
        required=True,
        help="MODEL:COUNT (e.g. H100:4), MODEL (one GPU), COUNT (any model), or a "
        "model set MODEL|MODEL:COUNT (quote it: 'H100|A100:4'): all GPUs of one model, "
        "the one with the most free GPUs that fits.",
    ),
    click.option(
        "--mixed-models",
        is_flag=True,
        help="With a model set in --gpus: the node may mix the set's models.",
    ),
    click.option("--host", "host_name", type=HOST, default=None, help="Pin to this host."),
    click.option(
        "--host-selector",
        "host_selector",
        type=LABEL,
        multiple=True,
        help="KEY=VALUE a host's labels must hold (agent --label); repeatable.",
    ),
    click.option(
        "--exclude-host",
        "exclude_hosts",
        type=HOST,
        multiple=True,
        help="A host the node must not go to (anti-affinity); repeatable.",
    ),
    click.option(
        "--max-latency",
        type=LATENCY,
        default=None,
        help="Most host-to-box round trip for every GPU, e.g. 4us.",
    ),
    click.option(
        "--max-slowdown",
        type=SLOWDOWN,
        default=None,
        help="Most predicted slowdown of --workload on every GPU, e.g. 1.05 for 5%.",
    ),
    click.option(
        "--workload",
        type=WORKLOAD,
        default=None,
        help="Workload profile for --max-slowdown: a name (training, inference-online, "
        "...) or ROUND_TRIPS@STEP_TIME, e.g. 400@5ms.",
    ),
    click.option("--min-memory", type=MEMORY, default=None, help="Least memory per GPU."),
    click.option(
        "--cpus",
        type=CPUS,
        default=None,
        help="CPU cores the node needs free on its host (agent --cpus).",
    ),
    click.option(
        "--host-memory",
        type=HOST_MEMORY,
        default=None,
        help="Memory the node needs free on its host, e.g. 64GiB (agent --memory).",
    ),
    click.option(
        "--affinity",
        type=click.Choice(["box", "switch"]),
        default=None,
        help="Require every GPU from one box (peer-to-peer behind its PCIe switch), or "
        "'switch': from boxes under one top-of-rack switch (the host may be elsewhere).",
    ),
    click.option(
        "--spread",
        type=SPREAD,
        default=None,
        help="Spread over boxes: 'boxes' takes every GPU from a different box, "
        "'boxes:M' at most M from any one box.",
    ),
    click.option("--vfio", is_flag=True, help="Bind the GPUs to vfio-pci for a VM."),
    click.option(
        "--tenant",
        type=TENANT_ID,
        default="",
        help="Tenant the node is charged to (its quota applies); a tenant is always "
        "charged itself.",
    ),
    click.option("--label", "labels", type=LABEL, multiple=True, help="KEY=VALUE; repeatable."),
]


_OPTION_NAMES: Final = (
    "gpus",
    "mixed_models",
    "host_name",
    "host_selector",
    "exclude_hosts",
    "max_latency",
    "max_slowdown",
    "workload",
    "min_memory",
    "cpus",
    "host_memory",
    "affinity",
    "spread",
    "vfio",
    "tenant",
    "labels",
)
"""The parameter names of :data:`_OPTIONS`, taken out of the command's arguments."""


def node_request_options(command: _F) -> _F:
    """Add the options that describe a node to ``command``, which then takes them as
    one keyword argument, ``request`` (a :class:`NodeRequest`)."""

    @functools.wraps(command)
    def with_request(*args: Any, **kwargs: Any) -> Any:
        options = {name: kwargs.pop(name) for name in _OPTION_NAMES}
        return command(*args, request=node_request(**options), **kwargs)

    wrapped: Any = with_request
    for option in reversed(_OPTIONS):
        wrapped = option(wrapped)
    return wrapped  # type: ignore[no-any-return]


def node_request(
    *,
    gpus: GpuSpec,
    mixed_models: bool,
    host_name: str | None,
    host_selector: tuple[tuple[str, str], ...],
    exclude_hosts: tuple[str, ...],
    max_latency: int | None,
    max_slowdown: float | None,
    workload: str | None,
    min_memory: int | None,
    cpus: int | None,
    host_memory: int | None,
    affinity: str | None,
    spread: int | None,
    vfio: bool,
    tenant: str,
    labels: tuple[tuple[str, str], ...],
) -> NodeRequest:
    """The request the options describe; a usage error for a combination no request can
    mean, InvalidArgument (from the parser) for a value out of shape."""
    if max_slowdown and not workload:
        raise click.UsageError(
            "--max-slowdown needs --workload: a profile name "
            f"({known_profiles()}) or ROUND_TRIPS@STEP_TIME, e.g. 400@5ms"
        )
    if affinity == "box" and spread:
        raise click.UsageError(
            "--affinity box takes every GPU from one box and --spread spreads them over "
            "boxes: give one or the other (--affinity switch with --spread keeps the boxes "
            "under one rack switch)"
        )
    return parse_node_request(
        _gpu_request(gpus, mixed_models),
        host=host_name,
        host_selector=labels_dict(host_selector),
        exclude_hosts=exclude_hosts,
        max_latency=max_latency,
        max_slowdown=max_slowdown,
        workload=workload,
        min_memory=min_memory,
        cpus=cpus,
        host_memory=host_memory,
        affinity=affinity,
        spread=spread,
        vfio=vfio,
        tenant=tenant,
        labels=labels_dict(labels),
    )


def _gpu_request(gpus: GpuSpec, mixed_models: bool) -> GpuSpec:
    """``gpus`` with ``--mixed-models`` applied; a usage error without a model set."""
    if not mixed_models:
        return gpus
    if len(gpus.models) < 2:
        raise click.UsageError(
            f"--mixed-models needs a model set in --gpus, such as 'H100|A100:{gpus.count}'; "
            f"got {gpus}",
        )
    return replace(gpus, mixed_models=True)
