#!/usr/bin/env bash
# Builds the crust guest image from Debian packages and the crust-agent:
#   <out>/vmlinuz            the linux-image-cloud-amd64 kernel
#   <out>/initramfs.cpio.gz  busybox, fs tools, kernel modules, crust-agent
#   <out>/vmlinuz.config     the kernel's build config (the shim reads which
#                            address families the guest has from it)
# <out> is target/guest-image (or $CRUST_GUEST_DIR, or --out DIR).
# --bench builds the bench image instead (target/guest-image-bench, or
# $CRUST_GUEST_BENCH_DIR): the same plus Debian's fio with its libraries and
# the static crust-guest-bench helper (for `crustctl bench --guest-io`).
# Skips the rebuild when a sha256 over every input matches the stamp.
# Concurrent runs in one checkout are serialised (flock).
set -euo pipefail

usage() {
	cat <<'EOF'
usage: guest/build-image.sh [--bench] [--out DIR] [--force]
  --bench     the bench image: also fio (Debian's, with its libraries) and
              crust-guest-bench (default out: $CRUST_GUEST_BENCH_DIR or
              <repo>/target/guest-image-bench)
  --out DIR   output directory (default: $CRUST_GUEST_DIR or <repo>/target/guest-image)
  --force     rebuild even when the stamp matches
Needs the Debian packages linux-image-cloud-amd64 busybox-static e2fsprogs
xfsprogs cpio (and gzip), fio for --bench, plus cargo. The agent is built in
cargo's target directory. Runs wait for each other (flock on the target and
the output directory); the stamp is written only for a complete image.
EOF
}

die() {
	echo "build-image: error: $*" >&2
	exit 1
}
say() { echo "build-image: $*"; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=
FORCE=0
BENCH=0
while [ $# -gt 0 ]; do
	case $1 in
	--bench)
		BENCH=1
		shift
		;;
	--out)
		[ $# -ge 2 ] || die "--out needs a directory"
		OUT=$2
		shift 2
		;;
	--out=*)
		OUT=${1#--out=}
		shift
		;;
	--force)
		FORCE=1
		shift
		;;
	-h | --help)
		usage
		exit 0
		;;
	*)
		usage >&2
		die "unknown argument: $1"
		;;
	esac
done
if [ -z "$OUT" ]; then
	if [ "$BENCH" = 1 ]; then
		OUT=${CRUST_GUEST_BENCH_DIR:-$ROOT/target/guest-image-bench}
	else
		OUT=${CRUST_GUEST_DIR:-$ROOT/target/guest-image}
	fi
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

command -v cargo >/dev/null || die "cargo not found (needed to build crust-agent)"
command -v flock >/dev/null || die "flock not found: install the Debian package 'util-linux'"
# Where cargo puts the agent: cargo's own answer honours every way of
# setting it (CARGO_TARGET_DIR, .cargo/config, a wrapper).
TARGET_DIR=${CARGO_TARGET_DIR:-$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps |
	sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')}
[ -n "$TARGET_DIR" ] || die "cargo metadata named no target directory"
mkdir -p "$TARGET_DIR"

# One run at a time per target dir, then per output dir. Two --bench runs
# at once (the bench and test scripts) stamped an initramfs without the
# agent: one run moved the other's half-written initramfs.cpio.gz.tmp into
# place. And every image of a checkout copies the one agent binary, which
# a build under way replaces. Always in this order: runs never deadlock.
lock() {
	flock -n "$1" && return 0
	say "waiting for another build-image.sh (lock in $2)"
	flock "$1"
}
exec 8>"$TARGET_DIR/.build-image.lock"
lock 8 "$TARGET_DIR"
exec 9>"$OUT/.lock"
lock 9 "$OUT"

# Sbin dirs are not on every user's PATH.
export PATH="$PATH:/usr/sbin:/sbin"

# A file the image needs; missing means its package is not installed.
need() {
	[ -e "$1" ] || die "$1 is missing: install the Debian package '$2' (apt-get install -y $2)"
}
# Absolute path of a tool from a package.
tool() {
	local p
	p=$(command -v "$1" 2>/dev/null) || die "$1 not found: install the Debian package '$2' (apt-get install -y $2)"
	echo "$p"
}
pkg_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo "not-from-dpkg"; }

