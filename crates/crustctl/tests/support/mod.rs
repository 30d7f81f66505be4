//! A small in-memory CSI driver for crustctl's own tests: it is the test
//! double of the *server* so the *client* (crustctl) can be tested over real
//! gRPC on a real unix socket. It keeps volumes, stagings and publications
//! in memory, records every request (as encoded protobuf, decoded again by
//! the tests), creates/removes publish targets like a real driver, and
//! answers with the status codes the CSI spec prescribes.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_proto::csi::v1 as csi;
use csi::controller_server::{Controller, ControllerServer};
use csi::identity_server::{Identity, IdentityServer};
use csi::node_server::{Node, NodeServer};
use prost::Message;
use tonic::{Code, Request, Response, Status};

pub const DRIVER: &str = "fake.csi.crust.io";
pub const NODE_ID: &str = "fake-node";
pub const TOPOLOGY_KEY: &str = "topology.fake.crust.io/node";

/// What the fake advertises and how it misbehaves.
#[derive(Clone)]
pub struct Options {
    pub stage_unstage: bool,
    pub stats: bool,
    pub defer: bool,
    pub controller_publish: bool,
    /// Probe sleeps this long (to test client deadlines).
    pub probe_delay: Duration,
    /// rpc name -> (every Nth call fails, with this code).
    pub fail_every: HashMap<&'static str, (u64, Code)>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            stage_unstage: true,
            stats: true,
            defer: true,
            controller_publish: false,
            probe_delay: Duration::ZERO,
            fail_every: HashMap::new(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct FakeVolume {
    pub name: String,
    pub capacity: i64,
    pub context: HashMap<String, String>,
}

#[derive(Default)]
pub struct State {
    pub next_id: u64,
    pub volumes: BTreeMap<String, FakeVolume>,
    pub snapshots: BTreeMap<String, csi::Snapshot>,
    /// (volume id, node id)
    pub attached: BTreeSet<(String, String)>,
    /// (volume id, staging path)
    pub staged: BTreeSet<(String, String)>,
    /// (volume id, target path)
    pub published: BTreeSet<(String, String)>,
    pub requests: Vec<(&'static str, Vec<u8>)>,
    pub calls: HashMap<&'static str, u64>,
}

#[derive(Clone)]
struct Svc {
    state: Arc<Mutex<State>>,
    opts: Arc<Options>,
}

/// A running fake driver; stops when dropped.
pub struct Fake {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub state: Arc<Mutex<State>>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Fake {
    pub fn start(opts: Options) -> Fake {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("csi.sock");
        let state = Arc::new(Mutex::new(State::default()));
        let svc = Svc {
            state: state.clone(),
            opts: Arc::new(opts),
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let sock = socket.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::UnixListener::bind(&sock).expect("bind fake socket");
                ready_tx.send(()).unwrap();
                tonic::transport::Server::builder()
                    .add_service(IdentityServer::new(svc.clone()))
                    .add_service(ControllerServer::new(svc.clone()))
                    .add_service(NodeServer::new(svc))
                    .serve_with_incoming_shutdown(
                        tokio_stream::wrappers::UnixListenerStream::new(listener),
                        async {
                            let _ = rx.await;
                        },
                    )
                    .await
                    .expect("fake server");
            });
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("fake server did not start");
        Fake {
            dir,
            socket,
            state,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }

    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Every recorded request of `rpc`, decoded.
    pub fn requests<M: Message + Default>(&self, rpc: &str) -> Vec<M> {
        self.state
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|(n, _)| *n == rpc)
            .map(|(_, b)| M::decode(b.as_slice()).expect("decode recorded request"))
            .collect()
    }

    pub fn raw_requests(&self, rpc: &str) -> Vec<Vec<u8>> {
        self.state
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|(n, _)| *n == rpc)
            .map(|(_, b)| b.clone())
            .collect()
    }

    pub fn last<M: Message + Default>(&self, rpc: &str) -> M {
        self.requests::<M>(rpc)
            .pop()
            .unwrap_or_else(|| panic!("no {rpc} request recorded"))
    }

    pub fn count(&self, rpc: &str) -> usize {
        self.raw_requests(rpc).len()
    }

    /// Adds a volume directly (for tests of one RPC).
    pub fn add_volume(&self, id: &str, capacity: i64) {
        self.state.lock().unwrap().volumes.insert(
            id.to_string(),
            FakeVolume {
                name: id.to_string(),
                capacity,
                context: HashMap::new(),
            },
        );
    }

    /// (volumes, attachments, stagings, publications) still held.
    pub fn held(&self) -> (usize, usize, usize, usize) {
        let s = self.state.lock().unwrap();
        (
            s.volumes.len(),
            s.attached.len(),
            s.staged.len(),
            s.published.len(),
        )
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

type R<T> = Result<Response<T>, Status>;

impl Svc {
    /// Records the request and applies the failure injection.
    fn rec<M: Message>(&self, rpc: &'static str, m: &M) -> Result<(), Status> {
        let mut s = self.state.lock().unwrap();
        s.requests.push((rpc, m.encode_to_vec()));
        let n = {
            let c = s.calls.entry(rpc).or_default();
            *c += 1;
            *c
        };
        if let Some((every, code)) = self.opts.fail_every.get(rpc)
            && n % every == 0
        {
            return Err(Status::new(
                *code,
                format!("injected failure of {rpc} call {n}"),
            ));
        }
        Ok(())
    }

    fn need_volume(s: &State, id: &str) -> Result<FakeVolume, Status> {
        if id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        s.volumes
            .get(id)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("volume {id} does not exist")))
    }

    fn volume_msg(id: &str, v: &FakeVolume) -> csi::Volume {
        csi::Volume {
            capacity_bytes: v.capacity,
            volume_id: id.to_string(),
            volume_context: v.context.clone(),
            content_source: None,
            accessible_topology: vec![node_topology()],
        }
    }
}

fn node_topology() -> csi::Topology {
    csi::Topology {
        segments: [(TOPOLOGY_KEY.to_string(), NODE_ID.to_string())].into(),
    }
}

fn is_block(c: &Option<csi::VolumeCapability>) -> bool {
    matches!(
        c.as_ref().and_then(|c| c.access_type.as_ref()),
        Some(csi::volume_capability::AccessType::Block(_))
    )
}

#[tonic::async_trait]
impl Identity for Svc {
    async fn get_plugin_info(
        &self,
        r: Request<csi::GetPluginInfoRequest>,
    ) -> R<csi::GetPluginInfoResponse> {
        self.rec("GetPluginInfo", r.get_ref())?;
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: DRIVER.into(),
            vendor_version: "0.0.1-test".into(),
            manifest: [("fake".to_string(), "yes".to_string())].into(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        r: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> R<csi::GetPluginCapabilitiesResponse> {
        use csi::plugin_capability::{Service, Type, VolumeExpansion, service, volume_expansion};
        self.rec("GetPluginCapabilities", r.get_ref())?;
        let svc = |t: service::Type| csi::PluginCapability {
            r#type: Some(Type::Service(Service { r#type: t as i32 })),
        };
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities: vec![
                svc(service::Type::ControllerService),
                svc(service::Type::VolumeAccessibilityConstraints),
                csi::PluginCapability {
                    r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                        r#type: volume_expansion::Type::Online as i32,
                    })),
                },
            ],
        }))
    }

    async fn probe(&self, r: Request<csi::ProbeRequest>) -> R<csi::ProbeResponse> {
        self.rec("Probe", r.get_ref())?;
        if !self.opts.probe_delay.is_zero() {
            tokio::time::sleep(self.opts.probe_delay).await;
        }
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}

