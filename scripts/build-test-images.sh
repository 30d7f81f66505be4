#!/usr/bin/env bash
# Builds the container images the containerd tests import, offline, from
# Debian packages (no registry):
#   <out>/busybox.tar  OCI layout: busybox-static with every applet linked in
#                      /bin, plus Debian's iputils `ping` (busybox's has no
#                      `-M do`) and `iperf3` in /usr/bin with the libraries
#                      ldd names, and crust-escape (scripts/test-images/
#                      escape.c, static: the confinement tests' break-out
#                      attempts); cmd ["sh"]; ref crust.test/busybox:latest
#   <out>/pause.tar    OCI layout: busybox-static as /bin/sleep, entrypoint
#                      ["/bin/sleep", "infinity"]; ref crust.test/pause:latest
#   <out>/webserver.tar OCI layout: the busybox image's files plus /www, whose
#                      index.html busybox httpd serves on port 80 (the
#                      entrypoint): critest's web-server image stand-in;
#                      ref crust.test/webserver:latest
# Import with `ctr images import <tar>` (the ref name is in index.json).
# <out> is target/test-images (or $CRUST_TEST_IMAGES_DIR, or --out DIR).
# Skips the rebuild when a sha256 over every input matches the stamp.
set -euo pipefail

die() {
	echo "build-test-images: error: $*" >&2
	exit 1
}
say() { echo "build-test-images: $*"; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${CRUST_TEST_IMAGES_DIR:-$ROOT/target/test-images}
FORCE=0
while [ $# -gt 0 ]; do
	case $1 in
	--out)
		[ $# -ge 2 ] || die "--out needs a directory"
		OUT=$2
		shift 2
		;;
	--force)
		FORCE=1
		shift
		;;
	-h | --help)
		echo "usage: scripts/build-test-images.sh [--out DIR] [--force]"
		echo "Needs the Debian packages busybox-static, umoci, iputils-ping and iperf3."
		exit 0
		;;
	*) die "unknown argument: $1" ;;
	esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

BUSYBOX=/bin/busybox
[ -x "$BUSYBOX" ] || die "$BUSYBOX missing: apt-get install -y busybox-static"
if ldd "$BUSYBOX" 2>&1 | grep -q '=>'; then
	die "$BUSYBOX is dynamically linked: apt-get install -y busybox-static"
fi
command -v umoci >/dev/null || die "umoci not found: apt-get install -y umoci"
PING=/usr/bin/ping
IPERF3=/usr/bin/iperf3
[ -x "$PING" ] || die "$PING missing: apt-get install -y iputils-ping"
[ -x "$IPERF3" ] || die "$IPERF3 missing: apt-get install -y iperf3"
ESCAPE_SRC=$ROOT/scripts/test-images/escape.c
command -v gcc >/dev/null || die "gcc not found: apt-get install -y gcc libc6-dev"
# The loader and every library ldd resolves for PROG.
libs_of() { ldd "$1" | awk '/=> \//{print $3} /^\t\/lib/{print $1}'; }
pkg_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo "not-from-dpkg"; }

KEY=$(
	{
		echo "format 4"
		echo "gcc $(gcc -dumpfullversion) libc6-dev $(pkg_version libc6-dev)"
		sha256sum "${BASH_SOURCE[0]}" "$BUSYBOX" "$PING" "$IPERF3" "$ESCAPE_SRC" \
			$(libs_of "$PING") $(libs_of "$IPERF3") | cut -d' ' -f1
		echo "umoci $(pkg_version umoci)"
	} | sha256sum | cut -d' ' -f1
)
STAMP=$OUT/.stamp
if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] &&
	[ -f "$OUT/busybox.tar" ] && [ -f "$OUT/pause.tar" ] && [ -f "$OUT/webserver.tar" ]; then
	say "up to date in $OUT (key ${KEY:0:12})"
	exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/crust-test-images.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# image NAME REF_NAME SETUP_FN CONFIG_ARGS...: one single-layer OCI layout,
# tarred to $OUT/NAME.tar, tagged REF_NAME in index.json.
image() {
	local name=$1 ref=$2 setup=$3
	shift 3
	local layout=$WORK/$name-oci bundle=$WORK/$name-bundle
	umoci init --layout "$layout"
	umoci new --image "$layout:latest"
	umoci unpack --image "$layout:latest" "$bundle" >/dev/null
	"$setup" "$bundle/rootfs"
	umoci repack --image "$layout:latest" "$bundle"
	umoci config --image "$layout:latest" \
		--config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
		--author crust --os linux --architecture amd64 "$@"
	# Full reference in the index annotation: `ctr images import` names the
	# image by it.
	umoci tag --image "$layout:latest" "$ref"
	umoci rm --image "$layout:latest"
	umoci gc --layout "$layout"
	tar -C "$layout" --owner=0 --group=0 --numeric-owner --sort=name --mtime=@0 -cf "$OUT/$name.tar.tmp" .
	mv -f "$OUT/$name.tar.tmp" "$OUT/$name.tar"
	say "built $OUT/$name.tar ($ref, $(du -h "$OUT/$name.tar" | cut -f1))"
}

# add_prog PROG ROOTFS: PROG into ROOTFS/usr/bin, its libraries at their
# own paths (the loader's search finds them there too).
add_prog() {
	local prog=$1 r=$2 lib
	mkdir -p "$r/usr/bin"
	cp "$prog" "$r/usr/bin/"
	for lib in $(libs_of "$prog"); do
		mkdir -p "$r$(dirname "$lib")"
		cp -L "$lib" "$r$lib"
	done
	chroot "$r" "/usr/bin/$(basename "$prog")" --version >/dev/null 2>&1 ||
		chroot "$r" "/usr/bin/$(basename "$prog")" -V >/dev/null 2>&1 ||
		die "$prog does not start on the image's libraries"
}

setup_busybox() {
	local r=$1 a
	mkdir -p "$r"/{bin,etc,tmp,root,proc,sys,dev,run,var,data}
	chmod 1777 "$r/tmp"
	cp "$BUSYBOX" "$r/bin/busybox"
	for a in $("$BUSYBOX" --list); do
		[ -e "$r/bin/$a" ] || ln -s busybox "$r/bin/$a"
	done
	# Before busybox's /bin on the image's PATH. Copied without ping's file
	# capability: the tests' containers run as root with CAP_NET_RAW.
	add_prog "$PING" "$r"
	add_prog "$IPERF3" "$r"
	gcc -static -O2 -Wall -Werror -o "$r/usr/bin/crust-escape" "$ESCAPE_SRC"
	printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$r/etc/passwd"
	printf 'root:x:0:\nnogroup:x:65534:\n' >"$r/etc/group"
}

setup_pause() {
	local r=$1
	mkdir -p "$r"/{bin,proc,sys,dev,etc}
	cp "$BUSYBOX" "$r/bin/sleep"
}

setup_webserver() {
	setup_busybox "$1"
	mkdir -p "$1/www"
	echo '<html><body>crust test web server</body></html>' >"$1/www/index.html"
}

image busybox "crust.test/busybox:latest" setup_busybox --config.cmd sh
image webserver "crust.test/webserver:latest" setup_webserver \
	--config.entrypoint /bin/httpd --config.entrypoint=-f --config.entrypoint=-p \
	--config.entrypoint 80 --config.entrypoint=-h --config.entrypoint /www \
	--config.exposedports 80/tcp
image pause "crust.test/pause:latest" setup_pause \
	--config.entrypoint /bin/sleep --config.cmd infinity

echo "$KEY" >"$STAMP.tmp"
mv -f "$STAMP.tmp" "$STAMP"