command -v cpio >/dev/null || die "cpio not found: install the Debian package 'cpio'"
command -v gzip >/dev/null || die "gzip not found: install the Debian package 'gzip'"

# --- kernel -----------------------------------------------------------------
KVER=${CRUST_GUEST_KERNEL_VERSION:-}
if [ -z "$KVER" ]; then
	# The metapackage names the exact kernel it pulls in.
	KVER=$(dpkg-query -W -f='${Depends}' linux-image-cloud-amd64 2>/dev/null |
		grep -o 'linux-image-[^ ,(]*-cloud-amd64' | head -n1 | sed 's/^linux-image-//' || true)
fi
if [ -z "$KVER" ]; then
	KVER=$(find /boot -maxdepth 1 -name 'vmlinuz-*-cloud-amd64' 2>/dev/null |
		sed 's|.*/vmlinuz-||' | sort -V | tail -n1)
fi
[ -n "$KVER" ] || die "no cloud kernel found: install the Debian package 'linux-image-cloud-amd64'"
VMLINUZ=/boot/vmlinuz-$KVER
MODDIR=/lib/modules/$KVER
need "$VMLINUZ" linux-image-cloud-amd64
need "$MODDIR/modules.dep" linux-image-cloud-amd64
KCONFIG=/boot/config-$KVER

# --- user space from packages ---------------------------------------------------
BUSYBOX=/bin/busybox
need "$BUSYBOX" busybox-static
if ldd "$BUSYBOX" 2>&1 | grep -q '=>'; then
	die "$BUSYBOX is dynamically linked: install the Debian package 'busybox-static'"
fi
E2FSCK=$(tool e2fsck e2fsprogs)
RESIZE2FS=$(tool resize2fs e2fsprogs)
XFS_GROWFS=$(tool xfs_growfs xfsprogs)
# iptables-restore (its nftables backend) for a pod namespace's rules
# carried into the guest (CRUST_SHIM_NETNS_RULES=guest), with the
# extensions it loads at run time (-m owner, -j REDIRECT...).
XTABLES=$(tool xtables-nft-multi iptables)
XTABLES_EXT=/usr/lib/x86_64-linux-gnu/xtables
need "$XTABLES_EXT/libxt_REDIRECT.so" iptables
FIO=
if [ "$BENCH" = 1 ]; then
	FIO=$(tool fio fio)
fi

# --- agent --------------------------------------------------------------------
TRIPLE=x86_64-unknown-linux-gnu
PACKAGES=(-p crust-agent)
[ "$BENCH" = 1 ] && PACKAGES+=(-p crust-guest-bench)
# The agent compiles containers' seccomp profiles with libseccomp: its
# static library links into the static binary.
LIBSECCOMP_A=/usr/lib/x86_64-linux-gnu/libseccomp.a
need "$LIBSECCOMP_A" libseccomp-dev
say "building ${PACKAGES[*]} (static glibc and libseccomp, profile agent)"
(
	cd "$ROOT"
	# --target keeps build scripts and proc macros off the static flag.
	RUSTFLAGS="-C target-feature=+crt-static" \
		LIBSECCOMP_LINK_TYPE=static LIBSECCOMP_LIB_PATH=$(dirname "$LIBSECCOMP_A") \
		cargo build --quiet --profile agent "${PACKAGES[@]}" --target "$TRIPLE"
)
AGENT=$TARGET_DIR/$TRIPLE/agent/crust-agent
HELPER=
[ "$BENCH" = 1 ] && HELPER=$TARGET_DIR/$TRIPLE/agent/crust-guest-bench
for b in "$AGENT" $HELPER; do
	[ -x "$b" ] || die "cargo did not produce $b"
	if ldd "$b" 2>&1 | grep -q '=>'; then
		die "$b is dynamically linked (is libc6-dev installed? it provides libc.a)"
	fi
