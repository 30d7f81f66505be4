//! StaticBackend with loop devices standing in for pre-provisioned disks.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crust_backend::*;
use crust_blockdev::{AttachOptions, FsType, LoopGuard, MountGuard, Probe};

const MIB: u64 = 1 << 20;

struct Disks {
    dir: tempfile::TempDir,
    // Declared after `dir`: dropped (detached) before the files go.
    loops: Vec<LoopGuard>,
}

impl Disks {
    fn new(sizes_mib: &[u64]) -> Disks {
        crust_testkit::require_root();
        let dir = tempfile::tempdir().unwrap();
        let mut loops = Vec::new();
        for (i, s) in sizes_mib.iter().enumerate() {
            let img = dir.path().join(format!("disk{i}.img"));
            File::create(&img).unwrap().set_len(s * MIB).unwrap();
            loops.push(LoopGuard::attach(&img, AttachOptions::default()).unwrap());
        }
        Disks { dir, loops }
    }

    fn dev(&self, i: usize) -> PathBuf {
        self.loops[i].path().to_path_buf()
    }

    fn devices(&self) -> Vec<PathBuf> {
        self.loops.iter().map(|l| l.path().to_path_buf()).collect()
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state/claims.json")
    }

    fn open(&self) -> StaticBackend {
        StaticBackend::open(StaticConfig {
            devices: self.devices(),
            state_file: self.state(),
        })
        .unwrap()
    }
}

#[test]
fn claims_smallest_fitting_device_and_reports_exhaustion() {
    let d = Disks::new(&[32, 8, 16]);
    let b = d.open();
    assert_eq!(b.kind(), "static");
    b.probe().unwrap();
    let cap = b.capacity().unwrap();
    assert_eq!(cap.available_bytes, 56 * MIB);
    assert_eq!(cap.maximum_volume_size, 32 * MIB);
    assert_eq!(cap.minimum_volume_size, 8 * MIB);

    let a = b.create("a", 10 * MIB, 0).unwrap();
    assert_eq!(a.backing, d.dev(2));
    assert_eq!(a.size_bytes, 16 * MIB, "the device's real size");
    assert_eq!(b.create("a", 10 * MIB, 0).unwrap(), a);
    assert_eq!(b.create("a", 16 * MIB, 16 * MIB).unwrap(), a);
    assert!(matches!(
        b.create("a", 20 * MIB, 0),
        Err(BackendError::SizeMismatch { .. })
    ));

    // Nothing is in [20, 24] MiB; nothing is 40 MiB at all.
    assert!(matches!(
        b.create("x", 20 * MIB, 24 * MIB),
        Err(BackendError::OutOfRange(..))
    ));
    assert!(matches!(
        b.create("x", 40 * MIB, 0),
        Err(BackendError::OutOfRange(..))
    ));
    assert!(matches!(
        b.create("x", 20 * MIB, 10 * MIB),
        Err(BackendError::OutOfRange(..))
    ));

    let small = b.create("small", MIB, 0).unwrap();
    assert_eq!(small.backing, d.dev(1));
    let c = b.create("c", 20 * MIB, 0).unwrap();
    assert_eq!(c.backing, d.dev(0));
    // Devices that would fit exist but are all claimed.
    assert!(matches!(
        b.create("d", MIB, 0),
        Err(BackendError::Exhausted { requested, available: 0 }) if requested == MIB
    ));
    assert_eq!(b.capacity().unwrap().available_bytes, 0);
    let ids: Vec<String> = b.list().unwrap().into_iter().map(|a| a.volume_id).collect();
    assert_eq!(ids, ["a", "c", "small"]);
    assert_eq!(b.attach("a").unwrap(), d.dev(2));
    assert_eq!(b.attached_device("a").unwrap(), Some(d.dev(2)));
    b.detach("a").unwrap();
    assert!(matches!(b.attach("zz"), Err(BackendError::NotFound(_))));
}

