//! Real loop devices, mkfs and mounts. Needs root; every device and mount
//! is held by a guard declared after the temp dir it lives in, so drop
//! order is unmount → detach → remove dir, also on failure.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crust_blockdev::*;

const MIB: u64 = 1 << 20;

fn sparse(dir: &Path, name: &str, size: u64) -> PathBuf {
    let p = dir.join(name);
    File::create(&p).unwrap().set_len(size).unwrap();
    p
}

fn mkdir(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::create_dir(&p).unwrap();
    p
}

fn rw() -> AttachOptions {
    AttachOptions::default()
}

#[test]
fn attach_find_detach_round_trip() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "vol.img", 16 * MIB);
    let guard = LoopGuard::attach(&img, rw()).unwrap();
    let dev = guard.path().to_path_buf();

    assert!(is_block_device(&dev));
    assert_eq!(block_device_size(&dev).unwrap(), 16 * MIB);
    let (major, minor) = device_major_minor(&dev).unwrap();
    assert_eq!(major, 7);
    assert_eq!(
        dev,
        PathBuf::from(format!("/dev/loop{}", guard.info().number))
    );
    let _ = minor;

    // Found again from sysfs alone, as a restarted plugin would, also
    // through a non-canonical spelling of the path.
    assert_eq!(find_by_backing(&img).unwrap(), Some(dev.clone()));
    let odd = dir.path().join(".").join("vol.img");
    assert_eq!(find_by_backing(&odd).unwrap(), Some(dev.clone()));
    let st = loop_status(&dev).unwrap().expect("bound");
    assert_eq!(st.backing_file, std::fs::canonicalize(&img).unwrap());
    assert!(!st.autoclear, "device must survive the process");
    assert!(!st.read_only);
    assert!(!st.backing_deleted);
    assert_eq!(st.size_bytes, 16 * MIB);
    assert!(list_loops().unwrap().iter().any(|s| s.path == dev));

    // Bytes written through the device land in the file.
    let data = crust_testkit::noise(4096, 7);
    let f = OpenOptions::new().write(true).open(&dev).unwrap();
    f.write_all_at(&data, 8192).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let mut back = vec![0u8; 4096];
    File::open(&img)
        .unwrap()
        .read_exact_at(&mut back, 8192)
        .unwrap();
    assert_eq!(back, data);

    let info = guard.release();
    detach(&info.path).unwrap();
    assert_eq!(find_by_backing(&img).unwrap(), None);
    // Checked by backing path: a parallel test may reuse the number at once.
    assert!(find_all_by_backing(&img).unwrap().is_empty());
    detach(&info.path).unwrap(); // idempotent when unbound (or not ours)
    // Detach never touches the data.
    let mut back = vec![0u8; 4096];
    File::open(&img)
        .unwrap()
        .read_exact_at(&mut back, 8192)
        .unwrap();
    assert_eq!(back, data);
}

/// Runs inside a child process started by `device_survives_process_exit`.
#[test]
#[ignore = "helper run in a child process by device_survives_process_exit"]
fn child_attach_helper() {
    let Some(img) = std::env::var_os("CRUST_BLOCKDEV_CHILD_IMG") else {
        return;
    };
    let info = LoopDevice::attach(Path::new(&img), rw()).unwrap();
    println!("CHILD-DEVICE {}", info.path.display());
}

#[test]
fn device_survives_process_exit() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "restart.img", 4 * MIB);
    // Another process attaches and exits, like a plugin that restarts.
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_attach_helper", "--ignored", "--nocapture"])
        .env("CRUST_BLOCKDEV_CHILD_IMG", &img)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dev = stdout
        .lines()
        .find_map(|l| l.strip_prefix("CHILD-DEVICE "))
        .map(PathBuf::from);
    let guard = dev.as_deref().map(|d| LoopGuard::adopt_path(d).unwrap());
    assert!(out.status.success(), "child failed: {stdout}");
    let dev = dev.expect("child printed its device");
    // Nothing but sysfs tells this process about the device.
    assert_eq!(find_by_backing(&img).unwrap(), Some(dev.clone()));
    assert!(!loop_status(&dev).unwrap().unwrap().autoclear);
    drop(guard);
    assert!(find_all_by_backing(&img).unwrap().is_empty());
}

#[test]
fn concurrent_attaches_get_distinct_devices() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let imgs: Vec<PathBuf> = (0..8)
        .map(|i| sparse(dir.path(), &format!("c{i}.img"), MIB))
        .collect();
    // Every thread races for the same "first free" device; the losers
    // get EBUSY from the kernel and must retry with another one.
    let guards: Vec<LoopGuard> = std::thread::scope(|s| {
        let hs: Vec<_> = imgs
            .iter()
            .map(|img| s.spawn(move || LoopGuard::attach(img, rw())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    let mut devs: Vec<&Path> = guards.iter().map(|g| g.path()).collect();
    devs.sort();
    devs.dedup();
    assert_eq!(devs.len(), imgs.len());
    for (img, g) in imgs.iter().zip(&guards) {
        assert_eq!(find_by_backing(img).unwrap().as_deref(), Some(g.path()));
    }
}

#[test]
fn read_only_attach_refuses_writes() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "ro.img", 4 * MIB);
    let guard = LoopGuard::attach(
        &img,
        AttachOptions {
            read_only: true,
            ..AttachOptions::default()
        },
    )
    .unwrap();
    assert!(loop_status(guard.path()).unwrap().unwrap().read_only);
    let w = OpenOptions::new()
        .write(true)
        .open(guard.path())
        .and_then(|mut f| f.write_all(&[1u8; 512]).and_then(|_| f.sync_all()));
    assert!(w.is_err(), "write to a read-only loop device succeeded");
}

#[test]
fn direct_io_attach_reports_dio() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "dio.img", 4 * MIB);
    let guard = LoopGuard::attach(
        &img,
        AttachOptions {
            direct_io: true,
            ..AttachOptions::default()
        },
    )
    .unwrap();
    // /tmp is ext4 here, which supports O_DIRECT, so the kernel keeps it.
    assert!(loop_status(guard.path()).unwrap().unwrap().direct_io);
}

