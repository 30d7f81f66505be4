//! The record directories on disk. Every access below the root goes through
//! directory file descriptors with `O_NOFOLLOW`, so a symlink planted in the
//! root can never redirect a read or a write; mutations hold `flock` on the
//! record directory so concurrent stagers, claimers and removers serialize.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::error::{HandoffError, Result};
use crate::mountinfo::{MountInfo, VOLUME_TYPE_BLOCK, VOLUME_TYPE_DIRECTVOL};
use crate::validate;

mod dirs;
mod fsio;
mod layout;

use dirs::{Entry, Staged, compare_staged, entry_name, first_sandbox};
use fsio::{read_bounded, read_runtime_cli, unlink_ignore_missing, write_atomic};
pub use layout::{DEFAULT_CRUST_ROOT, DEFAULT_KATA_ROOT, Layout, crust_key, kata_key};

/// File holding the record itself (both layouts).
pub const MOUNT_INFO_FILE: &str = "mountInfo.json";
/// File holding the runtime CLI's absolute path (CRUST layout only).
pub const RUNTIME_CLI_FILE: &str = "runtime-cli";
/// Largest `mountInfo.json` accepted.
pub const MAX_RECORD_SIZE: u64 = 64 * 1024;
/// Temp files sort after every valid sandbox id (`~` > alphanumerics), so a
/// Kata runtime picking "the first non-mountInfo.json file" never picks one
/// while a sandbox file exists.
const TMP_PREFIX: &str = "~tmp.";
/// Longest file name the kernel accepts (NAME_MAX).
const NAME_MAX: usize = 255;

/// What the caller's deployment allows.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Targets must lie beneath one of these (e.g. `/var/lib/kubelet/pods`).
    /// Empty: any absolute normalized path.
    pub allowed_target_prefixes: Vec<String>,
    /// Regular files beneath these roots are accepted as devices (VM images,
    /// tests). Empty: block devices under /dev only.
    pub file_device_roots: Vec<PathBuf>,
    /// Filesystems a record may name (default: every `crust_fs::FsType`).
    pub allowed_fstypes: Vec<String>,
    /// The caller's name for the setting behind `file_device_roots` (a
    /// flag and variable), so that a refusal says what to change.
    pub file_device_setting: String,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            allowed_target_prefixes: Vec::new(),
            file_device_roots: Vec::new(),
            allowed_fstypes: crust_fs::FsType::NAMES.map(String::from).to_vec(),
            file_device_setting: "the file-device roots".into(),
        }
    }
}

/// A record seen by [`Store::list`].
#[derive(Debug)]
pub struct ListedRecord {
    /// The directory name.
    pub key: String,
    /// The target path when the layout can recover it (Kata); the CRUST
    /// layout stores only a digest.
    pub target: Option<String>,
    pub state: Result<RecordState>,
}

/// Everything a record directory says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordState {
    pub mount_info: MountInfo,
    pub claimant: Option<String>,
    pub runtime_cli: Option<String>,
}

/// A record matched by [`Store::find_for_source`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceMatch {
    /// The target path the record was staged for.
    pub target: String,
    /// What the OCI source adds beneath the target (relative, normalized,
    /// empty when the source is the target itself).
    pub subpath: String,
    pub mount_info: MountInfo,
}

/// One layout rooted at one directory, with the caller's policy.
#[derive(Debug, Clone)]
pub struct Store {
    layout: Layout,
    root: PathBuf,
    policy: Policy,
}

