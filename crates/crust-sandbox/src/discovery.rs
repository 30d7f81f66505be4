//! Which OCI mounts are deferred volumes: every path-like mount source is
//! looked up in the two root-only hand-off roots (CRUST layout, then Kata
//! layout), probing parents down to the kubelet `pods/<uid>/volumes` layer
//! so that a subPath appended by kubelet is found too. Nothing else is ever
//! consulted: a `mountInfo.json` planted inside a volume is just a file.
//!
//! When the bundle names its pod (a pod-uid annotation, see
//! [`crate::bundle::POD_UID_ANNOTATIONS`]), every deferred volume must lie
//! in that pod's `<pods>/<uid>/volumes/`: a hostPath naming another pod's
//! volume directory would otherwise take that pod's device whenever its
//! claim is missing or stale. A bundle without such an annotation (our
//! own demo and tests, a bare OCI runtime) is matched by path alone.
//!
//! The kubelet root is read from the pod's own mount sources
//! ([`Discovery::for_bundle`]); kubelet's subPath binds
//! (`<pod>/volume-subpaths/...`) are mapped through the mount table to the
//! published target they show and the subPath beneath it
//! ([`Discovery::kubelet_bind`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use crust_handoff::kubelet::{self, VOLUME_SUBPATHS, VOLUMES};
use crust_handoff::validate::{check_abs_path, is_within};
use crust_handoff::{HandoffError, Layout, MountInfo, Policy, SourceMatch, Store};
use serde::{Deserialize, Serialize};

use crate::bundle::Bundle;
// The records' old paths, which crust-shim and the tests use.
pub use crate::records::{LayoutKind, Volume, WorkloadMount, volume_id};

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("mount {destination}: {reason}")]
    InvalidSource { destination: String, reason: String },
    #[error("volume {path}: {source}")]
    Record {
        path: String,
        #[source]
        source: HandoffError,
    },
    #[error("configuration: {0}")]
    Config(String),
}

impl DiscoveryError {
    fn record(path: &str, source: HandoffError) -> Self {
        DiscoveryError::Record {
            path: path.to_string(),
            source,
        }
    }
}

/// What discovery decided for a bundle.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub volumes: Vec<Volume>,
    pub mounts: Vec<WorkloadMount>,
    /// Host-path mounts with no hand-off record: without a shared
    /// filesystem the guest cannot see them.
    pub skipped: Vec<String>,
    /// The same mounts with their sources, in bundle order (what
    /// `--share-binds` shares over virtio-fs).
    #[serde(default)]
    pub binds: Vec<HostBind>,
}

/// A bundle bind whose source has no hand-off record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostBind {
    pub destination: String,
    pub source: String,
    pub readonly: bool,
}

/// The kubelet pods directory when neither the setting nor a bundle's
/// mount sources say otherwise.
pub const DEFAULT_PODS_DIR: &str = "/var/lib/kubelet/pods";
/// The one setting that fixes the kubelet pods directory.
pub const PODS_DIR_SETTING: &str = "--pods-layer-stop (CRUST_RUNTIME_PODS_LAYER_STOP)";

/// A kubelet subPath bind resolved to the volume it shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletBind {
    /// The publish target whose filesystem (or placeholder) it shows.
    pub target: String,
    /// Relative, normalized; empty for the whole volume.
    pub subpath: String,
}

/// The two hand-off roots and the kubelet pods directory that bounds
/// parent probing.
#[derive(Debug, Clone)]
pub struct Discovery {
    crust: Store,
    kata: Store,
    pods_dir: String,
    /// `pods_dir` came from the setting, not the default.
    configured: bool,
}

