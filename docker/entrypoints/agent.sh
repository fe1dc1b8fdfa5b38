#!/usr/bin/env bash
# Start a host agent once its simulated fabric exists: waits for fabric.json in the
# directory given by --sim-state (or $DXPOOL_AGENT_SIM_STATE_DIR), then execs
# `dxpool -v agent "$@"`. The wait covers engines that start the agents before the one-shot
# setup service has finished. Exits 1 if the fabric does not appear within
# $DXPOOL_FABRIC_WAIT_S seconds (default 120).
set -euo pipefail

state_dir="${DXPOOL_AGENT_SIM_STATE_DIR:-}"
previous=""
for arg in "$@"; do
  case "$previous" in --sim-state | --sim-state-dir) state_dir="$arg" ;; esac
  case "$arg" in --sim-state=* | --sim-state-dir=*) state_dir="${arg#*=}" ;; esac
  previous="$arg"
done

if [ -n "$state_dir" ]; then
  wait_s="${DXPOOL_FABRIC_WAIT_S:-120}"
  waited=0
  until [ -f "$state_dir/fabric.json" ]; do
    if [ "$waited" -ge "$wait_s" ]; then
      echo "agent: no simulated fabric in $state_dir after ${wait_s}s;" \
        "did the setup service run? (docker-compose logs setup)" >&2
      exit 1
    fi
    [ "$waited" -eq 0 ] && echo "agent: waiting for the simulated fabric in $state_dir" >&2
    sleep 1
    waited=$((waited + 1))
  done
fi

# -v: the root `dxpool` command sets the dxpool loggers to WARNING unless told otherwise,
# which would hide the agent's INFO lines whatever its --log-level says.
exec dxpool -v agent "$@"
