#!/usr/bin/env bash
# The test command: builds every binary and the guest image (cached), runs
# the whole workspace's tests, then fails if anything was left behind.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "the tests need root (loop devices, mounts, QEMU): run as root" >&2
  exit 1
fi
bash scripts/install-deps.sh --if-missing

export CI="${CI:-true}"
# The benchmarks' A/B switch (QEMU through the host page cache) would change
# what the tests assert about the data path.
unset CRUST_RUNTIME_HOST_CACHE
# What an interrupted earlier run left is not this run's leak.
leaks_before=$(mktemp)
trap 'rm -f "$leaks_before"' EXIT
bash scripts/check-leaks.sh --record "$leaks_before"
# The shape the code keeps: formatting and the workspace lints
# ([workspace.lints], clippy.toml), as errors. Never skipped: install-deps.sh
# (run above) adds rustfmt and clippy, and a run without them fails here.
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# No new import circle between the modules of a crate (~1 s; the known
# ones are listed with a reason in scripts/module-cycles.allow).
python3 scripts/module-cycles.py --self-test
python3 scripts/module-cycles.py
# The fuzz smoke: each parser target ~20 s (scripts/fuzz.sh), failing on
# any crash. Before the workspace build and tests: it needs neither (its
# own workspace and target dir), and a parser crash then fails the run in
# minutes rather than after the guest tests. Needs the nightly toolchain.
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  bash scripts/fuzz.sh --smoke
else
  echo "test.sh: no nightly toolchain (rustup toolchain list): fuzz smoke skipped" >&2
fi
cargo build --workspace --bins --locked
bash guest/build-image.sh
# The static per-poll runtime CLI the node payload ships (images tests).
bash scripts/build-poll-cli.sh >/dev/null
# The bench image (fio + crust-guest-bench) for crustctl's guest_io test;
# cached by its stamp like the test image (~45 s when it must be built).
bash guest/build-image.sh --bench
# Concurrent image builds in one checkout serialise and never stamp a
# broken image (~20-70 s: three forced image assemblies, agent already built).
bash guest/test-build-image-race.sh
bash scripts/build-test-images.sh

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast --test-threads 2
else
  cargo test --workspace --locked --no-fail-fast -- --test-threads 2
fi

bash scripts/check-leaks.sh --since "$leaks_before"
