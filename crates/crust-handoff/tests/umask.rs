//! Modes on disk do not depend on the umask (own test binary: the umask is
//! process-wide).

use std::fs;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};

use crust_handoff::{Layout, MountInfo, Policy, Store};

#[test]
fn modes_are_explicit_under_a_permissive_and_a_strict_umask() {
    let dev = fs::read_dir("/dev")
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_type().map(|t| t.is_block_device()).unwrap_or(false))
        .expect("a block device under /dev")
        .path();
    let dev = dev.to_str().unwrap();
    for umask in [0o000, 0o077, 0o777] {
        let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(umask));
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("deep/records");
        let store = Store::new(Layout::Crust, &root, Policy::default()).unwrap();
        let r = store
            .stage("/t/vol", &MountInfo::block(dev, "ext4"))
            .and_then(|_| store.claim("/t/vol", "sb", |_| true))
            .and_then(|_| store.set_runtime_cli("/t/vol", "/usr/bin/x"));
        rustix::process::umask(old);
        r.unwrap();
        let mode = |p: &std::path::Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        let dir = store.record_dir("/t/vol").unwrap();
        assert_eq!(mode(&root), 0o700, "umask {umask:o}");
        assert_eq!(mode(&dir), 0o700, "umask {umask:o}");
        for f in ["mountInfo.json", "sb", "runtime-cli"] {
            assert_eq!(mode(&dir.join(f)), 0o600, "{f} under umask {umask:o}");
        }
    }
}
