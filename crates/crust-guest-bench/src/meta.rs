//! Metadata workloads: small files created, written, fsynced, stat'ed and
//! unlinked one by one; a tree of N entries; a `find`-style walk of it.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::Latency;

/// Entries per directory of the tree (plus the directory itself).
pub const TREE_FANOUT: usize = 50;

fn ctx(what: &str, p: &Path) -> impl FnOnce(std::io::Error) -> String {
    let s = format!("{what} {}", p.display());
    move |e| format!("{s}: {e}")
}

/// For each of `files` files in the new directory `dir`: create, write
/// `size` bytes, fsync, close, stat (one timed operation); then unlink each
/// (timed). `dir` is removed at the end.
pub fn create_fsync_stat_unlink(dir: &Path, files: usize, size: usize) -> Result<Value, String> {
    fs::create_dir(dir).map_err(ctx("mkdir", dir))?;
    let data = vec![0x5a_u8; size];
    let mut create = Vec::with_capacity(files);
    let t0 = Instant::now();
    for i in 0..files {
        let p = dir.join(format!("f{i:06}"));
        let t = Instant::now();
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&p)
            .map_err(ctx("create", &p))?;
        f.write_all(&data).map_err(ctx("write", &p))?;
        f.sync_all().map_err(ctx("fsync", &p))?;
        drop(f);
        let st = fs::metadata(&p).map_err(ctx("stat", &p))?;
        create.push(t.elapsed());
        if st.len() != size as u64 {
            return Err(format!(
                "{}: size {} after writing {size}",
                p.display(),
                st.len()
            ));
        }
    }
    let create_wall = t0.elapsed();
    let mut unlink = Vec::with_capacity(files);
    let t1 = Instant::now();
    for i in 0..files {
        let p = dir.join(format!("f{i:06}"));
        let t = Instant::now();
        fs::remove_file(&p).map_err(ctx("unlink", &p))?;
        unlink.push(t.elapsed());
    }
    let unlink_wall = t1.elapsed();
    fs::remove_dir(dir).map_err(ctx("rmdir", dir))?;
    let wall = create_wall + unlink_wall;
    Ok(json!({
        "files": files,
        "file_size": size,
        "seconds": wall.as_secs_f64(),
        "files_per_s": files as f64 / wall.as_secs_f64().max(1e-9),
        "create_fsync_stat": Latency::of(&mut create).to_json(),
        "unlink": Latency::of(&mut unlink).to_json(),
    }))
}

/// Creates a tree of `entries` entries below the new directory `dir`:
/// directories of [`TREE_FANOUT`] empty files each. Returns the count made.
pub fn make_tree(dir: &Path, entries: usize) -> Result<Value, String> {
    let t0 = Instant::now();
    fs::create_dir(dir).map_err(ctx("mkdir", dir))?;
    let mut made = 0;
    let mut d = 0;
    while made < entries {
        let sub = dir.join(format!("d{d:05}"));
        fs::create_dir(&sub).map_err(ctx("mkdir", &sub))?;
        made += 1;
        d += 1;
        for f in 0..TREE_FANOUT {
            if made >= entries {
                break;
            }
            let p = sub.join(format!("f{f:03}"));
            File::create(&p).map_err(ctx("create", &p))?;
            made += 1;
        }
    }
    rustix::fs::syncfs(File::open(dir).map_err(ctx("open", dir))?)
        .map_err(|e| format!("syncfs {}: {e}", dir.display()))?;
    Ok(json!({"entries": made, "seconds": t0.elapsed().as_secs_f64()}))
}

/// Walks `dir` like `find -ls`: every directory read, every entry
/// lstat'ed. Counts entries below `dir`.
pub fn walk(dir: &Path) -> Result<Value, String> {
    fn visit(d: &Path, n: &mut usize) -> Result<(), String> {
        for e in fs::read_dir(d).map_err(ctx("readdir", d))? {
            let e = e.map_err(ctx("readdir", d))?;
            let md = fs::symlink_metadata(e.path()).map_err(ctx("lstat", &e.path()))?;
            *n += 1;
            if md.is_dir() {
                visit(&e.path(), n)?;
            }
        }
        Ok(())
    }
    let before = device_reads(dir);
    let t0 = Instant::now();
    let mut n = 0;
    visit(dir, &mut n)?;
    let s = t0.elapsed().max(Duration::from_nanos(1)).as_secs_f64();
    let mut out = json!({"entries": n, "seconds": s, "entries_per_s": n as f64 / s});
    // What the walk read from the device under it (none for virtio-fs).
    if let (Some(b), Some(a)) = (before, device_reads(dir)) {
        out["device_reads"] = json!(a.0.saturating_sub(b.0));
        out["device_read_bytes"] = json!(a.1.saturating_sub(b.1) * 512);
    }
    Ok(out)
}

/// Reads completed and sectors read by the block device of `p`'s
/// filesystem (`/sys/dev/block/MAJ:MIN/stat`); `None` when it has none.
fn device_reads(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let dev = fs::metadata(p).ok()?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let stat = fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/stat")).ok()?;
    let f: Vec<u64> = stat
        .split_whitespace()
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    Some((*f.first()?, *f.get(2)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_and_unlink_leave_nothing() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("m");
        let v = create_fsync_stat_unlink(&d, 25, 512).unwrap();
        assert_eq!(v["files"], 25);
        assert_eq!(v["create_fsync_stat"]["count"], 25);
        assert_eq!(v["unlink"]["count"], 25);
        assert!(v["files_per_s"].as_f64().unwrap() > 0.0);
        assert!(!d.exists());
        // An existing directory is refused (nothing of the caller's removed).
        fs::create_dir(&d).unwrap();
        fs::write(d.join("keep"), b"x").unwrap();
        assert!(
            create_fsync_stat_unlink(&d, 1, 1)
                .unwrap_err()
                .contains("mkdir")
        );
        assert!(d.join("keep").exists());
    }

    #[test]
    fn the_walk_counts_every_entry_of_the_tree() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("tree");
        for n in [1, 50, 51, 52, 1000] {
            let _ = fs::remove_dir_all(&d);
            assert_eq!(make_tree(&d, n).unwrap()["entries"], n);
            assert_eq!(walk(&d).unwrap()["entries"], n, "tree of {n}");
        }
        // A filesystem without a block device (virtio-fs, proc) reports no reads.
        assert_eq!(device_reads(Path::new("/proc")), None);
    }
}
