#!/usr/bin/env bash
# Build the base image every dxpool container starts from: a minimal Debian bookworm root
# filesystem (debootstrap --variant=minbase) with python3 (3.11), python3-venv, python3-pip
# and ca-certificates, imported into the container engine. No container registry is needed.
#
# Idempotent: if the image already exists it says so and does nothing (--rebuild forces a
# new build). Needs root (debootstrap) and a running engine.
#
# Usage: docker/base-image.sh [--rebuild]
# Environment:
#   DXPOOL_BASE_IMAGE     image to create           (default: dxpool-base:bookworm)
#   DXPOOL_DEBIAN_MIRROR  Debian mirror to bootstrap (default: the first Debian archive
#                         this machine's apt sources name)
#   DXPOOL_ENGINE         container engine command   (default: docker)
set -euo pipefail

image="${DXPOOL_BASE_IMAGE:-dxpool-base:bookworm}"

# The Debian archive this machine's apt already uses (deb822 .sources or one-line .list),
# so the build needs no mirror of its own; empty when apt names none.
apt_debian_mirror() {
  local file found
  for file in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$file" ] || continue
    found=$(awk '
      /^[[:space:]]*(URIs:|deb[[:space:]])/ {
        for (i = 2; i <= NF; i++) if ($i ~ /\/debian\/?$/) { print $i; exit }
      }' "$file")
    if [ -n "$found" ]; then
      echo "$found"
      return 0
    fi
  done
  return 0
}
mirror="${DXPOOL_DEBIAN_MIRROR:-$(apt_debian_mirror)}"
engine="${DXPOOL_ENGINE:-docker}"
packages="python3,python3-venv,python3-pip,ca-certificates"

say() { echo "base-image: $*" >&2; }
die() { say "error: $*"; exit 1; }

rebuild=false
case "${1:-}" in
  "") ;;
  --rebuild) rebuild=true ;;
  -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (usage: $0 [--rebuild])" ;;
esac

command -v "$engine" >/dev/null || die "'$engine' not found: install docker.io (or set DXPOOL_ENGINE)"
"$engine" info >/dev/null 2>&1 || die "'$engine info' failed: start the engine (e.g. dockerd &)"

if "$engine" image inspect "$image" >/dev/null 2>&1 && ! $rebuild; then
  say "$image already exists; nothing to do (--rebuild to build it again)"
  exit 0
fi

[ "$(id -u)" -eq 0 ] || die "debootstrap needs root; run this script as root"
command -v debootstrap >/dev/null || die "debootstrap not found: apt-get install debootstrap"

rootfs="$(mktemp -d /tmp/dxpool-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

[ -n "$mirror" ] || die "no Debian archive in this machine's apt sources: set DXPOOL_DEBIAN_MIRROR"
say "bootstrapping Debian bookworm (minbase + $packages) from $mirror into $rootfs"
started=$SECONDS
debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" \
  > "$rootfs.log" 2>&1 || { tail -n 20 "$rootfs.log" >&2; die "debootstrap failed (log: $rootfs.log)"; }
rm -f "$rootfs.log"
say "bootstrapped in $((SECONDS - started))s; trimming apt caches and docs"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*

say "importing the root filesystem as $image"
tar -C "$rootfs" -c . | "$engine" import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  - "$image" >/dev/null
say "built $image ($("$engine" image inspect --format '{{.Size}}' "$image") bytes) in $((SECONDS - started))s"
