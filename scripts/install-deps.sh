#!/usr/bin/env bash
# Debian packages crust's tests, demo and guest image need.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
pkgs=(
  qemu-system-x86        # the guest VMs (software emulation)
  linux-image-cloud-amd64 # guest kernel and its modules
  busybox-static         # guest userland
  e2fsprogs xfsprogs     # mkfs/resize on host and in the guest
  cpio zstd xz-utils kmod # building the initramfs
  util-linux             # losetup/mount used by test guards
)
if [ "$(id -u)" != 0 ]; then
  echo "install-deps.sh must run as root" >&2
  exit 1
fi
apt-get update
apt-get install -y --no-install-recommends "${pkgs[@]}"
