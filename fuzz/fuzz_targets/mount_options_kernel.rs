//! Long form only: the mount-option allow-list against the kernel's own
//! parser. Whatever `crust_fs::options::parse` accepts for ext4 or xfs,
//! a real mount of a real filesystem with those options must accept too
//! (crust refusing more than the kernel is fine; the reverse would turn a
//! validated request into a failure at mount time, or worse, into an
//! option the allow-list's bounds were meant to stop).
//!
//! Input: [`mount_options`]'s format (one header byte: bit 0 xfs, bit 1
//! readonly; then one option element per line), so both share a corpus.
//! Needs root and what `scripts/fuzz.sh` sets up for it: a loop device
//! per filesystem (`CRUST_FUZZ_EXT4_DEV`, `CRUST_FUZZ_XFS_DEV`), an empty
//! directory (`CRUST_FUZZ_MNT`), and a private mount namespace
//! (`unshare -m`), so nothing it mounts is seen outside.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use arbitrary::Unstructured;
use crust_fs::FsType;
use libfuzzer_sys::fuzz_target;

struct Setup {
    ext4: PathBuf,
    xfs: PathBuf,
    mnt: PathBuf,
    /// Per filesystem, the build-dependent options this kernel refuses
    /// even alone: quota support (`CONFIG_QUOTA`, `CONFIG_XFS_QUOTA`),
    /// POSIX ACLs (`CONFIG_EXT4_FS_POSIX_ACL`: without it ext4 does not
    /// know `acl`/`noacl`) and ext4's project quota, a superblock feature
    /// (`-O project`); no option list can know those. Printed at start.
    ext4_refused: Vec<&'static str>,
    xfs_refused: Vec<&'static str>,
}

impl Setup {
    fn probe_quota(&self, fstype: FsType, dev: &Path) -> Vec<&'static str> {
        let refused: Vec<&'static str> = crust_fs::options::option_names(fstype)
            .into_iter()
            .filter(|w| is_build_dependent(w))
            .filter(|w| {
                let ok = crust_blockdev::mount::mount_fs(
                    dev,
                    &self.mnt,
                    fstype,
                    &[w.to_string()],
                    false,
                )
                .is_ok();
                crust_blockdev::mount::unmount(&self.mnt).expect("unmount");
                !ok
            })
            .collect();
        eprintln!(
            "mount_options_kernel: {fstype:?}: build-dependent options this kernel refuses \
             alone (not checked): {refused:?}"
        );
        refused
    }
}

/// The options whose very name depends on the kernel's build (quota,
/// ACLs).
fn is_build_dependent(word: &str) -> bool {
    let key = crust_fs::options::option_key(word);
    matches!(key, "acl" | "noacl")
        || key != "noquota" && (key.contains("quota") || key.ends_with("qnoenforce"))
}

/// In the private mount namespace `unshare -m` gave this process, lets go
/// of the copies of every mount it does not use: otherwise each would
/// stay pinned for the whole run (a test's loop device could not be
/// detached, a host volume not be grown) while only the namespace holds
/// them. Refuses to run in the namespace `scripts/fuzz.sh` was started in
/// (`CRUST_FUZZ_HOST_MNTNS`): not the parent's, since libFuzzer's merge
/// starts its inner runs through `sh -c` inside the private namespace, and
/// not init's, which a root in a container may not read.
fn leave_only_what_is_used(keep: &[&Path]) {
    let host = std::env::var_os("CRUST_FUZZ_HOST_MNTNS")
        .expect("CRUST_FUZZ_HOST_MNTNS is not set: run this target through scripts/fuzz.sh");
    let own = std::fs::read_link("/proc/self/ns/mnt").expect("own mount namespace");
    assert_ne!(
        own,
        PathBuf::from(host),
        "mount_options_kernel must run in a private mount namespace (unshare -m): see scripts/fuzz.sh"
    );
    let text = std::fs::read("/proc/self/mountinfo").expect("mountinfo");
    let mut points: Vec<PathBuf> = crust_blockdev::mount::parse_mountinfo(&text)
        .expect("mountinfo parses")
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    // Deepest first, so a mount goes before the one it sits on.
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let used = ["/", "/proc", "/sys", "/dev"]
            .iter()
            .any(|k| p == Path::new(k))
            || keep.iter().any(|k| k.starts_with(&p));
        if !used {
            let _ = rustix::mount::unmount(&p, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

fn setup() -> &'static Setup {
    static S: OnceLock<Setup> = OnceLock::new();
    S.get_or_init(|| {
        let var = |k: &str| {
            PathBuf::from(std::env::var_os(k).unwrap_or_else(|| {
                panic!("{k} is not set: run this target through scripts/fuzz.sh --long")
            }))
        };
        let exe = std::env::current_exe().expect("own path");
        let cwd = std::env::current_dir().expect("working directory");
        let mnt = var("CRUST_FUZZ_MNT");
        leave_only_what_is_used(&[&exe, &cwd, &mnt]);
        let mut s = Setup {
            ext4: var("CRUST_FUZZ_EXT4_DEV"),
            xfs: var("CRUST_FUZZ_XFS_DEV"),
            mnt,
            ext4_refused: Vec::new(),
            xfs_refused: Vec::new(),
        };
        s.ext4_refused = s.probe_quota(FsType::Ext4, &s.ext4.clone());
        s.xfs_refused = s.probe_quota(FsType::Xfs, &s.xfs.clone());
        s
    })
}

fuzz_target!(|data: &[u8]| {
    let s = setup();
    let mut u = Unstructured::new(data);
    let head = u.arbitrary::<u8>().unwrap_or(0);
    let (fstype, dev, refused) = if head & 1 == 0 {
        (FsType::Ext4, &s.ext4, &s.ext4_refused)
    } else {
        (FsType::Xfs, &s.xfs, &s.xfs_refused)
    };
    let readonly = head & 2 != 0;
    let Ok(text) = std::str::from_utf8(u.take_rest()) else {
        return;
    };
    let options: Vec<String> = text.split('\n').map(str::to_string).collect();
    let Ok(parsed) = crust_fs::options::parse(fstype, &options, readonly) else {
        return;
    };
    let key = crust_fs::options::option_key;
    if parsed.words.iter().any(|w| refused.contains(&key(w))) {
        return;
    }
    // The host's own mount routine: the allow-list, then mount(2).
    if let Err(e) = crust_blockdev::mount::mount_fs(dev, &s.mnt, fstype, &options, readonly) {
        panic!(
            "{fstype:?} options {options:?} (readonly: {readonly}) pass the allow-list but not the kernel: {e}"
        );
    }
    crust_blockdev::mount::unmount(&s.mnt).expect("unmount");
});
