#!/usr/bin/env bash
# The docker-compose integration run as CI does it, on a fresh Debian machine, as root:
#   1. installs docker.io, docker-compose and debootstrap if any is missing;
#   2. starts the Docker engine if it is not running (systemd if it runs, else dockerd
#      in the background, logging to /var/log/dxpool-dockerd.log);
#   3. builds the base image once (docker/base-image.sh);
#   4. finds a Python with dxpool and pytest ($PYTHON, else python3), or makes .venv
#      with `pip install -e .[dev]` as scripts/test.sh does;
#   5. runs python -m pytest -m compose tests/compose (it builds the dxpool image, starts
#      the pool under a project name of its own, and takes it down with -v at the end).
# Prints how long each step took. Extra arguments go to pytest.
#
# Usage: sudo docker/compose-test.sh [--setup-only | pytest args...]
#   --setup-only: stop after step 3 (what .ci/run uses before the whole test suite).
set -euo pipefail
cd "$(dirname "$0")/.."

started=$SECONDS
step_started=$SECONDS
say() { echo "compose-test: $*" >&2; }
step_done() {
  say "$1 ($((SECONDS - step_started))s)"
  step_started=$SECONDS
}

[ "$(id -u)" -eq 0 ] || { say "error: run as root (installs packages, starts dockerd)"; exit 1; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv python3-pip)
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing ${missing[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
    >/dev/null
fi
step_done "packages present"

if ! docker info >/dev/null 2>&1; then
  if [ -d /run/systemd/system ]; then
    say "starting docker with systemctl"
    systemctl start docker
  else
    # A dockerd that died leaves containerd's pid file behind; once that pid is reused by
    # another process, a new dockerd waits for a containerd that is not there.
    pidfile=/var/run/docker/containerd/containerd.pid
    if [ -f "$pidfile" ] && ! grep -qs containerd "/proc/$(cat "$pidfile")/comm"; then
      rm -f "$pidfile"
    fi
    say "starting dockerd (log: /var/log/dxpool-dockerd.log)"
    nohup dockerd >/var/log/dxpool-dockerd.log 2>&1 &
  fi
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 \
    || { say "error: the Docker engine did not start; see /var/log/dxpool-dockerd.log"; exit 1; }
fi
step_done "Docker engine running"

docker/base-image.sh
step_done "base image present"
if [ "${1:-}" = "--setup-only" ]; then
  say "setup done in $((SECONDS - started))s"
  exit 0
fi

python="${PYTHON:-python3}"
if ! "$python" -c 'import dxpool.client, pytest, pytest_timeout' 2>/dev/null; then
  say "no Python with dxpool and pytest at '$python': setting up .venv"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev]'
  python="$PWD/.venv/bin/python"
fi
step_done "Python ready: $python"

status=0
"$python" -m pytest -m compose tests/compose "$@" || status=$?
step_done "pytest exited with $status"
say "total $((SECONDS - started))s"
exit "$status"