impl Store {
    /// Validates the policy; touches nothing on disk.
    pub fn new(layout: Layout, root: impl Into<PathBuf>, policy: Policy) -> Result<Self> {
        let root = root.into();
        let root_str = root
            .to_str()
            .ok_or_else(|| HandoffError::InvalidArgument("root is not UTF-8".into()))?;
        validate::check_abs_path("root", root_str).map_err(HandoffError::InvalidArgument)?;
        let mut policy = policy;
        for p in &mut policy.allowed_target_prefixes {
            let trimmed = p.trim_end_matches('/');
            validate::check_abs_path("allowed target prefix", trimmed)
                .map_err(HandoffError::InvalidArgument)?;
            *p = trimmed.to_string();
        }
        for r in &policy.file_device_roots {
            let s = r.to_str().ok_or_else(|| {
                HandoffError::InvalidArgument("file-device root is not UTF-8".into())
            })?;
            validate::check_abs_path("file-device root", s.trim_end_matches('/'))
                .map_err(HandoffError::InvalidArgument)?;
        }
        if policy.allowed_fstypes.is_empty() {
            return Err(HandoffError::InvalidArgument(
                "the fstype allow-list is empty".into(),
            ));
        }
        Ok(Store {
            layout,
            root,
            policy,
        })
    }

