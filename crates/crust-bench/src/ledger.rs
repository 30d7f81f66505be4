//! The ledger of what a run created, written before the call that creates
//! it, and the context that makes the calls and undoes them in cleanup.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use crust_proto::csi::v1 as csi;
use tokio::sync::watch;
use tonic::{Code, Status};

use crate::recorder::{Recorder, status_text};
use crate::{BenchConfig, BenchError, CleanupReport};
use crust_csi_client::Csi;

#[derive(Debug, Clone)]
pub(crate) enum Item {
    /// `id` is `None` while the CreateVolume outcome is unknown.
    Volume {
        name: String,
        id: Option<String>,
    },
    ControllerPublished {
        volume: String,
        node: String,
    },
    Staged {
        volume: String,
        path: String,
    },
    Published {
        volume: String,
        target: String,
    },
    /// A directory we made; `child` is a path inside it the driver may
    /// have created (the publish target). `root` dirs outlive scenarios.
    Dir {
        path: PathBuf,
        child: Option<PathBuf>,
        root: bool,
    },
}

impl Item {
    /// Undo order: publications, stagings, attachments, volumes, dirs.
    pub(crate) fn phase(&self) -> u8 {
        match self {
            Item::Published { .. } => 0,
            Item::Staged { .. } => 1,
            Item::ControllerPublished { .. } => 2,
            Item::Volume { .. } => 3,
            Item::Dir { .. } => 4,
        }
    }
}

#[derive(Default)]
pub(crate) struct Ledger {
    pub(crate) next: u64,
    pub(crate) items: BTreeMap<u64, Item>,
}

impl Ledger {
    pub(crate) fn add(&mut self, item: Item) -> u64 {
        self.next += 1;
        self.items.insert(self.next, item);
        self.next
    }
}

// ----------------------------------------------------------------- context

pub(crate) struct Ctx {
    pub(crate) csi: Csi,
    pub(crate) cfg: BenchConfig,
    pub(crate) run_id: String,
    pub(crate) staging_root: PathBuf,
    pub(crate) target_root: PathBuf,
    pub(crate) stage: bool,
    pub(crate) controller_publish: bool,
    pub(crate) node_id: String,
    pub(crate) topology: Option<csi::Topology>,
    pub(crate) ledger: Mutex<Ledger>,
    /// Totals of every cleanup pass (per op, per scenario, final).
    pub(crate) cleaned: Mutex<CleanupReport>,
    pub(crate) stop: watch::Receiver<bool>,
    pub(crate) seq: AtomicU64,
}

/// A volume a worker uses.
#[derive(Clone)]
pub(crate) struct Vol {
    pub(crate) id: String,
    pub(crate) context: HashMap<String, String>,
    pub(crate) publish_context: HashMap<String, String>,
}

/// Directories and ledger keys of one publish of one volume.
pub(crate) struct Mount {
    pub(crate) staging: String,
    pub(crate) target: String,
    pub(crate) keys: Vec<u64>,
}

pub(crate) fn transient(code: Code) -> bool {
    matches!(
        code,
        Code::DeadlineExceeded | Code::Unavailable | Code::Cancelled | Code::Unknown
    )
}

impl Ctx {
    pub(crate) fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    pub(crate) fn track(&self, item: Item) -> u64 {
        self.ledger.lock().unwrap().add(item)
    }

    pub(crate) fn untrack(&self, key: u64) {
        self.ledger.lock().unwrap().items.remove(&key);
    }

    pub(crate) fn create_request(&self, name: String) -> csi::CreateVolumeRequest {
        csi::CreateVolumeRequest {
            name,
            capacity_range: Some(csi::CapacityRange {
                required_bytes: self.cfg.size as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![self.cfg.capability.clone()],
            parameters: self.cfg.params.clone(),
            secrets: self.cfg.secrets.clone(),
            accessibility_requirements: self.topology.clone().map(|t| csi::TopologyRequirement {
                requisite: vec![t.clone()],
                preferred: vec![t],
            }),
            ..Default::default()
        }
    }

    /// CreateVolume, tracked. Returns the ledger key and the volume.
    pub(crate) async fn create(
        &self,
        rec: Option<&Recorder>,
        name: String,
    ) -> Result<(u64, Vol), Status> {
        let key = self.track(Item::Volume {
            name: name.clone(),
            id: None,
        });
        let call = async {
            let resp = self.csi.create_volume(self.create_request(name)).await?;
            match resp.volume {
                Some(v) if !v.volume_id.is_empty() => Ok(v),
                _ => Err(Status::internal("CreateVolume returned no volume id")),
            }
        };
        let res = match rec {
            Some(r) => r.timed("CreateVolume", call).await,
            None => call.await,
        };
        match res {
            Ok(v) => {
                if let Some(Item::Volume { id, .. }) =
                    self.ledger.lock().unwrap().items.get_mut(&key)
                {
                    *id = Some(v.volume_id.clone());
                }
                Ok((
                    key,
                    Vol {
                        id: v.volume_id,
                        context: v.volume_context,
                        publish_context: HashMap::new(),
                    },
                ))
            }
            Err(s) => {
                // A definite failure created nothing; an unknown outcome
                // stays in the ledger for cleanup to resolve.
                if !transient(s.code()) && s.code() != Code::Internal {
                    self.untrack(key);
                }
                Err(s)
            }
        }
    }

    /// Attaches the volume to this node when the controller wants that.
    pub(crate) async fn attach(&self, vol: &mut Vol) -> Result<Option<u64>, Status> {
        if !self.controller_publish {
            return Ok(None);
        }
        let key = self.track(Item::ControllerPublished {
            volume: vol.id.clone(),
            node: self.node_id.clone(),
        });
        let resp = self
            .csi
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: vol.id.clone(),
                node_id: self.node_id.clone(),
                volume_capability: Some(self.cfg.capability.clone()),
                readonly: false,
                secrets: self.cfg.secrets.clone(),
                volume_context: vol.context.clone(),
            })
            .await?;
        vol.publish_context = resp.publish_context;
        Ok(Some(key))
    }

