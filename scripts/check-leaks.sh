#!/usr/bin/env bash
# Fails when a test run left loop devices, test mounts, QEMU, virtiofsd, a
# crust shim, a test containerd or a CNI network namespace behind.
#   check-leaks.sh                    everything present now is a leak
#   check-leaks.sh --record FILE      note what is present before a run
#   check-leaks.sh --since FILE       only what appeared after --record is
#                                     a leak (an interrupted earlier run's
#                                     leftovers are reported, not failed on)
set -uo pipefail
mode=all base=
case "${1:-}" in
  --record) mode=record base=$2 ;;
  --since) mode=since base=$2 ;;
  "") ;;
  *) echo "usage: $0 [--record FILE | --since FILE]" >&2; exit 2 ;;
esac

# Live (not zombie) processes whose command line matches $1.
live() {
  local p
  for p in $(pgrep -f -- "$1" 2>/dev/null); do
    case $(ps -o stat= -p "$p" 2>/dev/null) in Z* | "") ;; *) echo "$p" ;; esac
  done
}

# One line per resource, prefixed by its kind.
inventory() {
  losetup -a 2>/dev/null | sed 's/^/loop device: /'
  grep -E ' /(tmp|run/crust|var/run/crust|var/lib/kubelet)' /proc/mounts | sed 's/^/mount: /'
  # CRI pods' network namespaces (a test containerd's CNI pods).
  find /var/run/netns -maxdepth 1 -name 'cni-*' 2>/dev/null | sed 's/^/netns: /'
  # -f: the process name pgrep -x sees is cut at 15 characters.
  local pat p
  for pat in '^qemu-system-x86_64 ' '^virtiofsd ' 'containerd-shim-crust-v2' 'containerd --config /tmp/ctrd-'; do
    for p in $(live "$pat"); do
      echo "process: $p $(ps -o args= -p "$p" 2>/dev/null | cut -c1-200)"
    done
  done
}

now=$(inventory | sort)
if [ $mode = record ]; then
  printf '%s\n' "$now" >"$base"
  exit 0
fi
if [ $mode = since ]; then
  old=$(sort "$base")
  before=$(comm -12 <(printf '%s\n' "$old") <(printf '%s\n' "$now") | sed '/^$/d')
  if [ -n "$before" ]; then
    echo "note: present before this run started (not counted):" >&2
    printf '%s\n' "$before" >&2
  fi
  now=$(comm -13 <(printf '%s\n' "$old") <(printf '%s\n' "$now") | sed '/^$/d')
fi
now=$(printf '%s\n' "$now" | sed '/^$/d')
if [ -n "$now" ]; then
  echo "leak: left behind by the tests:" >&2
  printf '%s\n' "$now" >&2
  exit 1
fi
echo "no leftovers: no loop device, test mount, QEMU, virtiofsd, crust shim, test containerd or CNI network namespace"
