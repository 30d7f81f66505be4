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
  umoci jq patchelf binutils # scripts/build-images.sh: OCI images, self-contained node payload
  containerd              # the node installer's config is checked with `containerd config dump`
)
# PyPI: the Kubernetes schemas for validating deploy/kubernetes offline
# (they ship inside the package; no download at validation time).
py_pkgs=(kubernetes-validate==1.37.0)
if [ "${1:-}" = "--if-missing" ]; then
  missing=0
  python3 -c 'import kubernetes_validate' 2>/dev/null || missing=1
  for t in qemu-system-x86_64 busybox mkfs.ext4 mkfs.xfs xfs_growfs xfs_io cpio losetup \
    umoci jq patchelf strip containerd; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$t" >/dev/null 2>&1 || missing=1
  done
  ls /boot/vmlinuz-*cloud-amd64 >/dev/null 2>&1 || missing=1
  [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || missing=1
  [ $missing = 0 ] && exit 0
  echo "install-deps: installing missing Debian packages: ${pkgs[*]}"
fi
if [ "$(id -u)" != 0 ]; then
  echo "install-deps.sh must run as root" >&2
  exit 1
fi
apt-get update
apt-get install -y --no-install-recommends "${pkgs[@]}"
python3 -m pip install --quiet --disable-pip-version-check "${py_pkgs[@]}"
