//! Claiming deferred volumes for a sandbox: the hand-off record's sandbox
//! claim (checked against the record as planned), the runtime CLI path
//! crust_ops will call for stats and resize, and the release. Shared by
//! both front doors (the `crust-runtime` shim and the containerd shim).

use std::path::{Path, PathBuf};

use crate::discovery::Discovery;
use crate::error::RuntimeError;
use crate::records::{LayoutKind, Volume};
use crate::sandbox::SandboxStore;

/// The full runtime CLI's file name.
pub const FULL_CLI: &str = "crust-runtime";
/// The small CLI for kubelet's polls (src/bin/crust-runtime-poll.rs).
pub const POLL_CLI: &str = "crust-runtime-poll";

/// The runtime CLI to record in `dir` (where the runtime is installed):
/// `crust-runtime-poll` when it is installed there, else `crust-runtime`.
pub fn cli_in(dir: &Path) -> PathBuf {
    let poll = dir.join(POLL_CLI);
    if poll.is_file() {
        poll
    } else {
        dir.join(FULL_CLI)
    }
}

/// The runtime CLI recorded in claims: [`cli_in`] the directory of the
/// running executable (found through /proc/self/exe).
pub fn recorded_cli() -> Result<String, RuntimeError> {
    let exe = this_executable()?;
    let dir = Path::new(&exe).parent().unwrap_or(Path::new("/"));
    cli_in(dir)
        .into_os_string()
        .into_string()
        .map_err(|_| RuntimeError::ExeNotUtf8)
}

/// The `crust-runtime` executable that is running, found through
/// /proc/self/exe.
pub fn this_executable() -> Result<String, RuntimeError> {
    let exe = std::env::current_exe()
        .and_then(|p| p.canonicalize())
        .map_err(RuntimeError::io("locating this executable"))?;
    exe.to_str()
        .map(str::to_owned)
        .ok_or(RuntimeError::ExeNotUtf8)
}

/// Claims `v` for sandbox `id` and, in the CRUST layout, records
/// `runtime_cli` (an absolute path answering `crust stats|resize`).
pub fn claim(
    discovery: &Discovery,
    store: &SandboxStore,
    id: &str,
    v: &Volume,
    runtime_cli: &str,
) -> Result<(), RuntimeError> {
    let s = discovery.store(v.layout);
    s.claim(&v.target, id, |other| store.holds_volumes(other))?;
    // The record was read when the bundle was planned; until our claim it
    // could be replaced. Once claimed it cannot (stage refuses a different
    // record a sandbox holds), so what is on disk now must be what we plan
    // to attach.
    if let Err(reason) = still_as_planned(s, v) {
        if let Err(e) = s.release(&v.target, id) {
            tracing::warn!(target = %v.target, "releasing the claim: {e}");
        }
        return Err(RuntimeError::RecordChanged {
            target: v.target.clone(),
            sandbox: id.to_string(),
            reason,
        });
    }
    if v.layout == LayoutKind::Crust
        && let Err(e) = s.set_runtime_cli(&v.target, runtime_cli)
    {
        let _ = s.release(&v.target, id);
        return Err(e.into());
    }
    Ok(())
}

/// Compares the record on disk with the volume planned from it.
pub fn still_as_planned(s: &crust_handoff::Store, v: &Volume) -> Result<(), String> {
    let mi = s.read(&v.target).map_err(|e| e.to_string())?;
    let now = Volume::from_record(v.layout, &v.target, &mi, false);
    let pairs = [
        ("device", &now.device, &v.device),
        ("fstype", &now.fstype, &v.fstype),
    ];
    for (what, now, planned) in pairs {
        if now != planned {
            return Err(format!("{what} {planned} became {now}"));
        }
    }
    if now.identity != v.identity {
        return Err(format!(
            "device identity {:?} became {:?}",
            v.identity, now.identity
        ));
    }
    if now.options != v.options {
        return Err(format!("options {:?} became {:?}", v.options, now.options));
    }
    if (now.fs_group, &now.fs_group_policy) != (v.fs_group, &v.fs_group_policy) {
        return Err(format!(
            "fsGroup {:?}/{:?} became {:?}/{:?}",
            v.fs_group, v.fs_group_policy, now.fs_group, now.fs_group_policy
        ));
    }
    Ok(())
}

pub fn release_all(discovery: &Discovery, id: &str, vols: &[Volume]) {
    for v in vols {
        if let Err(e) = discovery.store(v.layout).release(&v.target, id) {
            tracing::warn!(target = %v.target, "releasing the claim: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_poll_cli_is_recorded_when_installed_next_to_the_runtime() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(cli_in(d.path()), d.path().join(FULL_CLI));
        std::fs::write(d.path().join(POLL_CLI), b"").unwrap();
        assert_eq!(cli_in(d.path()), d.path().join(POLL_CLI));
    }

    use super::*;
    use crate::shim::Code;
    use crust_handoff::MountInfo;
    use std::os::unix::fs::PermissionsExt;

    fn some_block_device() -> Option<String> {
        use std::os::unix::fs::FileTypeExt;
        std::fs::read_dir("/dev").ok()?.flatten().find_map(|e| {
            let ft = e.file_type().ok()?;
            ft.is_block_device()
                .then(|| e.path().to_str().unwrap().to_string())
        })
    }

    #[test]
    fn a_record_replaced_between_plan_and_claim_is_released_and_refused() {
        let Some(dev) = some_block_device() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let pods = dir.path().join("pods").to_str().unwrap().to_string();
        let discovery =
            Discovery::new(dir.path().join("crust"), dir.path().join("kata"), &pods).unwrap();
        let sandboxes = SandboxStore::new(dir.path().join("run"));
        for layout in [LayoutKind::Crust, LayoutKind::Kata] {
            let target = format!("{pods}/u/volumes/kubernetes.io~csi/{layout:?}/mount");
            let store = discovery.store(layout);
            let planned_mi = MountInfo::block(dev.clone(), "ext4");
            store.stage(&target, &planned_mi).unwrap();
            let planned = Volume::from_record(layout, &target, &planned_mi, false);

            // Unchanged: claimed (and, CRUST layout, the CLI recorded).
            claim(
                &discovery,
                &sandboxes,
                "sb1",
                &planned,
                &this_executable().unwrap(),
            )
            .unwrap();
            let st = store.inspect(&target).unwrap();
            assert_eq!(st.claimant.as_deref(), Some("sb1"));
            assert_eq!(st.runtime_cli.is_some(), layout == LayoutKind::Crust);
            store.release(&target, "sb1").unwrap();

            // Swapped after planning (unclaimed, so stage may replace it):
            // the claim is dropped again and nothing is attached.
            for change in [
                |m: &mut MountInfo| m.options = vec!["ro".into()],
                |m: &mut MountInfo| m.fstype = "xfs".into(),
                |m: &mut MountInfo| m.set_fs_group(Some(7)),
            ] {
                let mut swapped = planned_mi.clone();
                change(&mut swapped);
                store.stage(&target, &swapped).unwrap();
                let e = claim(
                    &discovery,
                    &sandboxes,
                    "sb2",
                    &planned,
                    &this_executable().unwrap(),
                )
                .unwrap_err();
                assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
                assert!(e.to_string().contains("changed while sandbox sb2"), "{e}");
                let st = store.inspect(&target).unwrap();
                assert_eq!((st.claimant, st.runtime_cli), (None, None), "{layout:?}");
                assert_eq!(st.mount_info, store.normalized(&swapped));
                store.stage(&target, &planned_mi).unwrap();
            }
            store.remove(&target).unwrap();
        }
    }
}