    /// Makes the per-op staging dir (when staging) and target parent dir,
    /// the way kubelet does before calling the driver.
    pub(crate) fn make_dirs(&self, n: u64) -> Result<Mount, BenchError> {
        // Distinct names, so one root may serve as both staging and target.
        let mut keys = Vec::new();
        let staging = if self.stage {
            let p = self.staging_root.join(format!("{}-stage-{n}", self.run_id));
            std::fs::create_dir(&p).map_err(|source| BenchError::Io {
                what: "create staging dir",
                path: p.clone(),
                source,
            })?;
            keys.push(self.track(Item::Dir {
                path: p.clone(),
                child: None,
                root: false,
            }));
            p
        } else {
            PathBuf::new()
        };
        let parent = self.target_root.join(format!("{}-pod-{n}", self.run_id));
        if let Err(source) = std::fs::create_dir(&parent) {
            return Err(BenchError::Io {
                what: "create target parent dir",
                path: parent,
                source,
            });
        }
        let target = parent.join("volume");
        keys.push(self.track(Item::Dir {
            path: parent,
            child: Some(target.clone()),
            root: false,
        }));
        let utf8 = |p: &Path| {
            p.to_str()
                .map(str::to_string)
                .ok_or_else(|| BenchError::Io {
                    what: "use",
                    path: p.to_path_buf(),
                    source: std::io::Error::other("path is not UTF-8"),
                })
        };
        Ok(Mount {
            staging: if self.stage {
                utf8(&staging)?
            } else {
                String::new()
            },
            target: utf8(&target)?,
            keys,
        })
    }

