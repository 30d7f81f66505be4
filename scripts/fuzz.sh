#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz, libFuzzer) of the parsers that read
# another process's bytes. Targets live in fuzz/ (its own cargo workspace).
#
#   scripts/fuzz.sh --smoke [TARGET...]        CI: build, ~20 s per target, fail on any crash
#                                              (given no target: all but the long-form-only ones,
#                                              and as root mount_options_kernel)
#   scripts/fuzz.sh --long [SECONDS] [TARGET...]  SECONDS per target (default 3600)
#   scripts/fuzz.sh --long 3600 --save ...     then minimize the run's corpus into fuzz/corpus/
#   scripts/fuzz.sh --coverage [TARGET...]     line coverage of the committed corpora:
#                                              HTML and text per target under target/fuzz-coverage/report/
#   scripts/fuzz.sh --list                     the targets
#   scripts/fuzz.sh --ledger                   long-form time and executions accumulated per target
#
# Long-form budgets (accumulated over runs; the run's own corpus is kept
# in the fuzz target dir, so the next run starts where this one ended):
# each target at least 3600 s; handoff_record writes a record per input
# (a few thousand runs/s), so give it 2x for the same depth. Every long
# run appends a line per target to fuzz/long-form.tsv (date, target,
# seconds, executions, coverage, ok or crash); commit it with the corpora.
# Long-form only (not in the smoke unless named): csi_request, whose
# build (crust-csi and its gRPC stack with the sanitizer, the fuzz
# manifest's `csi` feature) alone takes about 8 minutes on two cores; and
# mount_options_kernel (which the smoke runs too when it is root), the
# allow-list against real mounts (root; this
# script gives it an ext4 and an xfs loop device and runs it in a private
# mount namespace, where it first drops the mount copies it does not use,
# so it pins no other mount of the node; it shares mount_options' corpus
# and dictionary); and oci_plan, the shim's OCI spec -> container plan
# (the `shim` feature: the sandbox crate's stack with the sanitizer).
#
# Needs the nightly toolchain and cargo-fuzz (scripts/install-deps.sh);
# --coverage also Debian's llvm-N (llvm-cov, llvm-profdata) where N is the
# nightly's LLVM major (rustc +nightly -vV): rustup's llvm-tools cannot be
# downloaded here. Not in install-deps.sh (about 130 MB for a report).
# A crash leaves its input under <target dir>/artifacts/<target>/ and the
# command that replays it is printed; keep it as a unit test of the
# parser's crate once fixed. Runs as any user; handoff_record's records go
# to a scratch directory under /dev/shm removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

mode=""
secs=""
save=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) mode=smoke; secs=20 ;;
    --long)
      mode=long
      secs=3600
      if [[ "${2:-}" =~ ^[0-9]+$ ]]; then secs=$2; shift; fi
      ;;
    --save) save=1 ;;
    --list) mode=list ;;
    --ledger) mode=ledger ;;
    --coverage) mode=coverage ;;
    -h | --help)
      sed -n '2,39p' "$0"
      exit 0
      ;;
    -*)
      echo "fuzz.sh: unknown option $1" >&2
      exit 2
      ;;
    *) targets+=("$1") ;;
  esac
  shift
done
[ -n "$mode" ] || { sed -n '2,39p' "$0" >&2; exit 2; }

all_targets=$(sed -n 's/^name = "\([a-z0-9_]*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^crust-fuzz$' || true)
if [ "$mode" = list ]; then
  echo "$all_targets"
  exit 0
fi
ledger=fuzz/long-form.tsv
if [ "$mode" = ledger ]; then
  # The budget each target's accumulated time is held to.
  awk -F'\t' -v all="$all_targets" '
    BEGIN { n = split(all, names, "\n"); for (i = 1; i <= n; i++) { secs[names[i]] = 0 } }
    /^#/ || NF < 6 { next }
    { secs[$2] += $3; execs[$2] += $4; runs[$2]++; if ($6 != "ok") crashes[$2]++ }
    END {
      printf "%-22s %8s %14s %5s %8s  %s\n", "target", "seconds", "executions", "runs", "crashes", "budget"
      for (i = 1; i <= n; i++) {
        t = names[i]; want = (t == "handoff_record") ? 7200 : 3600
        printf "%-22s %8d %14d %5d %8d  %s\n", t, secs[t], execs[t], runs[t], crashes[t], \
          (secs[t] >= want ? "met" : sprintf("%d s to go", want - secs[t]))
      }
    }' "$ledger"
  exit 0
