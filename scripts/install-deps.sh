#!/usr/bin/env bash
# What crust's tests, demo, benchmarks and guest image need on a fresh
# Debian machine: Debian packages, virtiofsd and cargo-fuzz (crates.io) and the tests'
# Python packages (PyPI) in one virtualenv.
# --if-missing: only install what is missing (quiet when nothing is).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
pkgs=(
  qemu-system-x86         # the guest VMs (software emulation)
  qemu-utils              # qemu-img bench: the host column of crustctl bench --guest-io
  linux-image-cloud-amd64 # guest kernel and its modules
  busybox-static          # guest userland
  e2fsprogs xfsprogs      # mkfs/resize on the host and in the guest
  cpio gzip kmod          # building the initramfs
  gcc libc6-dev           # libc.a for the static guest agent; the static crust-escape of
                          # the test image (scripts/build-test-images.sh)
  util-linux              # losetup/mount used by test guards; flock (guest/build-image.sh); wipefs (libblkid signatures
                          # before a format), unshare (a mount in another namespace)
  containerd runc         # the private containerd of the shim tests (ctr, CRI plugin); the
                          # node installer's config is checked with `containerd config dump`
  umoci                   # OCI images (scripts/build-test-images.sh, scripts/build-images.sh)
  jq patchelf binutils    # scripts/build-images.sh: self-contained node payload
  libseccomp-dev libcap-ng-dev pkg-config  # building virtiofsd; libseccomp.a links into the agent
  fio                     # the bench guest image (guest/build-image.sh --bench copies it
                          # and its libraries): crustctl bench --guest-io
  iproute2 iputils-ping   # pod networking tests: namespaces, veths, tc; ping with -M do
  containernetworking-plugins  # CNI plugins (bridge, host-local, portmap, loopback) of the
                          # private containerd's CRI pods (/usr/lib/cni)
  iptables                # what the bridge and portmap plugins program (hostPort); the pod
                          # namespace rules tests (iptables-legacy, iptables-nft)
  nftables                # nft: the anti-spoofing table in each pod namespace (the shim
                          # needs it on a node) and reading a namespace's rules
  tcpdump                 # captures on the test bridges (anti-spoofing tests)
  iperf3                  # pod network throughput (crustctl bench, issue 26)
  golang-go               # tools/kata-record-decode: Kata's record decoding (crust-handoff's kata_differential test)
)
# virtiofsd (virtio-fs daemon, Rust) from crates.io, into /usr/local/bin.
VIRTIOFSD_VERSION=1.14.0
have_virtiofsd() {
  command -v virtiofsd >/dev/null 2>&1 &&
    virtiofsd --version 2>/dev/null | grep -q "^virtiofsd $VIRTIOFSD_VERSION"
}
install_virtiofsd() {
  have_virtiofsd && return 0
  echo "install-deps: building virtiofsd $VIRTIOFSD_VERSION (cargo install, a few minutes)"
  cargo install --locked --root /usr/local --version "$VIRTIOFSD_VERSION" virtiofsd
}
# cargo-fuzz (crates.io) for scripts/fuzz.sh, pinned; it drives the nightly
# toolchain's libFuzzer support, so without nightly there is nothing to
# install (fuzz.sh says so and test.sh skips its fuzz step).
CARGO_FUZZ_VERSION=0.13.2
have_nightly() { rustup toolchain list 2>/dev/null | grep -q '^nightly'; }
have_cargo_fuzz() {
  ! have_nightly ||
    cargo fuzz --version 2>/dev/null | grep -qx "cargo-fuzz $CARGO_FUZZ_VERSION"
}
install_cargo_fuzz() {
  have_cargo_fuzz && return 0
  echo "install-deps: building cargo-fuzz $CARGO_FUZZ_VERSION (cargo install, about a minute)"
  cargo install --locked --root /usr/local --version "$CARGO_FUZZ_VERSION" cargo-fuzz
}
# rustfmt and clippy for scripts/test.sh's lint gate, which always runs
# them (components of the toolchain in use, from rustup).
have_lints() {
  cargo fmt --version >/dev/null 2>&1 && cargo clippy --version >/dev/null 2>&1
}
install_lints() {
  have_lints && return 0
  echo "install-deps: adding rustfmt and clippy (rustup component add)"
  rustup component add rustfmt clippy
  have_lints
}
# Python packages of the tests, in one virtualenv (the tests find it at
# $CRUST_TEST_PYTHON or $VENV/bin/python): grpcio (grpc-core) calls crust's
# gRPC servers; kubernetes-validate checks deploy/kubernetes offline (its
# schemas ship inside the package).
VENV="${CRUST_TEST_VENV:-/opt/crust-test-venv}"
PY_PKGS=(grpcio==1.85.1 grpcio-tools==1.85.1 kubernetes-validate==1.37.0)
have_python_pkgs() {
  "$VENV/bin/python" -c "import grpc, grpc_tools, kubernetes_validate" >/dev/null 2>&1
}
install_python_pkgs() {
  have_python_pkgs && return 0
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
  have_python_pkgs
}

