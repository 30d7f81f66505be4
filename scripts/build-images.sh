#!/usr/bin/env bash
# Builds crust's two container images offline, without a Docker daemon, as
# OCI archives under target/images/ (umoci from Debian does the OCI work):
#
#   crust-csi-<version>.oci.tar             the CSI plugin, crustctl, and the tools
#                                           it runs: e2fsprogs, xfsprogs, util-linux
#   crust-node-installer-<version>.oci.tar  crust-node-install + the payload it puts
#                                           on a node under /opt/crust: crust-runtime
#                                           (+ its static per-poll CLI),
#                                           containerd-shim-crust-v2 and virtiofsd
#                                           (when built/installed), QEMU + firmware,
#                                           the guest image
#
# How Debian's tools get into the images: the exact binaries installed on
# the build machine (scripts/install-deps.sh) are copied with the libraries
# `ldd` resolves for them and the loader. This keeps the images small (no
# package manager, no shell, only what runs), needs no download or
# dependency solver at build time, and ships the very tool versions the
# test suite ran against; their packages and versions are recorded in the
# image (/usr/share/crust/packages.txt, with each package's copyright file).
# The node payload goes further: every binary's loader path and library
# search path are rewritten (patchelf) to <prefix>/lib, so on the node it
# never loads a host library.
#
# Reproducible: same inputs -> same image digests. File times are
# SOURCE_DATE_EPOCH (default: the last commit's time), owners 0:0, modes
# normalised, umoci writes no history, and the archive is tarred sorted with
# fixed metadata. Versioned from the workspace version (`-dev` suffix for the
# debug profile).
#
# Usage: scripts/build-images.sh [--profile release|debug] [--no-build] [--stage-only]
#   --no-build    use the binaries already in target/<profile>/ (CI builds them)
#                 and the static crust-runtime-poll scripts/build-poll-cli.sh built
#   --stage-only  stop after preparing target/images/stage/ (the root
#                 filesystems and the node payload), no OCI work
# Env: CRUST_IMAGE_REGISTRY (default localhost/crust), SOURCE_DATE_EPOCH.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release build=1 stage_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --stage-only) stage_only=1; shift ;;
    *) echo "usage: $0 [--profile release|debug] [--no-build] [--stage-only]" >&2; exit 2 ;;
  esac
done
case "$profile" in release|debug) ;; *) echo "--profile: release or debug" >&2; exit 2 ;; esac

for t in umoci patchelf jq strip ldd dpkg-query readelf gcc; do
  command -v "$t" >/dev/null || { echo "build-images: $t missing (scripts/install-deps.sh)" >&2; exit 1; }
done

registry="${CRUST_IMAGE_REGISTRY:-localhost/crust}"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}"
created="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"
version="$(cargo metadata --no-deps --format-version 1 --offline \
  | jq -r '.packages[] | select(.name == "crust-csi") | .version')"
tag="$version"
[ "$profile" = debug ] && tag="$version-dev"
prefix=/opt/crust
bindir="${CARGO_TARGET_DIR:-target}/$profile"
out="${CRUST_IMAGES_OUT:-target/images}"
stage="$out/stage"
target_guest="${CRUST_GUEST_DIR:-target/guest-image}"

# The shim is a workspace binary once issue 13 lands; virtiofsd comes from
# `cargo install virtiofsd` (or a distribution package).
has_shim=0
cargo metadata --no-deps --format-version 1 --offline \
  | jq -e '[.packages[].targets[] | select(.kind == ["bin"] and .name == "containerd-shim-crust-v2")] | length > 0' \
  >/dev/null && has_shim=1

if [ "$build" = 1 ]; then
  pkgs=(-p crust-csi -p crustctl -p crust-runtime -p crust-node-install)
  [ "$has_shim" = 1 ] && pkgs+=(--bin containerd-shim-crust-v2)
  if [ "$profile" = release ]; then
    cargo build --release --locked "${pkgs[@]}"
  else
    cargo build --locked "${pkgs[@]}"
  fi
  bash guest/build-image.sh
fi
# The per-poll runtime CLI ships static (scripts/build-poll-cli.sh): built
# here, or (--no-build) already built by that script.
poll_cli="${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/agent/crust-runtime-poll"
if [ "$build" = 1 ]; then
  poll_cli="$(bash scripts/build-poll-cli.sh)"
