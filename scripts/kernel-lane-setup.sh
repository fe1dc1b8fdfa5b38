#!/usr/bin/env bash
# Install what the real-kernel test lane (pytest -m kernel, tests/kernel/) needs on a
# fresh Debian machine, as root: QEMU, a distribution kernel for the guest, busybox and
# udev for the guest's userland, pciutils, and virtme-ng (PyPI) in the given Python.
#
# The lane boots that kernel in a QEMU guest that shares this machine's root filesystem
# read-only; the guest runs the host agent's Linux driver against its own sysfs while the
# test plays the box side over QMP. Where this script cannot install something the lane
# skips and says what is missing; this script fails only when told the lane is required
# (DXPOOL_REQUIRE_KERNEL=1).
#
# Usage: scripts/kernel-lane-setup.sh [--debian-only | PYTHON]
#   PYTHON (default .venv/bin/python) gets virtme-ng and qemu.qmp unless it has them
#   (pip install -e '.[dev]' brings both); --debian-only installs the Debian packages only.
set -uo pipefail
cd "$(dirname "$0")/.."

started=$SECONDS
say() { echo "kernel-lane-setup: $*" >&2; }
python="${1:-.venv/bin/python}"
required="${DXPOOL_REQUIRE_KERNEL:-0}"
fail() {
  say "error: $*"
  [ "$required" = "1" ] && exit 1
  exit 0
}

[ "$(id -u)" -eq 0 ] || fail "run as root (installs Debian packages); the kernel lane will skip"

missing=()
command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
compgen -G '/boot/vmlinuz-*' >/dev/null || missing+=(linux-image-amd64)
[ -x /bin/busybox ] || missing+=(busybox-static)
command -v lspci >/dev/null || missing+=(pciutils)
command -v udevadm >/dev/null || missing+=(udev)
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing ${missing[*]}"
  apt-get update -q >/dev/null || fail "apt-get update failed"
  # Installing a kernel image runs its hooks (initramfs); the lane does not need them.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}" >/dev/null || fail "apt-get install ${missing[*]} failed"
fi
say "Debian packages present ($((SECONDS - started))s)"

if [ "$python" = "--debian-only" ]; then
  exit 0
fi
if ! "$python" -c 'import virtme_ng, qemu.qmp' 2>/dev/null; then
  say "installing the kernel-lane extra into $python"
  "$python" -m pip install --quiet -e '.[kernel-lane]' || fail "pip install .[kernel-lane] failed"
fi
say "virtme-ng and qemu.qmp present; setup done in $((SECONDS - started))s"
