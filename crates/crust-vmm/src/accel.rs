//! Choosing between KVM and TCG: only a real boot proves KVM.
//!
//! Some hosts open `/dev/kvm`, create VMs and even start QEMU with `-S`,
//! yet a booted guest hangs (nested KVM that cannot run a guest kernel:
//! "KVM internal error ... emulation failure" in `qemu.log`). So
//! [`Accel::Auto`] never guesses from the device or a paused QEMU:
//!
//! | step | what happens | cost on a half-working host |
//! |---|---|---|
//! | cache hit | the verdict recorded for this host boot, QEMU binary and guest kernel is used | none |
//! | probe | the crust guest image boots under `-accel kvm` until its agent answers a ping, bounded by [`VmConfig::kvm_probe_timeout`]; KVM if it answers, TCG otherwise, recorded with the reason | one probe per host boot |
//! | boot | [`crate::Vm::boot`]: a KVM boot that does not reach the agent within [`VmConfig::kvm_boot_timeout`] is killed, recorded as failed (later boots use TCG) and booted again under TCG | at most once per host boot |
//!
//! The verdict file is `<accel_cache>/accel.json` (directory 0700, file
//! 0600, written atomically), one entry per key: the host boot
//! (`/proc/sys/kernel/random/boot_id`), the QEMU binary and the guest
//! kernel (path, size, mtime, inode) and the firmware. Entries of an
//! earlier host boot are dropped. Concurrent choosers serialize on a lock
//! file next to it, so one probe serves them all.
//!
//! A probe that fails for reasons that have nothing to do with KVM (a
//! broken guest image) would wrongly disable KVM: when a TCG boot then
//! fails too, the negative verdict is forgotten ([`forget_failure`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{FlockOperation, Mode, OFlags};
use serde::{Deserialize, Serialize};

use crate::VmError;
use crate::config::{Accel, VmConfig};
use crate::vm::Vm;
pub use crust_sandbox_records::{AccelChoice, ResolvedAccel};

/// Name of the verdict file in the cache directory.
pub const CACHE_FILE: &str = "accel.json";
const LOCK_FILE: &str = "accel.lock";

/// Worst-case extra time `Accel::Auto` may add to a boot on a
/// half-working host (a probe that times out plus a KVM boot that does):
/// callers that bound a whole boot add this to their own deadline.
pub fn auto_overhead(cfg: &VmConfig) -> Duration {
    // Each attempt may also wait for QEMU's sockets (launch's own bound).
    cfg.kvm_probe_timeout + cfg.kvm_boot_timeout + 2 * crate::vm::START_TIMEOUT
}

/// How `cfg.accel` resolves before a boot. Auto consults the cache and
/// probes when it has no verdict.
pub async fn choose(cfg: &VmConfig) -> Result<AccelChoice, VmError> {
    match cfg.accel {
        Accel::Tcg => Ok(AccelChoice::new(ResolvedAccel::Tcg, "requested (accel tcg)")),
        Accel::Kvm if kvm_usable() => Ok(AccelChoice::new(
            ResolvedAccel::Kvm,
            "requested (accel kvm); no fallback",
        )),
        Accel::Kvm => Err(VmError::InvalidConfig(
            "accel kvm requested but /dev/kvm is unusable here (missing, no permission, or it cannot create a VM)"
                .into(),
        )),
        Accel::Auto => auto_choice(cfg).await,
    }
}

/// One entry of the verdict file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub accel: ResolvedAccel,
    pub reason: String,
    pub boot_id: String,
    /// Seconds since the epoch.
    pub decided_at: u64,
    /// How long the probe took (0 for a verdict from a failed boot).
    pub probe_ms: u64,
}

type Verdicts = BTreeMap<String, Verdict>;

async fn auto_choice(cfg: &VmConfig) -> Result<AccelChoice, VmError> {
    let Some(dir) = cfg.accel_cache.as_deref() else {
        let (accel, reason, _) = probe(cfg).await?;
        return Ok(AccelChoice::new(accel, reason));
    };
    let key = CacheKey::of(cfg)?;
    let cache = match Cache::open(dir).await {
        Ok(c) => c,
        Err(e) => {
            // No cache: still correct, only slower on a half-working host.
            tracing::warn!(
                "accelerator cache {}: {e}; probing without it",
                dir.display()
            );
            let (accel, reason, _) = probe(cfg).await?;
            return Ok(AccelChoice::new(accel, reason));
        }
    };
    if let Some(v) = cache.get(&key) {
        return Ok(AccelChoice::new(
            v.accel,
            format!("{} (verdict cached for this host boot)", v.reason),
        ));
    }
    let (accel, reason, took) = probe(cfg).await?;
    tracing::info!(accel = accel.as_str(), "accelerator probe: {reason}");
    if let Err(e) = cache.put(&key, accel, &reason, took) {
        tracing::warn!(
            "recording the accelerator verdict in {}: {e}",
            dir.display()
        );
    }
    Ok(AccelChoice::new(accel, reason))
}

