"""The outcome of one plugin call: a code that says what happens next, and reasons.

Plugins report outcomes with a :class:`Status`, never by raising. An exception that
escapes a plugin is a bug; the pipeline turns it into an ``ERROR`` status naming the
plugin, so one faulty plugin cannot take the broker down.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Code(enum.Enum):
    """What a status means for the candidate it was given."""

    SUCCESS = "success"
    # The candidate does not fit now; it may fit once the inventory changes.
    UNSCHEDULABLE = "unschedulable"
    # The request cannot fit whatever the inventory's state; retrying will not help.
    UNRESOLVABLE = "unresolvable"
    # The plugin failed; the candidate is dropped and the error reported.
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Status:
    """A code, the human reasons behind it and the plugin that returned it."""

    code: Code = Code.SUCCESS
    reasons: tuple[str, ...] = ()
    plugin: str = ""

    @property
    def ok(self) -> bool:
        return self.code is Code.SUCCESS

    @classmethod
    def unschedulable(cls, *reasons: str, plugin: str = "") -> Status:
        return cls(Code.UNSCHEDULABLE, reasons, plugin)

    @classmethod
    def unresolvable(cls, *reasons: str, plugin: str = "") -> Status:
        return cls(Code.UNRESOLVABLE, reasons, plugin)

    @classmethod
    def error(cls, *reasons: str, plugin: str = "") -> Status:
        return cls(Code.ERROR, reasons, plugin)

    def message(self) -> str:
        """The reasons joined into one line ("" for a success without reasons)."""
        return "; ".join(self.reasons)


SUCCESS = Status()
