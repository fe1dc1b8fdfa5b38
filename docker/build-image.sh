#!/usr/bin/env bash
# Build the dxpool image (default dxpool:dev) that docker-compose.yml runs:
#   1. the base image, once (docker/base-image.sh);
#   2. a wheelhouse of dxpool's dependencies for CPython 3.11 on Linux, in
#      build/docker-wheels/, downloaded here with this machine's pip settings (index,
#      proxy, certificates), so the image build needs no network of its own; refreshed
#      only when pyproject.toml's dependencies change;
#   3. docker build -f docker/Dockerfile (cached layers make a rebuild take seconds).
#
# Usage: docker/build-image.sh
# Environment: DXPOOL_IMAGE (dxpool:dev), DXPOOL_BASE_IMAGE (dxpool-base:bookworm),
#              DXPOOL_ENGINE (docker), PYTHON (python3, 3.11 or newer, with pip)
set -euo pipefail
cd "$(dirname "$0")/.."

image="${DXPOOL_IMAGE:-dxpool:dev}"
base="${DXPOOL_BASE_IMAGE:-dxpool-base:bookworm}"
engine="${DXPOOL_ENGINE:-docker}"
python="${PYTHON:-python3}"
wheels=build/docker-wheels

say() { echo "build-image: $*" >&2; }

DXPOOL_BASE_IMAGE="$base" DXPOOL_ENGINE="$engine" docker/base-image.sh

# Runtime dependencies with the server and agent extras (the image runs the broker, the
# agents and etcd), plus the build backend, as pip requirement lines.
requirements="$("$python" - <<'PY'
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
extras = project["project"]["optional-dependencies"]
lines = {
    *project["build-system"]["requires"],
    *project["project"]["dependencies"],
    *extras["server"],
    *extras["agent"],
}
print("\n".join(sorted(lines)))
PY
)"
mkdir -p "$wheels"
if [ -f "$wheels/requirements.txt" ] && [ "$(cat "$wheels/requirements.txt")" = "$requirements" ]; then
  say "wheelhouse $wheels is current"
else
  say "downloading wheels for CPython 3.11 into $wheels"
  rm -f "$wheels"/*.whl "$wheels/requirements.txt"
  arch="$(uname -m)"
  platforms=()
  for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_${arch}"); done
  printf '%s\n' "$requirements" >"$wheels/requirements.in"
  "$python" -m pip download --quiet --disable-pip-version-check --dest "$wheels" \
    --only-binary=:all: --implementation cp --python-version 3.11 \
    --platform manylinux2014_"$arch" "${platforms[@]}" \
    -r "$wheels/requirements.in"
  mv "$wheels/requirements.in" "$wheels/requirements.txt"
  say "$(find "$wheels" -name '*.whl' | wc -l) wheels downloaded"
fi

say "building $image from docker/Dockerfile"
started=$SECONDS
"$engine" build --quiet --build-arg BASE_IMAGE="$base" -f docker/Dockerfile -t "$image" . >/dev/null
say "built $image in $((SECONDS - started))s"