impl Discovery {
    /// `pods_dir` empty: read from each bundle's mount sources
    /// ([`Self::for_bundle`]), [`DEFAULT_PODS_DIR`] for a bundle that names
    /// no pod.
    pub fn new(
        crust_root: PathBuf,
        kata_root: PathBuf,
        pods_dir: &str,
    ) -> Result<Self, DiscoveryError> {
        let configured = !pods_dir.is_empty();
        let pods_dir = match pods_dir.trim_end_matches('/') {
            "" if !configured => DEFAULT_PODS_DIR.to_string(),
            p => p.to_string(),
        };
        check_abs_path("pods layer", &pods_dir)
            .map_err(|e| DiscoveryError::Config(format!("{PODS_DIR_SETTING}: {e}")))?;
        let crust = Store::new(Layout::Crust, crust_root, Policy::default())
            .map_err(|e| DiscoveryError::Config(e.to_string()))?;
        let kata = Store::new(Layout::Kata, kata_root, Policy::default())
            .map_err(|e| DiscoveryError::Config(e.to_string()))?;
        Ok(Discovery {
            crust,
            kata,
            pods_dir,
            configured,
        })
    }

    /// The kubelet pods directory this discovery bounds probing with.
    pub fn pods_dir(&self) -> &str {
        &self.pods_dir
    }

    /// This discovery for `bundle`'s pod. kubelet names every source it
    /// makes for a pod under `<root>/pods/<uid>/` (volumes, subPath binds,
    /// `etc-hosts`, the termination log), so the pods directory is read
    /// from them; sources that disagree, or disagree with the setting,
    /// fail here, before any volume is asked for or claimed. A bundle
    /// without a pod uid keeps the configured (or default) directory.
    pub fn for_bundle(&self, bundle: &Bundle) -> Result<Discovery, DiscoveryError> {
        let Some(uid) = bundle.pod_uid.as_deref() else {
            return Ok(self.clone());
        };
        let seen: BTreeSet<&str> = bundle
            .mounts
            .iter()
            .filter(|m| m.source_is_path())
            .filter_map(|m| kubelet::pod_path(m.source.as_deref()?, Some(uid)))
            .map(|p| p.pods_dir)
            .collect();
        let found = match seen.len() {
            0 => return Ok(self.clone()),
            1 => *seen.first().expect("one"),
            _ => {
                return Err(DiscoveryError::Config(format!(
                    "the mount sources of pod {uid} lie under more than one kubelet pods \
                     directory ({}); refusing to guess which holds its volumes",
                    seen.into_iter().collect::<Vec<_>>().join(", ")
                )));
            }
        };
        if self.configured && found != self.pods_dir {
            return Err(DiscoveryError::Config(format!(
                "pod {uid}'s volumes are under {found}, but {PODS_DIR_SETTING} says {}: set it \
                 to {found}, or leave it unset to read it from kubelet's paths",
                self.pods_dir
            )));
        }
        let mut d = self.clone();
        d.pods_dir = found.to_string();
        Ok(d)
    }

    /// kubelet's subPath bind at `source` (`<pods>/<uid>/volume-subpaths/
    /// <volume>/<container>/<index>`), mapped through the mount table: the
    /// publish target under the same pod's `volumes/` whose filesystem (the
    /// volume's, or the plugin's placeholder once the volume is in a guest)
    /// it shows, and the subPath (the bind's root beneath the target's).
    /// None: not such a bind, or of no publish target.
    pub fn kubelet_bind(&self, source: &str) -> Result<Option<KubeletBind>, DiscoveryError> {
        let Some(p) = kubelet::pod_path(source, None) else {
            return Ok(None);
        };
        if p.layer != VOLUME_SUBPATHS || p.pods_dir != self.pods_dir {
            return Ok(None);
        }
        let table = crust_blockdev::mount_info()
            .map_err(|e| DiscoveryError::Config(format!("reading the mount table: {e}")))?;
        // The topmost mount at each mount point is what a path shows.
        let mut top: BTreeMap<&Path, &crust_blockdev::MountEntry> = BTreeMap::new();
        for m in &table {
            top.insert(m.mount_point.as_path(), m);
        }
        let Some(bind) = top.get(Path::new(source)) else {
            return Ok(None);
        };
        let invalid = |reason: String| DiscoveryError::InvalidSource {
            destination: source.to_string(),
            reason,
        };
        if bind.root.to_string_lossy().ends_with("//deleted") {
            return Err(invalid(format!(
                "kubelet's subPath bind shows a deleted path ({})",
                bind.root.display()
            )));
        }
        let volumes = Path::new(&p.pod_dir()).join(VOLUMES);
        let Some(target) = top
            .values()
            .filter(|m| {
                (m.major, m.minor) == (bind.major, bind.minor)
                    && m.mount_point.starts_with(&volumes)
                    && m.mount_point != volumes
                    && bind.root.starts_with(&m.root)
            })
            .max_by_key(|m| m.root.components().count())
        else {
            return Ok(None);
        };
        let rest = bind.root.strip_prefix(&target.root).expect("filtered");
        let mut parts = Vec::new();
        for c in rest.components() {
            match c {
                Component::Normal(n) => parts.push(
                    n.to_str()
                        .ok_or_else(|| invalid("the subPath is not UTF-8".into()))?,
                ),
                _ => return Err(invalid(format!("subPath {} is not plain", rest.display()))),
            }
        }
        let target = target
            .mount_point
            .to_str()
            .ok_or_else(|| invalid("the publish target is not UTF-8".into()))?;
        Ok(Some(KubeletBind {
            target: target.to_string(),
            subpath: parts.join("/"),
        }))
    }

