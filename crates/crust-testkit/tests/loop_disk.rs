//! `LoopDisk` on real loop devices: format, mount, grow, and nothing left
//! behind when the test using it panics.

use std::path::PathBuf;
use std::sync::Mutex;

use crust_blockdev::{AttachOptions, FsType, LoopGuard, MountGuard};
use crust_testkit::LoopDisk;

const MIB: u64 = 1 << 20;

#[test]
fn format_mount_grow_and_release_on_panic() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("disk.img");
    let seen: Mutex<Option<(PathBuf, PathBuf)>> = Mutex::new(None);

    let res = std::panic::catch_unwind(|| {
        let disk = LoopDisk::with_fs(&file, 32 * MIB, FsType::Ext4);
        assert_eq!(disk.fstype(), FsType::Ext4);
        assert_eq!(
            crust_blockdev::block_device_size(disk.dev()).unwrap(),
            32 * MIB
        );
        disk.grow(48 * MIB);
        assert_eq!(
            crust_blockdev::block_device_size(disk.dev()).unwrap(),
            48 * MIB
        );
        assert_eq!(std::fs::metadata(disk.file()).unwrap().len(), 48 * MIB);
        disk.with_host_mount(false, |m| std::fs::write(m.join("kept"), b"data").unwrap());
        let m = disk.mount_temp(&[], false);
        assert!(crust_blockdev::is_mountpoint(m.path()).unwrap());
        *seen.lock().unwrap() = Some((disk.dev().to_path_buf(), m.path().to_path_buf()));
        panic!("test failure while mounted");
    });
    assert!(res.is_err());

    let (dev, mnt) = seen.lock().unwrap().take().unwrap();
    assert!(!mnt.exists(), "temp mount dir removed");
    let mounted = crust_blockdev::mount_info().unwrap();
    assert!(!mounted.iter().any(|m| m.mount_point == mnt), "{mounted:?}");
    assert_eq!(
        crust_blockdev::find_by_backing(&file).unwrap(),
        None,
        "{dev:?} detached"
    );

    // What was written before the panic is on the file.
    let lo = LoopGuard::attach(&file, AttachOptions::default()).unwrap();
    let target = tempfile::tempdir().unwrap();
    let m = MountGuard::mount_fs(lo.path(), target.path(), FsType::Ext4, &[], true).unwrap();
    assert_eq!(std::fs::read(target.path().join("kept")).unwrap(), b"data");
    m.unmount().unwrap();
}
