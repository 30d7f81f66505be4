#!/usr/bin/env bash
# Debian packages crust's tests, demo and guest image need, and the Python
# gRPC client (grpcio, from PyPI) of the interop tests, in a virtualenv.
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
  util-linux              # losetup/mount used by test guards; wipefs (libblkid signatures
                          # before a format), unshare (a mount in another namespace)
  umoci jq patchelf binutils # scripts/build-images.sh: OCI images, self-contained node payload
  containerd              # the node installer's config is checked with `containerd config dump`
)
# Python packages of the tests, in one virtualenv (the tests find it at
# $CRUST_TEST_PYTHON or $VENV/bin/python): grpcio (grpc-core) calls crust's
# gRPC servers; kubernetes-validate checks deploy/kubernetes offline (its
# schemas ship inside the package).
VENV="${CRUST_TEST_VENV:-/opt/crust-test-venv}"
PY_PKGS=(grpcio==1.85.1 grpcio-tools==1.85.1 kubernetes-validate==1.37.0)
have_grpcio() {
  "$VENV/bin/python" -c "import grpc, grpc_tools, kubernetes_validate" >/dev/null 2>&1
}
install_grpcio() {
  have_grpcio && return 0
  echo "install-deps: installing ${PY_PKGS[*]} into $VENV"
  local py
  py="$(command -v python3 || true)"
  if [ -z "$py" ] || ! "$py" -m venv --clear "$VENV" >/dev/null 2>&1; then
    # Debian's python3 needs its venv module packaged separately.
    apt-get update
    apt-get install -y --no-install-recommends python3 python3-venv
    /usr/bin/python3 -m venv --clear "$VENV"
  fi
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_PKGS[@]}"
  have_grpcio
}

if [ "${1:-}" = "--if-missing" ]; then
  missing=0
  for t in qemu-system-x86_64 busybox mkfs.ext4 mkfs.xfs xfs_growfs xfs_io cpio losetup \
    wipefs unshare e2fsck umoci jq patchelf strip containerd; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$t" >/dev/null 2>&1 || missing=1
  done
  ls /boot/vmlinuz-*cloud-amd64 >/dev/null 2>&1 || missing=1
  [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || missing=1
  if [ $missing = 0 ]; then
    have_grpcio && exit 0
    [ "$(id -u)" = 0 ] || { echo "install-deps.sh must run as root" >&2; exit 1; }
    install_grpcio
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
install_grpcio