    pub fn store(&self, layout: LayoutKind) -> &Store {
        match layout {
            LayoutKind::Crust => &self.crust,
            LayoutKind::Kata => &self.kata,
        }
    }

    /// The deepest layer parent probing may reach for `source`:
    /// `<pods>/<uid>/volumes` for a source beneath it, else the source
    /// itself (exact match only).
    pub fn stop_layer(&self, source: &str) -> String {
        let Some(rest) = source
            .strip_prefix(&self.pods_dir)
            .and_then(|r| r.strip_prefix('/'))
        else {
            return source.to_string();
        };
        let mut parts = rest.splitn(3, '/');
        match (parts.next(), parts.next()) {
            (Some(uid), Some("volumes")) if !uid.is_empty() => {
                format!("{}/{uid}/volumes", self.pods_dir)
            }
            _ => source.to_string(),
        }
    }

    /// The record `source` refers to, in either layout. When both layouts
    /// match, the more specific (longer) target wins, CRUST on a tie.
    pub fn lookup(
        &self,
        source: &str,
    ) -> Result<Option<(LayoutKind, SourceMatch)>, DiscoveryError> {
        check_abs_path("mount source", source).map_err(|reason| DiscoveryError::InvalidSource {
            destination: source.to_string(),
            reason,
        })?;
        if let Some(kb) = self.kubelet_bind(source)? {
            // The target's own record only, with the bind's subPath.
            return Ok(self.lookup_at(&kb.target, &kb.target)?.map(|(l, m)| {
                (
                    l,
                    SourceMatch {
                        subpath: kb.subpath,
                        ..m
                    },
                )
            }));
        }
        self.lookup_at(source, &self.stop_layer(source))
    }

    /// [`Self::lookup`] of a plain path, probing parents down to `stop`.
    fn lookup_at(
        &self,
        source: &str,
        stop: &str,
    ) -> Result<Option<(LayoutKind, SourceMatch)>, DiscoveryError> {
        let c = self
            .crust
            .find_for_source(source, stop)
            .map_err(|e| DiscoveryError::record(source, e))?;
        let k = self
            .kata
            .find_for_source(source, stop)
            .map_err(|e| DiscoveryError::record(source, e))?;
        Ok(match (c, k) {
            (Some(c), Some(k)) if k.target.len() > c.target.len() => Some((LayoutKind::Kata, k)),
            (Some(c), _) => Some((LayoutKind::Crust, c)),
            (None, Some(k)) => Some((LayoutKind::Kata, k)),
            (None, None) => None,
        })
    }

