"""click parameter types for the request grammar of :mod:`dxpool.request` and resource names.

A value that does not parse becomes a :class:`click.BadParameter` (exit status 2) whose
message shows the grammar and echoes the value, e.g.
``Invalid value for '--gpus': cannot parse GPU request 'H100:x': expected MODEL:COUNT ...``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import click
from click.shell_completion import CompletionItem

from dxpool import client
from dxpool.client import Client
from dxpool.config import resolve_connection
from dxpool.errors import InvalidArgument
from dxpool.fabric.overhead import WORKLOAD_GRAMMAR, parse_slowdown, parse_workload
from dxpool.identity import SCHEME, Identity
from dxpool.limits import MAX_DURATION_NS, MAX_HOST_CPUS, MAX_LATENCY_NS
from dxpool.names import check_id, check_request_id
from dxpool.request import (
    GPU_GRAMMAR,
    SPREAD_GRAMMAR,
    GpuSpec,
    check_model,
    format_duration_ns,
    parse_duration_ns,
    parse_gpus,
    parse_host_memory_mib,
    parse_memory_mib,
    parse_spread,
)
from dxpool.selector import SELECTOR_GRAMMAR, parse_selector

_T = TypeVar("_T")


class GrammarType(click.ParamType[_T, Any]):
    """Parses with a :mod:`dxpool` parser; its InvalidArgument becomes a usage error.

    With ``names``, the shell's tab completion offers the names the broker knows (see
    :func:`_complete_names`)."""

    def __init__(
        self,
        name: str,
        parse: Callable[[str], _T],
        grammar: str = "",
        names: Callable[[Client], list[str]] | None = None,
    ) -> None:
        self.name = name
        self._parse = parse
        self._grammar = grammar
        self._names = names

    def shell_complete(
        self, ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        if self._names is None:
            return []
        return [CompletionItem(name) for name in _complete_names(ctx, self._names, incomplete)]

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> _T:
        if not isinstance(value, str):
            return cast(_T, value)  # already converted (a default given as a parsed value)
        try:
            return self._parse(value)
        except InvalidArgument as error:
            message = error.message
            if self._grammar and self._grammar not in message:
                message = f"{message}; expected {self._grammar}"
            self.fail(message, param, ctx)


COMPLETION_TIMEOUT_S = 2.0
"""How long tab completion waits for the broker before it offers nothing."""


def _complete_names(
    ctx: click.Context, names: Callable[[Client], list[str]], incomplete: str
) -> list[str]:
    """The short names (``box1``, ``box1/3``, ``n1``) the broker knows that start with
    ``incomplete``, for the shell's completion; nothing when the broker cannot answer in
    :data:`COMPLETION_TIMEOUT_S` (completion must never hang a shell or print an error).
    The broker and its TLS settings come from the root's flags on the command line, else
    the environment and the config file, as for the command itself."""
    root = ctx.find_root().params
    try:
        tls, token = resolve_connection(
            ca=root.get("tls_ca"),
            cert=root.get("tls_cert"),
            key=root.get("tls_key"),
            token_file=root.get("token_file"),
        )
        with Client(
            root.get("endpoint"),
            timeout_s=COMPLETION_TIMEOUT_S,
            max_attempts=1,
            tls=tls,
            token=token,
            insecure=tls is None and token is None,
        ) as client:
            found = names(client)
    except Exception:  # completion offers what it can; errors are for the command itself
        return []
    short = [_short_name(name) for name in found]
    return sorted(name for name in short if name.startswith(incomplete))


def _short_name(name: str) -> str:
    """``boxes/box1/gpus/3`` -> ``box1/3``; ``nodes/n1`` -> ``n1``."""
    parts = name.split("/")
    if len(parts) == 4 and parts[0] == "boxes" and parts[2] == "gpus":
        return f"{parts[1]}/{parts[3]}"
    return parts[-1]


def _seconds(value: str) -> float:
    return parse_duration_ns(value) / 1e9


def _seconds_or_number(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        return _seconds(value)
    if not 0 <= seconds <= MAX_DURATION_NS / 1e9:
        raise InvalidArgument(
            f"{value!r} is out of range: give 0 to {MAX_DURATION_NS // 10**9} seconds "
            "or a duration such as 120s or 5m"
        )
    return seconds


def _gpus(value: str) -> GpuSpec:
    spec = parse_gpus(value)
    if spec.model and ":" not in value:
        # MODEL alone means one GPU. Said out loud, because an unquoted set is cut by the
        # shell at '|' (`--gpus H100|A100:4` runs `dxpool ... --gpus H100 | A100:4`).
        several = "a model set" if len(spec.models) > 1 else "a model"
        click.echo(
            f"warning: --gpus {value.strip()} is {several} without a count: one GPU "
            f"({spec}); write MODEL:COUNT, and quote a model set: --gpus 'H100|A100:4'",
            err=True,
        )
    return spec


def _label(value: str) -> tuple[str, str]:
    key, sep, text = value.partition("=")
    if not sep or not key.strip():
        raise InvalidArgument(f"cannot parse label {value!r}: expected KEY=VALUE, e.g. team=ml")
    return key.strip(), text


def _selector(value: str) -> str:
    parse_selector(value)
    return value.strip()


def _workload(value: str) -> str:
    parse_workload(value)
    return value.strip()


def _model_limit(value: str) -> tuple[str, int]:
    model, sep, count = value.partition("=")
    model, count = model.strip(), count.strip()
    if not sep or not count.isascii() or not count.isdigit() or len(count) > 7:
        raise InvalidArgument(
            f"cannot parse {value!r}: expected MODEL=COUNT, e.g. H100=8 (COUNT a whole "
            "number, 0 allows none)"
        )
    if not model:
        raise InvalidArgument(f"cannot parse {value!r}: name a GPU model, e.g. H100=8")
    return check_model(model), int(count)


GPUS = GrammarType("MODEL:COUNT", _gpus, GPU_GRAMMAR)
"""``H100:4``, ``A100``, ``8``, ``*:2`` or ``H100|A100:4`` -> :class:`~dxpool.request.GpuSpec`."""
DURATION = GrammarType("DURATION", parse_duration_ns)
"""``4us`` -> 4000 (nanoseconds)."""


def _latency(value: str) -> int:
    ns = parse_duration_ns(value)
    if ns > MAX_LATENCY_NS:
        raise InvalidArgument(
            f"latency {value} is more than {format_duration_ns(MAX_LATENCY_NS)}: give a round "
            "trip such as 4us"
        )
    return ns


LATENCY = GrammarType("DURATION", _latency)
"""A round-trip bound (``--max-latency``): a duration up to ``MAX_LATENCY_NS``."""

NODE_ID = GrammarType("ID", lambda value: check_id(value, "node"))
GANG_ID = GrammarType("ID", lambda value: check_id(value, "gang"))


def _tenant_as_given(value: str) -> str:
    if value:
        client.tenant_name(value)  # raises for a malformed one; the value goes on as given
    return value


TENANT_ID = GrammarType("TENANT", _tenant_as_given)


def _identity(value: str) -> str:
    if not value:
        return value
    prefix = f"{SCHEME}://"
    return Identity.parse(value if value.startswith(prefix) else prefix + value).uri


IDENTITY = GrammarType("ROLE/NAME", _identity)
"""``tenant/team-a`` or ``dxpool://tenant/team-a`` -> ``dxpool://tenant/team-a``."""
REQUEST_ID = GrammarType("REQUEST_ID", check_request_id)
CPUS = click.IntRange(min=1, max=MAX_HOST_CPUS)
SECONDS = GrammarType("DURATION", _seconds)
"""``120s`` or ``500ms`` -> seconds as a float."""
SLOWDOWN = GrammarType("RATIO", parse_slowdown)
"""``1.05`` -> 1.05 (at most 5% slower)."""
HOST_MEMORY = GrammarType("SIZE", parse_host_memory_mib)
"""``64GiB`` -> 65536 (MiB): a host's memory or a node's need of it."""
SPREAD = GrammarType("boxes[:M]", parse_spread, SPREAD_GRAMMAR)
"""``boxes`` -> 1, ``boxes:2`` -> 2: the most GPUs a node may take from one box."""
WORKLOAD = GrammarType("WORKLOAD", _workload, WORKLOAD_GRAMMAR)
"""``training`` or ``400@5ms`` -> the same text, once it parses as a workload."""
DAEMON_SECONDS = GrammarType("DURATION", _seconds_or_number)
"""``120s``, ``5m`` or a bare number of seconds (``120``, as daemon flags always took) ->
seconds as a float."""
MEMORY = GrammarType("SIZE", parse_memory_mib)
"""``80GiB`` -> 81920 (MiB)."""
LABEL = GrammarType("KEY=VALUE", _label)
"""``team=ml`` -> ``("team", "ml")``."""
SELECTOR = GrammarType("SELECTOR", _selector, SELECTOR_GRAMMAR)
"""``team=ml,tier!=dev`` -> the same text, once it parses as a label selector."""
BOX = GrammarType("BOX", client.box_name, names=lambda c: [b.name for b in c.list_boxes()])
"""``box1`` or ``boxes/box1`` -> ``boxes/box1``."""
HOST = GrammarType("HOST", client.host_name, names=lambda c: [h.name for h in c.list_hosts()])
"""``h1`` or ``hosts/h1`` -> ``hosts/h1``."""
NODE = GrammarType("NODE", client.node_name, names=lambda c: [n.name for n in c.list_nodes()])
"""``n1`` or ``nodes/n1`` -> ``nodes/n1``."""
GANG = GrammarType("GANG", client.gang_name)
"""``g1`` or ``gangs/g1`` -> ``gangs/g1``."""
GPU = GrammarType("GPU", client.gpu_name, names=lambda c: [g.name for g in c.list_gpus()])
"""``box1/3`` or ``boxes/box1/gpus/3`` -> ``boxes/box1/gpus/3``."""
TENANT = GrammarType(
    "TENANT", client.tenant_name, names=lambda c: [t.name for t in c.list_tenants()]
)
"""``team-a`` or ``tenants/team-a`` -> ``tenants/team-a``."""
MODEL_LIMIT = GrammarType("MODEL=COUNT", _model_limit)
"""``H100=8`` -> ``("H100", 8)``."""
GPU_STATE = GrammarType("STATE", client.gpu_state)
"""``free`` -> ``GpuState.GPU_STATE_FREE``."""


def labels_dict(pairs: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The ``--label`` pairs of a command as a mapping (a later key wins)."""
    return dict(pairs)


selector_option = click.option(
    "-l",
    "--selector",
    "selector",
    type=SELECTOR,
    default="",
    help="Only objects whose labels match: KEY=VALUE, KEY!=VALUE, 'KEY in (V1,V2)', "
    "'KEY notin (V1,V2)', KEY or !KEY, comma-separated (all must hold), e.g. "
    "-l 'team=ml,tier notin (dev)'.",
)

dry_run_option = click.option(
    "--dry-run",
    is_flag=True,
    help="Only show what would be done: the objects are read, nothing is changed.",
)

ignore_not_found_option = click.option(
    "--ignore-not-found",
    is_flag=True,
    help="Treat a name that does not exist as already deleted.",
)