done

# --- kernel modules -------------------------------------------------------------
# Loaded by /init: the disk, console, NIC and hot-plug drivers. virtio_net
# is there before the agent starts (it finds the pod's NICs by MAC) and
# brings failover and net_failover as its dependencies. virtio_balloon
# reports freed guest pages, which the host then takes back.
BOOT_MODULES="virtio_ring virtio virtio_pci virtio_blk virtio_console virtio_net virtio_balloon"
# PCI hot-plug: built in on Debian's cloud kernel; taken along if modular.
HOTPLUG_MODULES="pciehp acpiphp"
# Filesystems, loaded by the agent on first mount (xfs.ko alone costs over a
# second of boot under TCG). Built-in ones need nothing.
FS_MODULES="ext4 xfs virtiofs"
# Netfilter, loaded by the agent before it applies carried rules: the
# nftables core and what iptables-nft's common rules need (NAT and
# REDIRECT, conntrack state, owner, mark, multiport, addrtype, comment,
# REJECT, LOG). Dependencies (nf_conntrack, nf_nat...) come along.
NF_MODULES="nf_tables nft_compat nft_chain_nat nft_nat nft_redir nft_masq nft_ct nft_reject_inet
	nft_limit x_tables xt_tcpudp xt_REDIRECT xt_owner xt_mark xt_conntrack xt_multiport
	xt_addrtype xt_comment xt_LOG ipt_REJECT ip6t_REJECT xt_nat"
# Network devices a container with NET_ADMIN may make, loaded on demand by
# the kernel through the image's /sbin/modprobe (the agent binary), as on
# a host: bridges, veth pairs, tun/tap, dummies, VXLAN, MACVLAN/IPVLAN,
# VLANs; and nftables' fib lookups and the bridge's netfilter hooks.
NET_MODULES="bridge veth tun dummy vxlan macvlan ipvlan 8021q nft_fib_inet br_netfilter"

norm() { echo "$1" | tr '-' '_'; }
declare -A MODPATH MODDEPS BUILTIN
# One awk pass (not a subshell per line): "name path dep-names...".
modname_awk='function mod(p) { sub(/.*\//, "", p); sub(/\.ko.*/, "", p); gsub(/-/, "_", p); return p }'
while read -r name rel deps; do
	MODPATH[$name]=$rel
	MODDEPS[$name]=$deps