elif [ ! -x "$poll_cli" ]; then
  echo "build-images: $poll_cli missing (scripts/build-poll-cli.sh)" >&2
  exit 1
fi

find_tool() {
  local d
  for d in /usr/sbin /sbin /usr/bin /bin; do
    [ -x "$d/$1" ] && { echo "$d/$1"; return; }
  done
  echo "build-images: tool $1 not found (scripts/install-deps.sh)" >&2
  return 1
}

# Libraries (and the loader) a dynamic ELF file loads, resolved paths.
elf_deps() {
  ldd "$1" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' || true
}

# The Debian package owning a file (dpkg lists some files without /usr).
pkg_of() {
  local p r
  r="$(readlink -f "$1")"
  for p in "$1" "$r" "${r#/usr}" "/usr$r"; do
    dpkg-query -S "$p" 2>/dev/null | head -1 | cut -d: -f1 && return 0
  done
  return 0
}

packages_file=""
note_pkg() {
  local pkg
  pkg="$(pkg_of "$1")"
  [ -n "$pkg" ] && echo "$pkg" >>"$packages_file"
  return 0
}

# Writes packages.txt (name version) and the packages' copyright files.
write_packages() { # <root> <dir for docs, in root>
  local root="$1" docs="$2" pkg
  sort -u "$packages_file" | while read -r pkg; do
    echo "$pkg $(dpkg-query -W -f '${Version}' "$pkg")"
    if [ -f "/usr/share/doc/$pkg/copyright" ]; then
      mkdir -p "$root$docs/$pkg"
      cp -L "/usr/share/doc/$pkg/copyright" "$root$docs/$pkg/copyright"
    fi
  done >"$root/usr/share/crust/packages.txt"
}

# Copies an ELF file (stripped of debug info) with its libraries and loader
# at their own paths: a normal root filesystem for a container image.
copy_elf_rootfs() { # <src> <root> <dest>
  local src="$1" root="$2" dest="$3" lib
  mkdir -p "$root$(dirname "$dest")"
  cp -L "$src" "$root$dest"
  strip --strip-debug "$root$dest" 2>/dev/null || true
  chmod 0755 "$root$dest"
  note_pkg "$src"
  for lib in $(elf_deps "$src"); do
    [ -f "$root$lib" ] && continue
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
    chmod 0755 "$root$lib"
    note_pkg "$lib"
  done
}

# Copies an ELF file into the payload, self-contained: libraries flat in
# <payload>/lib, the loader path and library path rewritten to <prefix>/lib.
copy_elf_payload() { # <src> <payload> <dest relative to payload>
  local src="$1" pl="$2" dest="$3" lib base
  mkdir -p "$pl/$(dirname "$dest")" "$pl/lib"
  cp -L "$src" "$pl/$dest"
  chmod 0755 "$pl/$dest"
  strip --strip-debug "$pl/$dest" 2>/dev/null || true
  patchelf --set-interpreter "$prefix/lib/ld-linux-x86-64.so.2" \
    --force-rpath --set-rpath "$prefix/lib" "$pl/$dest"
  note_pkg "$src"
  for lib in $(elf_deps "$src"); do
    base="$(basename "$lib")"
    [ -f "$pl/lib/$base" ] && continue
    cp -L "$lib" "$pl/lib/$base"
    chmod 0755 "$pl/lib/$base"
    note_pkg "$lib"
    # A library with its own search path would look on the host.
    if [ -n "$(patchelf --print-rpath "$pl/lib/$base" 2>/dev/null)" ]; then
      patchelf --set-rpath "$prefix/lib" "$pl/lib/$base"
    fi
  done
}

# A shared object (a QEMU module) into the payload: its libraries as for
# copy_elf_payload, its search path <prefix>/lib.
copy_so_payload() { # <src> <payload> <dest relative to payload>
  local src="$1" pl="$2" dest="$3" lib base
  mkdir -p "$pl/$(dirname "$dest")"
  cp -L "$src" "$pl/$dest"
  chmod 0755 "$pl/$dest"
  strip --strip-debug "$pl/$dest" 2>/dev/null || true
  patchelf --force-rpath --set-rpath "$prefix/lib" "$pl/$dest"
  note_pkg "$src"
  for lib in $(elf_deps "$src"); do
    base="$(basename "$lib")"
    [ -f "$pl/lib/$base" ] && continue
    cp -L "$lib" "$pl/lib/$base"
    chmod 0755 "$pl/lib/$base"
    note_pkg "$lib"
  done
}

