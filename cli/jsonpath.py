"""kubectl's JSONPath templates and custom columns over API objects, on ``jsonpath-ng``.

``-o jsonpath=TEMPLATE`` prints ``TEMPLATE`` with each ``{...}`` replaced, as kubectl
does: ``{.items[*].name}`` (a path; several results are joined by a blank), ``{range
.items[*]}...{end}`` (the text between, once per result, where ``{.name}`` or
``{@.name}`` read the current one), ``{"\\n"}`` (a quoted string, with ``\\n`` and
``\\t``). Paths are JSONPath as ``jsonpath-ng`` reads them, filters included
(``{.items[?(@.state=="NODE_STATE_READY")].name}``), over the object as ``-o json``
prints it; a list is ``{"items": [...]}``. ``-o custom-columns=NAME:.name,STATE:.state``
prints a table with a column per ``HEADER:PATH``, one row per object, and
``--sort-by PATH`` orders a list by the value at ``PATH``.

A template that does not parse is a usage error, found before any call to the broker.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jsonpath_ng.exceptions import JsonPathLexerError, JsonPathParserError
from jsonpath_ng.ext.parser import parse as parse_jsonpath

NONE = "<none>"
_PIECE = re.compile(r"\{((?:[^{}\"]|\"(?:[^\"\\]|\\.)*\")*)\}")


class TemplateError(ValueError):
    """A JSONPath template, custom-columns spec or --sort-by path that does not parse."""


@dataclass(frozen=True)
class JsonPath:
    """One path, relative to the object it is applied to (``.name``, ``@.name``, ``$``)."""

    text: str
    _compiled: Any

    @classmethod
    def parse(cls, text: str) -> JsonPath:
        path = text.strip()
        if path.startswith("{") and path.endswith("}"):
            path = path[1:-1].strip()
        if path in ("", "@", "$", "."):
            expression = "$"
        elif path.startswith("@"):
            expression = "$" + path[1:]
        elif path.startswith("$"):
            expression = path
        elif path.startswith("."):
            expression = "$" + path
        else:
            expression = "$." + path
        try:
            return cls(text, parse_jsonpath(expression))
        except (JsonPathLexerError, JsonPathParserError, Exception) as error:
            raise TemplateError(f"cannot parse JSONPath {text!r}: {error}") from None

    def values(self, data: Any) -> list[Any]:
        """Every value the path finds in ``data``, in document order."""
        return [match.value for match in self._compiled.find(data)]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return str(value)


@dataclass(frozen=True)
class _Literal:
    text: str


@dataclass(frozen=True)
class _Range:
    path: JsonPath
    body: tuple[Any, ...]


def _unquote(text: str) -> str:
    inner = text[1:-1]
    return inner.replace("\\n", "\n").replace("\\t", "\t").replace('\\"', '"').replace("\\\\", "\\")


@dataclass(frozen=True)
class Template:
    """A parsed ``-o jsonpath=`` template."""

    text: str
    pieces: tuple[Any, ...]

    @classmethod
    def parse(cls, text: str) -> Template:
        stack: list[tuple[JsonPath | None, list[Any]]] = [(None, [])]
        at = 0
        for match in _PIECE.finditer(text):
            if match.start() > at:
                stack[-1][1].append(_Literal(text[at : match.start()]))
            at = match.end()
            inner = match.group(1).strip()
            if inner == "end":
                if len(stack) == 1:
                    raise TemplateError(f"{{end}} without {{range}} in {text!r}")
                path, body = stack.pop()
                assert path is not None
                stack[-1][1].append(_Range(path, tuple(body)))
            elif inner.startswith("range ") or inner == "range":
                stack.append((JsonPath.parse(inner.removeprefix("range").strip()), []))
            elif inner.startswith('"') and inner.endswith('"') and len(inner) >= 2:
                stack[-1][1].append(_Literal(_unquote(inner)))
            else:
                stack[-1][1].append(JsonPath.parse(inner))
        rest = text[at:]
        if "{" in rest or "}" in rest:
            raise TemplateError(f"unbalanced braces in JSONPath template {text!r}")
        if rest:
            stack[-1][1].append(_Literal(rest))
        if len(stack) != 1:
            raise TemplateError(f"{{range}} without {{end}} in {text!r}")
        return cls(text, tuple(stack[0][1]))

    def render(self, data: Any) -> str:
        return "".join(_render(self.pieces, data))


def _render(pieces: Sequence[Any], data: Any) -> list[str]:
    out: list[str] = []
    for piece in pieces:
        if isinstance(piece, _Literal):
            out.append(piece.text)
        elif isinstance(piece, _Range):
            for item in piece.path.values(data):
                out.extend(_render(piece.body, item))
        else:
            out.append(" ".join(_text(value) for value in piece.values(data)))
    return out


@dataclass(frozen=True)
class CustomColumns:
    """A parsed ``-o custom-columns=HEADER:PATH,...`` spec."""

    headers: tuple[str, ...]
    paths: tuple[JsonPath, ...]

    @classmethod
    def parse(cls, text: str) -> CustomColumns:
        headers: list[str] = []
        paths: list[JsonPath] = []
        for part in text.split(","):
            header, sep, path = part.partition(":")
            if not sep or not header.strip() or not path.strip():
                raise TemplateError(
                    f"cannot parse custom column {part!r}: expected HEADER:PATH, e.g. "
                    "NAME:.name,STATE:.state"
                )
            headers.append(header.strip())
            paths.append(JsonPath.parse(path))
        return cls(tuple(headers), tuple(paths))

    def row(self, data: Any) -> list[str]:
        cells = []
        for path in self.paths:
            values = path.values(data)
            cells.append(",".join(_text(v) for v in values) if values else NONE)
        return cells


def sort_key(path: JsonPath) -> Any:
    """A key for ``sorted`` over objects (as dicts): by the first value ``path`` finds;
    numbers as numbers, objects without it last."""

    def key(data: Any) -> tuple[int, float, str]:
        values = path.values(data)
        if not values:
            return (2, 0.0, "")
        value = values[0]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return (0, float(value), "")
        if isinstance(value, str):
            try:
                return (0, float(value), "")
            except ValueError:
                return (1, 0.0, value)
        return (1, 0.0, _text(value))

    return key


__all__ = ["NONE", "CustomColumns", "JsonPath", "Template", "TemplateError", "sort_key"]
