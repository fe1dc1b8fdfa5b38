"""Help text: one-line summaries that end at the first sentence, not at an abbreviation.

click cuts a command's summary at its first period, which cuts "Compose a node, e.g.
`dxpool node create ...`" at "e.g". :class:`SummaryGroup` lists its commands with
:func:`summary` instead; every ``dxpool`` group is one, so ``--help`` reads the same at
every level.
"""

from __future__ import annotations

import re

import click

# A sentence ends at a period followed by a blank (or the end), unless the word before
# it is an abbreviation that never ends one.
_ABBREVIATIONS = ("e.g", "i.e", "etc", "vs", "cf")
_SENTENCE_END = re.compile(r"\.(?=\s|$)")


def summary(text: str, limit: int = 80) -> str:
    """The first sentence of ``text`` (its first paragraph, with ``\\b`` markers and
    line breaks dropped), cut with "..." only past ``limit`` characters."""
    paragraph = text.strip().split("\n\n")[0].replace("\b", "")
    flat = " ".join(paragraph.split())
    end = len(flat)
    for match in _SENTENCE_END.finditer(flat):
        before = flat[: match.start()].rsplit(" ", 1)[-1].lower()
        if before not in _ABBREVIATIONS:
            end = match.start()
            break
    sentence = flat[:end].rstrip(".:;, ")
    if len(sentence) > limit:
        sentence = sentence[: limit - 3].rsplit(" ", 1)[0] + "..."
    return sentence


class SummaryGroup(click.Group):
    """A group whose command list shows :func:`summary` of each command's help."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is None or command.hidden:
                continue
            text = command.short_help or summary(command.help or "")
            rows.append((name, text))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


__all__ = ["SummaryGroup", "summary"]
