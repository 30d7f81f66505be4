//! PoolBackend on real sparse files and loop devices (root). Each test
//! uses its own temp pool dir; loop devices and mounts are held by guards.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use crust_backend::*;
use crust_blockdev::{FsType, MountGuard};

const MIB: u64 = 1 << 20;

fn pool(dir: &Path, capacity: u64) -> PoolBackend {
    PoolBackend::open(PoolConfig::new(dir.join("pool"), capacity)).unwrap()
}

/// Loop devices on `file` (live or on a deleted copy). Checked by backing
/// path, not device number: parallel tests reuse freed numbers at once.
fn attached_to(file: &Path) -> Vec<PathBuf> {
    crust_blockdev::find_all_by_backing(file)
        .unwrap()
        .into_iter()
        .map(|s| s.path)
        .collect()
}

/// The pool's directory, and a guard that detaches every loop device
/// still on its images, so a failing assertion leaves nothing behind.
fn setup() -> (tempfile::TempDir, crust_testkit::LoopsUnder) {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let canon = std::fs::canonicalize(dir.path()).unwrap();
    (dir, crust_testkit::LoopsUnder(canon.join("pool")))
}

#[test]
fn create_is_exact_sparse_idempotent_and_bounded() {
    let (dir, _c) = setup();
    let p = pool(dir.path(), 64 * MIB);
    assert_eq!(p.kind(), "pool");
    p.probe().unwrap();
    let cap = p.capacity().unwrap();
    assert_eq!(cap.available_bytes, 64 * MIB);
    assert_eq!(cap.maximum_volume_size, 64 * MIB);
    assert_eq!(cap.minimum_volume_size, DEFAULT_MINIMUM_VOLUME_SIZE);

    let size = 5 * MIB + 4096;
    let a = p.create("vol-a", size, 0).unwrap();
    assert_eq!(a.size_bytes, size);
    let meta = std::fs::metadata(&a.backing).unwrap();
    assert_eq!(meta.len(), size, "exact size, no rounding");
    assert_eq!(meta.blocks(), 0, "sparse");
    assert_eq!(meta.mode() & 0o777, 0o600);
    assert_eq!(p.create("vol-a", size, 0).unwrap(), a);
    assert_eq!(p.get("vol-a").unwrap(), Some(a.clone()));
    assert!(matches!(
        p.create("vol-a", 6 * MIB, 0),
        Err(BackendError::SizeMismatch { existing, requested, .. }) if existing == size && requested == 6 * MIB
    ));
    assert_eq!(p.capacity().unwrap().available_bytes, 64 * MIB - size);

    match p.create("vol-big", 60 * MIB, 0) {
        Err(BackendError::Exhausted {
            requested,
            available,
        }) => {
            assert_eq!(requested, 60 * MIB);
            assert_eq!(available, 64 * MIB - size);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        p.create("tiny", 1000, 0),
        Err(BackendError::OutOfRange(1000, _))
    ));
    assert!(matches!(
        p.create("lim", 4 * MIB, 2 * MIB),
        Err(BackendError::OutOfRange(..))
    ));
    assert!(matches!(
        p.create("", MIB, 0),
        Err(BackendError::Invalid(_))
    ));
    assert!(matches!(
        p.create("a\nb", MIB, 0),
        Err(BackendError::Invalid(_))
    ));
    // Failed creates leave nothing behind.
    assert_eq!(p.list().unwrap().len(), 1);

    // Ids that are not file-name safe still work, under a hashed name.
    let odd = p.create("ns/odd id", MIB, 0).unwrap();
    assert_eq!(odd.backing.parent().unwrap(), p.dir());
    assert!(
        odd.backing
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("ns_odd_id-")
    );

    p.delete("vol-a").unwrap();
    assert!(!a.backing.exists());
    assert_eq!(p.get("vol-a").unwrap(), None);
    p.delete("vol-a").unwrap();
    p.delete("never-existed").unwrap();
    assert_eq!(p.capacity().unwrap().available_bytes, 63 * MIB);
}

#[test]
fn list_is_sorted_by_id() {
    let (dir, _c) = setup();
    let p = pool(dir.path(), 64 * MIB);
    for id in ["charlie", "alpha", "bravo", "Zulu"] {
        p.create(id, MIB, 0).unwrap();
    }
    let ids: Vec<String> = p.list().unwrap().into_iter().map(|a| a.volume_id).collect();
    assert_eq!(ids, ["Zulu", "alpha", "bravo", "charlie"]);
}

