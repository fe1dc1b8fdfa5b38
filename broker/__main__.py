"""``python -m dxpool.broker``: run one broker in the foreground (also ``dxpool broker``).

Without the server extra this says what to install and exits 1, instead of failing on an
import: the check asks the import system (:mod:`dxpool.extras`) before the broker, which
needs the extra, is imported.
"""

from __future__ import annotations

import sys

import dxpool.grpc_env  # noqa: F401 - before anything imports grpc
from dxpool.extras import install_hint, missing_modules


def main() -> None:
    """Run the broker command, or report the missing extra and exit 1."""
    missing = missing_modules("server")
    if missing:
        print(
            "error: `python -m dxpool.broker` needs the server extra, which is not installed "
            f"(missing modules: {', '.join(missing)}): {install_hint('server')}",
            file=sys.stderr,
        )
        sys.exit(1)
    from dxpool.cli.commands.broker import broker_command

    broker_command()


if __name__ == "__main__":
    main()
