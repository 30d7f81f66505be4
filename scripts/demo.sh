#!/usr/bin/env bash
# The demo: one pod's volume mounted inside a QEMU guest, on a loop-file
# pool in a private work directory. Extra arguments go to `crustctl demo`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "the demo needs root (loop devices, mounts, QEMU): run as root" >&2
  exit 1
fi
bash scripts/install-deps.sh --if-missing
echo "building crust (release)..."
cargo build --release --workspace --bins --locked
bash guest/build-image.sh
exec target/release/crustctl demo "$@"
