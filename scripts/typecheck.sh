#!/usr/bin/env bash
# mypy over the installed layout: the top-level folders are the subpackages of `dxpool`
# (see package-dir in pyproject.toml), which mypy cannot follow through the editable
# install's import hook, so we check a tree of links shaped like the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/dxpool"
for entry in dxpool/*; do ln -s "$root/$entry" "$tree/dxpool/$(basename "$entry")"; done
ln -s "$root/proto/python" "$tree/dxpool/api"
for component in broker hostagent fabric cli; do ln -s "$root/$component" "$tree/dxpool/$component"; done
cd "$tree"
mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p dxpool
# Typed scripts outside the package, each checked on its own.
mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" "$root/scripts/error_reasons.py"