#[test]
fn refresh_capacity_after_growing_the_file() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "grow.img", 8 * MIB);
    let guard = LoopGuard::attach(&img, rw()).unwrap();
    File::options()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(24 * MIB)
        .unwrap();
    assert_eq!(block_device_size(guard.path()).unwrap(), 8 * MIB);
    assert_eq!(refresh_capacity(guard.path()).unwrap(), 24 * MIB);
    assert_eq!(block_device_size(guard.path()).unwrap(), 24 * MIB);
    assert_eq!(refresh_capacity(guard.path()).unwrap(), 24 * MIB);
}

#[test]
fn deleted_backing_file_is_not_found_by_path() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "gone.img", 4 * MIB);
    let guard = LoopGuard::attach(&img, rw()).unwrap();
    std::fs::remove_file(&img).unwrap();
    assert_eq!(find_by_backing(&img).unwrap(), None);
    let all = find_all_by_backing(&img).unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].path, guard.path());
    assert!(all[0].backing_deleted);
    // A new file at the same path is a different file.
    sparse(dir.path(), "gone.img", 4 * MIB);
    assert_eq!(find_by_backing(&img).unwrap(), None);
}

#[test]
fn detach_refuses_while_mounted_or_open() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "busy.img", 32 * MIB);
    let mnt = mkdir(dir.path(), "mnt");
    let lg = LoopGuard::attach(&img, rw()).unwrap();
    let dev = lg.path().to_path_buf();
    mkfs(&dev, FsType::Ext4).unwrap();
    let mg = MountGuard::mount_fs(&dev, &mnt, FsType::Ext4, &[], false).unwrap();

    let err = detach(&dev).unwrap_err();
    assert!(
        matches!(&err, LoopError::Busy { reason, .. } if reason.contains("mounted at")),
        "{err}"
    );
    let st = loop_status(&dev).unwrap().expect("still bound");
    assert!(
        !st.autoclear,
        "a refused detach must not leave a lazy detach behind"
    );
    mg.unmount().unwrap();

    // A plain opener (think QEMU) makes the kernel defer the detach; we
    // cancel that and say so instead.
    let holder = File::open(&dev).unwrap();
    let err = detach(&dev).unwrap_err();
    assert!(
        matches!(&err, LoopError::Busy { reason, .. } if reason.contains("still open")),
        "{err}"
    );
    let st = loop_status(&dev).unwrap().expect("still bound");
    assert!(!st.autoclear);
    drop(holder);
    let info = lg.release();
    detach(&info.path).unwrap();
    assert!(find_all_by_backing(&img).unwrap().is_empty());
}

#[test]
fn not_a_loop_device_is_rejected() {
    crust_testkit::require_root();
    let err = detach(Path::new("/dev/null")).unwrap_err();
    assert!(
        matches!(err, LoopError::Device(DeviceError::NotBlockDevice(_))),
        "{err}"
    );
    assert!(!is_block_device(Path::new("/dev/null")));
    assert!(!is_block_device(Path::new("/nonexistent/dev")));
    assert!(block_device_size(Path::new("/dev/null")).is_err());
}

#[test]
fn probe_blank_unknown_and_refuse_mkfs_on_data() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "probe.img", 16 * MIB);
    let lg = LoopGuard::attach(&img, rw()).unwrap();
    let dev = lg.path().to_path_buf();
    assert_eq!(probe_fs(&dev).unwrap(), Probe::Blank);

    // Data written behind the device's back (into the file) is still seen:
    // probing bypasses the page cache that the first probe filled.
    let junk = crust_testkit::noise(512, 42);
    let f = File::options().read(true).write(true).open(&img).unwrap();
    f.write_all_at(&junk, 100_000).unwrap();
    f.sync_all().unwrap();
    let p = probe_fs(&dev).unwrap();
    assert!(
        matches!(&p, Probe::Unknown(s) if s.contains("non-zero")),
        "{p:?}"
    );

    let err = mkfs(&dev, FsType::Ext4).unwrap_err();
    assert!(matches!(err, FsError::NotBlank { .. }), "{err}");
    let mut back = vec![0u8; 512];
    f.read_exact_at(&mut back, 100_000).unwrap();
    assert_eq!(back, junk, "refused mkfs must not touch the data");

    // Non-zero bytes only near the end also count.
    f.write_all_at(&[0u8; 512], 100_000).unwrap();
    f.write_all_at(&crust_testkit::noise(64, 3), 16 * MIB - 1000)
        .unwrap();
    f.sync_all().unwrap();
    assert!(matches!(probe_fs(&dev).unwrap(), Probe::Unknown(_)));

    // A partition table is named.
    f.write_all_at(&[0u8; 64], 16 * MIB - 1000).unwrap();
    f.write_all_at(&[0x55, 0xAA], 510).unwrap();
    f.sync_all().unwrap();
    let p = probe_fs(&dev).unwrap();
    assert!(
        matches!(&p, Probe::Unknown(s) if s.contains("MBR")),
        "{p:?}"
    );

    // Wiping the edges makes it blank again.
    wipe_edges(&dev, MIB).unwrap();
    assert_eq!(probe_fs(&dev).unwrap(), Probe::Blank);
}