done < <(awk "$modname_awk"'
	{ rel = $1; sub(/:$/, "", rel); line = mod(rel) " " rel
	  for (i = 2; i <= NF; i++) line = line " " mod($i)
	  print line }' "$MODDIR/modules.dep")
if [ -f "$MODDIR/modules.builtin" ]; then
	while read -r name; do BUILTIN[$name]=1; done < <(awk "$modname_awk"'{ print mod($1) }' "$MODDIR/modules.builtin")
fi

declare -A SEEN
ORDER=()
# Depth-first: dependencies before the module (virtio_ring before virtio).
visit() {
	local m=$1 d
	[ -n "${SEEN[$m]:-}" ] && return 0
	SEEN[$m]=1
	for d in ${MODDEPS[$m]}; do visit "$d"; done
	ORDER+=("$m")
}
# Module or built in; anything else means the kernel package changed.
require_module() {
	local m
	m=$(norm "$1")
	if [ -n "${MODPATH[$m]:-}" ]; then
		visit "$m"
	elif [ -z "${BUILTIN[$m]:-}" ]; then
		die "kernel module $m is neither in $MODDIR/modules.dep nor built in (linux-image-cloud-amd64 changed?)"
	fi
}
for m in $BOOT_MODULES; do require_module "$m"; done
for m in $HOTPLUG_MODULES; do
	m=$(norm "$m")
	[ -n "${MODPATH[$m]:-}" ] && visit "$m"
done
BOOT_ORDER=("${ORDER[@]}")
declare -A BOOT_SEEN FS_ORDER
for k in "${!SEEN[@]}"; do BOOT_SEEN[$k]=1; done
for fs in $FS_MODULES; do
	# Each list stands alone: shared dependencies appear in both.
	SEEN=()
	for k in "${!BOOT_SEEN[@]}"; do SEEN[$k]=1; done
	ORDER=()
	require_module "$fs"
	FS_ORDER[$fs]="${ORDER[*]}"
done
SEEN=()
for k in "${!BOOT_SEEN[@]}"; do SEEN[$k]=1; done
ORDER=()
for m in $NF_MODULES; do require_module "$m"; done
NF_ORDER="${ORDER[*]}"
for m in $NET_MODULES; do require_module "$m"; done
# Everything the network payload holds (netfilter first).
PAYLOAD_ORDER="${ORDER[*]}"
ALL_MODULES="${BOOT_ORDER[*]}"
for fs in $FS_MODULES; do ALL_MODULES="$ALL_MODULES ${FS_ORDER[$fs]}"; done
ALL_MODULES="$ALL_MODULES | netfilter $NF_ORDER | network $PAYLOAD_ORDER"
if [ -f "$KCONFIG" ] && ! grep -Eq '^CONFIG_HOTPLUG_PCI_(PCIE|ACPI)=[ym]' "$KCONFIG"; then
	die "$KCONFIG has neither PCIe nor ACPI PCI hot-plug"
fi

# --- cache key -------------------------------------------------------------------
AGENT_SUM=$(sha256sum <"$AGENT")
KEY=$(
	{
		echo "format 1"
		sha256sum "${BASH_SOURCE[0]}" "$AGENT" "$VMLINUZ" | cut -d' ' -f1
		echo "kernel $KVER $(pkg_version "linux-image-$KVER")"
		for p in busybox-static e2fsprogs xfsprogs libc6 liburcu8 iptables libnftnl11 libmnl0; do echo "$p $(pkg_version $p)"; done
		if [ "$BENCH" = 1 ]; then
			# fio's libraries come from many packages: hash what ldd resolves.
			echo "bench $(pkg_version fio)"
			sha256sum "$HELPER" "$FIO" $(ldd "$FIO" | awk '/=> \//{print $3}') | cut -d' ' -f1
		fi
		echo "modules ${BOOT_ORDER[*]} | ${ALL_MODULES}"
	} | sha256sum | cut -d' ' -f1
)
STAMP=$OUT/.stamp
if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] &&
	[ -f "$OUT/vmlinuz" ] && [ -f "$OUT/initramfs.cpio.gz" ]; then
	say "up to date in $OUT (key ${KEY:0:12}); nothing rebuilt"
	exit 0
fi

# --- stage the root filesystem --------------------------------------------------
# No stamp while the image is replaced: an interrupted run leaves none.
rm -f "$STAMP"
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/crust-guest-image.XXXXXX")
# mktemp makes it 0700; it becomes the guest's /.
chmod 755 "$STAGE"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,sbin,usr/bin,usr/sbin,lib,lib64,etc,proc,sys,dev,run,tmp,mnt,root,lib/modules}
chmod 1777 "$STAGE/tmp"

cp "$BUSYBOX" "$STAGE/bin/busybox"
for applet in $("$BUSYBOX" --list); do
	[ -e "$STAGE/bin/$applet" ] || ln -s busybox "$STAGE/bin/$applet"
done

