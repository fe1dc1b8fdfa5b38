"""``python -m dxpool.hostagent``: run one host agent in the foreground (also ``dxpool agent``).

The command and its options are :mod:`dxpool.cli.commands.agent`; this entry point runs
it under the module's name. Nothing imports this module.
"""

from __future__ import annotations

import dxpool.grpc_env  # noqa: F401 - before anything imports grpc


def main() -> None:
    """Run the ``dxpool agent`` command as ``python -m dxpool.hostagent``."""
    from dxpool.cli.commands.agent import agent_command

    agent_command(prog_name="python -m dxpool.hostagent")


if __name__ == "__main__":
    main()