fi
long_only="csi_request mount_options_kernel oci_plan"
build_all=0
if [ ${#targets[@]} -eq 0 ]; then
  build_all=1
  if [ "$mode" = smoke ]; then
    mapfile -t targets < <(grep -vxF -f <(tr ' ' '\n' <<<"$long_only") <<<"$all_targets")
    # As root the smoke also replays mount_options' corpus against real
    # mounts: a run of mount_options grows that corpus, and only the
    # kernel target tells whether what it found still mounts (it is
    # built with the others: it needs no feature).
    if [ "$(id -u)" = 0 ]; then
      targets+=(mount_options_kernel)
    else
      echo "fuzz.sh: mount_options_kernel skipped (needs root for its loop devices)" >&2
    fi
  else
    mapfile -t targets <<<"$all_targets"
  fi
fi
# The feature that builds a long-form-only target, when one is asked for.
feats=()
for t in "${targets[@]}"; do
  [ "$t" = csi_request ] && feats+=(csi)
  [ "$t" = oci_plan ] && feats+=(shim)
done
features=()
[ ${#feats[@]} -gt 0 ] && features=(--features "$(IFS=,; echo "${feats[*]}")")

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  echo "fuzz.sh: no nightly toolchain (rustup toolchain list): cannot build the fuzz targets" >&2
  exit 3
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: cargo-fuzz is not installed: run scripts/install-deps.sh" >&2
  exit 3
fi

# Its own target dir: sanitizer and coverage flags would rebuild the
# main workspace's dependencies in place otherwise.
tdir="${CRUST_FUZZ_TARGET_DIR:-$root/target/fuzz}"
mkdir -p "$tdir"
scratch=$(mktemp -d /dev/shm/crust-fuzz-run.XXXXXX)
cleanup() {
  if [ -f "$scratch/loops" ]; then
    while read -r d; do losetup -d "$d" 2>/dev/null || true; done <"$scratch/loops"
  fi
  rm -rf "$scratch"
  # handoff_record's fixed device path: only a run that used it removes
  # it, and only when no other run's handoff_record still reads it (a CI
  # smoke beside a long run had taken it away from the long run).
  if [[ " ${targets[*]} " == *" handoff_record "* ]] &&
    ! pgrep -f '/release/handoff_record ' >/dev/null; then
    rm -rf /dev/shm/crust-fuzz-handoff
  fi
}
trap cleanup EXIT
export CRUST_FUZZ_SCRATCH="$scratch"

# The committed corpus of a target (the kernel form shares its parser's).
corpus_of() {
  case "$1" in
    mount_options_kernel) echo fuzz/corpus/mount_options ;;
    *) echo "fuzz/corpus/$1" ;;
  esac
}

# mount_options_kernel's devices: an ext4 and an xfs image on loop
# devices and an empty mount point, all under the scratch dir; the trap
# detaches them. Its runs go through `in_ns`, a private mount namespace.
kernel_setup() {
  [ "$(id -u)" = 0 ] || { echo "fuzz.sh: mount_options_kernel needs root" >&2; exit 3; }
  local fs img dev
  for fs in ext4 xfs; do
    img="$scratch/$fs.img"
    truncate -s 1G "$img"
    # Made as crust makes them (mkfs defaults).
    "mkfs.$fs" -q "$img" >/dev/null
    dev=$(losetup --find --show "$img")
    echo "$dev" >>"$scratch/loops"
    export "CRUST_FUZZ_${fs^^}_DEV=$dev"
  done
  mkdir -p "$scratch/mnt"
  export CRUST_FUZZ_MNT="$scratch/mnt"
  # The namespace the target must not run in: this shell's.
  CRUST_FUZZ_HOST_MNTNS=$(readlink /proc/$$/ns/mnt)
  export CRUST_FUZZ_HOST_MNTNS
}
in_ns() {
  if [ "$1" = mount_options_kernel ]; then
    shift
    unshare -m --propagation private "$@"
  else
    shift
    "$@"
  fi
}

# The dictionary each target's mutations draw from.
dict_of() {
  case "$1" in
    mount_options_kernel) echo fuzz/dict/mount_options.dict ;;
    handoff_record | agent_frame | oci_plan) echo fuzz/dict/json.dict ;;
    mountinfo) echo fuzz/dict/mountinfo.dict ;;
    mount_options) echo fuzz/dict/mount_options.dict ;;
    kubelet_path) echo fuzz/dict/kubelet.dict ;;
    containerd_config) echo fuzz/dict/toml.dict ;;
    shim_http) echo fuzz/dict/http.dict ;;
    h2_authority) echo fuzz/dict/h2.dict ;;
    csi_request) echo fuzz/dict/csi.dict ;;
    peer_request) echo fuzz/dict/peer.dict ;;
  esac
}

