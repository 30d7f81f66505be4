//! crust's record reader against Kata's real decoding rules (issue 30):
//! tools/kata-record-decode, a stdlib-only Go program, decodes each record
//! with `encoding/json` into Kata's own `MountInfo` and applies what
//! Kata's Go runtime does with the metadata; crust reads the same bytes
//! with [`MountInfo::from_json`], the reader's checks and the accessors
//! the runtime uses. The inputs: `tests/kata_records/` (the unit tests'
//! records and Go's corners), the fuzz corpus of `handoff_record`, and
//! the directory `CRUST_KATA_DIFF_CORPUS` names (a fuzz run's corpus).
//!
//! Both must agree on accept/refuse and on every decoded field, but for
//! the differences in [`Difference`]: each is crust being stricter (or
//! refusing a group Kata would mishandle) on purpose, and says why.
//! Skipped, saying so, without a `go` (Debian's golang-go); failed
//! instead under `CI=true`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crust_handoff::validate::{check_metadata_read, check_volume_type};
use crust_handoff::{FsGroupChangePolicy, MountInfo};

/// Where crust and Kata's Go runtime read a record differently on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Difference {
    DuplicateKey,
    MissingDeviceOrFstype,
    NotAnObject,
    EncryptionKey,
    NotUnicode,
    NullInCollection,
    VolumeType,
    NonCanonicalGid,
    GidZero,
    GidOutOfRange,
}

impl Difference {
    /// Why crust differs.
    fn why(self) -> &'static str {
        match self {
            Difference::DuplicateKey => {
                "Go keeps the last of a repeated key (any case); crust refuses: which device a \
                 record names must not depend on a reader's duplicate rule"
            }
            Difference::MissingDeviceOrFstype => {
                "Go reads a missing device or fstype as \"\"; crust refuses: nothing to mount"
            }
            Difference::NotAnObject => {
                "Go reads a top-level null as an empty record; crust refuses: nothing to mount"
            }
            Difference::EncryptionKey => {
                "Kata passes an encryptionKey on; crust refuses it in any place and case: crust \
                 does not encrypt, and a key must never be stored in a hand-off record"
            }
            Difference::NotUnicode => {
                "Go turns invalid UTF-8 and lone surrogates into U+FFFD; crust refuses: a path \
                 so rewritten is not the one the writer meant"
            }
            Difference::NullInCollection => {
                "Go reads null in the options or metadata as \"\"; crust refuses: no writer means \
                 an empty option or value"
            }
            Difference::VolumeType => {
                "Kata's Go runtime never reads volume-type; crust takes only block, directvol or \
                 none (Kata's Rust runtime only directvol): crust hands off block devices only"
            }
            Difference::NonCanonicalGid => {
                "Kata's strconv.Atoi takes \"+7\" and \"007\"; crust ignores (warns about) an \
                 fsGroup that is not one decimal spelling of a u32"
            }
            Difference::GidZero => {
                "fsGroup 0 (root's group, which Kubernetes allows) is applied by crust; Kata's \
                 range check fails the volume"
            }
            Difference::GidOutOfRange => {
                "an fsGroup outside a u32 (or negative) fails the volume in Kata; crust mounts \
                 without a group change and warns, as for any unusable fsGroup"
            }
        }
    }
}

/// The verdict kata-record-decode prints per record.
#[derive(Debug, serde::Deserialize)]
struct GoVerdict {
    name: String,
    ok: bool,
    #[serde(default)]
    error: String,
    record: Option<GoRecord>,
    kata: Option<KataUse>,
}

#[derive(Debug, Default, PartialEq, serde::Deserialize)]
struct GoRecord {
    volume_type: String,
    device: String,
    fstype: String,
    metadata: BTreeMap<String, String>,
    options: Vec<String>,
}