# Copies a dynamically linked program and the libraries ldd names (into
# $3, default the image's root; libraries the image has are not copied).
add_prog() {
	local src=$1 dst=$2 root=${3:-$STAGE} lib
	mkdir -p "$root$(dirname "$dst")"
	cp -L "$src" "$root$dst"
	for lib in $(ldd "$src" | awk '/=> \//{print $3} /^\t\/lib/{print $1}'); do
		if [ ! -e "$STAGE$lib" ] && [ ! -e "$root$lib" ]; then
			mkdir -p "$root$(dirname "$lib")"
			cp -L "$lib" "$root$lib"
		fi
	done
}
add_prog "$E2FSCK" /usr/sbin/e2fsck
add_prog "$RESIZE2FS" /usr/sbin/resize2fs
add_prog "$XFS_GROWFS" /usr/sbin/xfs_growfs
# The network payload (iptables, the netfilter modules and the network
# device modules) is staged apart and packed into the image as one archive
# of its own, unpacked only when a pod's carried rules or the kernel's
# first module request need it: inflating it at every boot cost about
# 0.6 s under TCG.
NFSTAGE=$(mktemp -d "${TMPDIR:-/tmp}/crust-guest-nf.XXXXXX")
trap 'rm -rf "$STAGE" "$NFSTAGE"' EXIT
add_prog "$XTABLES" /usr/sbin/xtables-nft-multi "$NFSTAGE"
for a in iptables iptables-restore iptables-save ip6tables ip6tables-restore ip6tables-save; do
	ln -s xtables-nft-multi "$NFSTAGE/usr/sbin/$a"