#[test]
fn mkfs_mount_write_remount_read_back() {
    crust_testkit::require_root();
    for (fstype, size) in [(FsType::Ext4, 64 * MIB), (FsType::Xfs, 320 * MIB)] {
        let dir = tempfile::tempdir().unwrap();
        let img = sparse(dir.path(), "fs.img", size);
        let mnt = mkdir(dir.path(), "mnt");
        let lg = LoopGuard::attach(&img, rw()).unwrap();
        let dev = lg.path().to_path_buf();
        mkfs(&dev, fstype).unwrap();
        let probed = probe_fs(&dev).unwrap();
        assert_eq!(probed.fs_type(), Some(fstype), "{probed:?}");
        // Second mkfs refuses: the device now holds a filesystem.
        assert!(matches!(mkfs(&dev, fstype), Err(FsError::NotBlank { .. })));

        let opts = vec!["noatime".to_string()];
        let mg = MountGuard::mount_fs(&dev, &mnt, fstype, &opts, false).unwrap();
        assert!(is_mountpoint(&mnt).unwrap());
        let m = find_mount(&mnt).unwrap().expect("mounted");
        assert_eq!(m.fs_type, fstype.as_str());
        assert!(m.mount_options.iter().any(|o| o == "noatime"));
        // Idempotent; a different read-only-ness is a conflict.
        mount_fs(&dev, &mnt, fstype, &opts, false).unwrap();
        assert!(matches!(
            mount_fs(&dev, &mnt, fstype, &[], true),
            Err(MountError::ReadOnlyMismatch { .. })
        ));

        let data = crust_testkit::noise(300_000, 9);
        std::fs::write(mnt.join("payload"), &data).unwrap();
        let u = usage(&mnt).unwrap();
        assert!(u.bytes_total > 0 && u.bytes_total <= size);
        assert!(u.bytes_used >= 300_000, "{u:?}");
        assert!(u.bytes_available > 0 && u.bytes_available < u.bytes_total);
        assert!(u.inodes_used >= 2 && u.inodes_used + u.inodes_free == u.inodes_total);
        mg.unmount().unwrap();
        assert!(!is_mountpoint(&mnt).unwrap());
        unmount(&mnt).unwrap(); // idempotent
        assert!(!mnt.join("payload").exists());

        let mg = MountGuard::mount_fs(&dev, &mnt, fstype, &[], true).unwrap();
        assert_eq!(std::fs::read(mnt.join("payload")).unwrap(), data);
        assert!(find_mount(&mnt).unwrap().unwrap().is_read_only());
        assert!(std::fs::write(mnt.join("new"), b"x").is_err());
        drop(mg);
        drop(lg);
    }
}

#[test]
fn invalid_options_mount_nothing() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "opt.img", 32 * MIB);
    let mnt = mkdir(dir.path(), "mnt");
    let lg = LoopGuard::attach(&img, rw()).unwrap();
    mkfs(lg.path(), FsType::Ext4).unwrap();
    let err = mount_fs(
        lg.path(),
        &mnt,
        FsType::Ext4,
        &["errors=panic".to_string()],
        false,
    )
    .unwrap_err();
    assert!(matches!(err, MountError::InvalidOption { .. }), "{err}");
    assert!(!is_mountpoint(&mnt).unwrap());
    let err = mount_fs(
        lg.path(),
        &dir.path().join("missing"),
        FsType::Ext4,
        &[],
        false,
    )
    .unwrap_err();
    assert!(matches!(err, MountError::BadTarget(_)), "{err}");
}

#[test]
fn bind_mounts_dir_and_block_device() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "bind.img", 32 * MIB);
    let stage = mkdir(dir.path(), "stage");
    let publish = mkdir(dir.path(), "publish");
    let raw_target = dir.path().join("raw");
    File::create(&raw_target).unwrap();
    let lg = LoopGuard::attach(&img, rw()).unwrap();
    let dev = lg.path().to_path_buf();
    mkfs(&dev, FsType::Ext4).unwrap();
    let _stage_g = MountGuard::mount_fs(&dev, &stage, FsType::Ext4, &[], false).unwrap();
    std::fs::write(stage.join("f"), b"hello").unwrap();

    bind_mount(&stage, &publish, true).unwrap();
    let pub_g = MountGuard::new(&publish);
    assert_eq!(std::fs::read(publish.join("f")).unwrap(), b"hello");
    let e = std::fs::write(publish.join("g"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(30), "EROFS expected, got {e}");
    // The staging mount stays writable.
    std::fs::write(stage.join("g"), b"x").unwrap();
    bind_mount(&stage, &publish, true).unwrap(); // idempotent
    assert!(matches!(
        bind_mount(&stage, &publish, false),
        Err(MountError::ReadOnlyMismatch { .. })
    ));
    let other = mkdir(dir.path(), "other");
    assert!(matches!(
        bind_mount(&other, &publish, true),
        Err(MountError::TargetInUse { .. })
    ));
    // Health of the publish path follows the bind mount to the device.
    assert_eq!(fs_health(&dev, &publish, true), Health::Ok);
    drop(pub_g);

    // Raw block: the device node bound onto a file.
    bind_mount(&dev, &raw_target, false).unwrap();
    let _raw_g = MountGuard::new(&raw_target);
    assert!(is_mountpoint(&raw_target).unwrap());
    assert_eq!(block_device_size(&raw_target).unwrap(), 32 * MIB);
}

