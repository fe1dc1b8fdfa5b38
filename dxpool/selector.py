"""Label selectors, kubectl's grammar (equality- and set-based): parsed once here, used
by the CLI (``-l``) to refuse a bad selector before any call, and by the broker's List
RPCs (``label_selector``) to filter while paging.

Grammar: comma-separated requirements, all of which must hold::

    key=value   key==value   the label is set to value
    key!=value                the label is not set to value (or not set at all)
    key in (v1,v2)            the label is set to one of the values
    key notin (v1,v2)         the label is set to none of them (or not set at all)
    key                       the label is set (to anything)
    !key                      the label is not set

Keys and values are trimmed; a key may not be empty or contain ``=``, ``!``, ``,``,
parentheses or blanks, and a value none of ``=``, ``!``, ``,`` or parentheses. Commas
inside a set's parentheses separate its values, not requirements.
An empty selector matches everything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from dxpool.errors import InvalidArgument

SELECTOR_GRAMMAR = (
    "KEY=VALUE, KEY!=VALUE, KEY in (V1,V2), KEY notin (V1,V2), KEY or !KEY, "
    "comma-separated, e.g. team=ml,tier notin (dev,test)"
)
MAX_SELECTOR_LENGTH = 4096
_FORBIDDEN_IN_KEY = frozenset("=!, ()")
_FORBIDDEN_IN_VALUE = frozenset("=!,()")
_SET = re.compile(r"(?P<key>.*?)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)", re.DOTALL)
_SHOWN = 80


class Operator(Enum):
    EQUALS = "="
    NOT_EQUALS = "!="
    IN = "in"
    NOT_IN = "notin"
    EXISTS = "exists"
    NOT_EXISTS = "!exists"


@dataclass(frozen=True)
class Requirement:
    """One requirement of a selector: ``key`` with ``operator`` (and ``value``, or the
    ``values`` of a set)."""

    key: str
    operator: Operator
    value: str = ""
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator is Operator.EQUALS:
            return labels.get(self.key) == self.value
        if self.operator is Operator.NOT_EQUALS:
            return labels.get(self.key) != self.value
        if self.operator is Operator.IN:
            return self.key in labels and labels[self.key] in self.values
        if self.operator is Operator.NOT_IN:
            return labels.get(self.key) not in self.values if self.key in labels else True
        if self.operator is Operator.EXISTS:
            return self.key in labels
        return self.key not in labels


@dataclass(frozen=True)
class Selector:
    """A parsed selector: matches labels that satisfy every requirement."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)

    def __bool__(self) -> bool:
        return bool(self.requirements)


def _shown(text: str) -> str:
    """``text`` quoted for a message, cut at 80 characters."""
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def _fail(text: str, part: str, why: str) -> InvalidArgument:
    return InvalidArgument(
        f"invalid label selector {_shown(text)}: {why} in {_shown(part)}; "
        f"expected {SELECTOR_GRAMMAR}",
        reason="INVALID_SELECTOR",
    )


def _key(text: str, part: str, key: str) -> str:
    key = key.strip()
    if not key:
        raise _fail(text, part, "the key is empty")
    if any(c in _FORBIDDEN_IN_KEY for c in key):
        raise _fail(
            text, part, f"the key {_shown(key)} contains '=', '!', ',', a parenthesis or a blank"
        )
    return key


def _set_requirement(text: str, part: str, match: re.Match[str]) -> Requirement:
    values = [value.strip() for value in match.group("values").split(",")]
    if not any(values):
        raise _fail(text, part, "the set names no value")
    for value in values:
        if not value:
            raise _fail(text, part, "a value of the set is empty")
        if any(c in _FORBIDDEN_IN_VALUE for c in value):
            raise _fail(text, part, f"the value {_shown(value)} contains '=', '!' or '('")
    operator = Operator.IN if match.group("op") == "in" else Operator.NOT_IN
    return Requirement(_key(text, part, match.group("key")), operator, values=frozenset(values))


def _requirement(text: str, part: str) -> Requirement:
    set_match = _SET.fullmatch(part)
    if set_match is not None:
        return _set_requirement(text, part, set_match)
    if "(" in part or ")" in part:
        raise _fail(text, part, "a set is written KEY in (V1,V2) or KEY notin (V1,V2)")
    if "!=" in part:
        key, _, value = part.partition("!=")
        operator = Operator.NOT_EQUALS
    elif "==" in part:
        key, _, value = part.partition("==")
        operator = Operator.EQUALS
    elif "=" in part:
        key, _, value = part.partition("=")
        operator = Operator.EQUALS
    elif part.startswith("!"):
        return Requirement(_key(text, part, part[1:]), Operator.NOT_EXISTS)
    else:
        return Requirement(_key(text, part, part), Operator.EXISTS)
    value = value.strip()
    if "=" in value or "!" in value:
        raise _fail(text, part, f"the value {_shown(value)} contains '=' or '!'")
    return Requirement(_key(text, part, key), operator, value)


def _split(text: str) -> list[str]:
    """``text`` cut at the commas outside parentheses (a set's values stay together)."""
    parts: list[str] = []
    depth = 0
    start = 0
    for at, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(0, depth - 1)
        elif char == "," and depth == 0:
            parts.append(text[start:at])
            start = at + 1
    parts.append(text[start:])
    return parts


def parse_selector(text: str) -> Selector:
    """Parse ``text``; InvalidArgument (reason INVALID_SELECTOR) names the bad part and
    shows the grammar. An empty or blank selector matches everything."""
    if len(text) > MAX_SELECTOR_LENGTH:
        raise InvalidArgument(
            f"label selector is {len(text)} characters long; give at most {MAX_SELECTOR_LENGTH}",
            reason="INVALID_SELECTOR",
        )
    if not text.strip():
        return Selector()
    parts = [part.strip() for part in _split(text)]
    for part in parts:
        if not part:
            raise _fail(text, text, "a requirement is empty (two commas, or one at an end)")
    return Selector(tuple(_requirement(text, part) for part in parts))


__all__ = [
    "MAX_SELECTOR_LENGTH",
    "SELECTOR_GRAMMAR",
    "Operator",
    "Requirement",
    "Selector",
    "parse_selector",
]
