"""Printing API objects: ``-o table|wide|json|yaml|name``.

* ``json``/``yaml``: the API object as protobuf's JSON mapping renders it (camelCase field
  names, enum names, fields at their default value left out). A ``get`` of one object
  prints that object; a ``list`` prints a list (``[]`` when empty).
* ``table``/``wide``: plain kubectl-like columns (no borders; colour only on a terminal);
  ``wide`` adds columns. An empty list prints nothing on stdout and says so on stderr.
* ``name``: one resource name per line (``boxes/box1``), ready for ``xargs``.

Data goes to stdout; everything else (progress, warnings) goes to stderr via :func:`info`.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

import click
import yaml
from google.protobuf import json_format
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

M = TypeVar("M", bound=Message)
_F = TypeVar("_F", bound=Callable[..., Any])


class OutputFormat(StrEnum):
    TABLE = "table"
    WIDE = "wide"
    JSON = "json"
    YAML = "yaml"
    NAME = "name"


ALL_FORMATS = tuple(OutputFormat)
DOCUMENT_FORMATS = (OutputFormat.TABLE, OutputFormat.WIDE, OutputFormat.JSON, OutputFormat.YAML)
_TABLE_WIDTH = 100_000  # never squeeze columns; a terminal wraps long lines itself


def output_option(formats: Sequence[OutputFormat] = ALL_FORMATS) -> Callable[[_F], _F]:
    """The ``-o/--output`` option, parsed into an :class:`OutputFormat`."""
    return click.option(
        "-o",
        "--output",
        "output",
        type=click.Choice([f.value for f in formats]),
        default=OutputFormat.TABLE.value,
        show_default=True,
        callback=lambda _ctx, _param, value: OutputFormat(value),
        help="Output format.",
    )


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


def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
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
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def dump(data: Any, output: OutputFormat) -> str:
    """``data`` (plain dicts and lists) as JSON or YAML text."""
    if output is OutputFormat.JSON:
        return json.dumps(data, indent=2, ensure_ascii=False)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)


def print_one(message: M, view: View[M], output: OutputFormat) -> None:
    """Print one object in ``output`` format."""
    if output in (OutputFormat.JSON, OutputFormat.YAML):
        click.echo(dump(to_dict(message), output).rstrip("\n"))
    else:
        print_many([message], view, output)


def print_many(messages: Sequence[M], view: View[M], output: OutputFormat) -> None:
    """Print a list of objects in ``output`` format."""
    if output in (OutputFormat.JSON, OutputFormat.YAML):
        click.echo(dump([to_dict(m) for m in messages], output).rstrip("\n"))
    elif output is OutputFormat.NAME:
        for message in messages:
            click.echo(view.name(message))
    elif not messages:
        info(f"no {view.kind} found")
    else:
        wide = output is OutputFormat.WIDE
        click.echo(format_table(view.headers(wide), (view.row(m, wide) for m in messages)))


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