#[tonic::async_trait]
impl Controller for Svc {
    async fn create_volume(
        &self,
        r: Request<csi::CreateVolumeRequest>,
    ) -> R<csi::CreateVolumeResponse> {
        let r = r.into_inner();
        self.rec("CreateVolume", &r)?;
        if r.name.is_empty() {
            return Err(Status::invalid_argument("name is required"));
        }
        if r.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        let cap = r
            .capacity_range
            .map(|c| c.required_bytes)
            .filter(|b| *b > 0)
            .unwrap_or(1 << 30);
        let mut s = self.state.lock().unwrap();
        if let Some((id, v)) = s.volumes.iter().find(|(_, v)| v.name == r.name) {
            if v.capacity != cap {
                return Err(Status::already_exists(format!(
                    "volume {} exists with another size",
                    r.name
                )));
            }
            return Ok(Response::new(csi::CreateVolumeResponse {
                volume: Some(Svc::volume_msg(id, v)),
            }));
        }
        s.next_id += 1;
        let id = format!("fake-vol-{}", s.next_id);
        let v = FakeVolume {
            name: r.name.clone(),
            capacity: cap,
            context: [("fake.crust.io/name".to_string(), r.name)].into(),
        };
        s.volumes.insert(id.clone(), v.clone());
        Ok(Response::new(csi::CreateVolumeResponse {
            volume: Some(Svc::volume_msg(&id, &v)),
        }))
    }

