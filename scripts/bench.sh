#!/usr/bin/env bash
# Benchmarks crust-csi with crustctl's driver-agnostic CSI load generator.
#   scripts/bench.sh             standard CSI calls against a fresh plugin
#   scripts/bench.sh --deferred  stats/resize through crust_ops and a guest
#   scripts/bench.sh --scale     node scale: uncached stats (health cache
#                                off) at 16, 256 and 1024 published volumes,
#                                then every scenario with 256 idle foreign
#                                loop devices held
#   scripts/bench.sh --guest-io  in-guest fio: virtio-blk volume vs virtio-fs
# Extra arguments go to `crustctl bench`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "the benchmark needs root (loop devices, mounts, QEMU): run as root" >&2
  exit 1
fi
bash scripts/install-deps.sh --if-missing
cargo build --release --workspace --bins --locked
bash guest/build-image.sh
if [ "${1:-}" = "--guest-io" ]; then bash guest/build-image.sh --bench; fi

work=$(mktemp -d /var/tmp/crust-bench.XXXXXX)
csi_pid=
cleanup() {
  if [ -n "$csi_pid" ]; then kill "$csi_pid" 2>/dev/null || true; wait "$csi_pid" 2>/dev/null || true; fi
  # Never through a mount point a failed teardown may have left.
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT INT TERM
mkdir -p "$work/pool" "$work/state" "$work/stage" "$work/target" "$work/crust" "$work/runtime"

export CRUST_RUNTIME_ROOT="$work/runtime" CRUST_RUNTIME_CRUST_ROOT="$work/crust"
plugin_extra=(--pool-capacity 8Gi)
# Uncached figures: every stats call does the real work.
[ "${1:-}" = "--scale" ] && plugin_extra=(--pool-capacity 64Gi --health-ttl 0s)
target/release/crust-csi --endpoint "unix://$work/csi.sock" --node-id bench \
  --state-dir "$work/state" --backend pool --pool-dir "$work/pool" \
  --crust-root "$work/crust" --log-level warn "${plugin_extra[@]}" &
csi_pid=$!
for _ in $(seq 50); do [ -S "$work/csi.sock" ] && break; sleep 0.1; done

ctl=(target/release/crustctl --endpoint "unix://$work/csi.sock" bench)
# Defaults the caller's own --duration/--ops/--concurrency replace.
limits() {
  local d=$1 c=$2 a
  for a in "${@:3}"; do
    case $a in --duration|--duration=*|--ops|--ops=*) d=;; --concurrency|--concurrency=*) c=;; esac
  done
  [ -n "$d" ] && printf '%s\n' --duration "$d"
  [ -n "$c" ] && printf '%s\n' --concurrency "$c"
  return 0
}
# The runtime as it ships unless the caller names one: crust-runtime with
# its static per-poll CLI next to it (what sandboxes record for kubelet's
# polls), in target/bench-bin so the guest image is found at ../guest-image.
shipped_runtime=()
ship_runtime() {
  local a poll
  for a in "$@"; do case $a in --runtime|--runtime=*) return 0;; esac; done
  poll="$(bash scripts/build-poll-cli.sh)"
  mkdir -p target/bench-bin
  cp target/release/crust-runtime target/bench-bin/crust-runtime
  cp "$poll" target/bench-bin/crust-runtime-poll
  shipped_runtime=(--runtime "$PWD/target/bench-bin/crust-runtime")
}
if [ "${1:-}" = "--deferred" ]; then
  shift
  ship_runtime "$@"
  # One pod in a guest; deferred stats and expansions through crust_ops.
  "${ctl[@]}" --deferred --work-dir "$work/kubelet" --runtime-root "$work/runtime" \
    --crust-root "$work/crust" "${shipped_runtime[@]}" $(limits 10s 2 "$@") "$@"
elif [ "${1:-}" = "--scale" ]; then
  shift
  "${ctl[@]}" --staging-dir "$work/stage" --target-dir "$work/target" \
    --scenarios stats --stats-volumes 16,256,1024 --size 16Mi \
    $(limits 10s 4 "$@") "$@"
  "${ctl[@]}" --staging-dir "$work/stage" --target-dir "$work/target" \
    --idle-loops 256 --size 16Mi $(limits 10s 4 "$@") "$@"
elif [ "${1:-}" = "--guest-io" ]; then
  shift
  # One guest, a deferred volume and a virtio-fs shared one; the bench
  # image is found next to the binaries (target/guest-image-bench).
  "${ctl[@]}" --guest-io --work-dir "$work/kubelet" --runtime-root "$work/runtime" \
    --crust-root "$work/crust" "$@"
else
  "${ctl[@]}" --staging-dir "$work/stage" --target-dir "$work/target" \
    $(limits 10s 4 "$@") "$@"
fi