/// Records that a KVM boot failed, so later `Auto` boots on this host
/// boot use TCG without trying again.
pub async fn record_failure(cfg: &VmConfig, reason: &str) {
    let Some(dir) = cfg.accel_cache.as_deref() else {
        return;
    };
    let res = async {
        let key = CacheKey::of(cfg)?;
        Cache::open(dir)
            .await?
            .put(&key, ResolvedAccel::Tcg, reason, Duration::ZERO)
    }
    .await;
    if let Err(e) = res {
        tracing::warn!("recording the KVM failure in {}: {e}", dir.display());
    }
}

/// Drops a negative verdict: a guest that does not come up under TCG
/// either proves nothing about KVM.
pub async fn forget_failure(cfg: &VmConfig) {
    let Some(dir) = cfg.accel_cache.as_deref() else {
        return;
    };
    let res = async {
        let key = CacheKey::of(cfg)?;
        Cache::open(dir).await?.forget_tcg(&key)
    }
    .await;
    if let Err(e) = res {
        tracing::warn!("updating the accelerator cache in {}: {e}", dir.display());
    }
}

/// What a verdict depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CacheKey {
    boot_id: String,
    /// Everything but the boot id, one line per input.
    inputs: String,
}

impl CacheKey {
    fn of(cfg: &VmConfig) -> Result<CacheKey, VmError> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map_err(|e| VmError::Io {
                op: "read",
                path: "/proc/sys/kernel/random/boot_id".into(),
                source: e,
            })?
            .trim()
            .to_string();
        let qemu = find_binary(&cfg.qemu_binary).ok_or_else(|| VmError::Spawn {
            binary: cfg.qemu_binary.clone(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })?;
        let mut inputs = format!("qemu {}", file_identity(&qemu)?);
        inputs.push_str(&format!("\nkernel {}", file_identity(&cfg.kernel)?));
        match cfg.firmware_path() {
            Some(fw) => inputs.push_str(&format!("\nfirmware {}", file_identity(&fw)?)),
            None => inputs.push_str("\nfirmware default"),
        }
        Ok(CacheKey { boot_id, inputs })
    }
}

/// `path size mtime inode` of a file (after following symlinks).
fn file_identity(p: &Path) -> Result<String, VmError> {
    let canon = std::fs::canonicalize(p).map_err(|e| VmError::Io {
        op: "resolve",
        path: p.to_path_buf(),
        source: e,
    })?;
    let m = std::fs::metadata(&canon).map_err(|e| VmError::Io {
        op: "stat",
        path: canon.clone(),
        source: e,
    })?;
    Ok(format!(
        "{} size={} mtime={}.{:09} ino={}",
        canon.display(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ino()
    ))
}

/// An absolute path as is; a bare name looked up in `PATH`.
pub fn find_binary(p: &Path) -> Option<PathBuf> {
    if p.components().count() > 1 || p.is_absolute() {
        return p.is_file().then(|| p.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(p))
            .find(|c| c.is_file())
    })
}

/// The verdict file, held under its lock for as long as this lives.
struct Cache {
    dir: PathBuf,
    _lock: std::fs::File,
}

