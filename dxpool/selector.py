"""Label selectors, kubectl's equality-based grammar: parsed once here, used by the CLI
(``-l``) to refuse a bad selector before any call, and by the broker's List RPCs
(``label_selector``) to filter while paging.

Grammar: comma-separated requirements, all of which must hold::

    key=value   key==value   the label is set to value
    key!=value                the label is not set to value (or not set at all)
    key                       the label is set (to anything)
    !key                      the label is not set

Keys and values are trimmed; a key may not be empty or contain ``=``, ``!`` or ``,``.
An empty selector matches everything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from dxpool.errors import InvalidArgument

SELECTOR_GRAMMAR = "KEY=VALUE, KEY!=VALUE, KEY or !KEY, comma-separated, e.g. team=ml,tier!=dev"
MAX_SELECTOR_LENGTH = 4096
_FORBIDDEN_IN_KEY = frozenset("=!, ")
_SHOWN = 80


class Operator(Enum):
    EQUALS = "="
    NOT_EQUALS = "!="
    EXISTS = "exists"
    NOT_EXISTS = "!exists"


@dataclass(frozen=True)
class Requirement:
    """One requirement of a selector: ``key`` with ``operator`` (and ``value``)."""

    key: str
    operator: Operator
    value: str = ""

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator is Operator.EQUALS:
            return labels.get(self.key) == self.value
        if self.operator is Operator.NOT_EQUALS:
            return labels.get(self.key) != self.value
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
        raise _fail(text, part, f"the key {_shown(key)} contains '=', '!', ',' or a blank")
    return key


def _requirement(text: str, part: str) -> Requirement:
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
    parts = [part.strip() for part in text.split(",")]
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