#[test]
fn grow_fs_online_ext4_and_xfs() {
    crust_testkit::require_root();
    for (fstype, small, big) in [
        (FsType::Ext4, 64 * MIB, 128 * MIB),
        (FsType::Xfs, 304 * MIB, 400 * MIB),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let img = sparse(dir.path(), "g.img", small);
        let mnt = mkdir(dir.path(), "mnt");
        let lg = LoopGuard::attach(&img, rw()).unwrap();
        let dev = lg.path().to_path_buf();
        mkfs(&dev, fstype).unwrap();
        // The superblock spans the whole new device.
        assert_eq!(fs_bytes(&dev, fstype).unwrap(), small, "{fstype}");
        assert!(!fs_needs_grow(&dev, fstype).unwrap());
        let other = if fstype == FsType::Ext4 {
            FsType::Xfs
        } else {
            FsType::Ext4
        };
        assert!(fs_bytes(&dev, other).is_err(), "{fstype} read as {other}");
        let mg = MountGuard::mount_fs(&dev, &mnt, fstype, &[], false).unwrap();
        std::fs::write(mnt.join("keep"), b"still here").unwrap();
        let before = usage(&mnt).unwrap().bytes_total;

        File::options()
            .write(true)
            .open(&img)
            .unwrap()
            .set_len(big)
            .unwrap();
        assert_eq!(refresh_capacity(&dev).unwrap(), big);
        assert!(fs_needs_grow(&dev, fstype).unwrap());
        // Wrong mount point is refused.
        assert!(matches!(
            grow_fs(&dev, dir.path(), fstype),
            Err(FsError::NotMounted { .. })
        ));
        let after = if fstype == FsType::Ext4 && !can_grow_ext4_online() {
            // Sandboxes without CAP_SYS_RESOURCE: the kernel refuses the
            // online resize ioctl, and we must say why instead of the
            // tool's bare "Permission denied". Then grow offline.
            let err = grow_fs(&dev, &mnt, fstype).unwrap_err();
            assert!(
                matches!(
                    err,
                    FsError::MissingCapability {
                        capability: "CAP_SYS_RESOURCE",
                        ..
                    }
                ),
                "{err}"
            );
            assert!(matches!(
                grow_fs_offline(&dev, fstype),
                Err(FsError::InUse { .. })
            ));
            mg.unmount().unwrap();
            grow_fs_offline(&dev, fstype).unwrap();
            grow_fs_offline(&dev, fstype).unwrap();
            let _mg = MountGuard::mount_fs(&dev, &mnt, fstype, &[], false).unwrap();
            let after = usage(&mnt).unwrap().bytes_total;
            assert_eq!(std::fs::read(mnt.join("keep")).unwrap(), b"still here");
            after
        } else {
            let after = grow_fs(&dev, &mnt, fstype).unwrap();
            assert_eq!(usage(&mnt).unwrap().bytes_total, after);
            // Growing again is a no-op.
            assert_eq!(grow_fs(&dev, &mnt, fstype).unwrap(), after);
            assert_eq!(std::fs::read(mnt.join("keep")).unwrap(), b"still here");
            drop(mg);
            after
        };
        assert!(
            after > before + (big - small) / 2,
            "{fstype}: {before} -> {after}"
        );
        assert!(!fs_needs_grow(&dev, fstype).unwrap(), "{fstype} grown");
        assert!(after <= big);
        if fstype == FsType::Xfs {
            assert!(matches!(
                grow_fs_offline(&dev, fstype),
                Err(FsError::OfflineGrowUnsupported(_))
            ));
        }
    }
}

#[test]
fn health_ok_then_remounted_read_only() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "h.img", 32 * MIB);
    let mnt = mkdir(dir.path(), "mnt");
    let lg = LoopGuard::attach(&img, rw()).unwrap();
    let dev = lg.path().to_path_buf();
    mkfs(&dev, FsType::Ext4).unwrap();
    let mg = MountGuard::mount_fs(&dev, &mnt, FsType::Ext4, &[], false).unwrap();
    assert_eq!(fs_health(&dev, &mnt, false), Health::Ok);
    assert_eq!(
        fs_health_with_timeout(&dev, &mnt, false, DEFAULT_HEALTH_TIMEOUT),
        Health::Ok
    );
    assert_eq!(device_health(&dev), Health::Ok);

    // The wrong device for this mount point.
    let h = fs_health(Path::new("/dev/zero"), &mnt, false);
    assert!(matches!(&h, Health::Abnormal(_)), "{h:?}");

    let st = Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(st.success());
    let h = fs_health(&dev, &mnt, false);
    match &h {
        Health::Abnormal(s) => {
            let m = &s.message;
            assert!(m.contains("read-only"), "{m}");
            assert!(m.contains(&dev.display().to_string()), "{m}");
            assert!(
                matches!(
                    s.kind,
                    SymptomKind::FilesystemReadOnly | SymptomKind::MountReadOnly
                ),
                "{s:?}"
            );
        }
        Health::Ok => panic!("read-only remount not detected"),
    }
    // Read-only was what a read-only publish expects.
    assert_eq!(fs_health(&dev, &mnt, true), Health::Ok);

    mg.unmount().unwrap();
    let h = fs_health(&dev, &mnt, false);
    assert!(
        matches!(&h, Health::Abnormal(s) if s.message.contains("not mounted")
            && s.kind == SymptomKind::NotMounted),
        "{h:?}"
    );
    drop(lg);
    // A loop device that lost its backing store shows as size 0; an empty
    // backing file gives the same picture without racing other tests.
    let empty = sparse(dir.path(), "empty.img", 0);
    let eg = LoopGuard::attach(&empty, rw()).unwrap();
    let h = device_health(eg.path());
    assert!(
        matches!(&h, Health::Abnormal(s) if s.message.contains("size 0")
            && s.kind == SymptomKind::DeviceEmpty),
        "{h:?}"
    );
    let h = device_health(&dir.path().join("no-such-dev"));
    assert!(
        matches!(&h, Health::Abnormal(s) if s.message.contains("no longer exists")
            && s.kind == SymptomKind::DeviceMissing),
        "{h:?}"
    );
}

