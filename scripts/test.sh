#!/usr/bin/env bash
# Set up a virtual environment (.venv) and run every check that guards correctness:
# generated-code freshness, lint, types, and the full test suite (slow suites included).
# Usage: scripts/test.sh [pytest args...]     e.g. scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'
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
echo "== pytest"
python -m pytest "$@"