    /// The record staged exactly for `volume_path` (no parent probing),
    /// CRUST layout first. Used by stats/resize and hot-plug.
    pub fn exact(
        &self,
        volume_path: &str,
    ) -> Result<Option<(LayoutKind, MountInfo)>, DiscoveryError> {
        check_abs_path("volume path", volume_path).map_err(|reason| {
            DiscoveryError::InvalidSource {
                destination: volume_path.to_string(),
                reason,
            }
        })?;
        for layout in [LayoutKind::Crust, LayoutKind::Kata] {
            match self.store(layout).read(volume_path) {
                Ok(mi) => return Ok(Some((layout, mi))),
                Err(HandoffError::NotFound(_)) => {}
                Err(e) => return Err(DiscoveryError::record(volume_path, e)),
            }
        }
        Ok(None)
    }

    /// A deferred volume of pod `uid` lies in `<pods>/<uid>/volumes/`.
    fn check_owner(&self, uid: &str, source: &str, target: &str) -> Result<(), String> {
        let own = format!("{}/{uid}/{VOLUMES}", self.pods_dir);
        let binds = format!("{}/{uid}/{VOLUME_SUBPATHS}", self.pods_dir);
        let inside = |p: &str, dir: &str| p.len() > dir.len() && is_within(p, dir);
        if (inside(source, &own) || inside(source, &binds)) && inside(target, &own) {
            return Ok(());
        }
        let owner = source
            .strip_prefix(&self.pods_dir)
            .and_then(|r| r.strip_prefix('/'))
            .and_then(|r| r.split('/').next())
            .filter(|u| !u.is_empty());
        Err(match owner {
            Some(other) if other != uid => format!(
                "source {source} is a volume of pod {other}, not of this sandbox's pod {uid}; \
                 refusing to hand it to this sandbox"
            ),
            _ => format!(
                "source {source} (hand-off record for {target}) is not in pod {uid}'s volumes \
                 directory {own}/; refusing to hand it to this sandbox"
            ),
        })
    }

    /// Finds every deferred volume of `bundle`. Reads only; claims nothing.
    pub fn plan(&self, bundle: &Bundle) -> Result<Plan, DiscoveryError> {
        let mut plan = Plan::default();
        // target -> index in plan.volumes, plus whether every mount is ro.
        let mut by_target: BTreeMap<String, (usize, bool)> = BTreeMap::new();
        for m in &bundle.mounts {
            if !m.source_is_path() {
                continue;
            }
            let source = m.source.as_deref().unwrap_or_default();
            let found = self.lookup(source).map_err(|e| match e {
                DiscoveryError::InvalidSource { reason, .. } => DiscoveryError::InvalidSource {
                    destination: m.destination.clone(),
                    reason,
                },
                e => e,
            })?;
            let Some((layout, found)) = found else {
                plan.skipped.push(m.destination.clone());
                plan.binds.push(HostBind {
                    destination: m.destination.clone(),
                    source: source.to_string(),
                    readonly: m.readonly(),
                });
                continue;
            };
            if let Some(uid) = &bundle.pod_uid {
                self.check_owner(uid, source, &found.target)
                    .map_err(|reason| DiscoveryError::InvalidSource {
                        destination: m.destination.clone(),
                        reason,
                    })?;
            }
            let ro = m.readonly();
            let id = match by_target.get_mut(&found.target) {
                Some((idx, all_ro)) => {
                    *all_ro &= ro;
                    plan.volumes[*idx].id.clone()
                }
                None => {
                    let v = Volume::from_record(layout, &found.target, &found.mount_info, false);
                    if let Some(other) = plan.volumes.iter().find(|o| o.id == v.id) {
                        return Err(DiscoveryError::Config(format!(
                            "volumes {} and {} hash to the same id",
                            other.target, v.target
                        )));
                    }
                    by_target.insert(found.target.clone(), (plan.volumes.len(), ro));
                    let id = v.id.clone();
                    plan.volumes.push(v);
                    id
                }
            };
            plan.mounts.push(WorkloadMount {
                volume: id,
                subpath: found.subpath,
                destination: m.destination.clone(),
                readonly: ro,
            });
        }
        for (idx, all_ro) in by_target.values() {
            plan.volumes[*idx].readonly |= *all_ro;
        }
        // Two mounts on one destination would shadow each other silently.
        let mut dests: Vec<&str> = bundle
            .mounts
            .iter()
            .map(|m| m.destination.as_str())
            .collect();
        dests.sort_unstable();
        if let Some(w) = dests.windows(2).find(|w| w[0] == w[1]) {
            return Err(DiscoveryError::InvalidSource {
                destination: w[0].to_string(),
                reason: "more than one mount has this destination".into(),
            });
        }
        Ok(plan)
    }
}