# The files of crust's own that each target exists to exercise: the
# coverage summary's figure.
parser_files_of() {
  case "$1" in
    handoff_record) echo crates/crust-handoff/src/{mountinfo,validate}.rs crates/crust-handoff/src/store/{mod,layout,dirs,fsio}.rs ;;
    agent_frame) echo crates/crust-agent-proto/src/{frame,messages,network}.rs ;;
    mountinfo) echo crates/crust-mountinfo/src/lib.rs crates/crust-agent/src/sys.rs ;;
    mount_options | mount_options_kernel) echo crates/crust-fs/src/options.rs ;;
    kubelet_path) echo crates/crust-handoff/src/kubelet.rs ;;
    containerd_config) echo crates/crust-node-install/src/containerd.rs ;;
    shim_http) echo crates/crust-shim-api/src/call.rs ;;
    h2_authority) echo crates/crust-h2-authority/src/lib.rs ;;
    csi_request) echo crates/crust-csi/src/controller/{mod,service}.rs crates/crust-csi/src/{caps,paging}.rs crates/crust-csi/src/node/mod.rs ;;
    oci_plan) echo crates/crust-sandbox/src/spec.rs ;;
    peer_request) echo crates/crust-peer-seal/src/lib.rs ;;
  esac
}

# --coverage: each target built with source-based coverage (no sanitizer)
# in its own target dir, run over its committed corpus, reported by the
# LLVM of the nightly's major version.
if [ "$mode" = coverage ]; then
  major=$(rustc +nightly -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
  llvm="/usr/lib/llvm-$major/bin"
  if [ ! -x "$llvm/llvm-cov" ] || [ ! -x "$llvm/llvm-profdata" ]; then
    echo "fuzz.sh: --coverage needs llvm-cov and llvm-profdata of LLVM $major (the nightly's):" \
      "apt-get install llvm-$major" >&2
    exit 3
  fi
  ctdir="${CRUST_FUZZ_COVERAGE_DIR:-$root/target/fuzz-coverage}"
  report="$ctdir/report"
  mkdir -p "$report"
  # Only crust's sources: not the registry's, the standard library's or
  # the fuzz targets' own.
  ignore='/\.cargo/|/rustc/|/library/|/fuzz/fuzz_targets/'
  t0=$(date +%s)
  summary=()
  for t in "${targets[@]}"; do
    log="$ctdir/$t.log"
    if [ "$t" = mount_options_kernel ]; then
      # Its lines of options.rs are mount_options' (same corpus, same
      # parser first); under cargo-fuzz's coverage runner its scratch
      # mount point's unmount answers EBUSY.
      echo "fuzz.sh: mount_options_kernel skipped: see mount_options" >&2
      continue
    fi
    if ! in_ns "$t" cargo +nightly fuzz coverage --fuzz-dir fuzz --target-dir "$ctdir" --sanitizer none \
      "${features[@]}" --llvm-path "$llvm" "$t" "$(corpus_of "$t")" >"$log" 2>&1; then
      grep -vE '^\s+(Compiling|Downloaded|Downloading)' "$log" | tail -30 >&2
      echo "fuzz.sh: coverage of $t failed" >&2
      exit 1
    fi
    # cargo-fuzz leaves its profile in fuzz/coverage/ (ignored by git).
    mv "fuzz/coverage/$t/coverage.profdata" "$report/$t.profdata"
    rm -rf "fuzz/coverage/$t"
    rmdir fuzz/coverage 2>/dev/null || true
    bin="$ctdir/x86_64-unknown-linux-gnu/release/$t"
    cov=("$llvm/llvm-cov")
    opts=(-instr-profile="$report/$t.profdata" -ignore-filename-regex="$ignore")
    rm -rf "${report:?}/$t"
    "${cov[@]}" show "$bin" "${opts[@]}" -format=html -output-dir="$report/$t"
    "${cov[@]}" report "$bin" "${opts[@]}" >"$report/$t.txt"
    # shellcheck disable=SC2046 # the file list is words
    lines=$("${cov[@]}" report "$bin" "${opts[@]}" $(parser_files_of "$t") |
      awk '$1 == "TOTAL" { print $10 " of " $8 " lines" }')
    n=$(find "$(corpus_of "$t")" -type f | wc -l)
    summary+=("$(printf '%-18s %5s inputs  %-24s %s' "$t" "$n" "$lines" "$(parser_files_of "$t" | sed 's|crates/||g')")")
  done
  echo "fuzz.sh: coverage of the committed corpora ($(($(date +%s) - t0)) s); HTML: $report/TARGET/index.html"
  printf '  %s\n' "${summary[@]}"
  exit 0
fi

t0=$(date +%s)
echo "fuzz.sh: building ${#targets[@]} targets (nightly, AddressSanitizer, debug assertions)"
build() {
  if ! cargo +nightly fuzz build --fuzz-dir fuzz --target-dir "$tdir" "${features[@]}" "$@" >"$tdir/build.log" 2>&1; then
    grep -vE '^\s+(Compiling|Downloaded|Downloading)' "$tdir/build.log" | tail -40 >&2
    echo "fuzz.sh: the fuzz build failed" >&2
    exit 1
  fi
}
# Given no target `cargo fuzz build` builds them all in one cargo run
# (but those whose feature is not asked for).
if [ "$build_all" = 1 ] || [ "${targets[*]}" = "$(echo $all_targets)" ]; then
  build
else
  for t in "${targets[@]}"; do build "$t"; done
fi
for t in "${targets[@]}"; do
  [ -x "$tdir/x86_64-unknown-linux-gnu/release/$t" ] || {
    echo "fuzz.sh: $t did not build" >&2
    exit 1
  }
done
t_built=$(date +%s)
echo "fuzz.sh: built in $((t_built - t0)) s"

for t in "${targets[@]}"; do
  [ "$t" = mount_options_kernel ] && kernel_setup
done
failed=()
summary=()
for t in "${targets[@]}"; do
  bin="$tdir/x86_64-unknown-linux-gnu/release/$t"
  work="$tdir/corpus/$t"
  arts="$tdir/artifacts/$t"
  mkdir -p "$work" "$arts"
  # Per mode: a CI smoke beside a long run must not overwrite its log.
  log="$tdir/$t.$mode.log"
  echo "fuzz.sh: $t for ${secs} s"
  # New inputs go to the run's corpus ($work); the committed seeds are
  # read only. -malloc_limit_mb: no input of a few KiB may make a parser
  # allocate 64 MiB at once; -timeout: none may take 5 s.
  started=$(date +%s)
  set +e
  in_ns "$t" "$bin" "$work" "$(corpus_of "$t")" \
    -dict="$(dict_of "$t")" -max_total_time="$secs" -max_len=8192 \
    -timeout=5 -rss_limit_mb=2048 -malloc_limit_mb=64 \
    -artifact_prefix="$arts/" -print_final_stats=1 >"$log" 2>&1
  rc=$?
  set -e
  # A crash on a seed ends the run before any of these is printed.
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1 || true)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1 || true)
  cov=$({ grep -aoE 'cov: [0-9]+' "$log" || true; } | tail -1 | cut -d' ' -f2)
  summary+=("$(printf '%-16s %6s s %10s execs %7s execs/s  cov %s' "$t" "$secs" "${runs:-?}" "${rate:-?}" "${cov:-?}")")
  if [ "$mode" = long ]; then
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%FT%H:%MZ)" "$t" "$(($(date +%s) - started))" \
      "${runs:-0}" "${cov:-?}" "$([ $rc = 0 ] && echo ok || echo crash)" >>"$ledger"
  fi
  if [ $rc != 0 ]; then
    failed+=("$t")
    echo "fuzz.sh: $t FAILED (exit $rc); its log's end:" >&2
    grep -avE '^#[0-9]+' "$log" | tail -40 >&2
    grep -a -m1 -A1 'panicked at' "$log" >&2 || true
    art=$(ls -t "$arts" 2>/dev/null | head -1 || true)
    [ -n "$art" ] && echo "fuzz.sh: replay: $bin $arts/$art" >&2
  fi
  if [ "$save" = 1 ] && [ $rc = 0 ]; then
    # Minimized: only inputs that add coverage over the committed seeds.
    # An input that crashes here is skipped by the merge and kept with
    # the artifacts; any crash fails the run (a merge is no place for it).
    before=$(find "$arts" -type f | wc -l)
    if ! in_ns "$t" "$bin" -merge=1 -artifact_prefix="$arts/" "$(corpus_of "$t")" "$work" \
      -dict="$(dict_of "$t")" >"$tdir/$t.$mode.merge.log" 2>&1 ||
      [ "$(find "$arts" -type f | wc -l)" != "$before" ]; then
      failed+=("$t")
      echo "fuzz.sh: $t: the merge into $(corpus_of "$t") crashed: $tdir/$t.$mode.merge.log, $arts/" >&2
      grep -a -m1 -A1 'panicked at' "$tdir/$t.$mode.merge.log" >&2 || true
    fi
    echo "fuzz.sh: $t: $(corpus_of "$t") now $(find "$(corpus_of "$t")" -type f | wc -l) inputs"
  fi
done

echo "fuzz.sh: summary ($mode, build $((t_built - t0)) s, total $(($(date +%s) - t0)) s)"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: crashed: ${failed[*]}" >&2
  exit 1
fi
