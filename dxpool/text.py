"""Checks on free text, shared by the broker and the host agent.

Free text (labels, reasons, tenants, locations, endpoints) must be printable: no control
characters (C0, DEL, C1), no format characters such as bidirectional overrides, no
unassigned or private-use code points, no line or paragraph separators, and no
whitespace other than the ASCII space (``str.isprintable``). Such text ends up in
terminals, logs and tables, where those characters hide or rewrite what is shown.

Every function raises :class:`~dxpool.errors.InvalidArgument` with a message that names
the field and says what to change.
"""

from __future__ import annotations

from collections.abc import Mapping

from dxpool.errors import InvalidArgument
from dxpool.limits import MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS, MAX_TEXT

_SHOWN = 40  # characters of a label key echoed in a field path


def check_text(value: str, field: str, limit: int = MAX_TEXT) -> str:
    """Return ``value`` if it is at most ``limit`` printable characters (see above)."""
    if len(value) > limit:
        raise InvalidArgument(
            f"{field} is {len(value)} characters long; the limit is {limit}: use a shorter value",
            reason="FIELD_TOO_LONG",
        )
    if not value.isprintable():
        position, char = next((i, c) for i, c in enumerate(value) if not c.isprintable())
        raise InvalidArgument(
            f"{field} contains the non-printable character U+{ord(char):04X} at position "
            f"{position}; remove it (control, format and separator characters, tabs and "
            "newlines are not allowed)",
            reason="INVALID_TEXT",
        )
    return value


def check_labels(labels: Mapping[str, str], field: str = "labels") -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(
            f"{field} has {len(labels)} entries; the limit is {MAX_LABELS}: remove some",
            reason="TOO_MANY_LABELS",
        )
    for key, value in sorted(labels.items()):
        if not key:
            raise InvalidArgument(f"{field} has an empty key; give every label a key")
        check_text(key, f"{field} key {key[:_SHOWN]!r}", MAX_LABEL_KEY)
        check_text(value, f"{field}[{key[:_SHOWN]!r}]", MAX_LABEL_VALUE)


def clean_text(value: str, limit: int) -> str:
    """``value`` made acceptable to :func:`check_text`: each non-printable character
    replaced by a space and the text cut to ``limit`` characters (ending in ``...``).
    For text a program produced (an error message), which should be reported, not
    refused."""
    cleaned = "".join(c if c.isprintable() else " " for c in value)
    if len(cleaned) <= limit:
        return cleaned
    return cleaned[: max(0, limit - 3)] + "..."


__all__ = ["check_labels", "check_text", "clean_text"]