    async fn delete_volume(
        &self,
        r: Request<csi::DeleteVolumeRequest>,
    ) -> R<csi::DeleteVolumeResponse> {
        let r = r.into_inner();
        self.rec("DeleteVolume", &r)?;
        if r.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        let mut s = self.state.lock().unwrap();
        if s.staged.iter().any(|(v, _)| *v == r.volume_id)
            || s.published.iter().any(|(v, _)| *v == r.volume_id)
            || s.attached.iter().any(|(v, _)| *v == r.volume_id)
        {
            return Err(Status::failed_precondition(format!(
                "volume {} is in use",
                r.volume_id
            )));
        }
        s.volumes.remove(&r.volume_id);
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        r: Request<csi::ControllerPublishVolumeRequest>,
    ) -> R<csi::ControllerPublishVolumeResponse> {
        let r = r.into_inner();
        self.rec("ControllerPublishVolume", &r)?;
        let mut s = self.state.lock().unwrap();
        Svc::need_volume(&s, &r.volume_id)?;
        if r.node_id != NODE_ID {
            return Err(Status::not_found(format!(
                "node {} does not exist",
                r.node_id
            )));
        }
        s.attached.insert((r.volume_id.clone(), r.node_id));
        Ok(Response::new(csi::ControllerPublishVolumeResponse {
            publish_context: [(
                "devicePath".to_string(),
                format!("/dev/fake/{}", r.volume_id),
            )]
            .into(),
        }))
    }

