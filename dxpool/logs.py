"""Structured logging for the broker, the agent and the CLI: constant messages, values as
``key=value`` on stderr.

Callers log ``log.info("gpu attached", extra={"gpu": name, "bdf": bdf})``; the formatter
appends every ``extra`` field to the line, quoting values that contain spaces.
"""

from __future__ import annotations

import logging
import sys

_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


def _value(value: object) -> str:
    text = str(value)
    if not text or any(ch.isspace() or ch in '"=' for ch in text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


class KeyValueFormatter(logging.Formatter):
    """``time level logger message key=value ...``, then any traceback."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [
            f"{key}={_value(value)}"
            for key, value in vars(record).items()
            if key not in _RESERVED and not key.startswith("_")
        ]
        if not fields:
            return line
        head, sep, tail = line.partition("\n")
        return f"{head} {' '.join(fields)}{sep}{tail}"


def configure_logging(level: str = "INFO") -> None:
    """Send the root logger's records to stderr as key=value lines at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


__all__ = ["KeyValueFormatter", "configure_logging"]