#[test]
fn health_detects_xfs_shutdown() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "x.img", 304 * MIB);
    let mnt = mkdir(dir.path(), "mnt");
    let lg = LoopGuard::attach(&img, rw()).unwrap();
    let dev = lg.path().to_path_buf();
    mkfs(&dev, FsType::Xfs).unwrap();
    let _mg = MountGuard::mount_fs(&dev, &mnt, FsType::Xfs, &[], false).unwrap();
    assert_eq!(fs_health(&dev, &mnt, false), Health::Ok);
    let st = Command::new("xfs_io")
        .args(["-x", "-c", "shutdown"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(st.success());
    let h = fs_health_with_timeout(&dev, &mnt, false, DEFAULT_HEALTH_TIMEOUT);
    assert!(
        matches!(&h, Health::Abnormal(s) if s.message.contains("I/O error")
            && s.message.contains("xfs_repair")
            && s.kind == SymptomKind::FilesystemIoErrors),
        "{h:?}"
    );
}

#[test]
fn usage_of_missing_path_is_an_error() {
    let e = usage(Path::new("/nonexistent/crust/path")).unwrap_err();
    assert_eq!(e.source.kind(), std::io::ErrorKind::NotFound);
}

/// Plays a guest's QEMU: another process holding `dev` open read-write
/// without `O_EXCL`, as its stdin. Killed and reaped on drop.
fn hold_open(dev: &Path) -> crust_testkit::ChildGuard {
    let f = OpenOptions::new().read(true).write(true).open(dev).unwrap();
    let child = Command::new("sleep")
        .arg("600")
        .stdin(f)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    crust_testkit::ChildGuard::new(child)
}

/// The ext4 primary superblock (1 KiB at offset 1 KiB), read past the
/// page cache's staleness by a fresh open.
fn ext4_superblock(dev: &Path) -> Vec<u8> {
    let mut sb = vec![0u8; 1024];
    File::open(dev)
        .unwrap()
        .read_exact_at(&mut sb, 1024)
        .unwrap();
    assert_eq!(&sb[0x38..0x3a], &[0x53, 0xef], "ext4 magic");
    sb
}

fn ext4_blocks(sb: &[u8]) -> u32 {
    u32::from_le_bytes(sb[4..8].try_into().unwrap())
}

#[test]
fn other_openers_are_found_and_block_fsck_grow_mkfs_and_wipe() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "guest.img", 32 * MIB);
    let blank_img = sparse(dir.path(), "blank.img", 16 * MIB);
    let lg = LoopGuard::attach(&img, rw()).unwrap();
    let blank_lg = LoopGuard::attach(&blank_img, rw()).unwrap();
    let (dev, blank) = (lg.path().to_path_buf(), blank_lg.path().to_path_buf());
    mkfs(&dev, FsType::Ext4).unwrap();

    // Nobody else: our own descriptors do not count.
    let own = File::open(&dev).unwrap();
    assert_eq!(device_openers(&dev).unwrap(), vec![]);
    assert!(!is_device_in_use(&dev).unwrap());
    drop(own);

    // The volume grows while a "guest" has it: the host must not fsck or
    // resize it, although O_EXCL says it is free.
    let mut qemu = hold_open(&dev);
    let pid = qemu.child().id();
    // The blank device is held through another node with its numbers
    // (found by numbers, not by path).
    let alias = dir.path().join("alias-node");
    let (major, minor) = device_major_minor(&blank).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &alias,
        rustix::fs::FileType::BlockDevice,
        rustix::fs::Mode::from_raw_mode(0o600),
        rustix::fs::makedev(major, minor),
    )
    .unwrap();
    let mut blank_holder = hold_open(&alias);
    let blank_pid = blank_holder.child().id();
    let sb_before = ext4_superblock(&dev);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    assert_eq!(refresh_capacity(&dev).unwrap(), 64 * MIB);

    assert!(!is_device_held_exclusively(&dev).unwrap(), "no O_EXCL");
    let openers = device_openers(&dev).unwrap();
    assert_eq!(
        openers,
        vec![Opener {
            pid,
            comm: "sleep".into()
        }]
    );
    assert!(is_device_in_use(&dev).unwrap());

    let err = grow_fs_offline(&dev, FsType::Ext4).unwrap_err();
    match &err {
        FsError::OpenElsewhere {
            device,
            opener,
            others: 0,
            ..
        } => {
            assert_eq!(device, &dev);
            assert_eq!(opener.pid, pid);
        }
        other => panic!("{other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("is open by pid {pid} (sleep)"))
            && msg
                .contains("refusing to check or grow a filesystem another kernel may have mounted"),
        "{msg}"
    );
    assert_eq!(
        ext4_superblock(&dev),
        sb_before,
        "no e2fsck or resize2fs touched the superblock"
    );

    // A blank device held open is not formatted.
    assert_eq!(
        device_openers(&blank).unwrap(),
        vec![Opener {
            pid: blank_pid,
            comm: "sleep".into()
        }]
    );
    let err = mkfs(&blank, FsType::Ext4).unwrap_err();
    assert!(
        matches!(&err, FsError::OpenElsewhere { opener, .. } if opener.pid == blank_pid),
        "{err}"
    );
    assert_eq!(probe_fs(&blank).unwrap(), Probe::Blank, "nothing written");

    // wipe_edges would destroy the guest's data: refused, data kept.
    let err = wipe_edges(&dev, MIB).unwrap_err();
    assert!(err.to_string().contains(&format!("pid {pid}")), "{err}");
    assert_eq!(ext4_superblock(&dev), sb_before);

    // The "guest" stops: now the offline growth runs.
    drop(qemu);
    drop(blank_holder);
    assert_eq!(device_openers(&dev).unwrap(), vec![]);
    grow_fs_offline(&dev, FsType::Ext4).unwrap();
    let sb_after = ext4_superblock(&dev);
    assert!(
        ext4_blocks(&sb_after) > ext4_blocks(&sb_before),
        "{} -> {}",
        ext4_blocks(&sb_before),
        ext4_blocks(&sb_after)
    );
    mkfs(&blank, FsType::Ext4).unwrap();
}