#[derive(Debug, serde::Deserialize)]
struct KataUse {
    fs_group: Option<u32>,
    fs_group_refused: bool,
    on_root_mismatch: bool,
    create_fs: Option<bool>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds the Go decoder into the test's scratch directory, or None
/// without a `go`.
fn build_decoder() -> Option<PathBuf> {
    if Command::new("go").arg("version").output().is_err() {
        return None;
    }
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kata-record-decode");
    let bin = scratch.join("kata-record-decode");
    // Its own caches: a test may run without $HOME, and never fetches.
    let out = Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(repo().join("tools/kata-record-decode"))
        .env("GOCACHE", scratch.join("cache"))
        .env("GOPATH", scratch.join("gopath"))
        .env("GOPROXY", "off")
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local")
        .output()
        .expect("run go build");
    assert!(
        out.status.success(),
        "go build of tools/kata-record-decode failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(bin)
}

/// The inputs as files: each record as is, and each fuzz seed's
/// mountInfo.json (the fuzz target's framing: a header byte, then the
/// record up to the first NUL).
fn inputs(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    let mut add_dir = |src: PathBuf, prefix: &str, unframe: bool| {
        let mut names: Vec<_> = std::fs::read_dir(&src)
            .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        for p in names {
            let mut bytes = std::fs::read(&p).unwrap();
            if unframe {
                let rest = bytes.get(1..).unwrap_or_default();
                bytes = rest.split(|&b| b == 0).next().unwrap().to_vec();
            }
            let name = format!("{prefix}/{}", p.file_name().unwrap().to_str().unwrap());
            let file = dir.join(name.replace('/', "_"));
            std::fs::write(&file, bytes).unwrap();
            out.push((name, file));
        }
    };
    add_dir(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kata_records"),
        "kata_records",
        false,
    );
    add_dir(
        repo().join("fuzz/corpus/handoff_record"),
        "fuzz/corpus/handoff_record",
        true,
    );
    // A fuzz run's own corpus too, by hand (scripts/fuzz.sh keeps it in
    // target/fuzz/corpus/handoff_record).
    if let Some(dir) = std::env::var_os("CRUST_KATA_DIFF_CORPUS") {
        add_dir(PathBuf::from(dir), "CRUST_KATA_DIFF_CORPUS", true);
    }
    out
}

/// Why crust refused bytes that Go decodes, from crust's own reason.
fn decode_difference(reason: &str, go: &GoRecord) -> Option<Difference> {
    let d = if reason.contains("duplicate") {
        Difference::DuplicateKey
    } else if reason.contains("missing field") {
        Difference::MissingDeviceOrFstype
    } else if reason.contains("not a JSON object") {
        Difference::NotAnObject
    } else if reason.contains("must never be stored") {
        Difference::EncryptionKey
    } else if reason.contains("invalid unicode code point")
        || reason.contains("lone leading surrogate")
        || reason.contains("unexpected end of hex escape")
    {
        Difference::NotUnicode
    } else if reason.contains("invalid type: null") {
        Difference::NullInCollection
    } else {
        return None;
    };
    // What Go read must fit the reason given.
    let fits = match d {
        Difference::MissingDeviceOrFstype => go.device.is_empty() || go.fstype.is_empty(),
        Difference::NotAnObject => *go == GoRecord::default(),
        _ => true,
    };
    fits.then_some(d)
}

/// Compares one record; Ok(differences seen) or Err(the disagreement).
fn compare(bytes: &[u8], go: &GoVerdict) -> Result<Vec<Difference>, String> {
    let crust = MountInfo::from_json(bytes);
    let (mi, rec, kata) = match (&crust, go.ok) {
        (Err(_), false) => return Ok(vec![]),
        (Ok(mi), false) => return Err(format!("crust reads {mi:?}, Go refuses: {}", go.error)),
        (Err(e), true) => {
            let rec = go.record.as_ref().unwrap();
            return decode_difference(e, rec)
                .map(|d| vec![d])
                .ok_or_else(|| format!("crust refuses ({e}), Go reads {rec:?}"));
        }
        (Ok(mi), true) => (mi, go.record.as_ref().unwrap(), go.kata.as_ref().unwrap()),
    };
    let crust_rec = GoRecord {
        volume_type: mi.volume_type.clone(),
        device: mi.device.clone(),
        fstype: mi.fstype.clone(),
        metadata: mi.metadata.clone(),
        options: mi.options.clone(),
    };
    if &crust_rec != rec {
        return Err(format!("crust reads {crust_rec:?}, Go reads {rec:?}"));
    }
    let mut diffs = vec![];
    if check_volume_type(&mi.volume_type).is_err() {
        diffs.push(Difference::VolumeType);
    }
    if check_metadata_read(mi).is_err() {
        diffs.push(Difference::EncryptionKey);
    }
    // createFilesystem: both ParseBool, both skip what it refuses.
    let crust_create = mi.create_filesystem().ok().flatten();
    if crust_create != kata.create_fs {
        return Err(format!(
            "createFilesystem: crust {crust_create:?}, Kata {:?}",
            kata.create_fs
        ));
    }
    let gid_spelled = mi.metadata.get("fsGroup").map(String::as_str);
    match (mi.fs_group(), kata.fs_group, kata.fs_group_refused) {
        (Some(a), Some(b), false) if a == b => {
            let crust_orm =
                mi.fs_group_change_policy() == Some(FsGroupChangePolicy::OnRootMismatch);
            if crust_orm != kata.on_root_mismatch {
                return Err(format!(
                    "fsGroupChangePolicy: crust OnRootMismatch={crust_orm}, Kata {}",
                    kata.on_root_mismatch
                ));
            }
        }
        (None, None, false) => {}
        (None, Some(_), false) => diffs.push(Difference::NonCanonicalGid),
        (Some(0), None, true) => diffs.push(Difference::GidZero),
        (None, None, true) => diffs.push(Difference::GidOutOfRange),
        (c, k, refused) => {
            return Err(format!(
                "fsGroup {gid_spelled:?}: crust {c:?}, Kata {k:?} (refused: {refused})"
            ));
        }
    }
    Ok(diffs)
}

/// The Go decoder and crust agree on every record but for the listed
/// differences, each of which the records exercise.
#[test]
fn crust_reads_records_as_kata_does_but_for_listed_differences() {
    let Some(bin) = build_decoder() else {
        crust_testkit::missing_tool(
            "kata_differential: no `go` on PATH (Debian's golang-go, scripts/install-deps.sh)",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let inputs = inputs(dir.path());
    let out = Command::new(&bin)
        .args(inputs.iter().map(|(_, f)| f))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kata-record-decode: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verdicts: Vec<GoVerdict> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert_eq!(verdicts.len(), inputs.len());

    let mut failures = vec![];
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let (mut accepted, mut refused) = (0, 0);
    for ((name, file), go) in inputs.iter().zip(&verdicts) {
        assert_eq!(Path::new(&go.name), file.as_path());
        if go.ok {
            accepted += 1;
        } else {
            refused += 1;
        }
        match compare(&std::fs::read(file).unwrap(), go) {
            Ok(diffs) => {
                for d in diffs {
                    seen.entry(format!("{d:?}")).or_default().push(name.clone());
                }
            }
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    eprintln!(
        "kata_differential: {} records (Go reads {accepted}, refuses {refused}); deliberate differences:",
        inputs.len()
    );
    for (d, names) in &seen {
        eprintln!("  {d}: {}", names.join(", "));
    }
    assert!(
        failures.is_empty(),
        "crust and Kata's Go decoder disagree:\n{}",
        failures.join("\n")
    );
    // Every listed difference is exercised (a stale entry would hide a
    // change of crust's rules).
    for d in [
        Difference::DuplicateKey,
        Difference::MissingDeviceOrFstype,
        Difference::NotAnObject,
        Difference::EncryptionKey,
        Difference::NotUnicode,
        Difference::NullInCollection,
        Difference::VolumeType,
        Difference::NonCanonicalGid,
        Difference::GidZero,
        Difference::GidOutOfRange,
    ] {
        assert!(
            seen.contains_key(&format!("{d:?}")),
            "{d:?} ({}) is exercised by no record",
            d.why()
        );
    }
}
