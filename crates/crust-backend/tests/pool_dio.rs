//! The pool attaches its loop devices with direct I/O at the block size
//! recorded for each volume (real loop devices, real filesystems, root).
//!
//! Time budget: about 2 s.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::Command;

use crust_backend::*;
use crust_blockdev::{AttachOptions, FsType, LoopGuard, LoopStatus, MountGuard};

const MIB: u64 = 1 << 20;

fn status(dev: &Path) -> LoopStatus {
    crust_blockdev::loop_status(dev).unwrap().expect("bound")
}

/// Bytes of `file` in the page cache, as `fincore` counts them.
fn cached_bytes(file: &Path) -> u64 {
    let out = Command::new("fincore")
        .args(["--bytes", "--noheadings", "--raw", "--output", "RES"])
        .arg(file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A guest writing through QEMU with `cache.direct=on` writes the device
/// with O_DIRECT; with a buffered loop device those bytes would still land
/// in the backing file's page cache.
#[test]
fn pool_volumes_bypass_the_host_page_cache() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let pool_dir = std::fs::canonicalize(dir.path()).unwrap().join("pool");
    let _c = crust_testkit::LoopsUnder(pool_dir.clone());
    let p = PoolBackend::open(PoolConfig::new(&pool_dir, 64 * MIB)).unwrap();
    let a = p.create("v", 32 * MIB, 0).unwrap();
    let dev = p.attach("v").unwrap();
    let s = status(&dev);
    assert!(s.direct_io, "{s:?}");
    assert_eq!(s.block_size, 512, "ext4 on a 512-byte disk: 512 is enough");

    let written = 16 * MIB;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc_o_direct())
        .open(&dev)
        .unwrap();
    let buf = crust_sys::buf::AlignedBuf::filled(MIB as usize, 0x5a);
    for _ in 0..written / MIB {
        f.write_all(buf.as_slice()).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    let cached = cached_bytes(&a.backing);
    assert!(
        cached * 20 < written,
        "{cached} bytes of the backing file cached after writing {written}"
    );
    p.detach("v").unwrap();
    p.delete("v").unwrap();
}

/// On a filesystem that needs 4 KiB-aligned direct I/O a new volume gets
/// 4 KiB sectors; a volume recorded before block sizes were (made on
/// 512-byte sectors) keeps 512 on every attach, losing direct I/O rather
/// than its filesystem; a copy keeps its source's size.
#[test]
fn block_size_is_recorded_at_creation_and_kept() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(dir.path()).unwrap();
    let img = base.join("4k.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1024 * MIB)
        .unwrap();
    let disk = LoopGuard::attach(
        &img,
        AttachOptions {
            block_size: 4096,
            ..AttachOptions::default()
        },
    )
    .unwrap();
    mkfs("mkfs.ext4", disk.path());
    let mnt = base.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let _m = MountGuard::mount_fs(disk.path(), &mnt, FsType::Ext4, &[], false).unwrap();
    let pool_dir = mnt.join("pool");
    let _c = crust_testkit::LoopsUnder(pool_dir.clone());
    let open = || PoolBackend::open(PoolConfig::new(&pool_dir, 1000 * MIB)).unwrap();

    let p = open();
    p.create("new", 320 * MIB, 0).unwrap();
    p.create("old", 320 * MIB, 0).unwrap();
    let s = status(&p.attach("new").unwrap());
    assert_eq!((s.block_size, s.direct_io), (4096, true), "{s:?}");
    p.detach("new").unwrap();
    drop(p);

    // "old" as an index from before this change has it: no block size.
    let index = pool_dir.join("index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    let old = v["volumes"]["old"].as_object_mut().unwrap();
    assert!(old.remove("block_size").is_some(), "recorded at creation");
    std::fs::write(&index, serde_json::to_vec(&v).unwrap()).unwrap();

    let p = open();
    let dev = p.attach("old").unwrap();
    let s = status(&dev);
    assert_eq!(s.block_size, 512, "{s:?}");
    assert!(
        !s.direct_io,
        "512-byte direct I/O on a 4 KiB filesystem: {s:?}"
    );
    // xfs records its sector size: it mounts only on 512-byte sectors again.
    mkfs("mkfs.xfs", &dev);
    p.detach("old").unwrap();
    let dev = p.attach("old").unwrap();
    assert_eq!(status(&dev).block_size, 512);
    let m2 = base.join("m2");
    std::fs::create_dir(&m2).unwrap();
    MountGuard::mount_fs(&dev, &m2, FsType::Xfs, &[], false)
        .unwrap()
        .unmount()
        .unwrap();
    p.detach("old").unwrap();

    // A clone keeps its source's sectors (and so its filesystem).
    p.create_from("clone", 320 * MIB, &ContentSource::Volume("old".into()))
        .unwrap();
    let s = status(&p.attach("clone").unwrap());
    assert_eq!(s.block_size, 512, "{s:?}");
    p.detach("clone").unwrap();
    drop(p);
}

/// The tool itself: crust's own mkfs reads the whole device first.
fn mkfs(tool: &str, dev: &Path) {
    let out = Command::new(tool).arg("-q").arg(dev).output().unwrap();
    assert!(out.status.success(), "{tool}: {out:?}");
}

fn libc_o_direct() -> i32 {
    rustix::fs::OFlags::DIRECT.bits() as i32
}
