#!/usr/bin/env bash
# One-shot setup of a compose pool: install the simulated fabric (boxes and hosts) in the
# shared volume, then register every box with the broker. Safe to run again: the fabric is
# completed, never replaced, and a box that is already registered is left as it is.
#
# Box i of $DXPOOL_BOXES sits in rack r<i> of site dc1, two racks a pod (p1: r1 r2, p2:
# r3 r4, ...), as `dxpool up` places them; the agents in docker-compose.yml follow the same
# plan, so host h<i> and box<i> share a rack.
#
# Environment (defaults in brackets):
#   DXPOOL_FABRIC_DIR  [/fabric]          DXPOOL_ENDPOINT   [broker:8470]
#   DXPOOL_BOXES       [box1 box2 box3]   DXPOOL_HOSTS      [h1 h2 h3]
#   DXPOOL_GPUS        [H100:8]           DXPOOL_GPU_MEMORY [80GiB]
#   DXPOOL_SLOTS       [8]                DXPOOL_BROKER_WAIT_S [120]
set -euo pipefail

fabric_dir="${DXPOOL_FABRIC_DIR:-/fabric}"
export DXPOOL_ENDPOINT="${DXPOOL_ENDPOINT:-broker:8470}"
read -r -a boxes <<<"${DXPOOL_BOXES:-box1 box2 box3}"
read -r -a hosts <<<"${DXPOOL_HOSTS:-h1 h2 h3}"
gpus="${DXPOOL_GPUS:-H100:8}"
memory="${DXPOOL_GPU_MEMORY:-80GiB}"
slots="${DXPOOL_SLOTS:-8}"
broker_wait_s="${DXPOOL_BROKER_WAIT_S:-120}"

fabric_args=(--state "$fabric_dir" --gpus "$gpus" --memory "$memory" --slots "$slots")
for box in "${boxes[@]}"; do fabric_args+=(--box "$box"); done
for host in "${hosts[@]}"; do fabric_args+=(--host "$host"); done
dxpool fabric sim create "${fabric_args[@]}"

echo "setup: waiting for the broker at $DXPOOL_ENDPOINT" >&2
waited=0
until dxpool --request-timeout 2s box list -o name >/dev/null 2>&1; do
  if [ "$waited" -ge "$broker_wait_s" ]; then
    echo "setup: the broker at $DXPOOL_ENDPOINT did not answer within ${broker_wait_s}s;" \
      "see docker-compose logs broker" >&2
    exit 1
  fi
  sleep 1
  waited=$((waited + 1))
done

index=0
for box in "${boxes[@]}"; do
  index=$((index + 1))
  if dxpool box get "$box" -o name >/dev/null 2>&1; then
    echo "setup: box $box is already registered" >&2
    continue
  fi
  dxpool box add "$box" --gpus "$gpus" --memory "$memory" \
    --site dc1 --pod "p$(((index + 1) / 2))" --rack "r$index" \
    --request-id "compose-setup-$box" -o name
done
echo "setup: done (${#boxes[@]} boxes, ${#hosts[@]} hosts)" >&2
