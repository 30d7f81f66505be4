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
            declared_blank: vec![],
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
    // The full read create started proves the device blank first.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while matches!(b.blankness("a").unwrap(), Blankness::Scanning { .. }) {
        assert!(std::time::Instant::now() < deadline, "the read never ended");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
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
    assert_eq!(
        &buf, &[0; 6],
        "a device the volume got blank is zeroed whole (punch hole on a loop device)"
    );

    // The released device is claimable again (smallest-first, config order).
    let again = b.create("b", MIB, 0).unwrap();
    assert_eq!(again.backing, a.backing);
    assert_eq!(
        crust_blockdev::probe_fs(&again.backing).unwrap(),
        Probe::Blank
    );
    assert_eq!(
        b.blankness("b").unwrap(),
        Blankness::Released {
            device: dev.clone(),
            volume: "a".into()
        }
    );
}

#[test]
fn claims_survive_reopen_and_lock_is_exclusive() {
    let d = Disks::new(&[8, 16]);
    let b = d.open();
    let a = b.create("a", 10 * MIB, 0).unwrap();
    let err = StaticBackend::open(StaticConfig {
        devices: d.devices(),
        declared_blank: vec![],
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
            declared_blank: vec![],
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
        declared_blank: vec![],
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

// ---- issue 24: a static device is formatted only with a proof it is blank ----

impl Disks {
    fn open_declaring(&self, declared_blank: Vec<PathBuf>) -> StaticBackend {
        StaticBackend::open(StaticConfig {
            devices: self.devices(),
            declared_blank,
            state_file: self.state(),
        })
        .unwrap()
    }

    /// Writes `bytes` at `offset` through device `i` (as a raw volume or an
    /// operator would), leaving no signature.
    fn write_at(&self, i: usize, offset: u64, bytes: &[u8]) {
        let f = File::options().write(true).open(self.dev(i)).unwrap();
        f.write_all_at(bytes, offset).unwrap();
        f.sync_all().unwrap();
    }

    fn state_json(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.state()).unwrap()).unwrap()
    }
}

/// Asks until the answer is no longer `Scanning` (10 s bound); checks
/// the progress each `Scanning` answer reports.
fn verdict(b: &StaticBackend, volume: &str, dev: &Path, size: u64) -> Blankness {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut last_done = 0;
    loop {
        match b.blankness(volume).unwrap() {
            Blankness::Scanning {
                device,
                done_bytes,
                total_bytes,
            } => {
                assert_eq!((device.as_path(), total_bytes), (dev, size));
                assert!(done_bytes >= last_done && done_bytes <= size);
                last_done = done_bytes;
            }
            other => return other,
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the full read takes too long"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The replayed bug: data only in the middle of a device (edges zero, no
/// signature) passes the edge probe; the full read finds it, the verdict
/// survives a restart, and deleting the volume does not launder it into
/// `Released` (crust never wrote that data).
#[test]
fn data_in_the_middle_is_found_by_a_full_read_and_kept() {
    let d = Disks::new(&[128]);
    let dev = d.dev(0);
    d.write_at(0, 50 * MIB, b"operator data");
    assert_eq!(crust_blockdev::probe_fs(&dev).unwrap(), Probe::Blank);
    // A state file from before verdicts (a claim, no read ever started):
    // it loads, and the first question starts the read.
    std::fs::create_dir_all(d.state().parent().unwrap()).unwrap();
    let old = serde_json::json!({"version": 1, "claims": {"a": {"device": dev, "size_bytes": 128 * MIB}}});
    std::fs::write(d.state(), old.to_string()).unwrap();
    let b = d.open();
    let first = b.blankness("a").unwrap();
    assert!(
        matches!(&first, Blankness::Scanning { device, total_bytes, .. } if *device == dev && *total_bytes == 128 * MIB),
        "{first:?}"
    );
    let holds = Blankness::HoldsData {
        device: dev.clone(),
        offset: 50 * MIB,
        setting: DECLARE_BLANK_SETTING,
    };
    assert_eq!(verdict(&b, "a", &dev, 128 * MIB), holds);
    assert_eq!(DECLARE_BLANK_SETTING, "--static-device-blank");
    let saved = &d.state_json()["verdicts"][dev.to_str().unwrap()];
    assert_eq!(saved["found"]["kind"], "data", "{saved}");
    assert_eq!(saved["device"]["size_bytes"], 128 * MIB);
    let (major, minor) = crust_blockdev::device_major_minor(&dev).unwrap();
    assert_eq!(
        (
            saved["device"]["major"].as_u64(),
            saved["device"]["minor"].as_u64()
        ),
        (Some(major.into()), Some(minor.into()))
    );

    drop(b);
    let b = d.open();
    assert_eq!(
        b.blankness("a").unwrap(),
        holds,
        "kept across a restart, no new read"
    );

    // Deleting wipes the edges; the middle still holds data crust never
    // wrote, so the next claimant's device is read again, not Released.
    b.delete("a").unwrap();
    b.create("b", MIB, 0).unwrap();
    assert_eq!(verdict(&b, "b", &dev, 128 * MIB), holds);
    assert!(matches!(b.blankness("zz"), Err(BackendError::NotFound(_))));
}

/// An all-zero device: `create` starts the read (its verdict reaches the
/// state file without anyone asking), deleting the volume records
/// `Released` for the next claimant, and both survive a restart.
#[test]
fn zero_device_is_read_all_zero_then_released_by_delete() {
    let d = Disks::new(&[64]);
    let dev = d.dev(0);
    let b = d.open();
    b.create("z", MIB, 0).unwrap();
    let key = dev.to_str().unwrap().to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while d.state_json()["verdicts"][&key].is_null() {
        assert!(
            std::time::Instant::now() < deadline,
            "create did not start the read"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(
        d.state_json()["verdicts"][&key]["found"]["kind"],
        "all_zero"
    );
    assert_eq!(
        b.blankness("z").unwrap(),
        Blankness::ReadAllZero {
            device: dev.clone()
        }
    );

    // The volume writes (as crust would after formatting); delete zeroes
    // the whole device (the tenant's data is not crust's) and records it.
    d.write_at(0, 30 * MIB, b"volume data");
    b.delete("z").unwrap();
    assert_eq!(
        crust_blockdev::first_data_offset(&dev, &mut |_, _| {}).unwrap(),
        None,
        "the released device is all zeros"
    );
    b.create("next", MIB, 0).unwrap();
    let released = Blankness::Released {
        device: dev.clone(),
        volume: "z".into(),
    };
    assert_eq!(b.blankness("next").unwrap(), released);
    drop(b);
    let b = d.open();
    assert_eq!(
        b.blankness("next").unwrap(),
        released,
        "kept across a restart"
    );
}

/// A declared device is answered `Declared` without any read (even with
/// data on it: the operator said so), also when declared under another
/// name of the same node; declaring a device that is not configured is
/// refused.
#[test]
fn declared_device_needs_no_read() {
    let d = Disks::new(&[16, 32]);
    d.write_at(1, 8 * MIB, b"whatever");
    let alias = d.dir.path().join("by-id-disk1");
    std::os::unix::fs::symlink(d.dev(1), &alias).unwrap();
    let b = d.open_declaring(vec![alias]);
    b.create("big", 20 * MIB, 0).unwrap();
    b.create("small", MIB, 0).unwrap();
    assert_eq!(
        b.blankness("big").unwrap(),
        Blankness::Declared {
            device: d.dev(1),
            setting: DECLARE_BLANK_SETTING
        }
    );
    // The undeclared one is being read (started by create); the declared
    // one never is.
    assert!(!matches!(
        b.blankness("small").unwrap(),
        Blankness::Declared { .. }
    ));
    verdict(&b, "small", &d.dev(0), 16 * MIB);
    assert!(d.state_json()["verdicts"][d.dev(1).to_str().unwrap()].is_null());
    drop(b);

    let other = Disks::new(&[8]);
    let err = StaticBackend::open(StaticConfig {
        devices: d.devices(),
        declared_blank: vec![other.dev(0)],
        state_file: d.state(),
    })
    .unwrap_err();
    assert!(
        matches!(&err, BackendError::Invalid(m) if m.contains("not one of the configured devices")),
        "{err}"
    );
}

/// A verdict is about one disk: the same node with another size (the disk
/// was replaced or grown) is read again.
#[test]
fn replaced_device_is_read_again() {
    let d = Disks::new(&[32]);
    let dev = d.dev(0);
    let b = d.open();
    b.create("a", MIB, 0).unwrap();
    assert_eq!(
        verdict(&b, "a", &dev, 32 * MIB),
        Blankness::ReadAllZero {
            device: dev.clone()
        }
    );
    drop(b);
    // Another disk behind the same node: bigger, with data.
    let img = d.dir.path().join("disk0.img");
    let f = File::options().write(true).open(&img).unwrap();
    f.set_len(48 * MIB).unwrap();
    f.write_all_at(b"new disk's data", 40 * MIB).unwrap();
    f.sync_all().unwrap();
    crust_blockdev::refresh_capacity(&dev).unwrap();
    let b = d.open();
    assert!(
        matches!(b.blankness("a").unwrap(), Blankness::Scanning { total_bytes, .. } if total_bytes == 48 * MIB)
    );
    assert_eq!(
        verdict(&b, "a", &dev, 48 * MIB),
        Blankness::HoldsData {
            device: dev.clone(),
            offset: 40 * MIB,
            setting: DECLARE_BLANK_SETTING
        }
    );
}
