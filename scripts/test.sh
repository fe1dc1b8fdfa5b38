#!/usr/bin/env bash
# Set up a virtual environment (.venv) and run every check that guards correctness:
# generated-code freshness, lint, types, import contracts, and the full test suite (slow
# suites included).
# Usage: scripts/test.sh [pytest args...]     e.g. scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
ensure_venv dev  # skipped when nothing changed since the last run
export PATH="$PWD/.venv/bin:$PATH"

echo "== generated API code is current"
python proto/generate.py --check
echo "== buf lint and buf breaking (the API against proto/api-baseline.binpb)"
scripts/buf.sh
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy"
scripts/typecheck.sh
echo "== import contracts (pyproject.toml [tool.importlinter])"
lint-imports
echo "== pytest"
python -m pytest "$@"