impl Discovery {
    /// [`Discovery::new`] for a runtime configuration: also accepts
    /// regular files beneath the configured file-device roots as devices
    /// (by crust_handoff's one rule, `validate::open_file_device`).
    pub fn for_config(cfg: &crate::config::Config) -> Result<Self, DiscoveryError> {
        let d = Discovery::new(
            cfg.crust_root.clone(),
            cfg.kata_root.clone(),
            &cfg.pods_layer_stop,
        )?;
        let policy = Policy {
            file_device_roots: cfg.file_device_roots.clone(),
            file_device_setting: crate::config::FILE_DEVICE_SETTING.into(),
            ..Policy::default()
        };
        let store = |s: &Store| {
            Store::new(s.layout(), s.root(), policy.clone())
                .map_err(|e| DiscoveryError::Config(e.to_string()))
        };
        Ok(Discovery {
            crust: store(&d.crust)?,
            kata: store(&d.kata)?,
            pods_dir: d.pods_dir,
            configured: d.configured,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::BundleMount;
    use std::os::unix::fs::PermissionsExt;

    struct Roots {
        _dir: tempfile::TempDir,
        crust: PathBuf,
        kata: PathBuf,
        pods: String,
    }

    fn roots() -> Roots {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        Roots {
            crust: dir.path().join("crust"),
            kata: dir.path().join("kata"),
            pods: dir.path().join("pods").to_str().unwrap().to_string(),
            _dir: dir,
        }
    }

    /// Any block device node the test machine has (records must name one).
    fn some_block_device() -> Option<String> {
        use std::os::unix::fs::FileTypeExt;
        std::fs::read_dir("/dev").ok()?.flatten().find_map(|e| {
            let ft = e.file_type().ok()?;
            ft.is_block_device()
                .then(|| e.path().to_str().unwrap().to_string())
        })
    }

    fn bundle(mounts: Vec<BundleMount>) -> Bundle {
        crate::bundle::for_tests(mounts)
    }

    fn bind(dest: &str, src: &str, ro: bool) -> BundleMount {
        BundleMount {
            destination: dest.into(),
            source: Some(src.into()),
            typ: Some("bind".into()),
            options: if ro {
                vec!["rbind".into(), "ro".into()]
            } else {
                vec!["rbind".into()]
            },
        }
    }

    fn with_pod(uid: &str, mounts: Vec<BundleMount>) -> Bundle {
        Bundle {
            pod_uid: Some(uid.into()),
            ..bundle(mounts)
        }
    }

    #[test]
    fn the_kubelet_root_comes_from_the_pods_own_sources() {
        let r = roots();
        let k0s = "/var/lib/k0s/kubelet/pods";
        let pod = with_pod(
            "u1",
            vec![
                bind("/etc/hosts", &format!("{k0s}/u1/etc-hosts"), false),
                bind(
                    "/d",
                    &format!("{k0s}/u1/volumes/kubernetes.io~csi/pv/mount"),
                    false,
                ),
                bind("/h", "/srv/host-path", false),
            ],
        );
        // Unset: read from the sources; a pod-less bundle keeps the default.
        let auto = Discovery::new(r.crust.clone(), r.kata.clone(), "").unwrap();
        assert_eq!(auto.pods_dir(), DEFAULT_PODS_DIR);
        assert_eq!(auto.for_bundle(&pod).unwrap().pods_dir(), k0s);
        assert_eq!(
            auto.for_bundle(&bundle(vec![])).unwrap().pods_dir(),
            DEFAULT_PODS_DIR
        );
        // Set and different: refused, naming the setting.
        let set = Discovery::new(r.crust.clone(), r.kata.clone(), DEFAULT_PODS_DIR).unwrap();
        let e = set.for_bundle(&pod).unwrap_err().to_string();
        assert!(
            e.contains("CRUST_RUNTIME_PODS_LAYER_STOP") && e.contains(k0s),
            "{e}"
        );
        let same = Discovery::new(r.crust.clone(), r.kata.clone(), &format!("{k0s}/")).unwrap();
        assert_eq!(same.for_bundle(&pod).unwrap().pods_dir(), k0s);
        // Two roots for one pod: refused.
        let mut two = pod.clone();
        two.mounts.push(bind(
            "/x",
            "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/q/mount",
            false,
        ));
        let e = auto.for_bundle(&two).unwrap_err().to_string();
        assert!(e.contains("more than one kubelet pods directory"), "{e}");
    }

    /// A tmpfs mounted at `at`, unmounted on drop.
    struct Tmpfs(PathBuf);
    impl Tmpfs {
        fn at(p: &Path) -> Tmpfs {
            std::fs::create_dir_all(p).unwrap();
            rustix::mount::mount("t", p, "tmpfs", rustix::mount::MountFlags::empty(), None)
                .unwrap();
            Tmpfs(p.to_path_buf())
        }
    }
    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = crust_blockdev::unmount(&self.0);
        }
    }

    #[test]
    fn kubelet_subpath_binds_map_to_their_volume() {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (mounts)"
        );
        let Some(dev) = some_block_device() else {
            return;
        };
        let r = roots();
        let d = Discovery::new(r.crust.clone(), r.kata.clone(), &r.pods).unwrap();
        let target = PathBuf::from(format!("{}/u/volumes/kubernetes.io~csi/pv/mount", r.pods));
        let vol = Tmpfs::at(&target);
        std::fs::create_dir_all(target.join("a/b")).unwrap();
        std::fs::write(target.join("a/f"), b"x").unwrap();
        // kubelet's binds: a directory, a file, the volume root.
        let bind_at = |i: u32, what: &Path, file: bool| {
            let p = PathBuf::from(format!("{}/u/volume-subpaths/data/app/{i}", r.pods));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            if file {
                std::fs::write(&p, b"").unwrap();
            } else {
                std::fs::create_dir(&p).unwrap();
            }
            crust_blockdev::bind_mount(what, &p, false).unwrap();
            crust_blockdev::MountGuard::new(p)
        };
        let b0 = bind_at(0, &target.join("a/b"), false);
        let b1 = bind_at(1, &target.join("a/f"), true);
        let b2 = bind_at(2, &target, false);
        let src = |g: &crust_blockdev::MountGuard| g.target().to_str().unwrap().to_string();
        let t = target.to_str().unwrap().to_string();
        let kb = |g| d.kubelet_bind(&src(g)).unwrap().unwrap();
        assert_eq!(
            kb(&b0),
            KubeletBind {
                target: t.clone(),
                subpath: "a/b".into()
            }
        );
        assert_eq!(kb(&b1).subpath, "a/f");
        assert_eq!(kb(&b2).subpath, "");
        // No record yet: a plain host bind (the handover offers the target).
        let b = with_pod("u", vec![bind("/data", &src(&b0), false)]);
        assert!(d.plan(&b).unwrap().volumes.is_empty());
        d.store(LayoutKind::Crust)
            .stage(&t, &MountInfo::block(dev, "ext4"))
            .unwrap();
        let plan = d.for_bundle(&b).unwrap().plan(&b).unwrap();
        assert_eq!(plan.volumes[0].target, t);
        assert_eq!(plan.mounts[0].subpath, "a/b");
        assert!(plan.binds.is_empty(), "{plan:?}");
        // Another pod's volume-subpaths, or a plain directory there: not
        // a bind of a volume of this pod.
        let stray = format!("{}/u/volume-subpaths/data/app/9", r.pods);
        std::fs::create_dir_all(&stray).unwrap();
        assert_eq!(d.kubelet_bind(&stray).unwrap(), None);
        let other = PathBuf::from(format!("{}/v/volume-subpaths/data/app/0", r.pods));
        std::fs::create_dir_all(&other).unwrap();
        crust_blockdev::bind_mount(&target.join("a/b"), &other, false).unwrap();
        let _g = crust_blockdev::MountGuard::new(&other);
        assert_eq!(d.kubelet_bind(other.to_str().unwrap()).unwrap(), None);
        drop((b0, b1, b2, vol));
    }