# Fixed metadata for every file of a tree.
normalise() { # <root>
  find "$1" -type d -exec chmod 0755 {} +
  find "$1" -type f ! -perm -u+x -exec chmod 0644 {} +
  find "$1" -type f -perm -u+x -exec chmod 0755 {} +
  [ -d "$1/tmp" ] && chmod 1777 "$1/tmp"
  chown -R 0:0 "$1"
  find "$1" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
}

base_rootfs() { # <root>
  local root="$1"
  mkdir -p "$root"/{etc,tmp,run,proc,sys,dev,var,usr/share/crust}
  ln -s ../run "$root/var/run"
  # root and the system groups, from Debian's base-passwd templates.
  cp /usr/share/base-passwd/passwd.master "$root/etc/passwd"
  cp /usr/share/base-passwd/group.master "$root/etc/group"
}

rm -rf "$stage"
mkdir -p "$stage"

# --- crust-csi -------------------------------------------------------------
csi="$stage/crust-csi/rootfs"
base_rootfs "$csi"
packages_file="$stage/crust-csi/packages.list"
: >"$packages_file"
copy_elf_rootfs "$bindir/crust-csi" "$csi" /usr/bin/crust-csi
copy_elf_rootfs "$bindir/crustctl" "$csi" /usr/bin/crustctl
# Every tool crust_blockdev runs (fs_tools(): the plugin's Probe checks
# them; crates/crust-fs/tests/scripts.rs checks this list has every tool the
# FsSpecs name), plus what an operator uses in the container.
for t in mkfs.ext4 e2fsck resize2fs mkfs.xfs xfs_growfs xfs_repair wipefs blkid losetup mount umount lsblk findmnt; do
  copy_elf_rootfs "$(find_tool "$t")" "$csi" "/usr/sbin/$t"
done
cp /etc/mke2fs.conf "$csi/etc/mke2fs.conf"
note_pkg /etc/mke2fs.conf
write_packages "$csi" /usr/share/doc
echo "$tag" >"$csi/usr/share/crust/version"
normalise "$csi"

# --- node installer and its payload -----------------------------------------
inst="$stage/crust-node-installer/rootfs"
pl="$inst/usr/share/crust/payload"
base_rootfs "$inst"
packages_file="$stage/crust-node-installer/packages.list"
: >"$packages_file"
copy_elf_rootfs "$bindir/crust-node-install" "$inst" /usr/bin/crust-node-install
copy_elf_rootfs "$(find_tool nsenter)" "$inst" /usr/bin/nsenter
components=(crust-runtime qemu-system-x86_64 guest-image)
copy_elf_payload "$bindir/crust-runtime" "$pl" bin/crust-runtime
# The CLI sandboxes record for crust_ops' stats polls (execs crust-runtime
# next to it for every other verb). Static: no loader or library to
# rewrite; its glibc is Debian's libc6-dev.
mkdir -p "$pl/bin"
cp "$poll_cli" "$pl/bin/crust-runtime-poll"
chmod 0755 "$pl/bin/crust-runtime-poll"
libc_a="$(gcc -print-file-name=libc.a)"
[ -f "$libc_a" ] || { echo "build-images: libc.a not found (libc6-dev)" >&2; exit 1; }
note_pkg "$libc_a"
if [ "$has_shim" = 1 ]; then
  copy_elf_payload "$bindir/containerd-shim-crust-v2" "$pl" bin/containerd-shim-crust-v2
  components+=(containerd-shim-crust-v2)
  echo "build-images: payload includes containerd-shim-crust-v2"
else
  echo "build-images: containerd-shim-crust-v2 is not a workspace binary yet; payload without it"
fi
virtiofsd="$(command -v virtiofsd || true)"
for c in "$HOME/.cargo/bin/virtiofsd" /usr/libexec/virtiofsd /usr/lib/qemu/virtiofsd; do
  [ -z "$virtiofsd" ] && [ -x "$c" ] && virtiofsd="$c"
done
if [ -n "$virtiofsd" ]; then
  copy_elf_payload "$virtiofsd" "$pl" bin/virtiofsd
  components+=(virtiofsd)
  echo "build-images: payload includes virtiofsd from $virtiofsd"
else
  echo "build-images: virtiofsd not installed (cargo install virtiofsd); payload without it"