/// The hand-to-guest check: a mounted device (in this or another mount
/// namespace), a device another claim holds, a mounted partition's disk
/// are refused with the holder named; while crust holds a device the
/// kernel refuses host mounts and mkfs; after the hold it is free again.
/// A process that mounts `dev` at `mnt` in a mount namespace of its own
/// and lives `secs` seconds more; returns once it is mounted there.
fn mounted_in_another_namespace(dev: &Path, mnt: &Path, secs: &str) -> std::process::Child {
    let script = format!(
        "mount -t ext4 {} {} && echo up && exec sleep {secs}",
        dev.display(),
        mnt.display()
    );
    let mut child = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "up");
    child
}

#[test]
fn exclusive_claims_refuse_mounted_and_held_devices_and_block_host_use() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "held.img", 32 * MIB);
    let guard = LoopGuard::attach(&img, rw()).unwrap();
    let dev = guard.path().to_path_buf();
    mkfs(&dev, FsType::Ext4).unwrap();
    let mnt = mkdir(dir.path(), "mnt");

    // Mounted on the host: refused, the mount named.
    let m = MountGuard::mount_fs(&dev, &mnt, FsType::Ext4, &[], false).unwrap();
    let e = claim_exclusive(&dev, true, HAND_TO_GUEST).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ClaimError::InUse { .. }), "{msg}");
    assert!(
        msg.contains(mnt.to_str().unwrap()) && msg.contains("hand it to a guest"),
        "{msg}"
    );
    // Host mounts are nosuid,nodev unless asked otherwise.
    let entry = find_mount(&mnt).unwrap().unwrap();
    assert!(
        entry.mount_options.iter().any(|o| o == "nosuid"),
        "{entry:?}"
    );
    assert!(
        entry.mount_options.iter().any(|o| o == "nodev"),
        "{entry:?}"
    );
    m.unmount().unwrap();
    MountGuard::mount_fs(
        &dev,
        &mnt,
        FsType::Ext4,
        &["suid".into(), "dev".into()],
        false,
    )
    .map(|m| {
        let entry = find_mount(&mnt).unwrap().unwrap();
        assert!(
            !entry
                .mount_options
                .iter()
                .any(|o| o == "nosuid" || o == "nodev"),
            "{entry:?}"
        );
        m.unmount().unwrap();
    })
    .unwrap();

    // Mounted only in another mount namespace: still refused.
    let mut child = mounted_in_another_namespace(&dev, &mnt, "30");
    assert!(
        find_mount(&mnt).unwrap().is_none(),
        "not mounted in our namespace"
    );
    let msg = claim_exclusive(&dev, false, HAND_TO_GUEST)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("mount namespace of pid"), "{msg}");
    let _ = child.kill();
    let _ = child.wait();
    // The namespace goes with its last process; the kernel lets go of
    // the mount right after.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while ensure_device_free(&dev, HAND_TO_GUEST).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "mount namespace lingers"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    // A copy of the mount that lives a moment only (a process setting up a
    // namespace of its own when the device was still mounted here): the
    // claim waits it out instead of refusing.
    let mut child = mounted_in_another_namespace(&dev, &mnt, "0.05");
    ensure_device_free(&dev, HAND_TO_GUEST).unwrap();
    let _ = child.wait();

    // Held by a claim (a guest's): a second claim, a host mount and mkfs
    // are refused by the kernel; the data stays.
    let hold = claim_exclusive(&dev, true, HAND_TO_GUEST).unwrap();
    assert!(claim_exclusive(&dev, false, HAND_TO_GUEST).is_err());
    assert!(mount_fs(&dev, &mnt, FsType::Ext4, &[], false).is_err());
    assert!(find_mount(&mnt).unwrap().is_none());
    let mkfs_status = Command::new("mkfs.ext4")
        .args(["-F", "-q"])
        .arg(&dev)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(
        !mkfs_status.success(),
        "mkfs must fail while the device is held"
    );
    drop(hold);
    assert_eq!(probe_fs(&dev).unwrap(), Probe::Fs(FsType::Ext4));
    ensure_device_free(&dev, HAND_TO_GUEST).unwrap();
}

