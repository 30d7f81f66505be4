//! A QEMU wrapper that makes KVM "half-working", the way some hosts are:
//! under `-accel kvm` it starts the real QEMU paused (`-S`, software
//! emulation), so QMP answers but the guest never runs. Tests of the
//! accelerator choice use it so they behave the same on hosts where KVM
//! works, is absent, or hangs.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// One QEMU start seen by the wrapper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuStart {
    pub pid: i32,
    /// `kvm` or `tcg`, as requested by the caller.
    pub accel: String,
    /// QEMU's `-name` (the guest name, without its options).
    pub name: String,
}

/// The wrapper script and the log of what it started.
pub struct HangingKvmQemu {
    pub path: PathBuf,
    log: PathBuf,
}

impl HangingKvmQemu {
    /// Writes `dir/qemu-wrapper`. KVM starts hang, except those whose
    /// `-name` is `spare` (e.g. `crust-accel-probe`: a KVM that passes its
    /// probe and hangs later), which run normally under TCG.
    pub fn new(dir: &Path, spare: Option<&str>) -> HangingKvmQemu {
        let qemu = [
            "/usr/bin/qemu-system-x86_64",
            "/usr/local/bin/qemu-system-x86_64",
        ]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect("qemu-system-x86_64 is installed (scripts/install-deps.sh)");
        let log = dir.join("qemu-starts.log");
        let script = format!(
            r#"#!/bin/sh
# A QEMU whose KVM hangs: -accel kvm runs the machine paused under TCG.
accel=tcg; name=""; prev=""
for a do
  case "$prev" in -accel) accel=${{a%%,*}} ;; -name) name=${{a%%,*}} ;; esac
  prev=$a
done
echo "$$ $accel $name" >> "{log}"
[ "$accel" = kvm ] || exec {qemu} "$@"
prev=""
for a do
  shift
  b=$a
  case "$prev:$a" in -accel:kvm) b=tcg ;; -cpu:host) b=max ;; esac
  set -- "$@" "$b"
  prev=$a
done
if [ -n "{spare}" ] && [ "$name" = "{spare}" ]; then exec {qemu} "$@"; fi
exec {qemu} "$@" -S
"#,
            log = log.display(),
            qemu = qemu.display(),
            spare = spare.unwrap_or_default(),
        );
        let path = dir.join("qemu-wrapper");
        std::fs::write(&path, script).expect("write the QEMU wrapper");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .expect("chmod the QEMU wrapper");
        HangingKvmQemu { path, log }
    }

    /// Every QEMU the wrapper started, in order.
    pub fn starts(&self) -> Vec<QemuStart> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut f = l.splitn(3, ' ');
                Some(QemuStart {
                    pid: f.next()?.parse().ok()?,
                    accel: f.next()?.to_string(),
                    name: f.next().unwrap_or_default().to_string(),
                })
            })
            .collect()
    }
}
