"""``python -m dxpool.cli`` runs the ``dxpool`` command."""

from __future__ import annotations

from dxpool.cli.main import main

if __name__ == "__main__":
    main()