# csi-sanity (kubernetes-csi/csi-test) for crust-csi's conformance tests is
# not a package of any registry reached here (and Debian's Go is too old to
# build it): CI lays it at ../shared/tools/csi-sanity beside the checkout,
# elsewhere CRUST_CSI_SANITY names it. Without it those tests skip, or fail
# under CI=true (scripts/test.sh's default): say so.
check_csi_sanity() {
  local beside
  beside="$(cd "$(dirname "$0")/.." && pwd)/../shared/tools/csi-sanity"
  [ -x "${CRUST_CSI_SANITY:-$beside}" ] && return 0
  echo "install-deps: csi-sanity not found at ${CRUST_CSI_SANITY:-$beside}: the csi_sanity" \
    "conformance tests will fail under CI=true and skip otherwise (build it as ../shared/tools/README.md says, or set CRUST_CSI_SANITY)" >&2
}
check_csi_sanity

if [ "${1:-}" = "--if-missing" ]; then
  missing=0
  # The filesystem tools are every one crust_fs's FsSpecs name (checked by
  # crates/crust-fs/tests/scripts.rs).
  for t in qemu-system-x86_64 qemu-img busybox mkfs.ext4 e2fsck resize2fs mkfs.xfs xfs_growfs \
    xfs_repair xfs_io cpio losetup wipefs unshare flock containerd ctr runc umoci jq patchelf \
    strip pkg-config fio ip ping iperf3 iptables nft tcpdump gcc; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$t" >/dev/null 2>&1 || missing=1
  done
  ls /boot/vmlinuz-*cloud-amd64 >/dev/null 2>&1 || missing=1
  [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || missing=1
  [ -f /usr/include/seccomp.h ] && [ -f /usr/include/cap-ng.h ] || missing=1
  [ -x /usr/lib/cni/bridge ] || missing=1
  if [ $missing = 0 ]; then
    have_virtiofsd && have_python_pkgs && have_cargo_fuzz && have_lints && exit 0
    [ "$(id -u)" = 0 ] || { echo "install-deps.sh must run as root" >&2; exit 1; }
    install_lints
    install_virtiofsd
    install_cargo_fuzz
    install_python_pkgs
    exit 0
  fi
  echo "install-deps: installing missing Debian packages: ${pkgs[*]}"
fi
if [ "$(id -u)" != 0 ]; then
  echo "install-deps.sh must run as root" >&2
  exit 1
fi
apt-get update
# Some machines ship a newer qemu-utils (a backport, from no configured
# repository) that Breaks the repository's qemu-system-common: pin
# qemu-utils to the QEMU the guests run, downgrading it if needed, so that
# qemu-img and the emulator are one release (only when a repository has
# that qemu-utils: a locally installed emulator keeps the old behaviour).
qemu_version=$(LC_ALL=C apt-cache policy qemu-system-x86 | awk '/Candidate:/ {print $2}')
apt_extra=()
if [ -n "$qemu_version" ] && [ "$qemu_version" != "(none)" ] &&
  LC_ALL=C apt-cache madison qemu-utils | awk -F' [|] ' '{print $2}' | grep -qxF "$qemu_version"; then
  for i in "${!pkgs[@]}"; do
    [ "${pkgs[$i]}" = qemu-utils ] && pkgs[$i]="qemu-utils=$qemu_version"
  done
  apt_extra=(--allow-downgrades)
fi
apt-get install -y --no-install-recommends "${apt_extra[@]}" "${pkgs[@]}"
install_lints
install_virtiofsd
install_cargo_fuzz
install_python_pkgs