    #[test]
    fn stop_layer_is_the_pods_volumes_dir() {
        let r = roots();
        let d = Discovery::new(r.crust.clone(), r.kata.clone(), &format!("{}/", r.pods)).unwrap();
        let src = format!("{}/uid1/volumes/kubernetes.io~csi/pv/mount/a/b", r.pods);
        assert_eq!(d.stop_layer(&src), format!("{}/uid1/volumes", r.pods));
        assert_eq!(d.stop_layer("/srv/data/x"), "/srv/data/x");
        let not_volumes = format!("{}/uid1/etc-hosts", r.pods);
        assert_eq!(d.stop_layer(&not_volumes), not_volumes);
    }

    #[test]
    fn plan_finds_subpaths_in_both_layouts() {
        let Some(dev) = some_block_device() else {
            return;
        };
        let r = roots();
        let d = Discovery::new(r.crust.clone(), r.kata.clone(), &r.pods).unwrap();
        let t1 = format!("{}/u/volumes/kubernetes.io~csi/pv1/mount", r.pods);
        let t2 = format!("{}/u/volumes/kubernetes.io~csi/pv2/mount", r.pods);
        let mut mi = MountInfo::block(dev.clone(), "ext4");
        mi.set_fs_group(Some(100));
        d.store(LayoutKind::Crust).stage(&t1, &mi).unwrap();
        d.store(LayoutKind::Kata)
            .stage(&t2, &MountInfo::block(dev.clone(), "xfs"))
            .unwrap();
        let b = bundle(vec![
            bind("/a", &format!("{t1}/sub/dir"), true),
            bind("/b", &t1, false),
            bind("/c", &t2, true),
            bind("/etc/hosts", "/etc/hosts", true),
            BundleMount {
                destination: "/proc".into(),
                source: Some("proc".into()),
                typ: Some("proc".into()),
                options: vec![],
            },
        ]);
        let plan = d.plan(&b).unwrap();
        assert_eq!(plan.volumes.len(), 2);
        let v1 = &plan.volumes[0];
        assert_eq!(
            (v1.layout, v1.target.as_str(), v1.fs_group),
            (LayoutKind::Crust, t1.as_str(), Some(100))
        );
        assert!(!v1.readonly, "one rw mount keeps the device rw");
        assert_eq!(v1.serial, format!("crust{}", v1.id));
        assert!(v1.serial.len() <= 20);
        let v2 = &plan.volumes[1];
        assert_eq!((v2.layout, v2.readonly), (LayoutKind::Kata, true));
        assert_eq!(plan.mounts.len(), 3);
        assert_eq!(plan.mounts[0].subpath, "sub/dir");
        assert!(plan.mounts[0].readonly);
        assert_eq!(plan.mounts[1].subpath, "");
        assert_eq!(plan.mounts[2].volume, v2.id);
        assert_eq!(plan.skipped, ["/etc/hosts"]);
        assert_eq!(
            plan.binds,
            [HostBind {
                destination: "/etc/hosts".into(),
                source: "/etc/hosts".into(),
                readonly: true,
            }]
        );
    }

