"""Printing API objects: ``-o table|wide|json|yaml|name``.

* ``json``/``yaml``: the API object as protobuf's JSON mapping renders it (camelCase field
  names, enum names, fields at their default value left out). A ``get`` of one object
  prints that object; a ``list`` prints a list (``[]`` when empty).
* ``table``/``wide``: plain kubectl-like columns (no borders; colour only on a terminal);
  ``wide`` adds columns. An empty list prints nothing on stdout and says so on stderr.
* ``name``: one resource name per line (``boxes/box1``), ready for ``xargs``.
* ``jsonpath=TEMPLATE`` and ``custom-columns=HEADER:PATH,...``: kubectl's, over the
  JSON form (see :mod:`dxpool.cli.jsonpath`). ``--sort-by PATH`` orders a list and
  ``--no-headers`` drops a table's header line.

Data goes to stdout; everything else (progress, warnings) goes to stderr via :func:`info`.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Generic, TypeVar

import click
import yaml
from google.protobuf import json_format
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from dxpool.cli.jsonpath import CustomColumns, JsonPath, Template, TemplateError, sort_key

M = TypeVar("M", bound=Message)
_F = TypeVar("_F", bound=Callable[..., Any])


class OutputFormat(StrEnum):
    TABLE = "table"
    WIDE = "wide"
    JSON = "json"
    YAML = "yaml"
    NAME = "name"
    JSONPATH = "jsonpath"
    CUSTOM_COLUMNS = "custom-columns"


ALL_FORMATS = (
    OutputFormat.TABLE,
    OutputFormat.WIDE,
    OutputFormat.JSON,
    OutputFormat.YAML,
    OutputFormat.NAME,
)
"""What every get, list and create command prints; they also take the templates."""
DOCUMENT_FORMATS = (OutputFormat.TABLE, OutputFormat.WIDE, OutputFormat.JSON, OutputFormat.YAML)
_TABLE_WIDTH = 100_000  # never squeeze columns; a terminal wraps long lines itself
_LISTING = "dxpool.listing"  # ctx.meta key of --sort-by and --no-headers


@dataclass(frozen=True)
class Output:
    """A templated format: ``-o jsonpath=TEMPLATE`` or ``-o custom-columns=SPEC``."""

    format: OutputFormat
    template: Template | None = None
    columns: CustomColumns | None = None


@dataclass(frozen=True)
class Listing:
    """``--sort-by`` and ``--no-headers`` of the command being run."""

    sort_by: JsonPath | None = None
    no_headers: bool = False


class _OutputType(click.ParamType[Any, Any]):
    name = "FORMAT"

    def __init__(self, formats: Sequence[OutputFormat], templates: bool) -> None:
        self._formats = [f.value for f in formats]
        self._templates = templates

    def get_metavar(self, param: click.Parameter, ctx: click.Context) -> str:
        templates = "|jsonpath=...|custom-columns=..." if self._templates else ""
        return "[" + "|".join(self._formats) + templates + "]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, (OutputFormat, Output)):
            return value
        text = str(value)
        if text in self._formats:
            return OutputFormat(text)
        kind, sep, spec = text.partition("=")
        if self._templates and sep and kind in ("jsonpath", "custom-columns"):
            try:
                if kind == "jsonpath":
                    return Output(OutputFormat.JSONPATH, template=Template.parse(spec))
                return Output(OutputFormat.CUSTOM_COLUMNS, columns=CustomColumns.parse(spec))
            except TemplateError as error:
                self.fail(str(error), param, ctx)
        choices = ", ".join(self._formats)
        more = ", jsonpath=TEMPLATE, custom-columns=HEADER:PATH,..." if self._templates else ""
        self.fail(f"{text!r} is not a format: use one of {choices}{more}", param, ctx)


def _stash_listing(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    current: Listing = ctx.meta.get(_LISTING, Listing())
    if param.name == "sort_by" and value:
        try:
            current = replace(current, sort_by=JsonPath.parse(value))
        except TemplateError as error:
            raise click.BadParameter(str(error), ctx, param) from None
    elif param.name == "no_headers":
        current = replace(current, no_headers=bool(value))
    ctx.meta[_LISTING] = current


def _listing() -> Listing:
    context = click.get_current_context(silent=True)
    return context.meta.get(_LISTING, Listing()) if context is not None else Listing()


def output_option(formats: Sequence[OutputFormat] = ALL_FORMATS) -> Callable[[_F], _F]:
    """The ``-o/--output`` option, parsed into an :class:`OutputFormat` (or, for
    ``jsonpath=`` and ``custom-columns=``, an :class:`Output`). Commands that print
    every format (:data:`ALL_FORMATS`) also take the templates, ``--sort-by`` and
    ``--no-headers``."""
    templates = tuple(formats) == ALL_FORMATS
    output = click.option(
        "-o",
        "--output",
        "output",
        type=_OutputType(formats, templates),
        default=OutputFormat.TABLE.value,
        show_default=True,
        help="Output format"
        + (
            ": jsonpath=TEMPLATE and custom-columns=HEADER:PATH,... read the JSON form, "
            "e.g. -o jsonpath='{.items[*].name}'."
            if templates
            else "."
        ),
    )
    if not templates:
        return output
    sort_by = click.option(
        "--sort-by",
        "sort_by",
        metavar="PATH",
        expose_value=False,
        callback=_stash_listing,
        help="Order a list by the value at this JSONPath of the JSON form, e.g. .createTime.",
    )
    no_headers = click.option(
        "--no-headers",
        "no_headers",
        is_flag=True,
        expose_value=False,
        callback=_stash_listing,
        help="Print tables without their header line.",
    )

    def decorate(command: _F) -> _F:
        return output(sort_by(no_headers(command)))

    return decorate


@dataclass(frozen=True)
class Column(Generic[M]):
    """One table column: a header and how to get its cell from a message."""

    header: str
    cell: Callable[[M], str]
    wide_only: bool = False


@dataclass(frozen=True)
class View(Generic[M]):
    """How one kind of API object prints as a table and as a name."""

    kind: str  # plural noun for messages, e.g. "boxes"
    columns: Sequence[Column[M]]
    name: Callable[[M], str] = field(default=lambda message: str(getattr(message, "name", "")))

    def headers(self, wide: bool) -> list[str]:
        return [c.header for c in self.columns if wide or not c.wide_only]

    def row(self, message: M, wide: bool) -> list[str]:
        return [c.cell(message) for c in self.columns if wide or not c.wide_only]


def info(message: str) -> None:
    """A line for the operator, not for pipes: stderr."""
    click.echo(message, err=True)


def to_dict(message: Message) -> dict[str, Any]:
    """The API object as protobuf's JSON mapping renders it."""
    return json_format.MessageToDict(message)


