#!/usr/bin/env bash
# buf's checks of the API in proto/: `buf lint` (style, with the exceptions proto/buf.yaml
# gives and why), then `buf breaking` against proto/api-baseline.binpb, the API as
# released: a change that breaks clients on the wire or in JSON fails here. A deliberate
# breaking change updates the baseline in the same commit: scripts/buf.sh --update-baseline.
# buf comes from npm (@bufbuild/buf, pinned below), installed once into .cache/buf.
set -euo pipefail
cd "$(dirname "$0")/.."
BUF_VERSION=1.75.0
prefix=.cache/buf
buf="$prefix/node_modules/.bin/buf"
if [ ! -x "$buf" ] || [ "$("$buf" --version 2>/dev/null)" != "$BUF_VERSION" ]; then
  if ! command -v npm >/dev/null; then
    if [ "${CI:-}" = "true" ]; then
      echo "error: npm is needed to install buf; .ci/run installs it" >&2
      exit 1
    fi
    echo "skipped: buf lint and buf breaking need npm (apt-get install npm) to install buf" >&2
    exit 0
  fi
  mkdir -p "$prefix"
  npm install --silent --no-audit --no-fund --prefix "$prefix" "@bufbuild/buf@$BUF_VERSION" >&2
fi
cd proto
if [ "${1:-}" = "--update-baseline" ]; then
  "$OLDPWD/$buf" build -o api-baseline.binpb
  echo "proto/api-baseline.binpb updated: commit it with the change it records"
  exit 0
fi
"$OLDPWD/$buf" lint
"$OLDPWD/$buf" breaking --against api-baseline.binpb
echo "buf lint and buf breaking: ok"