#[test]
fn concurrent_creates_never_overcommit() {
    let (dir, _c) = setup();
    let p = pool(dir.path(), 10 * MIB);
    let results: Vec<Result<Allocation>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let p = &p;
                s.spawn(move || p.create(&format!("v{i}"), 3 * MIB, 0))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(ok, 3, "{results:?}");
    assert!(
        results
            .iter()
            .filter(|r| r.is_err())
            .all(|r| matches!(r, Err(BackendError::Exhausted { .. })))
    );
    assert_eq!(p.capacity().unwrap().available_bytes, MIB);
}

#[test]
fn attach_is_idempotent_and_survives_reopen() {
    let (dir, _c) = setup();
    let p = pool(dir.path(), 64 * MIB);
    let a = p.create("vol", 8 * MIB, 0).unwrap();
    assert_eq!(p.attached_device("vol").unwrap(), None);

    // Concurrent attaches of one volume give one device.
    let devs: Vec<PathBuf> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| s.spawn(|| p.attach("vol").unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(devs.iter().all(|d| d == &devs[0]), "{devs:?}");
    let dev = devs[0].clone();
    assert_eq!(p.attach("vol").unwrap(), dev);
    assert_eq!(
        crust_blockdev::find_all_by_backing(&a.backing)
            .unwrap()
            .len(),
        1
    );
    assert_eq!(crust_blockdev::block_device_size(&dev).unwrap(), 8 * MIB);
    assert_eq!(p.backing_state("vol"), BackingState::Healthy);

    let f = File::options().write(true).open(&dev).unwrap();
    f.write_all_at(b"survives restarts", 4096).unwrap();
    f.sync_all().unwrap();
    drop(f);

    // "Restart": a new backend on the same directory finds the device.
    drop(p);
    let p = pool(dir.path(), 64 * MIB);
    assert_eq!(p.get("vol").unwrap(), Some(a.clone()));
    assert_eq!(p.attached_device("vol").unwrap(), Some(dev.clone()));
    assert_eq!(p.attach("vol").unwrap(), dev);
    assert_eq!(
        crust_blockdev::find_all_by_backing(&a.backing)
            .unwrap()
            .len(),
        1
    );

    // Detach keeps the data; attach again reads it back.
    p.detach("vol").unwrap();
    assert_eq!(p.attached_device("vol").unwrap(), None);
    p.detach("vol").unwrap();
    p.detach("unknown").unwrap();
    let dev2 = p.attach("vol").unwrap();
    let mut buf = [0u8; 17];
    File::open(&dev2)
        .unwrap()
        .read_exact_at(&mut buf, 4096)
        .unwrap();
    assert_eq!(&buf, b"survives restarts");
    assert!(matches!(p.attach("nope"), Err(BackendError::NotFound(_))));

    p.delete("vol").unwrap();
    assert!(attached_to(&a.backing).is_empty());
    let _ = dev2;
}

#[test]
fn second_open_of_a_pool_is_refused() {
    let (dir, _c) = setup();
    let p = pool(dir.path(), 64 * MIB);
    let err = PoolBackend::open(PoolConfig::new(dir.path().join("pool"), 64 * MIB)).unwrap_err();
    assert!(
        err.to_string().contains("in use by another process"),
        "{err}"
    );
    drop(p);
    pool(dir.path(), 64 * MIB);
}

#[test]
fn expand_grows_file_and_attached_device() {
    let (dir, _c) = setup();
    let p = pool(dir.path(), 64 * MIB);
    let a = p.create("vol", 8 * MIB, 0).unwrap();
    let dev = p.attach("vol").unwrap();
    assert_eq!(p.expand("vol", 24 * MIB).unwrap(), 24 * MIB);
    assert_eq!(std::fs::metadata(&a.backing).unwrap().len(), 24 * MIB);
    assert_eq!(crust_blockdev::block_device_size(&dev).unwrap(), 24 * MIB);
    assert_eq!(p.get("vol").unwrap().unwrap().size_bytes, 24 * MIB);
    // Never shrinks; asking for less returns the current size.
    assert_eq!(p.expand("vol", 16 * MIB).unwrap(), 24 * MIB);
    assert!(matches!(
        p.expand("vol", 100 * MIB),
        Err(BackendError::Exhausted { requested, .. }) if requested == 76 * MIB
    ));
    assert!(matches!(
        p.expand("nope", 10 * MIB),
        Err(BackendError::NotFound(_))
    ));
    assert_eq!(p.capacity().unwrap().available_bytes, 40 * MIB);
    // Expanding a detached volume just grows the file.
    p.detach("vol").unwrap();
    assert_eq!(p.expand("vol", 32 * MIB).unwrap(), 32 * MIB);
    let dev = p.attach("vol").unwrap();
    assert_eq!(crust_blockdev::block_device_size(&dev).unwrap(), 32 * MIB);
    p.delete("vol").unwrap();
}

#[test]
fn delete_refuses_a_mounted_volume() {
    let (dir, _c) = setup();
    let p = pool(dir.path(), 64 * MIB);
    let a = p.create("vol", 32 * MIB, 0).unwrap();
    let dev = p.attach("vol").unwrap();
    crust_blockdev::mkfs(&dev, FsType::Ext4).unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mg = MountGuard::mount_fs(&dev, &mnt, FsType::Ext4, &[], false).unwrap();

    let err = p.delete("vol").unwrap_err();
    assert!(err.to_string().contains("in use"), "{err}");
    assert!(a.backing.exists());
    assert!(p.get("vol").unwrap().is_some());
    let err = p.detach("vol").unwrap_err();
    assert!(err.to_string().contains("mounted at"), "{err}");

    mg.unmount().unwrap();
    p.delete("vol").unwrap();
    assert!(!a.backing.exists());
    assert!(attached_to(&a.backing).is_empty(), "{}", dev.display());
}

#[test]
fn backing_file_removed_is_reported_and_data_device_kept() {
    let (dir, _c) = setup();
    let p = pool(dir.path(), 64 * MIB);
    let a = p.create("vol", 32 * MIB, 0).unwrap();
    let dev = p.attach("vol").unwrap();
    crust_blockdev::mkfs(&dev, FsType::Ext4).unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mg = MountGuard::mount_fs(&dev, &mnt, FsType::Ext4, &[], false).unwrap();
    assert_eq!(p.backing_state("vol"), BackingState::Healthy);
    assert!(crust_blockdev::fs_health(&dev, &mnt, false).is_ok());

    // Someone deletes the image behind the driver's back.
    std::fs::remove_file(&a.backing).unwrap();
    match p.backing_state("vol") {
        BackingState::Missing(m) => {
            assert!(m.contains("was removed"), "{m}");
            assert!(m.contains(&dev.display().to_string()), "{m}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(p.attach("vol"), Err(BackendError::Device(m)) if m.contains("removed")));
    mg.unmount().unwrap();
    // Detach leaves the device that holds the last copy of the data.
    p.detach("vol").unwrap();
    assert_eq!(attached_to(&a.backing), vec![dev.clone()]);
    // Delete means the data may go.
    p.delete("vol").unwrap();
    assert!(attached_to(&a.backing).is_empty());
    assert!(matches!(p.backing_state("vol"), BackingState::Missing(_)));

    // A file replaced under an attached device is reported too.
    let b = p.create("vol-b", 4 * MIB, 0).unwrap();
    let dev_b = p.attach("vol-b").unwrap();
    std::fs::remove_file(&b.backing).unwrap();
    File::create(&b.backing).unwrap().set_len(4 * MIB).unwrap();
    match p.backing_state("vol-b") {
        BackingState::Degraded(m) => assert!(m.contains("deleted earlier copy"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Attach gives a fresh device on the current file, not the stale one.
    let dev_b2 = p.attach("vol-b").unwrap();
    assert_ne!(dev_b2, dev_b);
    assert_eq!(attached_to(&b.backing).len(), 2);
    p.delete("vol-b").unwrap();
    assert!(attached_to(&b.backing).is_empty());
}

#[test]
fn startup_reconciles_index_and_files() {
    let (dir, _c) = setup();
    let p = pool(dir.path(), 64 * MIB);
    let keep = p.create("keep", 2 * MIB, 0).unwrap();
    let ghost = p.create("ghost", 2 * MIB, 0).unwrap();
    let grown = p.create("grown", 2 * MIB, 0).unwrap();
    File::options()
        .write(true)
        .open(&keep.backing)
        .unwrap()
        .write_all_at(b"keep", 0)
        .unwrap();
    let pool_dir = p.dir().to_path_buf();
    drop(p);

    // The states a crash can leave behind.
    std::fs::remove_file(&ghost.backing).unwrap(); // entry without file
    File::options()
        .write(true)
        .open(&grown.backing)
        .unwrap()
        .set_len(3 * MIB)
        .unwrap();
    File::create(pool_dir.join("empty-orphan.img"))
        .unwrap()
        .set_len(MIB)
        .unwrap();
    let orphan = File::create(pool_dir.join("data-orphan.img")).unwrap();
    orphan.set_len(MIB).unwrap();
    orphan.write_all_at(b"precious", 512).unwrap();
    orphan.sync_all().unwrap();
    std::fs::write(pool_dir.join(".crust-tmp.index.json.1.1"), b"{").unwrap();

    let p = pool(dir.path(), 64 * MIB);
    let ids: Vec<String> = p.list().unwrap().into_iter().map(|a| a.volume_id).collect();
    assert_eq!(ids, ["ghost", "grown", "keep"]);
    assert_eq!(p.get("grown").unwrap().unwrap().size_bytes, 3 * MIB);
    assert!(
        matches!(p.backing_state("ghost"), BackingState::Missing(m) if m.contains("was removed"))
    );
    assert_eq!(p.backing_state("keep"), BackingState::Healthy);
    assert!(!pool_dir.join("empty-orphan.img").exists());
    assert!(!pool_dir.join("data-orphan.img").exists());
    assert!(!pool_dir.join(".crust-tmp.index.json.1.1").exists());
    let quarantined: Vec<PathBuf> = std::fs::read_dir(p.quarantine_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(quarantined.len(), 1);
    assert!(
        quarantined[0]
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("data-orphan.img.")
    );
    let mut buf = [0u8; 8];
    File::open(&quarantined[0])
        .unwrap()
        .read_exact_at(&mut buf, 512)
        .unwrap();
    assert_eq!(&buf, b"precious");
    // A retried delete of the ghost clears it.
    p.delete("ghost").unwrap();
    assert_eq!(p.get("ghost").unwrap(), None);
    // Orphans do not count against capacity: 2 + 3 MiB allocated.
    assert_eq!(p.capacity().unwrap().available_bytes, 59 * MIB);
    drop(p);

    // A corrupt index stops startup instead of guessing.
    std::fs::write(pool_dir.join("index.json"), b"{not json").unwrap();
    let err = PoolBackend::open(PoolConfig::new(&pool_dir, 64 * MIB)).unwrap_err();
    assert!(
        matches!(&err, BackendError::Invalid(m) if m.contains("corrupt")),
        "{err}"
    );
}

/// What the disk holds after a crash of a pool opened at `pool_dir`: its
/// files copied (sparse) to a fresh directory, without the close that
/// writes the deferred index.
fn crash_copy(pool_dir: &Path, to: &Path) -> PathBuf {
    let dest = to.join("pool");
    std::fs::create_dir_all(&dest).unwrap();
    for e in std::fs::read_dir(pool_dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == ".lock" || !e.file_type().unwrap().is_file() {
            continue;
        }
        let st = std::process::Command::new("cp")
            .arg("--sparse=always")
            .arg(e.path())
            .arg(dest.join(&name))
            .status()
            .unwrap();
        assert!(st.success());
    }
    dest
}

fn deferred(dir: &Path, capacity: u64) -> PoolBackend {
    PoolBackend::open(PoolConfig {
        index_sync: IndexSync::Deferred,
        ..PoolConfig::new(dir, capacity)
    })
    .unwrap()
}

fn indexed(pool_dir: &Path) -> Vec<String> {
    match std::fs::read(pool_dir.join("index.json")) {
        Ok(b) => {
            let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
            v["volumes"].as_object().unwrap().keys().cloned().collect()
        }
        Err(_) => Vec::new(),
    }
}

/// Issue 16: with the deferred index a plain create or delete writes no
/// index; the index reaches the disk before an attach and on close, and a
/// pool opened on what a crash left holds no leaked image and says what
/// the caller settles (an entry without file, never holding data).
#[test]
fn deferred_index_is_written_before_attach_and_a_crash_is_settled_at_open() {
    let (dir, _c) = setup();
    let pool_dir = dir.path().join("pool");
    let p = deferred(&pool_dir, 64 * MIB);
    let a = p.create("a", 2 * MIB, 0).unwrap();
    let b = p.create("b", 2 * MIB, 0).unwrap();
    assert!(indexed(&pool_dir).is_empty(), "no index write per create");
    assert!(!p.may_hold_data("a"));

    // Crash after the creates: empty images without entries are removed.
    let crash1 = tempfile::tempdir().unwrap();
    let c1 = crash_copy(&pool_dir, crash1.path());
    let p1 = deferred(&c1, 64 * MIB);
    assert!(p1.list().unwrap().is_empty());
    assert!(!c1.join("a.img").exists() && !c1.join("b.img").exists());
    assert!(!p1.quarantine_dir().exists(), "nothing held data");
    drop(p1);

    // An attach writes the index first (every deferred change at once).
    let dev = p.attach("a").unwrap();
    assert_eq!(indexed(&pool_dir), ["a", "b"]);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&dev)
        .unwrap()
        .write_all_at(b"data", 0)
        .unwrap();
    p.detach("a").unwrap();
    assert!(p.may_hold_data("a"));
    p.delete("b").unwrap();
    assert!(!b.backing.exists());
    assert_eq!(indexed(&pool_dir), ["a", "b"], "no index write per delete");

    // Crash after the delete: the entry without file is reported and a
    // retried delete (what crust-csi's settle does) clears it.
    let crash2 = tempfile::tempdir().unwrap();
    let c2 = crash_copy(&pool_dir, crash2.path());
    // And a create whose size never reached the disk.
    std::fs::write(c2.join("a.img"), b"").unwrap();
    let p2 = deferred(&c2, 64 * MIB);
    let ids: Vec<String> = p2
        .list()
        .unwrap()
        .into_iter()
        .map(|a| a.volume_id)
        .collect();
    assert_eq!(ids, ["a", "b"]);
    assert!(matches!(p2.backing_state("b"), BackingState::Missing(_)));
    assert!(!p2.may_hold_data("b"));
    p2.delete("b").unwrap();
    assert_eq!(std::fs::metadata(c2.join("a.img")).unwrap().len(), 2 * MIB);
    assert_eq!(p2.backing_state("a"), BackingState::Healthy);
    drop(p2);
    assert_eq!(indexed(&c2), ["a"], "written on close");

    drop(p);
    assert_eq!(indexed(&pool_dir), ["a"], "written on close");
    let p = deferred(&pool_dir, 64 * MIB);
    assert_eq!(p.get("a").unwrap().unwrap().backing, a.backing);
    let mut buf = [0u8; 4];
    File::open(&a.backing)
        .unwrap()
        .read_exact_at(&mut buf, 0)
        .unwrap();
    assert_eq!(&buf, b"data");
}

/// Issue 24: the pool says how it made each store, so the plugin formats
/// only what it can prove holds nothing it did not write: `create` made an
/// empty file, a clone or a restore is a copy (its history decides), and
/// an entry from an index written before this was recorded may be either,
/// so it never claims to be empty.
#[test]
fn blankness_says_how_the_store_was_made() {
    let (dir, _c) = setup();
    let pool_dir = dir.path().join("pool");
    let p = pool(dir.path(), 64 * MIB);
    p.create("a", 2 * MIB, 0).unwrap();
    p.create_from("c", 2 * MIB, &ContentSource::Volume("a".into()))
        .unwrap();
    p.create_snapshot("s", "a", None).unwrap();
    p.create_from("r", 4 * MIB, &ContentSource::Snapshot("s".into()))
        .unwrap();
    let answers = |p: &PoolBackend| -> Vec<Blankness> {
        ["a", "c", "r"]
            .iter()
            .map(|v| p.blankness(v).unwrap())
            .collect()
    };
    use Blankness::{Copy, MadeEmpty};
    assert_eq!(answers(&p), [MadeEmpty, Copy, Copy]);
    assert!(matches!(p.blankness("zz"), Err(BackendError::NotFound(_))));
    drop(p);
    let p = pool(dir.path(), 64 * MIB);
    assert_eq!(
        answers(&p),
        [MadeEmpty, Copy, Copy],
        "recorded in the index"
    );
    drop(p);

    // An index from before the field.
    let path = pool_dir.join("index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    for v in index["volumes"].as_object_mut().unwrap().values_mut() {
        assert!(v.as_object_mut().unwrap().remove("made").is_some());
    }
    std::fs::write(&path, serde_json::to_vec(&index).unwrap()).unwrap();
    let p = pool(dir.path(), 64 * MIB);
    assert_eq!(answers(&p), [Copy, Copy, Copy]);
}
