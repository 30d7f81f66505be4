//! A runtime CLI for crust-ops' integration tests, speaking the KEP's
//! protocol against a REAL loop-backed filesystem mounted on the host:
//!
//!   crust-test-runtime-cli crust stats <target>
//!   crust-test-runtime-cli crust resize <target> <min> <max>
//!   crust-test-runtime-cli crust capabilities
//!   crust-test-runtime-cli crust sandbox-state <sandbox-id>
//!   crust-test-runtime-cli crust freeze <target> <max-frozen-ms>
//!   crust-test-runtime-cli crust thaw <target>
//!   crust-test-runtime-cli crust throttle <target> <limits>
//!
//! `CRUST_TEST_CLI_MAP` names a JSON file mapping each target to
//! `{"mount": dir, "backing": file, "loop": "/dev/loopN"}`; an optional
//! `"behaviour"` of `hang`, `garbage`, `fail`, `kata-error` (an error
//! object, exit 0, as Kata's CLI prints it) or `empty` (`{}`) makes it
//! misbehave on purpose, `stopped` / `unknown` make it answer like crust-runtime for a
//! sandbox that is not running (an abnormal condition, or a failure whose
//! stderr says so), and an optional `"pidfile"` receives its pid. Stats
//! come from statvfs of the mount; when the mount is gone (the "guest"
//! was unmounted: the sandbox stopped) they are the abnormal condition
//! crust-runtime reports for a stopped sandbox. Resize grows the backing file, tells the
//! loop driver (LOOP_SET_CAPACITY), grows the mounted filesystem online
//! (resize2fs for ext4, xfs_growfs for xfs) and prints its new size (ext4
//! superblock, XFS geometry ioctl). Freeze and thaw FIFREEZE/FITHAW the
//! mount (playing the guest); `"freeze": "fail"` makes the freeze fail,
//! `"thaw": "fail"` (the guest died while frozen: the mount is thawed all
//! the same, and the failure reported) or `"thaw": "expired"` (the guest's
//! time limit thawed it first) the thaw. Throttle appends `<target>
//! <limits>` to the file `<CRUST_TEST_CLI_MAP>.throttled` (what the guest's
//! device would be given).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::process::{Command, ExitCode};

use serde_json::{Value, json};

fn main() -> ExitCode {
    match run() {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("crust-test-runtime-cli: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<String, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["crust", "capabilities"] => {
            return Ok(
                json!({"verbs": ["capabilities", "freeze", "resize", "sandbox-state", "stats", "thaw", "throttle"]})
                    .to_string(),
            );
        }
        ["crust", "sandbox-state", id] => return sandbox_state(id),
        ["crust", "freeze", target, _ms] => return freeze_thaw(target, true),
        ["crust", "thaw", target] => return freeze_thaw(target, false),
        ["crust", "throttle", target, limits] => return throttle(target, limits),
        ["crust", verb, ..] if !matches!(*verb, "stats" | "resize") => {
            eprintln!("unsupported: crust {verb}");
            std::process::exit(2);
        }
        _ => {}
    }
    let (op, target, rest) = match args.as_slice() {
        ["crust", "stats", target] => ("stats", *target, &[][..]),
        ["crust", "resize", target, rest @ ..] if rest.len() == 2 => ("resize", *target, rest),
        _ => {
            return Err(format!(
                "usage: crust stats <target> | crust resize <target> <min> <max> (got {args:?})"
            ));
        }
    };
    let map_path = std::env::var("CRUST_TEST_CLI_MAP")
        .map_err(|_| "CRUST_TEST_CLI_MAP is not set".to_string())?;
    let map: Value = serde_json::from_str(
        &std::fs::read_to_string(&map_path).map_err(|e| format!("{map_path}: {e}"))?,
    )
    .map_err(|e| format!("{map_path}: {e}"))?;
    let entry = map
        .get(target)
        .ok_or_else(|| format!("no volume for target {target}"))?;
    let field = |k: &str| {
        entry
            .get(k)
            .and_then(Value::as_str)
            .ok_or_else(|| format!("map entry for {target} lacks {k}"))
    };
    if let Some(pidfile) = entry.get("pidfile").and_then(Value::as_str) {
        std::fs::write(pidfile, std::process::id().to_string())
            .map_err(|e| format!("{pidfile}: {e}"))?;
    }
    match entry.get("behaviour").and_then(Value::as_str) {
        Some("hang") => loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        },
        Some("garbage") => return Ok("this is not json".into()),
        // What Kata's CLI prints (exit status 0) when its shim answered an
        // error, and a JSON object that says nothing.
        Some("kata-error") => {
            return Ok(
                json!({"code": "NOT_FOUND", "message": format!("no volume {target}")}).to_string(),
            );
        }
        Some("empty") => return Ok("{}".into()),
        Some("fail") => return Err(format!("sandbox for {target} is gone")),
        Some("stopped") if op == "stats" => return Ok(not_running(target)),
        Some("unknown") => {
            return Err(format!(
                "sandbox for {target} is not running (unknown to this runtime)"
            ));
        }
        _ => {}
    }
    let mount = field("mount")?;
    match op {
        "stats" if !is_mount_root(mount)? => Ok(not_running(target)),
        "stats" => stats(mount),
        _ => {
            let min: u64 = rest[0]
                .parse()
                .map_err(|_| format!("bad min {:?}", rest[0]))?;
            let max: u64 = rest[1]
                .parse()
                .map_err(|_| format!("bad max {:?}", rest[1]))?;
            resize(field("backing")?, field("loop")?, mount, min, max)
        }
    }
}