    pub(crate) async fn stage(
        &self,
        rec: Option<&Recorder>,
        vol: &Vol,
        m: &mut Mount,
    ) -> Result<(), Status> {
        if !self.stage {
            return Ok(());
        }
        m.keys.push(self.track(Item::Staged {
            volume: vol.id.clone(),
            path: m.staging.clone(),
        }));
        let call = self.csi.node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: vol.id.clone(),
            publish_context: vol.publish_context.clone(),
            staging_target_path: m.staging.clone(),
            volume_capability: Some(self.cfg.capability.clone()),
            secrets: self.cfg.secrets.clone(),
            volume_context: vol.context.clone(),
        });
        match rec {
            Some(r) => r.timed("NodeStageVolume", call).await.map(drop),
            None => call.await.map(drop),
        }
    }

    pub(crate) async fn publish(
        &self,
        rec: Option<&Recorder>,
        vol: &Vol,
        m: &mut Mount,
    ) -> Result<(), Status> {
        m.keys.push(self.track(Item::Published {
            volume: vol.id.clone(),
            target: m.target.clone(),
        }));
        let call = self.csi.node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: vol.id.clone(),
            publish_context: vol.publish_context.clone(),
            staging_target_path: m.staging.clone(),
            target_path: m.target.clone(),
            volume_capability: Some(self.cfg.capability.clone()),
            readonly: false,
            secrets: self.cfg.secrets.clone(),
            volume_context: vol.context.clone(),
            defer_fs_ops: self.cfg.defer_fs_ops,
        });
        match rec {
            Some(r) => r.timed("NodePublishVolume", call).await.map(drop),
            None => call.await.map(drop),
        }
    }

    /// Takes the ledger entries with `keys` (all when `None`) in undo order.
    pub(crate) fn pending(&self, keys: Option<&[u64]>, roots: bool) -> Vec<(u64, Item)> {
        let l = self.ledger.lock().unwrap();
        let mut v: Vec<(u64, Item)> = l
            .items
            .iter()
            .filter(|(k, _)| keys.is_none_or(|ks| ks.contains(k)))
            .filter(|(_, i)| roots || !matches!(i, Item::Dir { root: true, .. }))
            .map(|(k, i)| (*k, i.clone()))
            .collect();
        // Within a phase, newest first (a dir's children before the dir).
        v.sort_by(|a, b| a.1.phase().cmp(&b.1.phase()).then(b.0.cmp(&a.0)));
        v
    }

    /// Calls `f` until it succeeds or answers NOT_FOUND (nothing to undo),
    /// at most `cleanup_retries` times with a growing pause.
    pub(crate) async fn retry<F, Fut>(&self, what: &str, mut f: F) -> Result<(), String>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), Status>>,
    {
        let mut pause = Duration::from_millis(100);
        let attempts = self.cfg.cleanup_retries.max(1);
        for attempt in 1..=attempts {
            match f().await {
                Ok(()) => return Ok(()),
                Err(s) if s.code() == Code::NotFound => return Ok(()),
                Err(s)
                    if attempt == attempts
                        || matches!(
                            s.code(),
                            Code::InvalidArgument | Code::Unimplemented | Code::PermissionDenied
                        ) =>
                {
                    return Err(format!("{what}: {}", status_text(&s)));
                }
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Undoes the ledger entries with `keys` (everything when `None`).
    pub(crate) async fn cleanup(&self, keys: Option<&[u64]>, roots: bool) -> CleanupReport {
        let mut rep = CleanupReport::default();
        for (key, item) in self.pending(keys, roots) {
            let res = match &item {
                Item::Published { volume, target } => self
                    .retry(
                        &format!("NodeUnpublishVolume {volume} {target}"),
                        || async {
                            self.csi
                                .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                                    volume_id: volume.clone(),
                                    target_path: target.clone(),
                                    defer_fs_ops: self.cfg.defer_fs_ops,
                                })
                                .await
                                .map(drop)
                        },
                    )
                    .await
                    .map(|()| rep.node_unpublished += 1),
                Item::Staged { volume, path } => self
                    .retry(&format!("NodeUnstageVolume {volume} {path}"), || async {
                        self.csi
                            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                                volume_id: volume.clone(),
                                staging_target_path: path.clone(),
                            })
                            .await
                            .map(drop)
                    })
                    .await
                    .map(|()| rep.node_unstaged += 1),
                Item::ControllerPublished { volume, node } => self
                    .retry(
                        &format!("ControllerUnpublishVolume {volume} {node}"),
                        || async {
                            self.csi
                                .controller_unpublish_volume(
                                    csi::ControllerUnpublishVolumeRequest {
                                        volume_id: volume.clone(),
                                        node_id: node.clone(),
                                        secrets: self.cfg.secrets.clone(),
                                    },
                                )
                                .await
                                .map(drop)
                        },
                    )
                    .await
                    .map(|()| rep.controller_unpublished += 1),
                Item::Volume { name, id } => {
                    let id = match id {
                        Some(id) => Some(id.clone()),
                        None => self.resolve_unknown_create(name).await,
                    };
                    match id {
                        None => Ok(()),
                        Some(id) => self
                            .retry(&format!("DeleteVolume {id} ({name})"), || async {
                                self.csi
                                    .delete_volume(csi::DeleteVolumeRequest {
                                        volume_id: id.clone(),
                                        secrets: self.cfg.secrets.clone(),
                                    })
                                    .await
                                    .map(drop)
                            })
                            .await
                            .map(|()| rep.volumes_deleted += 1),
                    }
                }
                Item::Dir { path, child, .. } => remove_dir(path, child.as_deref())
                    .map(|removed| {
                        if removed {
                            rep.dirs_removed += 1
                        }
                    })
                    .map_err(|e| format!("directory {}: {e}", path.display())),
            };
            match res {
                Ok(()) => self.untrack(key),
                Err(e) => {
                    rep.leftovers.push(e);
                    // Reported once; do not try again in a later pass.
                    self.untrack(key);
                }
            }
        }
        self.cleaned.lock().unwrap().add(rep.clone());
        rep
    }

    /// A CreateVolume whose outcome is unknown: ask again under the same
    /// name (idempotent) and return the id so it can be deleted.
    pub(crate) async fn resolve_unknown_create(&self, name: &str) -> Option<String> {
        let attempts = self.cfg.cleanup_retries.max(1);
        for _ in 0..attempts {
            match self
                .csi
                .create_volume(self.create_request(name.to_string()))
                .await
            {
                Ok(r) => return r.volume.map(|v| v.volume_id).filter(|id| !id.is_empty()),
                Err(s) if !transient(s.code()) => return None,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        None
    }
}

/// Removes `child` (if the driver left it; only an empty dir or a plain
/// file) and then `path`. Never recursive: a mount still there makes this
/// fail, which is reported instead of hidden. Ok(false): already gone.
pub(crate) fn remove_dir(path: &Path, child: Option<&Path>) -> std::io::Result<bool> {
    if let Some(c) = child
        && std::fs::remove_dir(c).is_err()
    {
        let _ = std::fs::remove_file(c);
    }
    match std::fs::remove_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}