done
for so in "$XTABLES_EXT"/*.so; do
	add_prog "$so" "$so" "$NFSTAGE"
done
cp "$AGENT" "$STAGE/usr/sbin/crust-agent"
# The image holds the agent the key names (not one rebuilt since).
[ "$(sha256sum <"$STAGE/usr/sbin/crust-agent")" = "$AGENT_SUM" ] ||
	die "$AGENT changed while the image was built; run again"
if [ "$BENCH" = 1 ]; then
	add_prog "$FIO" /usr/bin/fio
	cp "$HELPER" "$STAGE/usr/sbin/crust-guest-bench"
	# Proof that fio runs on the image's libraries alone (same loader paths).
	chroot "$STAGE" /usr/bin/fio --version >/dev/null 2>&1 ||
		die "fio does not start on the image's libraries: $(chroot "$STAGE" /usr/bin/fio --version 2>&1 | head -n 3)"
fi

# Decompressed here so the guest needs no xz/zstd (into $2, default the
# image's root).
add_module() {
	local m=$1 src=$MODDIR/${MODPATH[$1]} root=${2:-$STAGE}
	mkdir -p "$root/lib/modules"
	case $src in
	*.ko) cp "$src" "$root/lib/modules/$m.ko" ;;
	*.ko.xz) xz -dc "$src" >"$root/lib/modules/$m.ko" ;;
	*.ko.zst) zstd -qdc "$src" >"$root/lib/modules/$m.ko" ;;
	*.ko.gz) gzip -dc "$src" >"$root/lib/modules/$m.ko" ;;
	*) die "unknown module format: $src" ;;
	esac
}
# /etc/modules.load: loaded by /init, in order. /etc/modules.d/<fs>: loaded
# in order by the agent before the first mount of <fs> (empty: built in).
mkdir -p "$STAGE/etc/modules.d"
: >"$STAGE/etc/modules.load"
for m in "${BOOT_ORDER[@]}"; do
	add_module "$m"
	echo "$m" >>"$STAGE/etc/modules.load"
done
for fs in $FS_MODULES; do
	: >"$STAGE/etc/modules.d/$fs"
	for m in ${FS_ORDER[$fs]}; do
		add_module "$m"
		echo "$m" >>"$STAGE/etc/modules.d/$fs"
	done
done
mkdir -p "$NFSTAGE/etc/modules.d"
: >"$NFSTAGE/etc/modules.d/netfilter"
for m in $NF_ORDER; do
	echo "$m" >>"$NFSTAGE/etc/modules.d/netfilter"
done
for m in $PAYLOAD_ORDER; do
	[ -e "$STAGE/lib/modules/$m.ko" ] || add_module "$m" "$NFSTAGE"
done
# The indexes of the image's /sbin/modprobe (crust-agent run under that
# name; the kernel runs it for a module it lacks): each module's load
# order, and depmod's aliases for the modules the image has.
declare -A IN_IMAGE
for m in "${BOOT_ORDER[@]}" $PAYLOAD_ORDER; do IN_IMAGE[$m]=1; done
for fs in $FS_MODULES; do for m in ${FS_ORDER[$fs]}; do IN_IMAGE[$m]=1; done; done
for m in $(printf '%s\n' "${!IN_IMAGE[@]}" | LC_ALL=C sort); do
	SEEN=()
	ORDER=()
	visit "$m"
	echo "$m ${ORDER[*]}"
done >"$STAGE/etc/modules.order"
awk "$modname_awk"'
	NR == FNR { want[$1] = 1; next }
	$1 == "alias" && (mod($3) in want) { print "alias " $2 " " mod($3) }' \
	<(printf '%s\n' "${!IN_IMAGE[@]}") "$MODDIR/modules.alias" >"$STAGE/etc/modules.alias"
grep -q ' bridge$' "$STAGE/etc/modules.alias" || die "$MODDIR/modules.alias names no alias of bridge"
ln -s /usr/sbin/crust-agent "$STAGE/sbin/modprobe"
# Proof that iptables runs on the image's libraries plus the payload's.
NFCHECK=$(mktemp -d "${TMPDIR:-/tmp}/crust-guest-nfcheck.XXXXXX")
cp -a "$STAGE/." "$NFSTAGE/." "$NFCHECK/" 2>/dev/null || { cp -a "$STAGE/." "$NFCHECK/"; cp -a "$NFSTAGE/." "$NFCHECK/"; }
if ! chroot "$NFCHECK" /usr/sbin/iptables --version >/dev/null 2>&1; then
	why=$(chroot "$NFCHECK" /usr/sbin/iptables --version 2>&1 | head -n 3)
	rm -rf "$NFCHECK"
	die "iptables does not start on the image's libraries: $why"
fi
rm -rf "$NFCHECK"
mkdir -p "$STAGE/usr/lib/crust"
(
	cd "$NFSTAGE"
	find . -print0 | LC_ALL=C sort -z |
		cpio --null --create --format=newc --owner=0:0 --reproducible --quiet
) | gzip -9 -n >"$STAGE/usr/lib/crust/network.cpio.gz"

ln -s /proc/self/mounts "$STAGE/etc/mtab"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$STAGE/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$STAGE/etc/group"
# The kernel opens /dev/console before devtmpfs is mounted.
mknod -m 600 "$STAGE/dev/console" c 5 1 2>/dev/null || true

cat >"$STAGE/init" <<'EOF'
#!/bin/sh
# crust guest init. Stays PID 1 (reaping orphans while it waits) and keeps
# crust-agent running; the agent powers the VM off on Shutdown.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# First, on the kernel's initramfs: move the image onto a tmpfs and make
# that the root. The initramfs (rootfs) is the root of every mount
# namespace and can never be pivoted away from, so on it a container could
# only be chrooted, and a chroot is left through `..`. From a tmpfs root
# each container pivot_roots into its rootfs and detaches the guest's tree,
# as runc does (docs/security.md). Each entry is removed once copied, so
# the image is held twice only one top-level directory at a time; /bin
# goes first and its copy serves the rest. /init stays: switch_root takes
# it as the proof that it is leaving an initramfs, then frees the rest.
if [ ! -e /.crust-root ]; then
	mount -t tmpfs -o mode=0755 root /mnt || { echo "init: no tmpfs for the root; powering off"; poweroff -f; }
	cp -a /bin /mnt/ && rm -rf /bin
	export PATH=/mnt/bin
	for e in /* /.[!.]*; do
		case $e in /mnt | /proc | /sys | /dev | '/.[!.]*') continue ;; esac
		if ! cp -a "$e" /mnt/; then
			echo "init: copying $e to the tmpfs root failed (too little guest memory?); powering off"
			poweroff -f
		fi
		[ "$e" = /init ] || rm -rf "$e"
	done
	mkdir -p /mnt/proc /mnt/sys /mnt/dev /mnt/mnt
	: >/mnt/.crust-root
	exec switch_root /mnt /init
fi
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mount -t devtmpfs -o nosuid devtmpfs /dev
exec </dev/null >/dev/console 2>&1
mkdir -p /dev/pts /dev/shm /run/crust
mount -t tmpfs -o nosuid,nodev tmpfs /tmp
while read -r m; do
	insmod "/lib/modules/$m.ko" || echo "init: loading module $m failed"
done </etc/modules.load
hostname crust
if [ ! -x /usr/sbin/crust-agent ]; then
	# The kernel unpacks the initramfs into RAM and goes on after a write
	# error: a guest with too little memory for the image lacks its last files.
	echo "init: /usr/sbin/crust-agent is missing: the initramfs did not unpack whole (too little guest memory for this image?); powering off"
	poweroff -f
fi
echo "init: modules loaded, starting crust-agent"
while :; do
	/usr/sbin/crust-agent
	echo "init: crust-agent exited ($?); restarting"
	sleep 1
done
EOF
chmod 755 "$STAGE/init"

# --- pack -------------------------------------------------------------------------
(
	cd "$STAGE"
	find . -print0 | LC_ALL=C sort -z |
		cpio --null --create --format=newc --owner=0:0 --reproducible --quiet
) | gzip -9 -n >"$OUT/initramfs.cpio.gz.tmp"
cp "$VMLINUZ" "$OUT/vmlinuz.tmp"
if [ -f "$KCONFIG" ]; then cp "$KCONFIG" "$OUT/vmlinuz.config.tmp"; fi
# Stamped only once the packed image is complete: it lists every program
# the guest runs.
LISTING=$(gzip -dc "$OUT/initramfs.cpio.gz.tmp" | cpio -t --quiet) ||
	die "the packed initramfs does not read back"
for f in init usr/sbin/crust-agent bin/busybox bin/switch_root ${HELPER:+usr/sbin/crust-guest-bench}; do
	grep -qx "\(\./\)\?$f" <<<"$LISTING" || die "the packed initramfs lacks $f"
done
mv -f "$OUT/initramfs.cpio.gz.tmp" "$OUT/initramfs.cpio.gz"
mv -f "$OUT/vmlinuz.tmp" "$OUT/vmlinuz"
if [ -f "$OUT/vmlinuz.config.tmp" ]; then mv -f "$OUT/vmlinuz.config.tmp" "$OUT/vmlinuz.config"; fi
echo "$KEY" >"$STAMP.tmp"
mv -f "$STAMP.tmp" "$STAMP"

say "built $OUT (key ${KEY:0:12})"
say "  kernel   $KVER  $(du -h "$OUT/vmlinuz" | cut -f1)"
say "  initrd   $(du -h "$OUT/initramfs.cpio.gz" | cut -f1) compressed, $(du -sh "$STAGE" | cut -f1) unpacked"
say "  agent    $(du -h "$AGENT" | cut -f1) ($AGENT)"
if [ "$BENCH" = 1 ]; then
	say "  bench    $("$FIO" --version) with $(ldd "$FIO" | grep -c '=> /') libraries, crust-guest-bench $(du -h "$HELPER" | cut -f1)"
fi
say "  modules  boot: ${BOOT_ORDER[*]}"
for fs in $FS_MODULES; do say "           on first $fs mount: ${FS_ORDER[$fs]:-(built in)}"; done
say "           for carried netfilter rules: $NF_ORDER"
say "           on demand (/sbin/modprobe), unpacked on first use: $PAYLOAD_ORDER"