#[test]
fn delete_wipes_the_device_for_the_next_claimant() {
    let d = Disks::new(&[16, 16]);
    let b = d.open();
    let a = b.create("a", 16 * MIB, 0).unwrap();
    let dev = b.attach("a").unwrap();
    crust_blockdev::mkfs(&dev, FsType::Ext4).unwrap();
    assert_eq!(
        crust_blockdev::probe_fs(&dev).unwrap(),
        Probe::Fs(FsType::Ext4)
    );
    let f = File::options().read(true).write(true).open(&dev).unwrap();
    f.write_all_at(b"middle", 8 * MIB).unwrap();
    f.write_all_at(b"tail", 16 * MIB - 4096).unwrap();
    f.sync_all().unwrap();

    // Mounted: not released, not wiped.
    let mnt = d.dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mg = MountGuard::mount_fs(&dev, &mnt, FsType::Ext4, &[], true).unwrap();
    let err = b.delete("a").unwrap_err();
    assert!(err.to_string().contains("in use"), "{err}");
    assert!(b.get("a").unwrap().is_some());
    drop(mg);

    b.delete("a").unwrap();
    assert_eq!(b.get("a").unwrap(), None);
    b.delete("a").unwrap();
    assert_eq!(crust_blockdev::probe_fs(&dev).unwrap(), Probe::Blank);
    let mut buf = [0u8; 4];
    f.read_exact_at(&mut buf, 16 * MIB - 4096).unwrap();
    assert_eq!(&buf, &[0; 4], "last MiB wiped");
    let mut buf = [0u8; 6];
    f.read_exact_at(&mut buf, 8 * MIB).unwrap();
    assert_eq!(&buf, b"middle", "only the edges are wiped (documented)");

    // The released device is claimable again (smallest-first, config order).
    let again = b.create("b", MIB, 0).unwrap();
    assert_eq!(again.backing, a.backing);
    assert_eq!(
        crust_blockdev::probe_fs(&again.backing).unwrap(),
        Probe::Blank
    );
}

#[test]
fn claims_survive_reopen_and_lock_is_exclusive() {
    let d = Disks::new(&[8, 16]);
    let b = d.open();
    let a = b.create("a", 10 * MIB, 0).unwrap();
    let err = StaticBackend::open(StaticConfig {
        devices: d.devices(),
        state_file: d.state(),
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("in use by another process"),
        "{err}"
    );
    drop(b);

    let b = d.open();
    assert_eq!(b.get("a").unwrap(), Some(a.clone()));
    assert_eq!(b.list().unwrap(), vec![a.clone()]);
    // The claimed device is not handed out again.
    assert!(matches!(
        b.create("b", 10 * MIB, 0),
        Err(BackendError::Exhausted { .. })
    ));
    let meta = std::fs::metadata(d.state()).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o600
    );
}

#[test]
fn expand_only_within_the_device() {
    let d = Disks::new(&[16]);
    let b = d.open();
    b.create("a", 4 * MIB, 0).unwrap();
    assert_eq!(b.expand("a", 12 * MIB).unwrap(), 16 * MIB);
    assert!(matches!(
        b.expand("a", 20 * MIB),
        Err(BackendError::OutOfRange(..))
    ));
    assert!(matches!(
        b.expand("zz", 20 * MIB),
        Err(BackendError::NotFound(_))
    ));
    // An admin grows the disk underneath; now the expand fits.
    let img = d.dir.path().join("disk0.img");
    File::options()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(24 * MIB)
        .unwrap();
    crust_blockdev::refresh_capacity(&d.dev(0)).unwrap();
    assert_eq!(b.expand("a", 20 * MIB).unwrap(), 24 * MIB);
    assert_eq!(b.get("a").unwrap().unwrap().size_bytes, 24 * MIB);
}

#[test]
fn open_validates_devices() {
    let d = Disks::new(&[8]);
    let open = |devices: Vec<PathBuf>| {
        StaticBackend::open(StaticConfig {
            devices,
            state_file: d.state(),
        })
    };
    assert!(matches!(open(vec![]), Err(BackendError::Invalid(_))));
    assert!(matches!(
        open(vec!["/dev/null".into()]),
        Err(BackendError::Invalid(_))
    ));
    assert!(matches!(
        open(vec!["dev/loop0".into()]),
        Err(BackendError::Invalid(_))
    ));
    assert!(matches!(
        open(vec![d.dir.path().join("nope")]),
        Err(BackendError::Invalid(_))
    ));
    let link = d.dir.path().join("alias");
    std::os::unix::fs::symlink(d.dev(0), &link).unwrap();
    let err = open(vec![d.dev(0), link]).unwrap_err();
    assert!(err.to_string().contains("same device"), "{err}");
    // Nothing was written by the failed opens.
    assert!(!d.state().exists());
}

#[test]
fn backing_state_reports_missing_device_node() {
    let d = Disks::new(&[8]);
    // Configure the disk through a symlink (like /dev/disk/by-id/...).
    let link = d.dir.path().join("by-id-disk");
    std::os::unix::fs::symlink(d.dev(0), &link).unwrap();
    let b = StaticBackend::open(StaticConfig {
        devices: vec![link.clone()],
        state_file: d.state(),
    })
    .unwrap();
    b.create("a", MIB, 0).unwrap();
    assert_eq!(b.backing_state("a"), BackingState::Healthy);
    std::fs::remove_file(&link).unwrap();
    assert!(matches!(b.backing_state("a"), BackingState::Missing(m) if m.contains("is gone")));
    assert!(matches!(b.attach("a"), Err(BackendError::Device(_))));
    assert!(matches!(b.backing_state("zz"), BackingState::Missing(_)));
    // Deleting a volume whose disk vanished releases the claim.
    b.delete("a").unwrap();
    assert_eq!(b.list().unwrap(), vec![]);
    let _ = Path::new("/");
}
