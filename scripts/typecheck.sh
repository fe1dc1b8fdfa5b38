#!/usr/bin/env bash
# mypy (strict) over the dxpool package, as it is imported: dxpool/broker, dxpool/cli and
# the other subpackages are links to the top-level folders, so mypy reads the real tree.
set -euo pipefail
cd "$(dirname "$0")/.."
mypy --config-file pyproject.toml -p dxpool
# Typed scripts outside the package, each checked on its own.
mypy --config-file pyproject.toml scripts/error_reasons.py
