//! Install and uninstall against a host root (`/host` in the installer's
//! pod, a temporary directory in tests).
//!
//! * The payload (what the node-installer image carries: `bin/`, `lib/`
//!   with the loader, `share/`, `guest-image/`, `share/crust/payload.json`)
//!   is copied under the prefix (`/opt/crust`) file by file: a file whose
//!   content and mode already match is left alone, any other is written to
//!   a temporary name, fsynced and renamed over, so a running QEMU or shim
//!   keeps its old inode and a new process sees a whole file.
//! * containerd: a drop-in in the root config's version (2 or 3), plus an
//!   `imports` entry when the root config does not already cover it; a
//!   version-2 root config with its own CRI section gets the runtime table
//!   inline instead (containerd 1.x would let a drop-in replace that whole
//!   section); a root config is created (version 2) only when none exists.
//!   Every decision is made before anything is written: a config this
//!   installer cannot handle (version 1, not TOML) changes nothing.
//! * Host files are reached only through [`crate::hostfs`]: no symbolic
//!   link is followed below the host root and only regular files are read
//!   or replaced, so a config that is a link (to `/etc/shadow`, or into a
//!   distribution's read-only tree) or a FIFO is refused by name before
//!   anything is written. No error quotes a file's content.
//! * Everything is decided before anything is written (the plan: every
//!   path checked, every missing directory known); then the record
//!   `<prefix>/.crust-install.json` is written **first**, `pending`, listing
//!   everything this run may create, and rewritten (temporary file, fsync,
//!   rename) as steps complete: payload, drop-in, root config (the drop-in
//!   before the `imports` entry naming it), then the record again, no
//!   longer pending. Whatever step fails or crashes, uninstall undoes it
//!   all; a failed first install rolls itself back at once (a failed
//!   upgrade keeps its record, since the old runtime may be in use).
//!   Uninstall undoes exactly the record (files, directories it created,
//!   the drop-in, the `imports` entry, a root config it created) and an
//!   upgrade removes files the new payload no longer has.
//! * Both are idempotent: a repeated run changes nothing and does not
//!   reload containerd.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::containerd::{self, Handler, RootConfig, Version};
// Their old paths (`install::InstallError`, `install::Step`) stay.
pub use crate::error::{InstallError, Step};
use crate::hostfs::HostRoot;

/// The install record, relative to the prefix.
pub const MANIFEST: &str = ".crust-install.json";
/// The payload's description, relative to the payload root.
pub const PAYLOAD_INFO: &str = "share/crust/payload.json";

type Result<T> = std::result::Result<T, InstallError>;

fn io_err(p: &Path) -> impl FnOnce(io::Error) -> InstallError + '_ {
    move |e| InstallError::Io(p.to_path_buf(), e)
}

/// Where and how to install.
#[derive(Debug, Clone)]
pub struct Options {
    /// The host's `/` as this process sees it.
    pub host_root: PathBuf,
    /// The payload directory (installer image: `/usr/share/crust/payload`).
    pub payload: PathBuf,
    /// Host path of the install (`/opt/crust`): the payload's binaries have
    /// it compiled in as their loader path, so it must match the payload.
    pub prefix: PathBuf,
    /// Host path of containerd's root config.
    pub containerd_config: PathBuf,
    /// Host path of the drop-in this installer writes.
    pub dropin: PathBuf,
    /// RuntimeClass handler name.
    pub handler: String,
    /// Run after containerd's configuration changed (e.g. `nsenter -t 1
    /// -m -- systemctl restart containerd`); None: the operator restarts it.
    pub reload: Option<Vec<String>>,
    /// Test seam: called after each [`Step`]; `true` fails the install
    /// there (a panic stands for a crash: no rollback runs).
    pub fault: Option<fn(Step) -> bool>,
}

impl Options {
    /// Defaults for a host mounted at `host_root`.
    pub fn new(host_root: impl Into<PathBuf>, payload: impl Into<PathBuf>) -> Options {
        Options {
            host_root: host_root.into(),
            payload: payload.into(),
            prefix: "/opt/crust".into(),
            containerd_config: "/etc/containerd/config.toml".into(),
            dropin: "/etc/containerd/conf.d/crust.toml".into(),
            handler: "crust".into(),
            reload: None,
            fault: None,
        }
    }

    fn check(&self) -> Result<()> {
        use std::path::Component;
        for p in [&self.prefix, &self.containerd_config, &self.dropin] {
            if !p.is_absolute() {
                return Err(InstallError::NotAbsolute(p.clone()));
            }
            // `..` or `.` would name another place than the one shown, and
            // `/` alone is no file or directory of ours.
            let normal = p
                .components()
                .skip(1)
                .all(|c| matches!(c, Component::Normal(_)));
            if !normal || p.components().count() < 2 {
                return Err(InstallError::NotNormal(p.clone()));
            }
        }
        Ok(())
    }
}

