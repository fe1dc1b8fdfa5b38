"""``dxpool completion bash|zsh|fish``: the shell completion script, from click."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

SHELLS = ("bash", "zsh", "fish")


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the completion script for SHELL. Load it in the current shell with

    \b
      source <(dxpool completion bash)        # bash
      source <(dxpool completion zsh)         # zsh
      dxpool completion fish | source         # fish
    """
    root = ctx.find_root().command
    complete = get_completion_class(shell)
    assert complete is not None  # every name in SHELLS has a class
    click.echo(complete(root, {}, "dxpool", "_DXPOOL_COMPLETE").source())