impl Cache {
    /// Creates the directory (0700) if needed, refuses one that others
    /// could write to, and takes the lock (waiting for a running probe).
    async fn open(dir: &Path) -> Result<Cache, VmError> {
        let io = |op: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| VmError::Io { op, path, source }
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io("mkdir", dir))?;
        let m = std::fs::symlink_metadata(dir).map_err(io("stat", dir))?;
        if !m.is_dir() || m.uid() != rustix::process::geteuid().as_raw() || m.mode() & 0o022 != 0 {
            return Err(VmError::InvalidConfig(format!(
                "accelerator cache {} must be a directory owned by this user and not writable by others",
                dir.display()
            )));
        }
        let lock_path = dir.join(LOCK_FILE);
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io("open", &lock_path))?;
        let _ = lock.set_permissions(std::fs::Permissions::from_mode(0o600));
        loop {
            match rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => break,
                Err(rustix::io::Errno::WOULDBLOCK) => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => return Err(io("lock", &lock_path)(e.into())),
            }
        }
        Ok(Cache {
            dir: dir.to_path_buf(),
            _lock: lock,
        })
    }

    fn path(&self) -> PathBuf {
        self.dir.join(CACHE_FILE)
    }

    /// Entries of this host boot; an unreadable file counts as empty.
    fn load(&self, boot_id: &str) -> Verdicts {
        let mut all: Verdicts = std::fs::read(self.path())
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        all.retain(|_, v| v.boot_id == boot_id);
        all
    }

    fn get(&self, key: &CacheKey) -> Option<Verdict> {
        self.load(&key.boot_id).remove(&key.inputs)
    }

    fn put(
        &self,
        key: &CacheKey,
        accel: ResolvedAccel,
        reason: &str,
        took: Duration,
    ) -> Result<(), VmError> {
        let mut all = self.load(&key.boot_id);
        all.insert(
            key.inputs.clone(),
            Verdict {
                accel,
                reason: reason.to_string(),
                boot_id: key.boot_id.clone(),
                decided_at: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
                probe_ms: took.as_millis() as u64,
            },
        );
        self.save(&all)
    }

    fn forget_tcg(&self, key: &CacheKey) -> Result<(), VmError> {
        let mut all = self.load(&key.boot_id);
        if all
            .get(&key.inputs)
            .is_some_and(|v| v.accel == ResolvedAccel::Tcg)
        {
            all.remove(&key.inputs);
            self.save(&all)?;
        }
        Ok(())
    }

    fn save(&self, all: &Verdicts) -> Result<(), VmError> {
        let path = self.path();
        let tmp = self.dir.join(format!(".{CACHE_FILE}.tmp"));
        let err = |op: &'static str, p: &Path| {
            let p = p.to_path_buf();
            move |source| VmError::Io {
                op,
                path: p,
                source,
            }
        };
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(err("create", &tmp))?;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(err("chmod", &tmp))?;
        let json = serde_json::to_vec_pretty(all).expect("verdicts serialize");
        f.write_all(&json).map_err(err("write", &tmp))?;
        f.sync_all().map_err(err("fsync", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(err("rename", &path))?;
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(err("fsync", &self.dir))
    }
}

