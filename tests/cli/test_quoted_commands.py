"""Every `dxpool ...` command that a message, hint or help text tells the operator to run
exists: a hint that names a missing command sends them nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from dxpool.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("broker", "cli", "dxpool", "hostagent", "fabric")
# `dxpool WORD WORD`: a command and, for a group, the subcommand (options and
# arguments after them are not checked).
QUOTED = re.compile(r"`dxpool ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)?)")


def _quoted() -> list[tuple[str, str]]:
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in QUOTED.finditer(path.read_text()):
                found.append((str(path.relative_to(ROOT)), match.group(1)))
    return found


def _resolves(words: list[str]) -> bool:
    command: click.Command | None = cli
    context = click.Context(cli)
    for word in words:
        if not isinstance(command, click.Group):
            return True  # the rest are arguments
        command = command.get_command(context, word)
        if command is None:
            return False
    return True


@pytest.mark.parametrize(("where", "quoted"), _quoted())
def test_a_quoted_command_exists(where: str, quoted: str) -> None:
    assert _resolves(quoted.split()), f"{where} tells the operator to run `dxpool {quoted}`"
