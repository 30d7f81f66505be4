#!/usr/bin/env bash
# Concurrent guest/build-image.sh runs in one checkout (the benchmark script
# and the test script at once stamped an initramfs that lacked the agent):
# two --bench runs into one output and a plain run beside them, all forced,
# all at once. Every run must succeed, and each image must hold what its
# guest runs and be the one its stamp names. Run by scripts/test.sh after
# the images are built (the agent is then built already: ~20 s).
# BUILD_IMAGE=path tests another copy of the script.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_IMAGE=${BUILD_IMAGE:-$ROOT/guest/build-image.sh}
T=$(mktemp -d "${TMPDIR:-/tmp}/crust-image-race.XXXXXX")
trap 'rm -rf "$T"' EXIT
fail() {
	echo "test-build-image-race: FAIL: $*" >&2
	exit 1
}

start=$(date +%s)
pids=()
bash "$BUILD_IMAGE" --bench --force --out "$T/bench" >"$T/bench-1.log" 2>&1 &
pids+=($!)
bash "$BUILD_IMAGE" --bench --force --out "$T/bench" >"$T/bench-2.log" 2>&1 &
pids+=($!)
bash "$BUILD_IMAGE" --force --out "$T/plain" >"$T/plain.log" 2>&1 &
pids+=($!)
logs=(bench-1 bench-2 plain)
for i in 0 1 2; do
	wait "${pids[$i]}" || fail "run ${logs[$i]} failed: $(tail -n 5 "$T/${logs[$i]}.log")"
done

# The image's programs (the cpio list) and its stamp: a run now finds it up
# to date, so the stamp was written for these very files.
check() {
	local out=$1 listing f
	shift
	listing=$(gzip -dc "$out/initramfs.cpio.gz" | cpio -t --quiet) ||
		fail "$out/initramfs.cpio.gz does not unpack"
	for f in init bin/busybox usr/sbin/crust-agent "$@"; do
		grep -qx "\(\./\)\?$f" <<<"$listing" || fail "$out/initramfs.cpio.gz lacks $f"
	done
	[ -s "$out/vmlinuz" ] || fail "$out/vmlinuz missing"
}
check "$T/bench" usr/sbin/crust-guest-bench usr/bin/fio
check "$T/plain"
bash "$BUILD_IMAGE" --bench --out "$T/bench" | grep -q "up to date" || fail "bench stamp does not match its image"
bash "$BUILD_IMAGE" --out "$T/plain" | grep -q "up to date" || fail "plain stamp does not match its image"
echo "test-build-image-race: 3 concurrent runs (2 --bench into one output, 1 plain) passed in $(($(date +%s) - start)) s"
