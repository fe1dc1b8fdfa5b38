"""Chaos runs are opt-in: they take minutes and are meant to find violations.

A test marked ``chaos`` runs when the marker expression names it (``-m chaos``) or
``$DXPOOL_CHAOS_SECONDS`` is set; otherwise it is skipped, so the default suite stays
fast and does not fail on what the chaos run is there to find.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expression = config.getoption("markexpr") or ""
    named = "chaos" in expression and "not chaos" not in expression
    wanted = named or bool(os.environ.get("DXPOOL_CHAOS_SECONDS"))
    if wanted:
        return
    skip = pytest.mark.skip(reason="chaos run: select it with -m chaos or DXPOOL_CHAOS_SECONDS")
    for item in items:
        if item.get_closest_marker("chaos") is not None:
            item.add_marker(skip)