def format_table(
    headers: Sequence[str], rows: Iterable[Sequence[str]], *, no_headers: bool = False
) -> str:
    """Plain columns: upper-case headers, three spaces apart, no trailing blanks."""
    color = sys.stdout.isatty()
    table = Table(
        box=None,
        pad_edge=False,
        padding=(0, 3, 0, 0),
        show_edge=False,
        header_style="bold" if color else "",
        highlight=False,
    )
    for header in headers:
        table.add_column(header.upper(), no_wrap=True, overflow="ignore")
    for row in rows:
        table.add_row(*row)
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=_TABLE_WIDTH,
        force_terminal=color,
        color_system="standard" if color else None,
        highlight=False,
        emoji=False,
        markup=False,
    )
    console.print(table)
    lines = [line.rstrip() for line in buffer.getvalue().splitlines()]
    return "\n".join(lines[1:] if no_headers else lines)


def dump(data: Any, output: OutputFormat) -> str:
    """``data`` (plain dicts and lists) as JSON or YAML text."""
    if output is OutputFormat.JSON:
        return json.dumps(data, indent=2, ensure_ascii=False)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)


def print_one(message: M, view: View[M], output: OutputFormat | Output) -> None:
    """Print one object in ``output`` format (a template reads the object itself)."""
    if isinstance(output, Output) and output.template is not None:
        click.echo(output.template.render(to_dict(message)))
    elif output in (OutputFormat.JSON, OutputFormat.YAML):
        assert isinstance(output, OutputFormat)
        click.echo(dump(to_dict(message), output).rstrip("\n"))
    else:
        print_many([message], view, output)


def print_many(messages: Sequence[M], view: View[M], output: OutputFormat | Output) -> None:
    """Print a list of objects in ``output`` format, in ``--sort-by`` order if given."""
    listing = _listing()
    if listing.sort_by is not None:
        key = sort_key(listing.sort_by)
        messages = sorted(messages, key=lambda message: key(to_dict(message)))
    if isinstance(output, Output):
        if output.template is not None:
            click.echo(output.template.render({"items": [to_dict(m) for m in messages]}))
        elif output.columns is not None and messages:
            rows = (output.columns.row(to_dict(m)) for m in messages)
            click.echo(format_table(output.columns.headers, rows, no_headers=listing.no_headers))
        elif not messages:
            info(f"no {view.kind} found")
    elif output in (OutputFormat.JSON, OutputFormat.YAML):
        click.echo(dump([to_dict(m) for m in messages], output).rstrip("\n"))
    elif output is OutputFormat.NAME:
        for message in messages:
            click.echo(view.name(message))
    elif not messages:
        info(f"no {view.kind} found")
    else:
        wide = output is OutputFormat.WIDE
        rows = (view.row(m, wide) for m in messages)
        click.echo(format_table(view.headers(wide), rows, no_headers=listing.no_headers))


class StreamPrinter(Generic[M]):
    """Prints objects one at a time as they arrive (``dxpool node watch``).

    Tables use fixed column widths so rows line up without knowing later rows; JSON prints
    one compact object per line; YAML separates documents with ``---``.
    """

    def __init__(
        self, view: View[M], output: OutputFormat, widths: Sequence[int] | None = None
    ) -> None:
        self._view = view
        self._output = output
        self._wide = output is OutputFormat.WIDE
        headers = view.headers(self._wide)
        self._widths = list(widths or [])[: len(headers)]
        self._widths += [max(12, len(h) + 3) for h in headers[len(self._widths) :]]
        self._header_done = False

    def _line(self, cells: Sequence[str]) -> str:
        padded = [c.ljust(w - 1) for c, w in zip(cells[:-1], self._widths, strict=False)]
        return " ".join([*padded, cells[-1]]).rstrip()

    def emit(self, message: M, document: Message | None = None) -> None:
        """Print ``message``; JSON/YAML print ``document`` (e.g. the whole event) if given."""
        if self._output is OutputFormat.JSON:
            data = to_dict(document or message)
            click.echo(json.dumps(data, separators=(",", ":"), ensure_ascii=False))
        elif self._output is OutputFormat.YAML:
            click.echo("---\n" + dump(to_dict(document or message), self._output).rstrip("\n"))
        elif self._output is OutputFormat.NAME:
            click.echo(self._view.name(message))
        else:
            if not self._header_done:
                click.echo(self._line([h.upper() for h in self._view.headers(self._wide)]))
                self._header_done = True
            click.echo(self._line(self._view.row(message, self._wide)))
