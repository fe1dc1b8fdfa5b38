"""Defaults that several components must agree on, in one place.

The broker listens where the CLI and the client look first, so a local pool started with
``dxpool up`` needs no configuration.
"""

from __future__ import annotations

DEFAULT_ENDPOINT = "127.0.0.1:8470"
