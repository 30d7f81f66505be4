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
//! * Everything done is recorded in `<prefix>/.crust-install.json`;
//!   uninstall undoes exactly that (files, directories it created, the
//!   drop-in, the `imports` entry, a root config it created) and an
//!   upgrade removes files the new payload no longer has.
//! * Both are idempotent: a repeated run changes nothing and does not
//!   reload containerd.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::containerd::{self, ConfigError, Handler, RootConfig, Version};

/// The install record, relative to the prefix.
pub const MANIFEST: &str = ".crust-install.json";
/// The payload's description, relative to the payload root.
pub const PAYLOAD_INFO: &str = "share/crust/payload.json";

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{0}: {1}")]
    Io(PathBuf, io::Error),
    #[error("payload {0}: {1}")]
    Payload(PathBuf, String),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("install record {0} is unreadable: {1}")]
    Manifest(PathBuf, String),
    #[error("{0} must be an absolute path")]
    NotAbsolute(PathBuf),
    #[error("reloading containerd ({command}) failed: {reason}")]
    Reload { command: String, reason: String },
}

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
        }
    }

    /// A host path as this process reaches it.
    fn host(&self, p: &Path) -> PathBuf {
        let rel: PathBuf = p
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect();
        self.host_root.join(rel)
    }

    fn check(&self) -> Result<()> {
        for p in [&self.prefix, &self.containerd_config, &self.dropin] {
            if !p.is_absolute() {
                return Err(InstallError::NotAbsolute(p.clone()));
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

fn read_opt(p: &Path) -> Result<Option<Vec<u8>>> {
    match fs::read(p) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(InstallError::Io(p.to_path_buf(), e)),
    }
}

/// Creates `dir` and missing parents, recording (as host paths) the ones
/// created.
fn mkdirs(opts: &Options, dir: &Path, created: &mut BTreeSet<PathBuf>) -> Result<()> {
    let mut cur = PathBuf::from("/");
    for c in dir
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
    {
        cur.push(c);
        let h = opts.host(&cur);
        match fs::symlink_metadata(&h) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(InstallError::Io(
                    h,
                    io::Error::other("exists and is not a directory"),
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir(&h).map_err(io_err(&h))?;
                fs::set_permissions(&h, fs::Permissions::from_mode(0o755)).map_err(io_err(&h))?;
                created.insert(cur.clone());
            }
            Err(e) => return Err(InstallError::Io(h, e)),
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically (temp file, fsync, rename) unless
/// it already holds them with `mode`. Returns whether it wrote.
fn put(path: &Path, bytes: &[u8], mode: u32) -> Result<bool> {
    if let Ok(m) = fs::symlink_metadata(path)
        && m.is_file()
        && m.permissions().mode() & 0o7777 == mode
        && read_opt(path)?.as_deref() == Some(bytes)
    {
        return Ok(false);
    }
    let dir = path.parent().expect("absolute");
    let tmp = dir.join(format!(
        ".{}.crust-tmp",
        path.file_name().expect("a file").to_string_lossy()
    ));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    f.write_all(bytes).map_err(io_err(&tmp))?;
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(true)
}

fn remove_file(path: &Path) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(InstallError::Io(path.to_path_buf(), e)),
    }
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

pub fn read_payload_info(payload: &Path) -> Result<PayloadInfo> {
    let p = payload.join(PAYLOAD_INFO);
    let bytes = fs::read(&p).map_err(io_err(&p))?;
    serde_json::from_slice(&bytes).map_err(|e| InstallError::Payload(p, e.to_string()))
}

pub fn read_manifest(opts: &Options) -> Result<Option<Manifest>> {
    let p = opts.host(&opts.prefix).join(MANIFEST);
    match read_opt(&p)? {
        None => Ok(None),
        Some(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| InstallError::Manifest(p, e.to_string())),
    }
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
    let old = read_manifest(opts)?;
    let handler = Handler {
        name: opts.handler.clone(),
        shim: opts.prefix.join("bin/containerd-shim-crust-v2"),
    };
    let plan = plan_root(opts, old.as_ref(), &handler)?;
    let mut report = Report::default();
    let mut dirs = old.as_ref().map(|m| m.dirs.clone()).unwrap_or_default();

    // 1. The payload, file by file.
    mkdirs(opts, &opts.prefix, &mut dirs)?;
    let mut files = BTreeMap::new();
    for rel in payload_files(&opts.payload)? {
        let src = opts.payload.join(&rel);
        let bytes = fs::read(&src).map_err(io_err(&src))?;
        let mode = fs::metadata(&src)
            .map_err(io_err(&src))?
            .permissions()
            .mode()
            & 0o755;
        let dest_host = opts.prefix.join(&rel);
        mkdirs(opts, dest_host.parent().expect("in prefix"), &mut dirs)?;
        if put(&opts.host(&dest_host), &bytes, mode)? {
            report.written.push(dest_host);
        }
        files.insert(rel, sha256(&bytes));
    }
    if let Some(m) = &old {
        for rel in m.files.keys().filter(|r| !files.contains_key(*r)) {
            let p = opts.prefix.join(rel);
            if remove_file(&opts.host(&p))? {
                report.removed.push(p);
            }
        }
    }

    // 2. containerd: the root config decides the drop-in's version.
    if let Some(text) = &plan.write {
        let path = &opts.containerd_config;
        mkdirs(opts, path.parent().expect("absolute"), &mut dirs)?;
        let host = opts.host(path);
        put(&host, text.as_bytes(), mode_of(&host))?;
        report.written.push(path.clone());
        report.containerd_changed = true;
    }
    let (root, version) = (plan.action, plan.version);
    let dropin = plan.dropin.then(|| opts.dropin.clone());
    if let Some(d) = &dropin {
        let text = containerd::render_dropin(&handler, version);
        mkdirs(opts, d.parent().expect("absolute"), &mut dirs)?;
        if put(&opts.host(d), text.as_bytes(), 0o644)? {
            report.written.push(d.clone());
            report.containerd_changed = true;
        }
    }
    if let Some(stale) = old.as_ref().and_then(|m| m.dropin.as_ref())
        && Some(stale) != dropin.as_ref()
        && remove_file(&opts.host(stale))?
    {
        report.removed.push(stale.clone());
        report.containerd_changed = true;
    }

    // 3. The record, last: it describes only what exists.
    let manifest = Manifest {
        version: info.version,
        prefix: opts.prefix.clone(),
        files,
        dirs,
        dropin,
        config_version: version,
        containerd_config: opts.containerd_config.clone(),
        root,
        handler: opts.handler.clone(),
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("serializable");
    put(&opts.host(&opts.prefix).join(MANIFEST), &json, 0o644)?;
    if report.containerd_changed {
        reload(opts)?;
    }
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

fn plan_root(opts: &Options, old: Option<&Manifest>, handler: &Handler) -> Result<RootPlan> {
    let path = &opts.containerd_config;
    let Some(bytes) = read_opt(&opts.host(path))? else {
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
        cfg.add_runtime(handler, version);
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

/// Removes exactly what the install record lists. Idempotent: without a
/// record there is nothing to remove.
pub fn uninstall(opts: &Options) -> Result<Report> {
    opts.check()?;
    let mut report = Report::default();
    let Some(m) = read_manifest(opts)? else {
        return Ok(report);
    };
    if let Some(d) = &m.dropin
        && remove_file(&opts.host(d))?
    {
        report.removed.push(d.clone());
        report.containerd_changed = true;
    }
    let root_host = opts.host(&m.containerd_config);
    match &m.root {
        RootAction::Untouched => {}
        RootAction::Created { written } => {
            if let Some(now) = read_opt(&root_host)? {
                if sha256(&now) == *written {
                    remove_file(&root_host)?;
                    report.removed.push(m.containerd_config.clone());
                    report.containerd_changed = true;
                } else {
                    drop_import(&m, &root_host, &now, &mut report)?;
                }
            }
        }
        RootAction::ImportAdded { original, written }
        | RootAction::RuntimeAdded { original, written } => {
            if let Some(now) = read_opt(&root_host)? {
                if sha256(&now) == *written {
                    put(&root_host, original.as_bytes(), mode_of(&root_host))?;
                    report.written.push(m.containerd_config.clone());
                    report.containerd_changed = true;
                } else {
                    // Edited since: take out only our entry.
                    drop_import(&m, &root_host, &now, &mut report)?;
                }
            }
        }
    }
    let prefix = opts.host(&m.prefix);
    for rel in m.files.keys() {
        if remove_file(&prefix.join(rel))? {
            report.removed.push(m.prefix.join(rel));
        }
    }
    remove_file(&prefix.join(MANIFEST))?;
    // Deepest first; a directory someone else put files in stays.
    for d in m.dirs.iter().rev() {
        let h = opts.host(d);
        match fs::remove_dir(&h) {
            Ok(()) => report.removed.push(d.clone()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::DirectoryNotEmpty
                ) => {}
            Err(e) => return Err(InstallError::Io(h, e)),
        }
    }
    if report.containerd_changed {
        reload(opts)?;
    }
    Ok(report)
}

fn mode_of(p: &Path) -> u32 {
    fs::metadata(p).map_or(0o644, |m| m.permissions().mode() & 0o7777)
}

/// Takes out only what this installer added (its `imports` entry or its
/// runtime table) from a root config edited since.
fn drop_import(m: &Manifest, host: &Path, now: &[u8], report: &mut Report) -> Result<()> {
    let mut cfg = RootConfig::parse(&m.containerd_config, &String::from_utf8_lossy(now))?;
    let changed = match (&m.root, &m.dropin) {
        (RootAction::RuntimeAdded { .. }, _) => cfg.remove_runtime(&m.handler, m.config_version),
        (_, Some(d)) => cfg.remove_import(d)?,
        (_, None) => false,
    };
    if changed {
        put(host, cfg.render().as_bytes(), mode_of(host))?;
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