/// `crust freeze` / `crust thaw` of the target's mount (see the module
/// doc for the misbehaviours).
fn freeze_thaw(target: &str, freeze: bool) -> Result<String, String> {
    let map_path = std::env::var("CRUST_TEST_CLI_MAP")
        .map_err(|_| "CRUST_TEST_CLI_MAP is not set".to_string())?;
    let map: Value = serde_json::from_str(
        &std::fs::read_to_string(&map_path).map_err(|e| format!("{map_path}: {e}"))?,
    )
    .map_err(|e| format!("{map_path}: {e}"))?;
    let entry = map
        .get(target)
        .ok_or_else(|| format!("no volume for target {target}"))?;
    let mount = entry
        .get("mount")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("map entry for {target} lacks mount"))?;
    let how = |k: &str| entry.get(k).and_then(Value::as_str).unwrap_or("");
    let mount = std::path::Path::new(mount);
    if freeze {
        if how("freeze") == "fail" {
            return Err(format!("sandbox for {target} is not running"));
        }
        crust_blockdev::freeze_unguarded(mount).map_err(|e| format!("{}: {e}", mount.display()))?;
        return Ok("{}".into());
    }
    let was =
        crust_blockdev::thaw_if_frozen(mount).map_err(|e| format!("{}: {e}", mount.display()))?;
    match how("thaw") {
        "fail" => Err(format!("sandbox for {target} is not running (QEMU exited)")),
        "expired" => Ok(json!({"was_frozen": false, "expired": true}).to_string()),
        _ => Ok(json!({"was_frozen": was, "expired": false}).to_string()),
    }
}

/// `crust sandbox-state ID`: the map entry whose `"sandbox"` is ID
/// decides: its `behaviour` (`hang`, `garbage`, `fail`, `stopped`,
/// `unknown`, `running`, `unsupported`), else running while its mount is
/// mounted and stopped once it is gone. No entry: unknown.
fn sandbox_state(id: &str) -> Result<String, String> {
    let map_path = std::env::var("CRUST_TEST_CLI_MAP")
        .map_err(|_| "CRUST_TEST_CLI_MAP is not set".to_string())?;
    let map: Value = serde_json::from_str(
        &std::fs::read_to_string(&map_path).map_err(|e| format!("{map_path}: {e}"))?,
    )
    .map_err(|e| format!("{map_path}: {e}"))?;
    let entry = map
        .as_object()
        .and_then(|m| {
            m.values()
                .find(|e| e.get("sandbox").and_then(Value::as_str) == Some(id))
        })
        .cloned();
    let answer = |state: &str, detail: &str| {
        Ok(json!({"sandbox_id": id, "state": state, "detail": detail}).to_string())
    };
    let Some(entry) = entry else {
        return answer("unknown", "no such sandbox in the map");
    };
    if let Some(pidfile) = entry.get("pidfile").and_then(Value::as_str) {
        std::fs::write(pidfile, std::process::id().to_string())
            .map_err(|e| format!("{pidfile}: {e}"))?;
    }
    match entry.get("behaviour").and_then(Value::as_str) {
        Some("hang") => loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        },
        Some("garbage") => Ok("this is not json".into()),
        Some("fail") => Err(format!("sandbox {id} is gone")),
        Some("unsupported") => {
            eprintln!("unsupported: crust sandbox-state");
            std::process::exit(2);
        }
        Some(s @ ("stopped" | "unknown" | "running")) => answer(s, "as the map says"),
        _ => match entry.get("mount").and_then(Value::as_str) {
            Some(m) if is_mount_root(m)? => answer("running", "its guest mount is there"),
            Some(_) => answer("stopped", "its guest mount is gone"),
            None => answer("unknown", "no mount in the map"),
        },
    }
}

/// What crust-runtime prints for a claimant whose VM is gone.
fn not_running(target: &str) -> String {
    json!({
        "usage": [],
        "volume_condition": {
            "abnormal": true,
            "message": format!("sandbox for {target} is not running (its guest mount is gone)"),
        },
    })
    .to_string()
}

/// Whether `dir` is the root of a mount (the "guest" still has the volume).
fn is_mount_root(dir: &str) -> Result<bool, String> {
    use rustix::fs::{AtFlags, StatxAttributes, StatxFlags};
    match rustix::fs::statx(
        rustix::fs::CWD,
        dir,
        AtFlags::NO_AUTOMOUNT | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::empty(),
    ) {
        Ok(st) if st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT) => {
            Ok(st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
        }
        Ok(_) => Err(format!("{dir}: the kernel does not report mount roots")),
        Err(rustix::io::Errno::NOENT) => Ok(false),
        Err(e) => Err(format!("statx {dir}: {e}")),
    }
}

