#!/usr/bin/env bash
# Fails when a test run left loop devices, test mounts or QEMU processes.
set -uo pipefail
status=0
loops=$(losetup -a 2>/dev/null || true)
if [ -n "$loops" ]; then
  echo "leak: loop devices still attached:" >&2
  echo "$loops" >&2
  status=1
fi
mnts=$(grep -E ' /(tmp|run/crust|var/run/crust|var/lib/kubelet)' /proc/mounts || true)
if [ -n "$mnts" ]; then
  echo "leak: test mounts still present:" >&2
  echo "$mnts" >&2
  status=1
fi
# -f: the process name pgrep -x sees is cut at 15 characters.
if pgrep -f '^qemu-system-x86_64 ' >/dev/null 2>&1; then
  echo "leak: QEMU processes still running:" >&2
  pgrep -a -f '^qemu-system-x86_64 ' >&2
  status=1
fi
# Live (not zombie) processes whose command line matches $1.
live() {
  local p
  for p in $(pgrep -f -- "$1" 2>/dev/null); do
    case $(ps -o stat= -p "$p" 2>/dev/null) in Z* | "") ;; *) echo "$p" ;; esac
  done
}
for pat in '^virtiofsd ' 'containerd-shim-crust-v2' 'containerd --config /tmp/ctrd-'; do
  pids=$(live "$pat")
  if [ -n "$pids" ]; then
    echo "leak: processes matching '$pat' still running:" >&2
    ps -o pid=,args= -p $pids >&2
    status=1
  fi
done
[ $status = 0 ] && echo "no leftovers: no loop device, test mount, QEMU, virtiofsd, crust shim or test containerd"
exit $status