/// The data file the alias tests write and read back (through debugfs,
/// so reading it mounts nothing).
const ALIAS_DATA: &str = "data.bin";

fn debugfs_cat(image: &Path, file: &str) -> Vec<u8> {
    let out = Command::new("debugfs")
        .args(["-R", &format!("cat /{file}")])
        .arg(image)
        .stderr(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "debugfs cat {file}");
    out.stdout
}

/// Issue 24: a device whose data another block device exposes (its
/// backing file attached again and mounted, a hard link of it attached, a
/// loop stacked on it) is never claimed: refused naming the alias and why,
/// nothing held, attached or mounted by the refusal, the bytes unchanged
/// and the filesystem clean; with the alias gone the claim succeeds.
#[test]
fn claims_refuse_devices_whose_data_another_device_exposes() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let data = crust_testkit::noise(256 * 1024, 24);
    for case in crust_testkit::AliasCase::ALL {
        let img = sparse(dir.path(), "vol.img", 32 * MIB);
        let guard = LoopGuard::attach(&img, rw()).unwrap();
        let dev = guard.path().to_path_buf();
        mkfs(&dev, FsType::Ext4).unwrap();
        let mnt = mkdir(dir.path(), "mnt");
        let m = MountGuard::mount_fs(&dev, &mnt, FsType::Ext4, &[], false).unwrap();
        std::fs::write(mnt.join(ALIAS_DATA), &data).unwrap();
        m.unmount().unwrap();
        std::fs::remove_dir(&mnt).unwrap();

        let alias = case.make(&img, &dev);
        let bound_before = find_all_by_backing(&img).unwrap();
        let image_before = crust_testkit::sha256(&img);
        let e = claim_exclusive(&dev, true, HAND_TO_GUEST).unwrap_err();
        let msg = e.to_string();
        assert!(e.is_refusal(), "{case:?}: {msg}");
        let why = match case {
            crust_testkit::AliasCase::Stacked => format!("backed by {} itself", dev.display()),
            _ => "bound to the same backing file (inode".into(),
        };
        assert!(
            msg.contains(&format!("{} ", alias.dev_str()))
                && msg.contains(&why)
                && msg.contains("refusing to hand it to a guest"),
            "{case:?}: {msg}"
        );
        assert!(
            matches!(&e, ClaimError::Aliased(AliasError::Found { aliases, .. }) if aliases.len() == 1),
            "{case:?}: {msg}"
        );
        // The refusal holds, attaches and mounts nothing.
        ensure_released(&dev, "check").unwrap();
        assert_eq!(find_all_by_backing(&img).unwrap(), bound_before);
        assert!(
            mount_info()
                .unwrap()
                .iter()
                .all(|m| Some((m.major, m.minor)) != device_major_minor(&dev).ok()),
            "{case:?}: the volume's device got mounted"
        );
        if alias.mount_point().is_none() {
            assert_eq!(crust_testkit::sha256(&img), image_before, "{case:?}");
        }
        drop(alias);

        // The alias gone, the same claim succeeds.
        drop(claim_exclusive(&dev, true, HAND_TO_GUEST).unwrap());
        drop(guard);
        assert!(find_all_by_backing(&img).unwrap().is_empty(), "{case:?}");
        crust_testkit::assert_fsck_clean(&img);
        assert_eq!(debugfs_cat(&img, ALIAS_DATA), data, "{case:?}");
        std::fs::remove_file(&img).unwrap();
    }
}

/// A partition of another loop bound to the same file is named too (the
/// second attach with partition scanning, as `losetup -P` does; the
/// partition added with BLKPG, as this kernel parses no partition tables).
#[test]
fn claims_name_the_partitions_of_an_alias() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "parts.img", 16 * MIB);
    let guard = LoopGuard::attach(&img, rw()).unwrap();
    let alias = crust_testkit::losetup(&img, true);
    let name = alias
        .path()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let status = Command::new("addpart")
        .arg(alias.path())
        .args(["1", "2048", "16384"])
        .status()
        .unwrap();
    assert!(status.success(), "addpart");
    assert!(Path::new(&format!("/sys/block/{name}/{name}p1")).exists());
    let msg = ensure_device_free(guard.path(), HAND_TO_GUEST)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains(&format!(
            "/dev/{name}p1 is a partition of /dev/{name}, which is bound to the same backing file"
        )),
        "{msg}"
    );
    // The file itself (a VM image handed as a file) is refused as well:
    // both loops expose it.
    let msg = ensure_device_free(&img, HAND_TO_GUEST)
        .unwrap_err()
        .to_string();
    assert!(msg.contains(guard.path().to_str().unwrap()), "{msg}");
}

/// A loop device `losetup` made (a window of a file), detached on drop.
struct Losetup(PathBuf);

impl Losetup {
    fn attach(args: &[&str], file: &Path) -> Losetup {
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .args(args)
            .arg(file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        Losetup(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()))
    }
}