/// Boots the guest image under KVM and waits for its agent. Returns the
/// verdict, its reason and how long the probe took. Errors only for
/// problems that would stop any boot (bad config, QEMU missing).
async fn probe(cfg: &VmConfig) -> Result<(ResolvedAccel, String, Duration), VmError> {
    let t0 = Instant::now();
    let base = cfg.accel_cache.clone().unwrap_or_else(std::env::temp_dir);
    let run_dir = base.join(format!("probe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    let mut pc = VmConfig::new("accel-probe", &cfg.kernel, &cfg.initrd, &run_dir);
    pc.qemu_binary = cfg.qemu_binary.clone();
    pc.firmware = cfg.firmware.clone();
    pc.memory_mib = cfg.memory_mib;
    pc.hotplug_ports = 0;
    pc.die_with_parent = true;
    pc.accel = Accel::Kvm;
    let choice = AccelChoice::new(ResolvedAccel::Kvm, "probe");
    let outcome = match Vm::launch_with(pc, choice).await {
        Ok(mut vm) => {
            let r = crate::vm::wait_agent(&mut vm, cfg.kvm_probe_timeout).await;
            let context = crate::vm::boot_context(vm.paths());
            let _ = vm.kill();
            match r {
                Ok(()) => Ok((
                    ResolvedAccel::Kvm,
                    format!(
                        "a KVM probe boot reached the guest agent in {:.1}s",
                        t0.elapsed().as_secs_f64()
                    ),
                )),
                Err(why) => Ok((
                    ResolvedAccel::Tcg,
                    format!(
                        "a KVM probe boot did not reach the guest agent within {:?}: {why}{}",
                        cfg.kvm_probe_timeout,
                        context.map(|c| format!(" ({c})")).unwrap_or_default()
                    ),
                )),
            }
        }
        Err(VmError::EarlyExit { log_tail, .. }) => Ok((
            ResolvedAccel::Tcg,
            format!(
                "QEMU cannot start a KVM guest here: {}",
                log_tail
                    .lines()
                    .map(str::trim)
                    .find(|l| !l.is_empty())
                    .unwrap_or("it exited without a message")
            ),
        )),
        Err(VmError::StartTimeout { after, .. }) => Ok((
            ResolvedAccel::Tcg,
            format!("QEMU did not come up under KVM within {after:?}"),
        )),
        Err(e) => Err(e),
    };
    let _ = std::fs::remove_dir_all(&run_dir);
    outcome.map(|(a, r)| (a, r, t0.elapsed()))
}

const KVM_API_VERSION: i32 = 12;

/// Whether /dev/kvm opens read-write, speaks API 12 and can create a VM.
/// Necessary for KVM, far from sufficient (see the module doc): only an
/// explicit `accel kvm` relies on it, to fail early.
pub fn kvm_usable() -> bool {
    let Ok(kvm) = rustix::fs::open("/dev/kvm", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
    else {
        return false;
    };
    crust_sys::kvm::api_version(&kvm).ok() == Some(KVM_API_VERSION)
        && crust_sys::kvm::create_vm(&kvm).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg_in(dir: &Path) -> VmConfig {
        let k = dir.join("vmlinuz");
        std::fs::write(&k, b"kernel").unwrap();
        let mut c = VmConfig::new("t", &k, &k, dir.join("run"));
        c.qemu_binary = "/bin/sh".into();
        c.accel_cache = Some(dir.join("cache"));
        c
    }

    #[tokio::test]
    async fn verdicts_are_keyed_private_and_forgettable() {
        let d = tempfile::tempdir().unwrap();
        let cfg = cfg_in(d.path());
        let key = CacheKey::of(&cfg).unwrap();
        assert!(key.inputs.contains("qemu /") && key.inputs.contains("kernel /"));
        {
            let c = Cache::open(cfg.accel_cache.as_ref().unwrap())
                .await
                .unwrap();
            assert_eq!(c.get(&key), None);
            c.put(&key, ResolvedAccel::Tcg, "hangs", Duration::from_millis(5))
                .unwrap();
            let v = c.get(&key).unwrap();
            assert_eq!(
                (v.accel, v.reason.as_str(), v.probe_ms),
                (ResolvedAccel::Tcg, "hangs", 5)
            );
        }
        let dir = cfg.accel_cache.clone().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join(CACHE_FILE)), 0o600);
        // A cached verdict answers without probing (a probe of /bin/sh as
        // QEMU would fail differently).
        let mut auto = cfg.clone();
        auto.accel = Accel::Auto;
        let ch = choose(&auto).await.unwrap();
        assert_eq!(ch.accel, ResolvedAccel::Tcg);
        assert!(
            ch.reason.starts_with("hangs (verdict cached"),
            "{}",
            ch.reason
        );
        // Another kernel is another key.
        let mut other = cfg.clone();
        let k2 = d.path().join("vmlinuz2");
        std::fs::write(&k2, b"other").unwrap();
        other.kernel = k2;
        assert_ne!(CacheKey::of(&other).unwrap(), key);
        // An entry of an earlier host boot is ignored, and dropped by the
        // next write.
        let mut stale = key.clone();
        stale.boot_id = "00000000-0000-0000-0000-000000000000".into();
        {
            let c = Cache::open(&dir).await.unwrap();
            c.put(&stale, ResolvedAccel::Kvm, "old", Duration::ZERO)
                .unwrap();
            assert_eq!(c.get(&key), None);
            c.put(&key, ResolvedAccel::Tcg, "hangs", Duration::ZERO)
                .unwrap();
            let raw: Verdicts =
                serde_json::from_slice(&std::fs::read(dir.join(CACHE_FILE)).unwrap()).unwrap();
            assert_eq!(raw.len(), 1);
        }
        forget_failure(&cfg).await;
        let c = Cache::open(&dir).await.unwrap();
        assert_eq!(c.get(&key), None);
    }

    #[tokio::test]
    async fn explicit_choices_need_no_probe() {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = cfg_in(d.path());
        cfg.accel = Accel::Tcg;
        let ch = choose(&cfg).await.unwrap();
        assert_eq!(ch.accel, ResolvedAccel::Tcg);
        assert!(!ch.fallback);
        cfg.accel = Accel::Kvm;
        match choose(&cfg).await {
            Ok(c) => assert!(kvm_usable() && c.accel == ResolvedAccel::Kvm),
            Err(e) => assert!(!kvm_usable() && e.to_string().contains("/dev/kvm"), "{e}"),
        }
        assert!(
            !d.path().join("cache").exists(),
            "explicit choices touch no cache"
        );
    }

    #[test]
    fn binaries_are_found_in_path() {
        assert_eq!(
            find_binary(Path::new("sh")).unwrap().file_name().unwrap(),
            "sh"
        );
        assert_eq!(
            find_binary(Path::new("/bin/sh")).unwrap(),
            Path::new("/bin/sh")
        );
        assert!(find_binary(Path::new("no-such-qemu-binary")).is_none());
    }
}