fi
# nft: the shim's anti-spoofing table and its reading of a pod
# namespace's rules (it looks next to itself first).
copy_elf_payload "$(find_tool nft)" "$pl" bin/nft
components+=(nft)
qemu="$(find_tool qemu-system-x86_64)"
copy_elf_payload "$qemu" "$pl" bin/qemu-system-x86_64
# Debian builds TCG as a module; QEMU loads modules from <bin>/../lib/<triplet>/qemu.
copy_so_payload /usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so "$pl" \
  lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so
# QEMU finds its firmware relative to its binary (<bin>/../share/qemu,
# ../share/seabios): the x86 files a q35 guest with direct kernel boot uses.
mkdir -p "$pl/share/qemu" "$pl/share/seabios"
for f in qboot.rom kvmvapic.bin linuxboot.bin linuxboot_dma.bin multiboot.bin multiboot_dma.bin pvh.bin; do
  [ -e "/usr/share/qemu/$f" ] && cp -L "/usr/share/qemu/$f" "$pl/share/qemu/$f" && note_pkg "/usr/share/qemu/$f"
done
for f in bios.bin bios-256k.bin; do
  cp -L "/usr/share/seabios/$f" "$pl/share/seabios/$f"
  note_pkg "/usr/share/seabios/$f"
done
mkdir -p "$pl/guest-image"
cp -L "$target_guest/vmlinuz" "$target_guest/initramfs.cpio.gz" "$pl/guest-image/"
mkdir -p "$pl/share/crust"
jq -n --arg v "$tag" --arg p "$prefix" --args '{version: $v, prefix: $p, components: $ARGS.positional}' \
  "${components[@]}" >"$pl/share/crust/payload.json"
mkdir -p "$inst/usr/share/crust"
write_packages "$inst" /usr/share/doc
cp "$inst/usr/share/crust/packages.txt" "$pl/share/crust/packages.txt"
cp -r "$inst/usr/share/doc" "$pl/share/doc"
echo "$tag" >"$inst/usr/share/crust/version"
normalise "$inst"

if [ "$stage_only" = 1 ]; then
  echo "build-images: staged $stage (no images written)"
  exit 0
fi

# --- OCI images ---------------------------------------------------------------
# <name> <rootfs> <umoci config args...>
build_image() {
  local name="$1" root="$2" layout="$stage/$1/oci"
  shift 2
  rm -rf "$layout"
  umoci init --layout "$layout"
  umoci new --image "$layout:$tag"
  umoci insert --image "$layout:$tag" --history.created "$created" \
    --history.author crust --history.created_by "scripts/build-images.sh" "$root" /
  umoci config --no-history --image "$layout:$tag" \
    --created "$created" --author "crust" --architecture amd64 --os linux \
    --config.user 0:0 \
    --config.env PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    --config.label "org.opencontainers.image.title=$name" \
    --config.label "org.opencontainers.image.version=$tag" \
    --config.label "org.opencontainers.image.licenses=Apache-2.0" \
    --manifest.annotation "org.opencontainers.image.version=$tag" \
    "$@"
  umoci gc --layout "$layout"
  # The name containerd gives the image on `ctr images import` (and the
  # one the manifests use): the full reference.
  local ref="$registry/$name:$tag" tmp
  tmp="$(mktemp)"
  jq -c --arg ref "$ref" \
    '.manifests |= map(.annotations["io.containerd.image.name"] = $ref)' \
    "$layout/index.json" >"$tmp"
  mv "$tmp" "$layout/index.json"
  find "$layout" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
  chmod -R u=rwX,go=rX "$layout"
  tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
    --format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    -C "$layout" -cf "$out/$name-$tag.oci.tar" .
  local digest
  digest="$(jq -r '.manifests[0].digest' "$layout/index.json")"
  # The archive's size, not its disk usage (du varies with the filesystem's
  # allocation, so two identical archives could report different sizes).
  local kib=$((($(stat -c %s "$out/$name-$tag.oci.tar") + 1023) / 1024))
  echo "$ref $digest ${kib}KiB" | tee -a "$out/images.txt"
}

: >"$out/images.txt"
build_image crust-csi "$csi" --config.entrypoint /usr/bin/crust-csi
build_image crust-node-installer "$inst" \
  --config.entrypoint /usr/bin/crust-node-install --config.cmd install --config.cmd --wait
