#!/usr/bin/env bash
# Set up a virtual environment (.venv) and run the embedded default in the foreground:
# a private etcd, a broker on 127.0.0.1:8470, a simulated fabric with GPU boxes, and host
# agents, all on mutual TLS with a private CA in .dxpool/pki (.dxpool/config.yaml points the
# CLI at it). Ctrl-C stops everything. Extra arguments go to `dxpool up` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
ensure_venv server  # skipped when nothing changed since the last start
# exec: `dxpool up` takes this script's pid, so a SIGTERM sent to it stops the pool in order
# (a shell in between would die and leave `dxpool up` running).
exec .venv/bin/dxpool up "$@"