/// What the payload says about itself (written by scripts/build-images.sh).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PayloadInfo {
    pub version: String,
    pub prefix: PathBuf,
    /// Components present, e.g. `crust-runtime`, `qemu-system-x86_64`,
    /// `containerd-shim-crust-v2`, `virtiofsd`, `guest-image`.
    pub components: Vec<String>,
}

/// How the root config was touched, so that uninstall can undo it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case", tag = "action")]
pub enum RootAction {
    /// It already imported the drop-in.
    Untouched,
    /// The drop-in was appended to its `imports`; `original` is the file
    /// before, `written` its sha256 after.
    ImportAdded { original: String, written: String },
    /// There was none; this one was written (sha256).
    Created { written: String },
    /// containerd 1.x config with its own CRI section: the runtime table
    /// was added inline (no drop-in, which would replace that section).
    RuntimeAdded { original: String, written: String },
}

/// `<prefix>/.crust-install.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    pub version: String,
    pub prefix: PathBuf,
    /// Relative to the prefix → sha256.
    pub files: BTreeMap<PathBuf, String>,
    /// Host directories this installer created (removed when empty).
    pub dirs: BTreeSet<PathBuf>,
    /// The drop-in written, if any (none when the runtime went inline).
    pub dropin: Option<PathBuf>,
    pub config_version: Version,
    pub containerd_config: PathBuf,
    pub root: RootAction,
    /// RuntimeClass handler name configured.
    pub handler: String,
    /// Written before anything else and still true while the install
    /// runs: the record then lists everything the run may have created.
    #[serde(default)]
    pub pending: bool,
}

/// What a run did.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct Report {
    pub written: Vec<PathBuf>,
    pub removed: Vec<PathBuf>,
    /// containerd's configuration changed (the reload command ran if set).
    pub containerd_changed: bool,
}