fn stats(mount: &str) -> Result<String, String> {
    let s = rustix::fs::statvfs(mount).map_err(|e| format!("statvfs {mount}: {e}"))?;
    let bs = s.f_frsize;
    let out = json!({
        "usage": [
            {
                "available": s.f_bavail * bs,
                "total": s.f_blocks * bs,
                "used": (s.f_blocks - s.f_bfree) * bs,
                "unit": "BYTES",
            },
            {
                "available": s.f_favail,
                "total": s.f_files,
                "used": s.f_files - s.f_ffree,
                "unit": "INODES",
            },
        ],
        "volume_condition": {"abnormal": false, "message": "mounted"},
    });
    Ok(out.to_string())
}

fn resize(backing: &str, loopdev: &str, mount: &str, min: u64, max: u64) -> Result<String, String> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(backing)
        .map_err(|e| format!("{backing}: {e}"))?;
    let current = file.metadata().map_err(|e| e.to_string())?.len();
    let want = if min != 0 {
        min
    } else if max != 0 {
        max
    } else {
        current
    };
    if max != 0 && want > max {
        return Err(format!("cannot satisfy [{min}, {max}]"));
    }
    if want > current {
        file.set_len(want)
            .map_err(|e| format!("grow {backing}: {e}"))?;
        file.sync_all().map_err(|e| e.to_string())?;
        let dev = File::open(loopdev).map_err(|e| format!("{loopdev}: {e}"))?;
        crust_sys::loopdev::set_capacity(&dev)
            .map_err(|e| format!("LOOP_SET_CAPACITY {loopdev}: {e}"))?;
    }
    let m = File::open(mount).map_err(|e| format!("{mount}: {e}"))?;
    let fs_type = rustix::fs::fstatfs(&m)
        .map_err(|e| format!("statfs {mount}: {e}"))?
        .f_type as u64;
    let size = match fs_type {
        EXT4_MAGIC => {
            // Online ext4 growth needs CAP_SYS_RESOURCE; without it this
            // fails and the error goes back to crust-ops on stderr.
            exec("resize2fs", &[loopdev])?;
            // Flush the grown superblock, then read it through the device.
            rustix::fs::syncfs(&m).map_err(|e| format!("syncfs {mount}: {e}"))?;
            ext4_size(loopdev)?
        }
        XFS_MAGIC => {
            exec("xfs_growfs", &[mount])?;
            xfs_size(&m)?
        }
        other => return Err(format!("{mount}: unsupported filesystem type {other:#x}")),
    };
    Ok(json!({ "capacity_bytes": size }).to_string())
}

const EXT4_MAGIC: u64 = 0xEF53;
const XFS_MAGIC: u64 = 0x5846_5342;

fn exec(tool: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(tool)
        .args(args)
        .output()
        .map_err(|e| format!("{tool}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{tool} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Data blocks times block size, from XFS_IOC_FSGEOMETRY_V1 (struct
/// xfs_fsop_geom_v1: 112 bytes; blocksize at 0, datablocks at 32).
fn xfs_size(mount: &File) -> Result<u64, String> {
    let g =
        crust_sys::fs::xfs_geometry_v1(mount).map_err(|e| format!("XFS_IOC_FSGEOMETRY_V1: {e}"))?;
    let block_size = g[0] & 0xffff_ffff;
    Ok(g[4] * block_size)
}

/// Block count times block size, from the ext4 superblock at offset 1024.
fn ext4_size(dev: &str) -> Result<u64, String> {
    let mut f = File::open(dev).map_err(|e| format!("{dev}: {e}"))?;
    let mut sb = [0u8; 1024];
    f.seek(SeekFrom::Start(1024)).map_err(|e| e.to_string())?;
    f.read_exact(&mut sb)
        .map_err(|e| format!("read superblock: {e}"))?;
    let u32_at = |o: usize| u32::from_le_bytes(sb[o..o + 4].try_into().unwrap());
    let u16_at = |o: usize| u16::from_le_bytes(sb[o..o + 2].try_into().unwrap());
    if u16_at(0x38) != 0xEF53 {
        return Err(format!("{dev} is not ext2/3/4"));
    }
    let incompat_64bit = u32_at(0x60) & 0x80 != 0;
    let mut blocks = u64::from(u32_at(0x04));
    if incompat_64bit {
        blocks |= u64::from(u32_at(0x150)) << 32;
    }
    let block_size = 1024u64 << u32_at(0x18);
    Ok(blocks * block_size)
}

/// Records what the guest's device would be given.
fn throttle(target: &str, limits: &str) -> Result<String, String> {
    use std::io::Write;
    let map = std::env::var("CRUST_TEST_CLI_MAP")
        .map_err(|_| "CRUST_TEST_CLI_MAP is not set".to_string())?;
    let log = format!("{map}.throttled");
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .and_then(|mut f| writeln!(f, "{target} {limits}"))
        .map_err(|e| format!("{log}: {e}"))?;
    Ok(String::new())
}