    /// The layout at its default root.
    pub fn with_default_root(layout: Layout, policy: Policy) -> Result<Self> {
        Store::new(layout, layout.default_root(), policy)
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Checks a target path against format and policy; returns its key.
    pub fn check_target(&self, target: &str) -> Result<String> {
        validate::check_abs_path("target path", target).map_err(HandoffError::InvalidArgument)?;
        let prefixes = &self.policy.allowed_target_prefixes;
        // Lexically inside, and still inside once the parts of both that
        // exist are resolved: a symlinked component must not lead out.
        let real_target = validate::resolve_existing(target);
        if !prefixes.is_empty()
            && !prefixes.iter().any(|p| {
                let real_prefix = validate::resolve_existing(p);
                validate::is_within(target, p)
                    && target != p
                    && validate::is_within(&real_target, &real_prefix)
                    && real_target != real_prefix
            })
        {
            return Err(HandoffError::InvalidArgument(format!(
                "target path {target:?} is outside the allowed prefixes ({})",
                prefixes.join(", ")
            )));
        }
        let key = self.layout.key(target);
        if key.len() > NAME_MAX {
            return Err(HandoffError::InvalidArgument(format!(
                "target path is too long for the Kata layout (its encoded name exceeds {NAME_MAX} bytes)"
            )));
        }
        Ok(key)
    }

    /// Where the record for `target` lives.
    pub fn record_dir(&self, target: &str) -> Result<PathBuf> {
        Ok(self.root.join(self.check_target(target)?))
    }

    /// Checks every field of a record to be written against format and
    /// policy, including that the device exists and is acceptable now.
    pub fn check_mount_info(&self, mi: &MountInfo) -> std::result::Result<(), String> {
        validate::check_metadata(&mi.metadata)?;
        self.check_record(mi)
    }

    /// The checks of a record being read: those of [`Store::check_mount_info`]
    /// but with metadata read as Kata reads it (unknown keys ignored,
    /// `createFilesystem` understood, `encryptionKey` refused; see
    /// [`validate::check_metadata_read`]).
    pub fn check_record(&self, mi: &MountInfo) -> std::result::Result<(), String> {
        validate::check_volume_type(&mi.volume_type)?;
        validate::check_fstype(&mi.fstype, &self.policy.allowed_fstypes)?;
        validate::check_metadata_read(mi)?;
        validate::check_options(&mi.options)?;
        validate::check_device(
            &mi.device,
            &self.policy.file_device_roots,
            &self.policy.file_device_setting,
        )?;
        Ok(())
    }

    /// `mi` as this layout writes it: a Kata-layout record's volume type
    /// is `directvol` (what Kata's Rust runtime requires; Kata's Go runtime
    /// ignores it, crust reads `block`, `directvol` and none alike).
    pub fn normalized(&self, mi: &MountInfo) -> MountInfo {
        let mut mi = mi.clone();
        if self.layout == Layout::Kata && matches!(mi.volume_type.as_str(), "" | VOLUME_TYPE_BLOCK)
        {
            mi.volume_type = VOLUME_TYPE_DIRECTVOL.into();
        }
        mi
    }

    /// Writes the record for `target`. Same content again: Ok. Different
    /// content: refused while a sandbox holds the volume, otherwise replaced
    /// atomically (and a stale `runtime-cli` dropped).
    pub fn stage(&self, target: &str, mi: &MountInfo) -> Result<()> {
        let mi = &self.normalized(mi);
        let (key, json) = self.checked_record(target, mi)?;
        let (dir, path, entries) = self.record_dir_for_write(&key)?;
        match compare_staged(&dir, &entries, mi, target, &path)? {
            Staged::Same => return Ok(()),
            Staged::Different if entries.iter().any(|e| matches!(e, Entry::RuntimeCli)) => {
                unlink_ignore_missing(&dir, RUNTIME_CLI_FILE, &path)?;
            }
            Staged::Different | Staged::Nothing => {}
        }
        write_atomic(&dir, MOUNT_INFO_FILE, json.as_bytes(), &path)
    }

    /// Replaces the I/O limits of the record staged for `target`
    /// (metadata [`crate::IO_LIMITS_KEY`]), claimed or not: the one field
    /// that may change under a sandbox, since its runtime applies it live
    /// and reads it again at every plug. The claim and `runtime-cli` stay.
    /// No record: [`HandoffError::NotFound`]. Returns whether it changed.
    pub fn set_io_limits(&self, target: &str, limits: &crate::IoLimits) -> Result<bool> {
        self.update_metadata(target, |metadata| {
            let before = metadata.get(crate::IO_LIMITS_KEY).cloned();
            if limits.is_unlimited() {
                metadata.remove(crate::IO_LIMITS_KEY);
            } else {
                metadata.insert(crate::IO_LIMITS_KEY.into(), limits.to_wire());
            }
            metadata.get(crate::IO_LIMITS_KEY) != before.as_ref()
        })
    }

    /// Applies `change` to the metadata of the record staged for `target`
    /// under the record's lock, claimed or not (the claim and `runtime-cli`
    /// stay), and writes the record back atomically when `change` says it
    /// changed something. No record: [`HandoffError::NotFound`].
    fn update_metadata(
        &self,
        target: &str,
        change: impl FnOnce(&mut std::collections::BTreeMap<String, String>) -> bool,
    ) -> Result<bool> {
        let key = self.check_target(target)?;
        let Some(root) = self.open_root(false)? else {
            return Err(HandoffError::NotFound(target.to_string()));
        };
        let Some(dir) = self.lock_record_dir(&root, &key, false)? else {
            return Err(HandoffError::NotFound(target.to_string()));
        };
        let path = self.display(&key);
        let bytes = read_bounded(&dir, MOUNT_INFO_FILE, MAX_RECORD_SIZE, &path)?
            .ok_or_else(|| HandoffError::NotFound(target.to_string()))?;
        let mut mi = MountInfo::from_json(&bytes).map_err(|e| HandoffError::bad(&path, e))?;
        if !change(&mut mi.metadata) {
            return Ok(false);
        }
        let (_, json) = self.checked_record(target, &mi)?;
        write_atomic(&dir, MOUNT_INFO_FILE, json.as_bytes(), &path)?;
        Ok(true)
    }

    /// Records `identity` (metadata [`crate::DEVICE_IDENTITY_KEY`]) in the
    /// record staged for `target` when it has none: a record another tool
    /// wrote (Kata's CSI driver) names its device by path alone, and the
    /// device found there at the first plug is the one every later plug
    /// must find. An identity already there is never replaced. No record:
    /// [`HandoffError::NotFound`]. Returns whether it wrote.
    pub fn pin_device_identity(&self, target: &str, identity: &str) -> Result<bool> {
        self.update_metadata(target, |metadata| {
            if metadata.contains_key(crate::DEVICE_IDENTITY_KEY) {
                return false;
            }
            metadata.insert(crate::DEVICE_IDENTITY_KEY.into(), identity.to_string());
            true
        })
    }

    /// Writes the record for `target` already claimed by `sandbox_id`
    /// (and, CRUST layout, with its `runtime_cli`): the claim and the CLI
    /// are written first and `mountInfo.json` last, so a reader sees
    /// either no record or one that `sandbox_id` holds; no other runtime
    /// can claim it in between (a handover: the plugin hands a volume to
    /// the sandbox that asked). Idempotent for the same sandbox and record.
    /// Another claimant: [`HandoffError::Claimed`]; a different record an
    /// unclaimed directory holds is replaced. A directory left without
    /// `mountInfo.json` by a crash is completed.
    pub fn stage_claimed(
        &self,
        target: &str,
        mi: &MountInfo,
        sandbox_id: &str,
        runtime_cli: Option<&str>,
    ) -> Result<()> {
        let mi = &self.normalized(mi);
        let (key, json) = self.checked_record(target, mi)?;
        validate::check_sandbox_id(sandbox_id).map_err(HandoffError::InvalidArgument)?;
        if let Some(cli) = runtime_cli {
            if self.layout == Layout::Kata {
                return Err(HandoffError::Unsupported(
                    "the Kata layout has no runtime-cli file".into(),
                ));
            }
            validate::check_abs_path("runtime cli", cli).map_err(HandoffError::InvalidArgument)?;
        }
        let (dir, path, entries) = self.record_dir_for_write(&key)?;
        let staged = entries.iter().any(|e| matches!(e, Entry::MountInfo));
        if staged && let Some(other) = first_sandbox(&entries).filter(|o| *o != sandbox_id) {
            return Err(HandoffError::Claimed {
                target: target.into(),
                by: other.to_string(),
            });
        }
        // A claim file left without its record by a crash names nobody who
        // could have used the record: it goes.
        for e in &entries {
            if let Entry::Sandbox(other) = e
                && other != sandbox_id
            {
                unlink_ignore_missing(&dir, other, &path)?;
            }
        }
        if !entries
            .iter()
            .any(|e| matches!(e, Entry::Sandbox(n) if n == sandbox_id))
        {
            match rustix::fs::openat(
                &dir,
                sandbox_id,
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            ) {
                Ok(fd) => rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600))
                    .map_err(|e| HandoffError::io("chmod claim", e))?,
                Err(Errno::EXIST) => {}
                Err(e) => return Err(HandoffError::io(format!("claim {path}"), e)),
            }
        }
        match runtime_cli {
            Some(cli) if read_runtime_cli(&dir, &path)?.as_deref() != Some(cli) => {
                write_atomic(&dir, RUNTIME_CLI_FILE, cli.as_bytes(), &path)?
            }
            _ => rustix::fs::fsync(&dir).map_err(|e| HandoffError::io("fsync record dir", e))?,
        }
        let same = staged
            && read_bounded(&dir, MOUNT_INFO_FILE, MAX_RECORD_SIZE, &path)?
                .and_then(|b| MountInfo::from_json(&b).ok())
                .as_ref()
                == Some(mi);
        if same {
            return Ok(());
        }
        write_atomic(&dir, MOUNT_INFO_FILE, json.as_bytes(), &path)
    }

    /// Removes the directory of `target` if it holds no `mountInfo.json`
    /// (what a [`Store::stage_claimed`] interrupted before its last write
    /// leaves: nobody could have read or used that record). A complete
    /// record is left alone: Ok(false). Removed or nothing there: Ok(true).
    pub fn discard_partial(&self, target: &str) -> Result<bool> {
        let key = self.check_target(target)?;
        let Some(root) = self.open_root(false)? else {
            return Ok(true);
        };
        let Some(dir) = self.lock_record_dir(&root, &key, false)? else {
            return Ok(true);
        };
        let path = self.display(&key);
        let entries = self.entries(&dir, &path)?;
        if entries.iter().any(|e| matches!(e, Entry::MountInfo)) {
            return Ok(false);
        }
        for e in &entries {
            unlink_ignore_missing(&dir, entry_name(e), &path)?;
        }
        match rustix::fs::unlinkat(&root, key.as_str(), AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(HandoffError::io(format!("remove {path}"), e)),
        }
        rustix::fs::fsync(&root).map_err(|e| HandoffError::io("fsync root", e))?;
        Ok(true)
    }

    /// Everything [`Store::stage`] would refuse, without writing: lets a
    /// caller staging into several layouts check them all first.
    pub fn check_stage(&self, target: &str, mi: &MountInfo) -> Result<()> {
        let mi = &self.normalized(mi);
        let key = self.check_target(target)?;
        self.check_mount_info(mi)
            .map_err(HandoffError::InvalidArgument)?;
        let Some(root) = self.open_root(false)? else {
            return Ok(());
        };
        let Some(dir) = self.open_record_dir(&root, &key)? else {
            return Ok(());
        };
        let path = self.display(&key);
        let entries = self.entries(&dir, &path)?;
        compare_staged(&dir, &entries, mi, target, &path).map(|_| ())
    }

    /// Kata's `direct-volume add`: a record given as JSON, accepted by the
    /// reader's rules ([`Store::check_record`]: what a runtime would
    /// consume). The caller's bytes are stored as given when every reader
    /// takes them alike: crust and Kata's Go runtime (same key folding,
    /// duplicates refused by [`MountInfo::from_json`]) and Kata's Rust
    /// runtime (exact key spelling, no `null` for a known key, volume type
    /// `directvol` in the Kata layout); otherwise the canonical form of
    /// what was read ([`MountInfo::to_json`] of [`Store::normalized`]).
    /// Returns the record as stored.
    pub fn stage_bytes(&self, target: &str, bytes: &[u8]) -> Result<MountInfo> {
        let given = MountInfo::from_json(bytes).map_err(HandoffError::InvalidArgument)?;
        let mi = self.normalized(&given);
        let key = self.check_target(target)?;
        self.check_record(&mi)
            .map_err(HandoffError::InvalidArgument)?;
        let json = if mi == given && crate::mountinfo::read_alike_by_every_runtime(bytes) {
            bytes.to_vec()
        } else {
            mi.to_json().into_bytes()
        };
        if json.len() as u64 > MAX_RECORD_SIZE {
            return Err(HandoffError::InvalidArgument(
                "the record would exceed 64 KiB".into(),
            ));
        }
        let (dir, path, entries) = self.record_dir_for_write(&key)?;
        match compare_staged(&dir, &entries, &mi, target, &path)? {
            Staged::Same => return Ok(mi),
            Staged::Different if entries.iter().any(|e| matches!(e, Entry::RuntimeCli)) => {
                unlink_ignore_missing(&dir, RUNTIME_CLI_FILE, &path)?;
            }
            Staged::Different | Staged::Nothing => {}
        }
        write_atomic(&dir, MOUNT_INFO_FILE, &json, &path)?;
        Ok(mi)
    }

    /// The validated record for `target`. A record that this library would
    /// not write (unknown keys, bad device, symlinks, too large) is refused.
    pub fn read(&self, target: &str) -> Result<MountInfo> {
        let key = self.check_target(target)?;
        let Some(root) = self.open_root(false)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        let Some(dir) = self.open_record_dir(&root, &key)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        self.read_mount_info(&dir, &self.display(&key))?
            .ok_or_else(|| HandoffError::NotFound(target.into()))
    }

    /// Whether a record directory with a `mountInfo.json` exists for
    /// `target`, without judging the record's content.
    pub fn exists(&self, target: &str) -> Result<bool> {
        let key = self.check_target(target)?;
        let Some(root) = self.open_root(false)? else {
            return Ok(false);
        };
        let Some(dir) = self.open_record_dir(&root, &key)? else {
            return Ok(false);
        };
        match rustix::fs::statat(&dir, MOUNT_INFO_FILE, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::RegularFile => Ok(true),
            Ok(_) => Err(HandoffError::bad(
                self.display(&key),
                "mountInfo.json is not a regular file",
            )),
            Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(HandoffError::io("stat mountInfo.json", e)),
        }
    }

    /// Mount info, claimant and runtime CLI of one record.
    pub fn inspect(&self, target: &str) -> Result<RecordState> {
        let key = self.check_target(target)?;
        let Some(root) = self.open_root(false)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        self.inspect_key(&root, &key)?
            .ok_or_else(|| HandoffError::NotFound(target.into()))
    }

    /// Removes the whole record directory. Missing: Ok. Anything this
    /// library does not know inside (a directory, a symlink, a stray name):
    /// refused, and nothing is removed.
    ///
    /// CRUST layout: while a sandbox claim file exists the record is kept
    /// and [`HandoffError::StillClaimed`] returned, because that sandbox's
    /// VM may still have the device (a second publish would hand it to a
    /// second VM). Our runtime drops its claim when a sandbox is deleted;
    /// a caller that has established that a claimant is dead uses
    /// [`Store::remove_with`].
    ///
    /// Kata layout: claims do not block removal. Kata leaves its
    /// `<sandbox-id>` file behind when a sandbox stops, so such a file says
    /// nothing about liveness; Kata's `direct-volume remove` deletes the
    /// record whatever it holds, and so does this.
    pub fn remove(&self, target: &str) -> Result<()> {
        self.remove_with(target, |_| true)
    }

    /// [`Store::remove`], where a claimant for which `is_alive` returns
    /// false is stale and goes with the record. `is_alive` is asked under
    /// the record's lock, for every claimant, only in the CRUST layout.
    pub fn remove_with(&self, target: &str, is_alive: impl Fn(&str) -> bool) -> Result<()> {
        self.remove_checked(target, is_alive, self.layout == Layout::Crust)
    }

    /// [`Store::remove_with`] in either layout: any claimant for which
    /// `is_alive` returns true keeps the record ([`HandoffError::StillClaimed`]).
    /// For callers that established each claimant's liveness themselves
    /// (crust_ops: its runtime's `sandbox-state`, Kata's shim socket).
    pub fn remove_unless_claimed(
        &self,
        target: &str,
        is_alive: impl Fn(&str) -> bool,
    ) -> Result<()> {
        self.remove_checked(target, is_alive, true)
    }

    fn remove_checked(
        &self,
        target: &str,
        is_alive: impl Fn(&str) -> bool,
        check_claims: bool,
    ) -> Result<()> {
        let key = self.check_target(target)?;
        let Some(root) = self.open_root(false)? else {
            return Ok(());
        };
        let Some(dir) = self.lock_record_dir(&root, &key, false)? else {
            return Ok(());
        };
        let path = self.display(&key);
        let entries = self.entries(&dir, &path)?;
        if check_claims {
            for e in &entries {
                if let Entry::Sandbox(by) = e
                    && is_alive(by)
                {
                    return Err(HandoffError::StillClaimed {
                        target: target.into(),
                        by: by.clone(),
                    });
                }
            }
        }
        // mountInfo.json goes last: a crash midway leaves a record a retry
        // removes, never a claim or a CLI without its record.
        let mut names: Vec<String> = entries
            .iter()
            .filter_map(|e| match e {
                Entry::RuntimeCli => Some(RUNTIME_CLI_FILE.to_string()),
                Entry::Temp(n) | Entry::Sandbox(n) => Some(n.clone()),
                Entry::MountInfo => None,
            })
            .collect();
        if entries.iter().any(|e| matches!(e, Entry::MountInfo)) {
            names.push(MOUNT_INFO_FILE.into());
        }
        for n in &names {
            unlink_ignore_missing(&dir, n, &path)?;
        }
        match rustix::fs::unlinkat(&root, key.as_str(), AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(HandoffError::io(format!("remove {path}"), e)),
        }
        rustix::fs::fsync(&root).map_err(|e| HandoffError::io("fsync root", e))
    }

    /// Marks `sandbox_id` as the one sandbox using the volume. Another
    /// claimant that `is_alive` says still runs: [`HandoffError::Claimed`].
    /// A dead one: its claim is removed and the new one taken. Same id: Ok.
    pub fn claim(
        &self,
        target: &str,
        sandbox_id: &str,
        is_alive: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let key = self.check_target(target)?;
        validate::check_sandbox_id(sandbox_id).map_err(HandoffError::InvalidArgument)?;
        let Some(root) = self.open_root(false)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        let Some(dir) = self.lock_record_dir(&root, &key, false)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        let path = self.display(&key);
        let entries = self.entries(&dir, &path)?;
        if !entries.iter().any(|e| matches!(e, Entry::MountInfo)) {
            return Err(HandoffError::NotFound(target.into()));
        }
        let mut mine = false;
        for e in &entries {
            let Entry::Sandbox(other) = e else { continue };
            if other == sandbox_id {
                mine = true;
            } else if is_alive(other) {
                return Err(HandoffError::Claimed {
                    target: target.into(),
                    by: other.clone(),
                });
            }
        }
        // Only now, when no live claimant stands in the way, drop stale ones.
        for e in &entries {
            if let Entry::Sandbox(other) = e
                && other != sandbox_id
            {
                unlink_ignore_missing(&dir, other, &path)?;
            }
        }
        if !mine {
            match rustix::fs::openat(
                &dir,
                sandbox_id,
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            ) {
                Ok(fd) => {
                    rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600))
                        .map_err(|e| HandoffError::io("chmod claim", e))?;
                }
                Err(Errno::EXIST) => {}
                Err(e) => return Err(HandoffError::io(format!("claim {path}"), e)),
            }
        }
        rustix::fs::fsync(&dir).map_err(|e| HandoffError::io("fsync record dir", e))
    }

    /// Drops `sandbox_id`'s claim (missing: Ok). With no claimant left, the
    /// `runtime-cli` goes too: no runtime serves the volume any more.
    pub fn release(&self, target: &str, sandbox_id: &str) -> Result<()> {
        let key = self.check_target(target)?;
        validate::check_sandbox_id(sandbox_id).map_err(HandoffError::InvalidArgument)?;
        let Some(root) = self.open_root(false)? else {
            return Ok(());
        };
        let Some(dir) = self.lock_record_dir(&root, &key, false)? else {
            return Ok(());
        };
        let path = self.display(&key);
        unlink_ignore_missing(&dir, sandbox_id, &path)?;
        let entries = self.entries(&dir, &path)?;
        if first_sandbox(&entries).is_none()
            && entries.iter().any(|e| matches!(e, Entry::RuntimeCli))
        {
            unlink_ignore_missing(&dir, RUNTIME_CLI_FILE, &path)?;
        }
        rustix::fs::fsync(&dir).map_err(|e| HandoffError::io("fsync record dir", e))
    }

    /// The sandbox holding the volume (Kata's rule: the first entry, in name
    /// order, that is not the record file).
    pub fn claimant(&self, target: &str) -> Result<Option<String>> {
        let key = self.check_target(target)?;
        let Some(root) = self.open_root(false)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        let Some(dir) = self.open_record_dir(&root, &key)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        let entries = self.entries(&dir, &self.display(&key))?;
        Ok(first_sandbox(&entries).map(str::to_string))
    }

    /// Records the runtime CLI that serves stats and resize (CRUST layout).
    pub fn set_runtime_cli(&self, target: &str, cli: &str) -> Result<()> {
        if self.layout == Layout::Kata {
            return Err(HandoffError::Unsupported(
                "the Kata layout has no runtime-cli file".into(),
            ));
        }
        let key = self.check_target(target)?;
        validate::check_abs_path("runtime cli", cli).map_err(HandoffError::InvalidArgument)?;
        let Some(root) = self.open_root(false)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        let Some(dir) = self.lock_record_dir(&root, &key, false)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        let path = self.display(&key);
        let entries = self.entries(&dir, &path)?;
        if !entries.iter().any(|e| matches!(e, Entry::MountInfo)) {
            return Err(HandoffError::NotFound(target.into()));
        }
        write_atomic(&dir, RUNTIME_CLI_FILE, cli.as_bytes(), &path)
    }

    /// The runtime CLI recorded for `target`; None before a runtime consumed
    /// the volume, and always None in the Kata layout.
    pub fn runtime_cli(&self, target: &str) -> Result<Option<String>> {
        let key = self.check_target(target)?;
        if self.layout == Layout::Kata {
            return Ok(None);
        }
        let Some(root) = self.open_root(false)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        let Some(dir) = self.open_record_dir(&root, &key)? else {
            return Err(HandoffError::NotFound(target.into()));
        };
        read_runtime_cli(&dir, &self.display(&key))
    }

    /// Every record directory under the root (other names are ignored: the
    /// root may be shared, e.g. `/run/crust` also holds the ops socket).
    pub fn list(&self) -> Result<Vec<ListedRecord>> {
        let Some(root) = self.open_root(false)? else {
            return Ok(Vec::new());
        };
        let mut keys = Vec::new();
        let dir =
            rustix::fs::Dir::read_from(&root).map_err(|e| HandoffError::io("read root", e))?;
        for ent in dir {
            let ent = ent.map_err(|e| HandoffError::io("read root", e))?;
            if let Ok(name) = ent.file_name().to_str()
                && self.layout.is_key(name)
            {
                keys.push(name.to_string());
            }
        }
        keys.sort();
        Ok(keys
            .into_iter()
            .map(|key| {
                let state = self
                    .inspect_key(&root, &key)
                    .and_then(|s| s.ok_or_else(|| HandoffError::NotFound(self.display(&key))));
                ListedRecord {
                    target: self.layout.target_of(&key),
                    key,
                    state,
                }
            })
            .collect())
    }

    /// For the runtime: the record an OCI mount `source` refers to. Probes
    /// the source itself, then each parent down to and including
    /// `stop_layer` (never above it), skipping paths outside the policy's
    /// prefixes. A source that is not an absolute path (`proc`, `tmpfs`)
    /// has no record. A record found but invalid is an error, never skipped.
    pub fn find_for_source(&self, source: &str, stop_layer: &str) -> Result<Option<SourceMatch>> {
        if !source.starts_with('/') {
            return Ok(None);
        }
        validate::check_abs_path("mount source", source).map_err(HandoffError::InvalidArgument)?;
        validate::check_abs_path("stop layer", stop_layer)
            .map_err(HandoffError::InvalidArgument)?;
        let Some(root) = self.open_root(false)? else {
            return Ok(None);
        };
        let mut candidate = source;
        loop {
            if let Ok(key) = self.check_target(candidate)
                && let Some(dir) = self.open_record_dir(&root, &key)?
                && let Some(mi) = self.read_mount_info(&dir, &self.display(&key))?
            {
                let subpath = source[candidate.len()..]
                    .trim_start_matches('/')
                    .to_string();
                return Ok(Some(SourceMatch {
                    target: candidate.to_string(),
                    subpath,
                    mount_info: mi,
                }));
            }
            if candidate == stop_layer || !validate::is_within(candidate, stop_layer) {
                return Ok(None);
            }
            match candidate.rfind('/') {
                Some(0) | None => return Ok(None),
                Some(i) => candidate = &candidate[..i],
            }
        }
    }

    /// The key of `target` and the JSON of `mi`, both checked, for a write.
    fn checked_record(&self, target: &str, mi: &MountInfo) -> Result<(String, String)> {
        let key = self.check_target(target)?;
        self.check_mount_info(mi)
            .map_err(HandoffError::InvalidArgument)?;
        let json = mi.to_json();
        if json.len() as u64 > MAX_RECORD_SIZE {
            return Err(HandoffError::InvalidArgument(
                "the record would exceed 64 KiB".into(),
            ));
        }
        Ok((key, json))
    }

    /// The record directory of `key`, created and locked, with its path
    /// for messages and what it holds.
    fn record_dir_for_write(&self, key: &str) -> Result<(OwnedFd, String, Vec<Entry>)> {
        let root = self.open_root(true)?.expect("root created");
        let dir = self
            .lock_record_dir(&root, key, true)?
            .expect("dir created");
        let path = self.display(key);
        let entries = self.entries(&dir, &path)?;
        Ok((dir, path, entries))
    }

    fn display(&self, key: &str) -> String {
        self.root.join(key).display().to_string()
    }
}