fn sha256(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Regular files of the payload, relative, sorted.
fn payload_files(root: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        for e in fs::read_dir(&dir).map_err(io_err(&dir))? {
            let e = e.map_err(io_err(&dir))?;
            let r = rel.join(e.file_name());
            let t = e.file_type().map_err(io_err(&e.path()))?;
            if t.is_dir() {
                stack.push(r);
            } else if t.is_file() {
                out.push(r);
            } else {
                return Err(InstallError::Payload(
                    e.path(),
                    "only regular files and directories may be installed (the build \
                     dereferences symlinks)"
                        .into(),
                ));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// A payload file's content and mode (the image's, trusted).
fn payload_file(payload: &Path, rel: &Path) -> Result<(Vec<u8>, u32)> {
    let src = payload.join(rel);
    let bytes = fs::read(&src).map_err(io_err(&src))?;
    let mode = fs::metadata(&src)
        .map_err(io_err(&src))?
        .permissions()
        .mode()
        & 0o755;
    Ok((bytes, mode))
}

pub fn read_payload_info(payload: &Path) -> Result<PayloadInfo> {
    let p = payload.join(PAYLOAD_INFO);
    let bytes = fs::read(&p).map_err(io_err(&p))?;
    serde_json::from_slice(&bytes).map_err(|e| InstallError::Payload(p, e.to_string()))
}

pub fn read_manifest(opts: &Options) -> Result<Option<Manifest>> {
    read_record(&HostRoot::open(&opts.host_root)?, opts)
}

fn read_record(host: &HostRoot, opts: &Options) -> Result<Option<Manifest>> {
    let p = opts.prefix.join(MANIFEST);
    let Some(f) = host.read(&p)? else {
        return Ok(None);
    };
    // serde_json's data errors may quote a value: say where, not what.
    serde_json::from_slice(&f.bytes).map(Some).map_err(|e| {
        InstallError::Manifest(
            host.shown(&p),
            format!(
                "{:?} error at line {}, column {}",
                e.classify(),
                e.line(),
                e.column()
            ),
        )
    })
}

fn write_record(host: &HostRoot, m: &Manifest) -> Result<()> {
    let json = serde_json::to_vec_pretty(m).expect("serializable");
    host.put(&m.prefix.join(MANIFEST), &json, Some(0o644))?;
    Ok(())
}

/// Everything an install will do, decided (and every path checked)
/// before anything is written.
struct Plan {
    handler: Handler,
    root: RootPlan,
    /// Payload files, relative to the prefix, with sha256 and mode.
    payload: Vec<(PathBuf, String, u32)>,
    /// A drop-in an earlier install wrote at another path.
    stale_dropin: Option<PathBuf>,
    /// The record written first: everything this run may create.
    intent: Manifest,
}

fn plan(
    opts: &Options,
    host: &HostRoot,
    old: Option<&Manifest>,
    info: PayloadInfo,
) -> Result<Plan> {
    let handler = Handler {
        name: opts.handler.clone(),
        shim: opts.prefix.join("bin/containerd-shim-crust-v2"),
    };
    let root = plan_root(opts, host, old, &handler)?;
    let mut dirs = old.map(|m| m.dirs.clone()).unwrap_or_default();
    dirs.extend(host.missing_dirs(&opts.prefix)?);
    let mut payload = Vec::new();
    let mut files = old.map(|m| m.files.clone()).unwrap_or_default();
    for rel in payload_files(&opts.payload)? {
        let dest = opts.prefix.join(&rel);
        dirs.extend(host.missing_dirs(dest.parent().expect("in prefix"))?);
        host.check_file(&dest)?;
        let (bytes, mode) = payload_file(&opts.payload, &rel)?;
        let sha = sha256(&bytes);
        files.insert(rel.clone(), sha.clone());
        payload.push((rel, sha, mode));
    }
    let dropin = root.dropin.then(|| opts.dropin.clone());
    if let Some(d) = &dropin {
        dirs.extend(host.missing_dirs(d.parent().expect("absolute"))?);
        host.check_file(d)?;
    }
    if root.write.is_some() {
        dirs.extend(host.missing_dirs(opts.containerd_config.parent().expect("absolute"))?);
    }
    let stale_dropin = old
        .and_then(|m| m.dropin.clone())
        .filter(|d| Some(d) != dropin.as_ref());
    let intent = Manifest {
        version: info.version,
        prefix: opts.prefix.clone(),
        files,
        dirs,
        dropin,
        config_version: root.version,
        containerd_config: opts.containerd_config.clone(),
        root: root.action.clone(),
        handler: opts.handler.clone(),
        pending: true,
    };
    Ok(Plan {
        handler,
        root,
        payload,
        stale_dropin,
        intent,
    })
}

/// Installs (or upgrades to) the payload. Idempotent.
pub fn install(opts: &Options) -> Result<Report> {
    opts.check()?;
    let info = read_payload_info(&opts.payload)?;
    if info.prefix != opts.prefix {
        return Err(InstallError::Payload(
            opts.payload.clone(),
            format!(
                "built for prefix {} (its binaries load their libraries from there), not {}",
                info.prefix.display(),
                opts.prefix.display()
            ),
        ));
    }
    let host = HostRoot::open(&opts.host_root)?;
    let old = read_record(&host, opts)?;
    let plan = plan(opts, &host, old.as_ref(), info)?;
    let record = host.shown(&opts.prefix.join(MANIFEST));
    let report = match apply(opts, &host, old.as_ref(), &plan) {
        Ok(r) => r,
        Err(cause) if old.is_none() => {
            let cause = Box::new(cause);
            return Err(match undo(&host, &plan.intent, &mut Report::default()) {
                Ok(()) => InstallError::RolledBack { cause },
                Err(e) => InstallError::RollbackFailed {
                    cause,
                    rollback: Box::new(e),
                    record,
                },
            });
        }
        Err(cause) => {
            return Err(InstallError::Incomplete {
                cause: Box::new(cause),
                record,
            });
        }
    };
    if report.containerd_changed {
        reload(opts)?;
    }
    Ok(report)
}

fn step(opts: &Options, s: Step) -> Result<()> {
    match opts.fault {
        Some(f) if f(s) => Err(InstallError::Fault(s)),
        _ => Ok(()),
    }
}

/// The writes, in the order that keeps the record a superset of what
/// exists and containerd's config loadable after any step.
fn apply(opts: &Options, host: &HostRoot, old: Option<&Manifest>, plan: &Plan) -> Result<Report> {
    let mut report = Report::default();
    let mut created = BTreeSet::new();
    // 0. A drop-in left at another path by an earlier install (the old
    //    record lists it until the new one replaces it).
    if let Some(stale) = &plan.stale_dropin
        && host.remove_file(stale)?
    {
        report.removed.push(stale.clone());
        report.containerd_changed = true;
    }

    // 1. The record of intent, before anything it lists. It lives in the
    //    prefix, so a crash between these two lines leaves at most the
    //    prefix's empty directories unrecorded.
    let mut record = plan.intent.clone();
    host.mkdirs(&opts.prefix, &mut created)?;
    write_record(host, &record)?;
    step(opts, Step::Recorded)?;

    // 2. The payload, file by file; then what the new one no longer has.
    let mut files = BTreeMap::new();
    for (rel, sha, mode) in &plan.payload {
        let (bytes, _) = payload_file(&opts.payload, rel)?;
        if sha256(&bytes) != *sha {
            return Err(InstallError::Payload(
                opts.payload.join(rel),
                "changed during the install".into(),
            ));
        }
        let dest = opts.prefix.join(rel);
        host.mkdirs(dest.parent().expect("in prefix"), &mut created)?;
        if host.put(&dest, &bytes, Some(*mode))? {
            report.written.push(dest);
        }
        files.insert(rel.clone(), sha.clone());
    }
    if let Some(m) = old {
        for rel in m.files.keys().filter(|r| !files.contains_key(*r)) {
            let p = opts.prefix.join(rel);
            if host.remove_file(&p)? {
                report.removed.push(p);
            }
        }
    }
    record.files = files;
    write_record(host, &record)?;
    step(opts, Step::Payload)?;

    // 3. The drop-in before the root config's `imports` entry naming it:
    //    a containerd restarted in between must not import a missing file.
    if let Some(d) = &record.dropin {
        let text = containerd::render_dropin(&plan.handler, plan.root.version);
        host.mkdirs(d.parent().expect("absolute"), &mut created)?;
        if host.put(d, text.as_bytes(), Some(0o644))? {
            report.written.push(d.clone());
            report.containerd_changed = true;
        }
    }
    step(opts, Step::Dropin)?;

    // 4. The root config.
    if let Some(text) = &plan.root.write {
        let path = &opts.containerd_config;
        host.mkdirs(path.parent().expect("absolute"), &mut created)?;
        if host.put(path, text.as_bytes(), None)? {
            report.written.push(path.clone());
            report.containerd_changed = true;
        }
    }
    step(opts, Step::RootConfig)?;

    // 5. Done: the record describes what exists.
    record.pending = false;
    write_record(host, &record)?;
    Ok(report)
}

/// What the root config needs, decided before anything is written so that
/// a config this installer cannot handle changes nothing.
struct RootPlan {
    action: RootAction,
    version: Version,
    /// New content of the root config, when it must be (re)written.
    write: Option<String>,
    /// Whether the runtime goes into a drop-in (else it is inline).
    dropin: bool,
}

fn plan_root(
    opts: &Options,
    host: &HostRoot,
    old: Option<&Manifest>,
    handler: &Handler,
) -> Result<RootPlan> {
    let path = &opts.containerd_config;
    let Some(bytes) = host.read(path)?.map(|f| f.bytes) else {
        let mut c = RootConfig::parse(
            path,
            &containerd::new_root_config(&[Path::new(containerd::DEFAULT_IMPORTS)]),
        )?;
        if !c.imports_file(&opts.dropin)? {
            c.add_import(&opts.dropin)?;
        }
        let text = c.render();
        return Ok(RootPlan {
            action: RootAction::Created {
                written: sha256(text.as_bytes()),
            },
            version: Version::V2,
            write: Some(text),
            dropin: true,
        });
    };
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let mut cfg = RootConfig::parse(path, &text)?;
    let version = cfg.version()?;
    if version == Version::V2 && cfg.has_cri_section(version) {
        // What uninstall restores: the first install's original while the
        // file is still as we left it; else the file as it is now, edits
        // included, without our table.
        let original = match old.map(|m| &m.root) {
            Some(RootAction::RuntimeAdded { original, written }) if *written == sha256(&bytes) => {
                original.clone()
            }
            _ => {
                let mut base = RootConfig::parse(path, &text)?;
                base.remove_runtime(&handler.name, version);
                base.render()
            }
        };
        cfg.add_runtime(handler, version)?;
        let edited = cfg.render();
        return Ok(RootPlan {
            action: RootAction::RuntimeAdded {
                original,
                written: sha256(edited.as_bytes()),
            },
            version,
            write: (edited != text).then_some(edited),
            dropin: false,
        });
    }
    if cfg.imports_file(&opts.dropin)? {
        // Already imported: by us earlier (keep that record, so uninstall
        // still takes our entry out, even from a file edited since) or by
        // the host's own configuration.
        let action = match old.map(|m| &m.root) {
            Some(a @ (RootAction::ImportAdded { .. } | RootAction::Created { .. })) => a.clone(),
            _ => RootAction::Untouched,
        };
        return Ok(RootPlan {
            action,
            version,
            write: None,
            dropin: true,
        });
    }
    cfg.add_import(&opts.dropin)?;
    let edited = cfg.render();
    Ok(RootPlan {
        action: RootAction::ImportAdded {
            original: text,
            written: sha256(edited.as_bytes()),
        },
        version,
        write: Some(edited),
        dropin: true,
    })
}

/// Removes exactly what the install record lists (a pending one too).
/// Idempotent: without a record there is nothing to remove.
pub fn uninstall(opts: &Options) -> Result<Report> {
    opts.check()?;
    let host = HostRoot::open(&opts.host_root)?;
    let mut report = Report::default();
    let Some(m) = read_record(&host, opts)? else {
        return Ok(report);
    };
    undo(&host, &m, &mut report)?;
    if report.containerd_changed {
        reload(opts)?;
    }
    Ok(report)
}

/// Undoes `m`, in the reverse order of [`apply`]. Every removal is
/// conditional (a file's absence, a config's digest), so a pending record
/// that lists more than was done is undone just as well.
fn undo(host: &HostRoot, m: &Manifest, report: &mut Report) -> Result<()> {
    // The root config first: it must never import a drop-in that is gone.
    let cfg = &m.containerd_config;
    let now = match &m.root {
        RootAction::Untouched => None,
        _ => host.read(cfg)?,
    };
    match (&m.root, now) {
        (RootAction::Untouched, _) | (_, None) => {}
        (RootAction::Created { written }, Some(now)) => {
            if sha256(&now.bytes) == *written {
                host.remove_file(cfg)?;
                report.removed.push(cfg.clone());
                report.containerd_changed = true;
            } else {
                drop_import(host, m, &now.bytes, report)?;
            }
        }
        (
            RootAction::ImportAdded { original, written }
            | RootAction::RuntimeAdded { original, written },
            Some(now),
        ) => {
            if sha256(&now.bytes) == *written {
                host.put(cfg, original.as_bytes(), None)?;
                report.written.push(cfg.clone());
                report.containerd_changed = true;
            } else {
                // Edited since (or never written): take out only our entry.
                drop_import(host, m, &now.bytes, report)?;
            }
        }
    }
    if let Some(d) = &m.dropin
        && host.remove_file(d)?
    {
        report.removed.push(d.clone());
        report.containerd_changed = true;
    }
    for rel in m.files.keys() {
        let p = m.prefix.join(rel);
        if host.remove_file(&p)? {
            report.removed.push(p);
        }
    }
    host.remove_file(&m.prefix.join(MANIFEST))?;
    // Deepest first; a directory someone else put files in stays.
    for d in m.dirs.iter().rev() {
        if host.remove_dir(d)? {
            report.removed.push(d.clone());
        }
    }
    Ok(())
}

/// Takes out only what this installer added (its `imports` entry or its
/// runtime table) from a root config edited since.
fn drop_import(host: &HostRoot, m: &Manifest, now: &[u8], report: &mut Report) -> Result<()> {
    let mut cfg = RootConfig::parse(&m.containerd_config, &String::from_utf8_lossy(now))?;
    let changed = match (&m.root, &m.dropin) {
        (RootAction::RuntimeAdded { .. }, _) => cfg.remove_runtime(&m.handler, m.config_version),
        (_, Some(d)) => cfg.remove_import(d)?,
        (_, None) => false,
    };
    if changed {
        host.put(&m.containerd_config, cfg.render().as_bytes(), None)?;
        report.written.push(m.containerd_config.clone());
        report.containerd_changed = true;
    }
    Ok(())
}

fn reload(opts: &Options) -> Result<()> {
    let Some(cmd) = opts.reload.as_ref().filter(|c| !c.is_empty()) else {
        return Ok(());
    };
    let shown = cmd.join(" ");
    let out = Command::new(&cmd[0])
        .args(&cmd[1..])
        .output()
        .map_err(|e| InstallError::Reload {
            command: shown.clone(),
            reason: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(InstallError::Reload {
            command: shown,
            reason: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod path_tests {
    use super::*;

    #[test]
    fn paths_must_name_what_they_show() {
        let ok = Options::new("/host", "/payload");
        assert!(ok.check().is_ok());
        for (prefix, config) in [
            ("/opt/crust/..", "/etc/containerd/config.toml"),
            ("/opt/crust", "/"),
            ("/opt/../etc", "/etc/containerd/config.toml"),
            ("opt/crust", "/etc/containerd/config.toml"),
        ] {
            let mut o = Options::new("/host", "/payload");
            o.prefix = prefix.into();
            o.containerd_config = config.into();
            assert!(o.check().is_err(), "{prefix} {config}");
        }
    }
}