    #[test]
    fn probing_never_goes_above_the_volumes_layer() {
        let Some(dev) = some_block_device() else {
            return;
        };
        let r = roots();
        let d = Discovery::new(r.crust.clone(), r.kata.clone(), &r.pods).unwrap();
        // A record at the pods dir itself must not capture a pod's source.
        let above = format!("{}/u", r.pods);
        d.store(LayoutKind::Crust)
            .stage(&above, &MountInfo::block(dev, "ext4"))
            .unwrap();
        let src = format!("{}/u/volumes/x/pv/mount", r.pods);
        assert!(d.lookup(&src).unwrap().is_none());
        // Outside the pods dir only the exact path counts.
        assert!(d.lookup(&format!("{above}/z")).unwrap().is_none());
        assert!(d.lookup(&above).unwrap().is_some());
    }

    #[test]
    fn a_pod_uid_annotation_ties_volumes_to_that_pod() {
        let Some(dev) = some_block_device() else {
            return;
        };
        let r = roots();
        let d = Discovery::new(r.crust.clone(), r.kata.clone(), &r.pods).unwrap();
        let mine = format!("{}/me/volumes/kubernetes.io~csi/pv1/mount", r.pods);
        let victim = format!("{}/victim/volumes/kubernetes.io~csi/pv2/mount", r.pods);
        let outside = "/srv/crust-test-outside".to_string();
        for t in [&mine, &victim, &outside] {
            d.store(LayoutKind::Crust)
                .stage(t, &MountInfo::block(dev.clone(), "ext4"))
                .unwrap();
        }
        let with_uid = |uid: Option<&str>, mounts| Bundle {
            pod_uid: uid.map(str::to_string),
            ..bundle(mounts)
        };
        // Its own volume, with a subPath: fine.
        let plan = d
            .plan(&with_uid(
                Some("me"),
                vec![bind("/a", &format!("{mine}/sub"), false)],
            ))
            .unwrap();
        assert_eq!(plan.volumes[0].target, mine);
        assert_eq!(plan.mounts[0].subpath, "sub");
        // Another pod's volume (a hostPath naming it): refused, naming both.
        let e = d
            .plan(&with_uid(
                Some("me"),
                vec![
                    bind("/a", &mine, false),
                    bind("/b", &format!("{victim}/x"), false),
                ],
            ))
            .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, DiscoveryError::InvalidSource { .. }), "{msg}");
        assert!(
            msg.contains("/b") && msg.contains("pod victim") && msg.contains("pod me"),
            "{msg}"
        );
        // A record outside the pods dir: not this pod's either.
        let e = d
            .plan(&with_uid(Some("me"), vec![bind("/c", &outside, false)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pod me's volumes directory"), "{e}");
        // Host paths without a record are skipped as before.
        let plan = d
            .plan(&with_uid(Some("me"), vec![bind("/h", "/etc/hosts", true)]))
            .unwrap();
        assert_eq!(plan.skipped, ["/h"]);
        // No annotation (bare OCI, our demo): matched by path alone.
        let plan = d
            .plan(&with_uid(
                None,
                vec![bind("/b", &victim, false), bind("/c", &outside, false)],
            ))
            .unwrap();
        assert_eq!(plan.volumes.len(), 2);
    }

    #[test]
    fn bad_records_are_errors_not_skips() {
        let r = roots();
        let d = Discovery::new(r.crust.clone(), r.kata.clone(), &r.pods).unwrap();
        let t = format!("{}/u/volumes/x/pv/mount", r.pods);
        // Written by hand: stage() would refuse the missing device.
        let dir = r.crust.join(crust_handoff::crust_key(&t));
        std::fs::create_dir_all(&dir).unwrap();
        for p in [&r.crust, &dir] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        let path = dir.join("mountInfo.json");
        std::fs::write(
            &path,
            MountInfo::block("/dev/crust-nonexistent", "ext4").to_json(),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = d
            .plan(&bundle(vec![bind("/d", &t, false)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/dev/crust-nonexistent"), "{e}");
    }

    #[test]
    fn duplicate_destinations_refused() {
        let r = roots();
        let d = Discovery::new(r.crust.clone(), r.kata.clone(), &r.pods).unwrap();
        let e = d
            .plan(&bundle(vec![
                bind("/d", "/srv/a", false),
                bind("/d", "/srv/b", false),
            ]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than one mount"), "{e}");
    }
}