    async fn controller_unpublish_volume(
        &self,
        r: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> R<csi::ControllerUnpublishVolumeResponse> {
        let r = r.into_inner();
        self.rec("ControllerUnpublishVolume", &r)?;
        let mut s = self.state.lock().unwrap();
        Svc::need_volume(&s, &r.volume_id)?;
        s.attached
            .retain(|(v, n)| !(*v == r.volume_id && (r.node_id.is_empty() || *n == r.node_id)));
        Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        r: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> R<csi::ValidateVolumeCapabilitiesResponse> {
        let r = r.into_inner();
        self.rec("ValidateVolumeCapabilities", &r)?;
        Svc::need_volume(&self.state.lock().unwrap(), &r.volume_id)?;
        Ok(Response::new(csi::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                volume_context: r.volume_context,
                volume_capabilities: r.volume_capabilities,
                parameters: r.parameters,
                mutable_parameters: r.mutable_parameters,
            }),
            message: String::new(),
        }))
    }

    async fn list_volumes(
        &self,
        r: Request<csi::ListVolumesRequest>,
    ) -> R<csi::ListVolumesResponse> {
        let r = r.into_inner();
        self.rec("ListVolumes", &r)?;
        let s = self.state.lock().unwrap();
        let start: usize = if r.starting_token.is_empty() {
            0
        } else {
            r.starting_token
                .parse()
                .ok()
                .filter(|i| *i <= s.volumes.len())
                .ok_or_else(|| {
                    Status::aborted(format!("invalid starting_token {:?}", r.starting_token))
                })?
        };
        let max = if r.max_entries > 0 {
            r.max_entries as usize
        } else {
            usize::MAX
        };
        let all: Vec<_> = s.volumes.iter().collect();
        let page: Vec<_> = all.iter().skip(start).take(max).collect();
        let end = start + page.len();
        Ok(Response::new(csi::ListVolumesResponse {
            entries: page
                .iter()
                .map(|(id, v)| csi::list_volumes_response::Entry {
                    volume: Some(Svc::volume_msg(id, v)),
                    status: Some(csi::list_volumes_response::VolumeStatus {
                        published_node_ids: s
                            .attached
                            .iter()
                            .filter(|(vid, _)| vid == *id)
                            .map(|(_, n)| n.clone())
                            .collect(),
                        volume_condition: Some(csi::VolumeCondition {
                            abnormal: false,
                            message: "healthy".into(),
                        }),
                    }),
                })
                .collect(),
            next_token: if end < all.len() {
                end.to_string()
            } else {
                String::new()
            },
        }))
    }

    async fn get_capacity(
        &self,
        r: Request<csi::GetCapacityRequest>,
    ) -> R<csi::GetCapacityResponse> {
        self.rec("GetCapacity", r.get_ref())?;
        Ok(Response::new(csi::GetCapacityResponse {
            available_capacity: 10 << 30,
            maximum_volume_size: Some(4 << 30),
            minimum_volume_size: Some(1 << 20),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        r: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> R<csi::ControllerGetCapabilitiesResponse> {
        use csi::controller_service_capability::{Rpc, Type, rpc::Type as T};
        self.rec("ControllerGetCapabilities", r.get_ref())?;
        let mut types = vec![
            T::CreateDeleteVolume,
            T::ListVolumes,
            T::GetCapacity,
            T::ExpandVolume,
            T::GetVolume,
            T::CreateDeleteSnapshot,
            T::ListSnapshots,
            T::ModifyVolume,
        ];
        if self.opts.controller_publish {
            types.push(T::PublishUnpublishVolume);
        }
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: types
                .into_iter()
                .map(|t| csi::ControllerServiceCapability {
                    r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })),
                })
                .collect(),
        }))
    }

    async fn create_snapshot(
        &self,
        r: Request<csi::CreateSnapshotRequest>,
    ) -> R<csi::CreateSnapshotResponse> {
        let r = r.into_inner();
        self.rec("CreateSnapshot", &r)?;
        let mut s = self.state.lock().unwrap();
        let v = Svc::need_volume(&s, &r.source_volume_id)?;
        let snap = csi::Snapshot {
            size_bytes: v.capacity,
            snapshot_id: format!("snap-{}", r.name),
            source_volume_id: r.source_volume_id,
            creation_time: Some(prost_types::Timestamp {
                seconds: 1_700_000_000,
                nanos: 0,
            }),
            ready_to_use: true,
            group_snapshot_id: String::new(),
            accessible_topology: vec![],
        };
        s.snapshots.insert(snap.snapshot_id.clone(), snap.clone());
        Ok(Response::new(csi::CreateSnapshotResponse {
            snapshot: Some(snap),
        }))
    }

    async fn delete_snapshot(
        &self,
        r: Request<csi::DeleteSnapshotRequest>,
    ) -> R<csi::DeleteSnapshotResponse> {
        let r = r.into_inner();
        self.rec("DeleteSnapshot", &r)?;
        self.state.lock().unwrap().snapshots.remove(&r.snapshot_id);
        Ok(Response::new(csi::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        r: Request<csi::ListSnapshotsRequest>,
    ) -> R<csi::ListSnapshotsResponse> {
        let r = r.into_inner();
        self.rec("ListSnapshots", &r)?;
        let s = self.state.lock().unwrap();
        Ok(Response::new(csi::ListSnapshotsResponse {
            entries: s
                .snapshots
                .values()
                .filter(|x| {
                    r.source_volume_id.is_empty() || x.source_volume_id == r.source_volume_id
                })
                .filter(|x| r.snapshot_id.is_empty() || x.snapshot_id == r.snapshot_id)
                .map(|x| csi::list_snapshots_response::Entry {
                    snapshot: Some(x.clone()),
                })
                .collect(),
            next_token: String::new(),
        }))
    }

    async fn get_snapshot(
        &self,
        r: Request<csi::GetSnapshotRequest>,
    ) -> R<csi::GetSnapshotResponse> {
        let r = r.into_inner();
        self.rec("GetSnapshot", &r)?;
        let s = self.state.lock().unwrap();
        let snap = s.snapshots.get(&r.snapshot_id).cloned().ok_or_else(|| {
            Status::not_found(format!("snapshot {} does not exist", r.snapshot_id))
        })?;
        Ok(Response::new(csi::GetSnapshotResponse {
            snapshot: Some(snap),
        }))
    }

    async fn controller_expand_volume(
        &self,
        r: Request<csi::ControllerExpandVolumeRequest>,
    ) -> R<csi::ControllerExpandVolumeResponse> {
        let r = r.into_inner();
        self.rec("ControllerExpandVolume", &r)?;
        let mut s = self.state.lock().unwrap();
        Svc::need_volume(&s, &r.volume_id)?;
        let want = r.capacity_range.map(|c| c.required_bytes).unwrap_or(0);
        let v = s.volumes.get_mut(&r.volume_id).unwrap();
        if want < v.capacity {
            return Err(Status::out_of_range("cannot shrink"));
        }
        v.capacity = want;
        Ok(Response::new(csi::ControllerExpandVolumeResponse {
            capacity_bytes: want,
            node_expansion_required: true,
        }))
    }

    async fn controller_get_volume(
        &self,
        r: Request<csi::ControllerGetVolumeRequest>,
    ) -> R<csi::ControllerGetVolumeResponse> {
        let r = r.into_inner();
        self.rec("ControllerGetVolume", &r)?;
        let s = self.state.lock().unwrap();
        let v = Svc::need_volume(&s, &r.volume_id)?;
        Ok(Response::new(csi::ControllerGetVolumeResponse {
            volume: Some(Svc::volume_msg(&r.volume_id, &v)),
            status: Some(csi::controller_get_volume_response::VolumeStatus {
                published_node_ids: vec![],
                volume_condition: Some(csi::VolumeCondition {
                    abnormal: false,
                    message: String::new(),
                }),
            }),
        }))
    }

    async fn controller_modify_volume(
        &self,
        r: Request<csi::ControllerModifyVolumeRequest>,
    ) -> R<csi::ControllerModifyVolumeResponse> {
        let r = r.into_inner();
        self.rec("ControllerModifyVolume", &r)?;
        Svc::need_volume(&self.state.lock().unwrap(), &r.volume_id)?;
        Ok(Response::new(csi::ControllerModifyVolumeResponse {}))
    }

    async fn controller_get_volume_health(
        &self,
        r: Request<csi::ControllerGetVolumeHealthRequest>,
    ) -> R<csi::ControllerGetVolumeHealthResponse> {
        let r = r.into_inner();
        self.rec("ControllerGetVolumeHealth", &r)?;
        Svc::need_volume(&self.state.lock().unwrap(), &r.volume_id)?;
        Ok(Response::new(csi::ControllerGetVolumeHealthResponse {
            volume_health: Some(csi::VolumeHealth {
                volume_id: r.volume_id,
                health_statuses: vec![],
            }),
        }))
    }

    async fn controller_list_volume_health(
        &self,
        r: Request<csi::ControllerListVolumeHealthRequest>,
    ) -> R<csi::ControllerListVolumeHealthResponse> {
        let r = r.into_inner();
        self.rec("ControllerListVolumeHealth", &r)?;
        Ok(Response::new(
            csi::ControllerListVolumeHealthResponse::default(),
        ))
    }
}

fn need_dir(p: &str, what: &str) -> Result<(), Status> {
    if p.is_empty() {
        return Err(Status::invalid_argument(format!("{what} is required")));
    }
    if !Path::new(p).is_dir() {
        return Err(Status::invalid_argument(format!(
            "{what} {p} is not a directory"
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl Node for Svc {
    async fn node_stage_volume(
        &self,
        r: Request<csi::NodeStageVolumeRequest>,
    ) -> R<csi::NodeStageVolumeResponse> {
        let r = r.into_inner();
        self.rec("NodeStageVolume", &r)?;
        if !self.opts.stage_unstage {
            return Err(Status::unimplemented("STAGE_UNSTAGE_VOLUME not supported"));
        }
        let mut s = self.state.lock().unwrap();
        Svc::need_volume(&s, &r.volume_id)?;
        need_dir(&r.staging_target_path, "staging_target_path")?;
        if r.volume_capability.is_none() {
            return Err(Status::invalid_argument("volume_capability is required"));
        }
        if s.staged
            .iter()
            .any(|(v, p)| *v == r.volume_id && *p != r.staging_target_path)
        {
            return Err(Status::failed_precondition("staged elsewhere"));
        }
        s.staged.insert((r.volume_id, r.staging_target_path));
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        r: Request<csi::NodeUnstageVolumeRequest>,
    ) -> R<csi::NodeUnstageVolumeResponse> {
        let r = r.into_inner();
        self.rec("NodeUnstageVolume", &r)?;
        let mut s = self.state.lock().unwrap();
        Svc::need_volume(&s, &r.volume_id)?;
        if s.published.iter().any(|(v, _)| *v == r.volume_id) {
            return Err(Status::failed_precondition("still published"));
        }
        s.staged.remove(&(r.volume_id, r.staging_target_path));
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        r: Request<csi::NodePublishVolumeRequest>,
    ) -> R<csi::NodePublishVolumeResponse> {
        let r = r.into_inner();
        self.rec("NodePublishVolume", &r)?;
        let mut s = self.state.lock().unwrap();
        Svc::need_volume(&s, &r.volume_id)?;
        if self.opts.stage_unstage
            && !s
                .staged
                .contains(&(r.volume_id.clone(), r.staging_target_path.clone()))
        {
            return Err(Status::failed_precondition(format!(
                "volume {} is not staged at {:?}",
                r.volume_id, r.staging_target_path
            )));
        }
        if r.target_path.is_empty() {
            return Err(Status::invalid_argument("target_path is required"));
        }
        let target = Path::new(&r.target_path);
        let parent = target
            .parent()
            .map(|p| p.to_string_lossy().to_string())
            .unwrap_or_default();
        need_dir(&parent, "target parent")?;
        let made = if is_block(&r.volume_capability) {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(target)
                .map(drop)
        } else {
            match std::fs::create_dir(target) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
                other => other,
            }
        };
        made.map_err(|e| Status::internal(format!("create target: {e}")))?;
        s.published.insert((r.volume_id, r.target_path));
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        r: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> R<csi::NodeUnpublishVolumeResponse> {
        let r = r.into_inner();
        self.rec("NodeUnpublishVolume", &r)?;
        let mut s = self.state.lock().unwrap();
        Svc::need_volume(&s, &r.volume_id)?;
        let target = Path::new(&r.target_path);
        if target.is_dir() {
            let _ = std::fs::remove_dir(target);
        } else if target.exists() {
            let _ = std::fs::remove_file(target);
        }
        s.published.remove(&(r.volume_id, r.target_path));
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        r: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> R<csi::NodeGetVolumeStatsResponse> {
        use csi::volume_usage::Unit;
        let r = r.into_inner();
        self.rec("NodeGetVolumeStats", &r)?;
        let s = self.state.lock().unwrap();
        let v = Svc::need_volume(&s, &r.volume_id)?;
        if !s
            .published
            .contains(&(r.volume_id.clone(), r.volume_path.clone()))
        {
            return Err(Status::not_found(format!(
                "volume {} is not published at {}",
                r.volume_id, r.volume_path
            )));
        }
        Ok(Response::new(csi::NodeGetVolumeStatsResponse {
            usage: vec![
                csi::VolumeUsage {
                    available: v.capacity - 4096,
                    total: v.capacity,
                    used: 4096,
                    unit: Unit::Bytes as i32,
                },
                csi::VolumeUsage {
                    available: 990,
                    total: 1000,
                    used: 10,
                    unit: Unit::Inodes as i32,
                },
            ],
            volume_condition: Some(csi::VolumeCondition {
                abnormal: false,
                message: "healthy".into(),
            }),
        }))
    }

    async fn node_expand_volume(
        &self,
        r: Request<csi::NodeExpandVolumeRequest>,
    ) -> R<csi::NodeExpandVolumeResponse> {
        let r = r.into_inner();
        self.rec("NodeExpandVolume", &r)?;
        let s = self.state.lock().unwrap();
        let v = Svc::need_volume(&s, &r.volume_id)?;
        Ok(Response::new(csi::NodeExpandVolumeResponse {
            capacity_bytes: r
                .capacity_range
                .map(|c| c.required_bytes)
                .unwrap_or(v.capacity),
        }))
    }

    async fn node_get_capabilities(
        &self,
        r: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> R<csi::NodeGetCapabilitiesResponse> {
        use csi::node_service_capability::{Rpc, Type, rpc::Type as T};
        self.rec("NodeGetCapabilities", r.get_ref())?;
        let mut types = vec![T::ExpandVolume, T::VolumeCondition];
        if self.opts.stage_unstage {
            types.push(T::StageUnstageVolume);
        }
        if self.opts.stats {
            types.push(T::GetVolumeStats);
        }
        if self.opts.defer {
            types.extend([
                T::DeferFsOps,
                T::DeferFsOpsWithSupplementalGroup,
                T::DeferFsOpsWithSupplementalGroupChangePolicy,
            ]);
        }
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities: types
                .into_iter()
                .map(|t| csi::NodeServiceCapability {
                    r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })),
                })
                .collect(),
        }))
    }

    async fn node_get_info(
        &self,
        r: Request<csi::NodeGetInfoRequest>,
    ) -> R<csi::NodeGetInfoResponse> {
        self.rec("NodeGetInfo", r.get_ref())?;
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: NODE_ID.into(),
            max_volumes_per_node: 0,
            accessible_topology: Some(node_topology()),
            supported_file_systems: vec!["ext4".into()],
        }))
    }

    async fn node_get_volume_health(
        &self,
        r: Request<csi::NodeGetVolumeHealthRequest>,
    ) -> R<csi::NodeGetVolumeHealthResponse> {
        let r = r.into_inner();
        self.rec("NodeGetVolumeHealth", &r)?;
        Svc::need_volume(&self.state.lock().unwrap(), &r.volume_id)?;
        Ok(Response::new(csi::NodeGetVolumeHealthResponse {
            volume_health: Some(csi::VolumeHealth {
                volume_id: r.volume_id,
                health_statuses: vec![csi::volume_health::VolumeHealthEntry {
                    status: csi::VolumeHealthErrorType::Degraded as i32,
                    reason: "FilesystemReadOnly".into(),
                    message: "read-only".into(),
                }],
            }),
        }))
    }

    async fn node_get_storage_health(
        &self,
        r: Request<csi::NodeGetStorageHealthRequest>,
    ) -> R<csi::NodeGetStorageHealthResponse> {
        self.rec("NodeGetStorageHealth", r.get_ref())?;
        Ok(Response::new(csi::NodeGetStorageHealthResponse {
            backend_health: vec![],
        }))
    }
}