impl Drop for Losetup {
    fn drop(&mut self) {
        let _ = detach(&self.0);
    }
}

/// [`route`] asked through a descriptor of `dev`, as a hold would.
fn route_of(dev: &Path, writable: bool) -> Route {
    let held = File::open(dev).unwrap();
    route(std::os::fd::AsFd::as_fd(&held), dev, writable)
}

fn route_reason(dev: &Path, writable: bool) -> String {
    match route_of(dev, writable) {
        Route::Device(why) => why,
        Route::BackingFile(_) => panic!("{} was bypassed", dev.display()),
    }
}

#[test]
fn route_hands_out_only_the_whole_proven_backing_file() {
    use std::os::unix::fs::MetadataExt;
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "vol.img", 8 * MIB);
    let guard = LoopGuard::attach(&img, rw()).unwrap();
    let dev = guard.path().to_path_buf();

    // The whole file, read-write: the descriptor is that inode, writable.
    let Route::BackingFile(fd) = route_of(&dev, true) else {
        panic!("{}", route_reason(&dev, true))
    };
    let file = File::from(fd);
    let meta = file.metadata().unwrap();
    assert_eq!(meta.ino(), std::fs::metadata(&img).unwrap().ino());
    file.write_all_at(b"through the file", 4096).unwrap();
    let mut back = [0u8; 16];
    File::open(&img)
        .unwrap()
        .read_exact_at(&mut back, 4096)
        .unwrap();
    assert_eq!(&back, b"through the file");
    assert_eq!(backing_file_bytes(&dev).unwrap(), 8 * MIB);

    // The block layer's read-only flag: no writable file.
    set_read_only(&dev, true).unwrap();
    assert!(route_reason(&dev, true).contains("read-only"));
    let Route::BackingFile(ro) = route_of(&dev, false) else {
        panic!("a read-only route was refused")
    };
    assert!(File::from(ro).write_all_at(b"x", 0).is_err());
    set_read_only(&dev, false).unwrap();

    // The path now names another file (bound over it): not the loop's.
    let other = sparse(dir.path(), "other.img", 8 * MIB);
    bind_mount(&other, &img, false).unwrap();
    let bound = MountGuard::new(&img);
    let why = route_reason(&dev, true);
    assert!(why.contains("the loop reads inode"), "{why}");
    drop(bound);

    // The file replaced under its name: the loop reads the old inode.
    std::fs::rename(&other, &img).unwrap();
    assert!(route_reason(&dev, true).contains("deleted or replaced"));
}

#[test]
fn route_keeps_windows_read_only_loops_and_other_devices() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "vol.img", 8 * MIB);
    let window = Losetup::attach(&["--offset", "1048576"], &img);
    assert!(route_reason(&window.0, false).contains("offset 1048576"));
    let limited = Losetup::attach(&["--sizelimit", "4194304"], &img);
    let why = route_reason(&limited.0, false);
    assert!(why.contains("4194304"), "{why}");

    let ro = LoopGuard::attach(
        &img,
        AttachOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(route_reason(ro.path(), true).contains("read-only"));
    assert!(matches!(route_of(ro.path(), false), Route::BackingFile(_)));

    // A loop device bound to nothing (the window's own node, detached).
    let gone = window.0.clone();
    drop(window);
    let why = route_reason(&gone, true);
    assert!(why.contains("bound to no file"), "{why}");

    // A block device that is no loop (the machine's disk, read-only open).
    let disk = std::fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with("loop"))
        .map(|n| PathBuf::from(format!("/dev/{n}")))
        .find(|p| is_block_device(p) && File::open(p).is_ok());
    match disk {
        Some(d) => assert_eq!(route_reason(&d, false), "not a loop device"),
        None => eprintln!("no block device but loops here: not-a-loop case skipped"),
    }
}

#[test]
fn holds_flush_what_the_device_cache_kept_from_before() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = sparse(dir.path(), "vol.img", 8 * MIB);
    let guard = LoopGuard::attach(
        &img,
        AttachOptions {
            direct_io: true,
            ..Default::default()
        },
    )
    .unwrap();
    let dev = guard.path().to_path_buf();
    let read_dev = |f: &File| {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, 0).unwrap();
        b
    };
    // A reader that keeps the device open keeps its page cache too
    // (udev's probe, a monitoring tool), here while a guest has it.
    let reader = File::open(&dev).unwrap();
    let hold = claim_exclusive(&dev, true, HAND_TO_GUEST).unwrap();
    assert_eq!(read_dev(&reader), [0; 8]);

    // The guest's QEMU writes the backing file around the loop device.
    let Route::BackingFile(fd) = route_of(&dev, true) else {
        panic!("{}", route_reason(&dev, true))
    };
    File::from(fd).write_all_at(b"guest!!!", 0).unwrap();
    assert_eq!(read_dev(&reader), [0; 8], "the stale cache this guards");
    drop(hold);
    assert_eq!(&read_dev(&reader), b"guest!!!");

    // A hold taken after a holder that never flushed (a crashed runtime).
    File::from(match route_of(&dev, true) {
        Route::BackingFile(fd) => fd,
        Route::Device(why) => panic!("{why}"),
    })
    .write_all_at(b"crashed!", 0)
    .unwrap();
    assert_eq!(read_dev(&reader), *b"guest!!!");
    let next = claim_exclusive(&dev, false, crust_blockdev::fs::FORMAT).unwrap();
    assert_eq!(&read_dev(&reader), b"crashed!");
    drop(next);
}
