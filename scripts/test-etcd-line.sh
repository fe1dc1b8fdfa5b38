#!/usr/bin/env bash
# The store and integration suites against a second etcd release line: Debian's
# etcd-server package (etcd 3.4), installed first if it is missing (as root). The
# package enables an etcd service on port 2379; it is kept from starting while it
# installs (policy-rc.d), and disabled and stopped where systemd runs.
#
# Usage: scripts/test-etcd-line.sh [--install-only | pytest args...]
#   DXPOOL_ETCD_BINARY=PATH runs the suites against another etcd instead (no install).
#   --install-only: install etcd-server and stop (what .ci/run does before the suite).
# Takes about 3 minutes on the 2-core test machines; needs .venv (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "test-etcd-line: $*" >&2; }
debian_etcd=/usr/bin/etcd
binary="${DXPOOL_ETCD_BINARY:-$debian_etcd}"

install_debian_etcd() {
  [ "$(id -u)" -eq 0 ] || { say "error: run as root to install etcd-server"; exit 1; }
  local policy=/usr/sbin/policy-rc.d made_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# no service starts while dxpool installs packages\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    made_policy=1
  fi
  local status=0
  say "installing etcd-server"
  apt-get update -q >/dev/null || status=$?
  if [ "$status" -eq 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends etcd-server \
      >/dev/null || status=$?
  fi
  if [ -n "$made_policy" ]; then
    rm -f "$policy"  # only what this script made
  fi
  [ "$status" -eq 0 ] || { say "error: installing etcd-server failed"; exit "$status"; }
  if [ -d /run/systemd/system ]; then
    systemctl disable --now etcd.service >/dev/null 2>&1 || true
  fi
}

if [ "$binary" = "$debian_etcd" ] && [ ! -x "$debian_etcd" ]; then
  install_debian_etcd
fi
[ -x "$binary" ] || { say "error: no etcd at $binary"; exit 1; }
say "$("$binary" --version | head -n 1) at $binary"
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
export DXPOOL_ETCD_BINARY="$binary"
exec .venv/bin/python -m pytest -m "not slow" -p no:cacheprovider \
  tests/store tests/integration "$@"
