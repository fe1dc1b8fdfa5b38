"""dxpool's entry points quiet gRPC's C core unless the operator chose its verbosity."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENTRY_POINTS = ("dxpool.cli.main", "dxpool.broker.__main__", "dxpool.hostagent.__main__")


@pytest.mark.parametrize("module", ENTRY_POINTS)
@pytest.mark.parametrize(("given", "expected"), [(None, "ERROR"), ("DEBUG", "DEBUG")])
def test_an_entry_point_sets_grpc_verbosity_before_grpc_is_imported(
    module: str, given: str | None, expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if given is not None:
        env["GRPC_VERBOSITY"] = given
    probe = (
        "import importlib, os, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(os.environ['GRPC_VERBOSITY'])\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == expected
