#!/usr/bin/env bash
# Debian packages crust's tests, demo and guest image need.
# --if-missing: do nothing when every tool is already there.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
pkgs=(
  qemu-system-x86         # the guest VMs (software emulation)
  linux-image-cloud-amd64 # guest kernel and its modules
  busybox-static          # guest userland
  e2fsprogs xfsprogs      # mkfs/resize on the host and in the guest
  cpio gzip kmod          # building the initramfs
  libc6-dev               # libc.a for the static guest agent
  util-linux              # losetup/mount used by test guards
  containerd runc         # the private containerd of the shim tests (ctr, CRI plugin)
  umoci                   # offline test images (scripts/build-test-images.sh)
  libseccomp-dev libcap-ng-dev pkg-config  # building virtiofsd
)
# virtiofsd (virtio-fs daemon, Rust) from crates.io, into /usr/local/bin.
VIRTIOFSD_VERSION=1.14.0
install_virtiofsd() {
  if command -v virtiofsd >/dev/null 2>&1 && virtiofsd --version 2>/dev/null | grep -q "^virtiofsd $VIRTIOFSD_VERSION"; then
    return 0
  fi
  echo "install-deps: building virtiofsd $VIRTIOFSD_VERSION (cargo install, a few minutes)"
  cargo install --locked --root /usr/local --version "$VIRTIOFSD_VERSION" virtiofsd
}
if [ "${1:-}" = "--if-missing" ]; then
  missing=0
  for t in qemu-system-x86_64 busybox mkfs.ext4 mkfs.xfs xfs_growfs xfs_io cpio losetup containerd ctr runc umoci pkg-config; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$t" >/dev/null 2>&1 || missing=1
  done
  ls /boot/vmlinuz-*cloud-amd64 >/dev/null 2>&1 || missing=1
  [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || missing=1
  [ -f /usr/include/seccomp.h ] && [ -f /usr/include/cap-ng.h ] || missing=1
  if [ $missing = 0 ]; then
    install_virtiofsd
    exit 0
  fi
  echo "install-deps: installing missing Debian packages: ${pkgs[*]}"
fi
if [ "$(id -u)" != 0 ]; then
  echo "install-deps.sh must run as root" >&2
  exit 1
fi
apt-get update
apt-get install -y --no-install-recommends "${pkgs[@]}"
install_virtiofsd
