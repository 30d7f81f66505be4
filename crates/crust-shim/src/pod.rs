//! The pod's VM, shared by every container of the pod: booted by the first
//! container (the CRI sandbox, or a lone `ctr run` container), with one
//! virtio-fs share for the containers' rootfs and binds, deferred volumes
//! hot-plugged as virtio-blk, and torn down with the pod.
//!
//! The pod is also a crust sandbox: its `state.json` (shim and
//! QEMU pids, volumes) lives in the same store and its shim API socket
//! answers `crust stats|resize`, so the `crust-runtime` CLI that the claim
//! names serves crust_ops for containerd pods exactly as for its own.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crust_agent_proto::stdio::StdioMux;
use crust_agent_proto::{ContainerMount, CreateContainer, MountSource, Rootfs, ShareRef};
use crust_sandbox::beneath::FsSpec;
use crust_sandbox::bundle::Bundle;
use crust_sandbox::claims::{claim, release_all};
use crust_sandbox::discovery::{Discovery, Volume};
use crust_sandbox::error::RuntimeError;
use crust_sandbox::handover::{self, Handover, VolumeEvent};
use crust_sandbox::lifecycle::{self, BootSpec, Recorded};
use crust_sandbox::plug::{self, Attachments, GuestPorts};
use crust_sandbox::sandbox::{ProcRef, SandboxState, SandboxStore, Status};
use crust_sandbox::share;
use crust_sandbox::shim::{Code, agent_code};
use crust_sandbox::vm::Guest;
use crust_sandbox::volumes;
use rustix::mount::MountAttrFlags;
use tokio::sync::watch;

use crate::config::ShimConfig;
use crust_sandbox::spec::{ContainerPlan, Limits, Planned};
use crust_sandbox::vm::PodVm;

pub use crust_sandbox::share::SHARE_TAG;

#[derive(Debug, thiserror::Error)]
pub enum PodError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("{what}: {reason}")]
    Host { what: String, reason: String },
    #[error("the pod's VM is not running ({0})")]
    VmGone(String),
    #[error("guest agent: {0}")]
    Agent(#[from] crust_agent_proto::ClientError),
    /// A user namespace the guest cannot honour (a mapping, a volume's
    /// filesystem): `crust_agent_proto::check_user_namespace`.
    #[error("user namespace: {0}")]
    UserNamespace(String),
    #[error(transparent)]
    Resize(#[from] crust_sandbox::resize::ResizeError),
    /// What the spec asks and a crust VM refuses (hostNetwork at boot).
    #[error(transparent)]
    Spec(#[from] crust_sandbox::spec::SpecError),
    #[error("pod {0} already runs a VM")]
    AlreadyRuns(String),
    /// The guest cannot be given the memory a container needs.
    #[error("pod {pod}: {why}")]
    NoMemory {
        pod: String,
        why: crust_sandbox::resize::ResizeError,
    },
    #[error("no free hot-plug slot left in the pod's VM")]
    NoHotplugSlot,
    #[error("no host block device {major}:{minor}")]
    NoHostDevice { major: i64, minor: i64 },
    #[error("{} is not a block device", .0.display())]
    NotBlockDevice(PathBuf),
}

impl PodError {
    pub fn host(what: impl Into<String>, reason: impl std::fmt::Display) -> PodError {
        PodError::Host {
            what: what.into(),
            reason: reason.to_string(),
        }
    }

    pub fn code(&self) -> Code {
        match self {
            PodError::Runtime(e) => e.code(),
            PodError::Host { .. } => Code::Internal,
            PodError::VmGone(_) => Code::Unavailable,
            PodError::Agent(e) => agent_code(e),
            PodError::UserNamespace(_) => Code::InvalidArgument,
            PodError::Resize(e) => e.code(),
            PodError::Spec(e) => e.code(),
            PodError::AlreadyRuns(_) => Code::AlreadyExists,
            PodError::NoMemory { .. } | PodError::NoHotplugSlot => Code::FailedPrecondition,
            PodError::NoHostDevice { .. } | PodError::NotBlockDevice(_) => Code::InvalidArgument,
        }
    }
}

/// The user namespace once the container's crust volumes are known:
/// each must take an idmapped mount. Before any is claimed or plugged.
fn check_idmap(
    plan: &ContainerPlan,
    vplan: &crust_sandbox::discovery::Plan,
) -> Result<(), PodError> {
    let volumes: Vec<(&str, &str)> = vplan
        .mounts
        .iter()
        .filter_map(|m| {
            let v = vplan.volumes.iter().find(|v| v.id == m.volume)?;
            Some((m.destination.as_str(), v.fstype.as_str()))
        })
        .collect();
    crust_agent_proto::check_user_namespace(&plan.user, plan.process.user.as_ref(), &volumes)
        .map_err(PodError::UserNamespace)
}

/// One pod: the VM, its share, its volumes, its sandbox state.
pub struct Pod {
    pub id: String,
    pub cfg: ShimConfig,
    store: SandboxStore,
    discovery: Discovery,
    vm: tokio::sync::RwLock<Option<Arc<PodVm>>>,
    boot: tokio::sync::Mutex<()>,
    state: Mutex<Option<SandboxState>>,
    next_stream: AtomicU32,
    /// Hot-plug buses, the volumes plugged and mounted in the guest, and
    /// the exclusive holds on their host devices.
    pub(crate) attachments: Attachments,
    /// One volume plug (claim included) at a time.
    plug_lock: tokio::sync::Mutex<()>,
    /// The VM's memory and vCPUs and what the containers ask of them.
    pub(crate) sizing: tokio::sync::Mutex<crust_sandbox::resize::Sizing>,
    /// One volume resize or throttle at a time.
    pub(crate) volume_locks: crust_sandbox::served::VolumeLocks,
    /// Stops the crust shim API server.
    api_stop: Mutex<Option<watch::Sender<bool>>>,
    /// Handed-over targets -> when they were asked for (latency events).
    asked_at: Mutex<HashMap<String, Instant>>,
    /// Declined handovers not yet published as containerd events.
    fallbacks: Mutex<Vec<VolumeEvent>>,
}

impl Pod {
    pub fn new(id: &str, cfg: ShimConfig) -> Result<Pod, PodError> {
        let discovery = Discovery::for_config(&cfg.runtime).map_err(RuntimeError::from)?;
        Ok(Pod {
            id: id.to_string(),
            store: SandboxStore::new(cfg.runtime.root.clone()),
            discovery,
            cfg,
            vm: Default::default(),
            boot: Default::default(),
            state: Mutex::new(None),
            next_stream: AtomicU32::new(1),
            attachments: Attachments::default(),
            plug_lock: Default::default(),
            sizing: Default::default(),
            volume_locks: Default::default(),
            api_stop: Mutex::new(None),
            asked_at: Mutex::new(HashMap::new()),
            fallbacks: Mutex::new(Vec::new()),
        })
    }

    pub fn store(&self) -> &SandboxStore {
        &self.store
    }

    pub fn share_dir(&self) -> PathBuf {
        self.store.dir(&self.id).join(share::SHARE_DIR)
    }

    /// A fresh stdio stream id.
    pub fn stream(&self) -> u32 {
        self.next_stream.fetch_add(1, Ordering::SeqCst)
    }

    pub async fn vm(&self) -> Result<Arc<PodVm>, PodError> {
        let vm = self.vm.read().await.clone();
        match vm {
            Some(v) => {
                let gone = v.exit.borrow().clone();
                match gone {
                    Some(r) => Err(PodError::VmGone(r)),
                    None => Ok(v),
                }
            }
            None => Err(PodError::VmGone("not booted".into())),
        }
    }

    pub async fn booted(&self) -> Option<Arc<PodVm>> {
        self.vm.read().await.clone()
    }

    pub fn snapshot(&self) -> Option<SandboxState> {
        self.state.lock().expect("state").clone()
    }

    fn update(&self, f: impl FnOnce(&mut SandboxState)) {
        let mut g = self.state.lock().expect("state");
        if let Some(st) = g.as_mut() {
            f(st);
            if let Err(e) = self.store.save(st) {
                tracing::error!("saving the pod state: {e}");
            }
        }
    }

    /// Boots the pod's VM (once): sandbox record, share, virtiofsd, QEMU,
    /// agent. `memory_mib` is the guest's memory.
    pub async fn boot(
        self: &Arc<Self>,
        bundle: &Path,
        memory_mib: u32,
        cpus: u32,
        cgroup: Option<&crust_sandbox::cgroup::Placement>,
        network: &crust_sandbox::net::PodNetworkSpec,
        policy: crust_sandbox::net::NetPolicy,
    ) -> Result<Arc<PodVm>, PodError> {
        let _g = self.boot.lock().await;
        if let Some(v) = self.vm.read().await.clone() {
            return Ok(v);
        }
        self.create_record(bundle)?;
        self.serve_api()?;
        let res = self.launch(memory_mib, cpus, cgroup, network, policy).await;
        match res {
            Ok(vm) => {
                *self.vm.write().await = Some(vm.clone());
                Ok(vm)
            }
            Err(e) => {
                self.update(|s| {
                    s.status = Status::Stopped;
                    s.reason = Some(e.to_string());
                });
                self.stop_api();
                self.remove_share();
                let _ = self.store.remove(&self.id);
                // Gone with its record: a later teardown has nothing to save.
                *self.state.lock().expect("state") = None;
                Err(e)
            }
        }
    }

    /// Serves the crust shim API on the pod's `shim.sock`.
    fn serve_api(self: &Arc<Self>) -> Result<(), PodError> {
        let listener = crust_sandbox::shim::bind(&self.store.socket(&self.id))
            .map_err(|e| PodError::host("binding the crust shim API socket", e))?;
        let (tx, _) = watch::channel(false);
        *self.api_stop.lock().expect("api") = Some(tx.clone());
        // The pod is its own shim API handler (crate::shimapi implements
        // it), so this module needs no name from there.
        tokio::spawn(crust_sandbox::shim::serve(listener, self.clone(), tx));
        Ok(())
    }

    fn stop_api(&self) {
        if let Some(tx) = self.api_stop.lock().expect("api").take() {
            let _ = tx.send(true);
        }
    }

    fn create_record(&self, bundle: &Path) -> Result<(), PodError> {
        // A record left by a shim of this pod that died is ours to replace.
        if self.store.exists(&self.id) {
            let old = self.store.load(&self.id).ok();
            if old.as_ref().is_some_and(|s| s.holds_volumes()) {
                return Err(PodError::AlreadyRuns(self.id.clone()));
            }
            let _ = self.store.remove(&self.id);
        }
        self.store.create(&self.id).map_err(RuntimeError::from)?;
        let mut st = SandboxState {
            shim: Some(ProcRef::current()),
            ..SandboxState::for_bundle_dir(&self.id, bundle.to_path_buf())
        };
        st.annotations.insert(
            "io.crust.front-door".into(),
            "containerd-shim-crust-v2".into(),
        );
        self.store.save(&st).map_err(RuntimeError::from)?;
        *self.state.lock().expect("state") = Some(st);
        Ok(())
    }

    /// The share directory: a shared mount point, so binds made below it
    /// later reach virtiofsd's own mount namespace. Returns its read-only
    /// guest view, which is what virtiofsd serves.
    fn make_share(&self) -> Result<PathBuf, PodError> {
        Ok(share::make_with_binds(&self.share_dir(), &[]).map_err(RuntimeError::from)?)
    }

    fn remove_share(&self) {
        share::remove_logged(&self.share_dir());
    }

    /// The pod's VM through the one boot both doors use
    /// ([`lifecycle::boot`]), with the pod's sizing, share and cgroup.
    async fn launch(
        &self,
        memory_mib: u32,
        cpus: u32,
        cgroup: Option<&crust_sandbox::cgroup::Placement>,
        network: &crust_sandbox::net::PodNetworkSpec,
        policy: crust_sandbox::net::NetPolicy,
    ) -> Result<Arc<PodVm>, PodError> {
        // A network that cannot go into a VM fails the sandbox before
        // anything boots.
        crust_sandbox::spec::check_host_network(network, self.cfg.host_network)?;
        let share = self.make_share()?;
        let rt = &self.cfg.runtime;
        let mut vc = Guest::config(rt, &self.store.vm_dir(&self.id), &self.id);
        vc.memory_mib = memory_mib;
        vc.cpus = cpus;
        vc.max_memory_mib = self.cfg.max_memory_mib.max(memory_mib);
        vc.max_cpus = self.cfg.max_vcpus().max(cpus);
        *self.sizing.lock().await =
            crust_sandbox::resize::Sizing::booted(memory_mib, cpus, vc.max_cpus);
        vc.shares = vec![crust_vmm::ShareSpec {
            tag: SHARE_TAG.into(),
            dir: share,
        }];
        vc.virtiofsd_binary = self.cfg.virtiofsd.clone();
        // QEMU and virtiofsd are born in the pod's cgroup: every page they
        // ever allocate is charged to the pod.
        // The shim serves this pod alone: it joins too (and leaves at the
        // end, [`crate::task`]'s end_pod, so the groups can go).
        if let Some(cg) = cgroup {
            cg.create()
                .map_err(|e| PodError::host("creating the pod's cgroup", e))?;
            cg.enter_self()
                .map_err(|e| PodError::host("placing the shim in the pod's cgroup", e))?;
            vc.cgroups = cg.dirs.clone();
        }
        let spec = BootSpec {
            cfg: rt,
            vm: vc,
            network: network.clone(),
            policy,
        };
        let mut record = |step: Recorded<'_>| {
            self.update(|s| step.apply(s));
            Ok(())
        };
        let booted = lifecycle::boot(spec, &mut record).await?;
        self.attachments.set_buses(booted.guest.hotplug_buses());
        let stdio = StdioMux::new(booted.guest.stdio_socket());
        let forward = booted
            .network
            .as_ref()
            .and_then(|a| crust_sandbox::forward::start(&a.ns, booted.guest.forward_socket()));
        self.update(|s| s.status = Status::Running);
        Ok(Arc::new(PodVm {
            guest: booted.guest,
            qmp: booted.qmp,
            agent: booted.agent,
            stdio,
            forward,
            exit: booted.exit,
        }))
    }

    /// Prepares the host side of one container (rootfs and binds in the
    /// share, deferred volumes plugged) and returns the guest request.
    /// On failure undoes its own host changes.
    pub async fn prepare(
        &self,
        vm: &PodVm,
        cid: &str,
        bundle: &Path,
        plan: &ContainerPlan,
        rootfs: &[containerd_shim_protos::api::Mount],
    ) -> Result<CreateContainer, PodError> {
        let res = self.prepare_inner(vm, cid, bundle, plan, rootfs).await;
        if res.is_err() {
            self.release_container(cid);
        }
        res
    }

    async fn prepare_inner(
        &self,
        vm: &PodVm,
        cid: &str,
        bundle: &Path,
        plan: &ContainerPlan,
        rootfs: &[containerd_shim_protos::api::Mount],
    ) -> Result<CreateContainer, PodError> {
        // Deferred volumes first: reads records only, claims nothing yet.
        let mut b = Bundle::load(bundle).map_err(RuntimeError::from)?;
        // A later mount on the same destination covers an earlier one.
        let dests: Vec<String> = b.mounts.iter().map(|m| m.destination.clone()).collect();
        let mut i = 0;
        b.mounts.retain(|_| {
            i += 1;
            !dests[i..].contains(&dests[i - 1])
        });
        // The pod's kubelet root, before anything is asked for or claimed.
        let discovery = self.discovery.for_bundle(&b).map_err(RuntimeError::from)?;
        self.take_published_volumes(&discovery, &b).await?;
        let vplan = discovery.plan(&b).map_err(RuntimeError::from)?;
        crust_sandbox::volumes::check_before_boot(&discovery, &vplan.volumes)
            .map_err(RuntimeError::from)?;
        check_idmap(plan, &vplan)?;
        // Every step in the share by descriptor from its root: the guest
        // may have written there (see crust_sandbox::beneath).
        let share = share::open(&self.share_dir()).map_err(RuntimeError::from)?;
        let root = share.as_fd();
        share::create_dir(root, cid).map_err(RuntimeError::from)?;
        mount_rootfs(root, &format!("{cid}/rootfs"), rootfs, &plan.root_path)?;
        let mounts = container_mounts(root, cid, plan, &vplan)?;
        for v in &vplan.volumes {
            self.plug(vm, v).await?;
        }
        let mut devices = Vec::new();
        let kubelet = kubelet_loop(&discovery, &b);
        for d in &plan.devices {
            let serial = self.plug_device(vm, d, &kubelet).await?;
            devices.push(crust_agent_proto::BlockDevice {
                serial,
                path: d.path.clone(),
                mode: d.mode,
                uid: d.uid,
                gid: d.gid,
            });
        }
        Ok(CreateContainer {
            id: cid.to_string(),
            rootfs: Rootfs::Share(ShareRef {
                tag: SHARE_TAG.into(),
                path: format!("{cid}/rootfs"),
            }),
            rootfs_readonly: plan.rootfs_readonly,
            process: plan.process.clone(),
            mounts,
            masked_paths: plan.masked_paths.clone(),
            readonly_paths: plan.readonly_paths.clone(),
            memory_limit_bytes: plan.memory_limit,
            devices,
            ipc: plan.ipc.clone(),
            uts: plan.uts.clone(),
            hostname: plan.hostname.clone(),
            pid: plan.pid.clone(),
            sysctl: plan.sysctl.clone(),
            seccomp: plan.seccomp.clone(),
            user: plan.user.clone(),
        })
    }

    /// Offers the container's crust-csi host publications for hand-over
    /// ([`handover::take_published_volumes`], the routine both doors
    /// share): a handed-over volume is plugged like any deferred volume, a
    /// declined one is shared over virtio-fs and published as an event.
    async fn take_published_volumes(
        &self,
        discovery: &Discovery,
        b: &Bundle,
    ) -> Result<(), PodError> {
        let handover = Handover::new(&self.cfg.runtime);
        let mut log = PodLog(self);
        let mut taken = handover::Taken::default();
        let r = handover::take_published_volumes(
            &handover,
            discovery,
            b,
            &self.id,
            &self.cfg.runtime_cli,
            &mut log,
            &mut taken,
        )
        .await;
        // What was taken before a failure counts too (its events are
        // published, its handed-over volumes timed).
        self.asked_at
            .lock()
            .expect("asked_at")
            .extend(taken.asked_at);
        self.fallbacks
            .lock()
            .expect("fallbacks")
            .extend(taken.fallbacks);
        Ok(r?)
    }

    /// The declined handovers since the last call (the task service
    /// publishes them as containerd events).
    pub fn take_fallbacks(&self) -> Vec<VolumeEvent> {
        std::mem::take(&mut *self.fallbacks.lock().expect("fallbacks"))
    }

    /// Claims a deferred volume, then formats (createFilesystem), holds,
    /// hot-plugs and mounts it through the plug routine both front doors
    /// share; once per pod.
    async fn plug(&self, vm: &PodVm, v: &Volume) -> Result<(), PodError> {
        let _one = self.plug_lock.lock().await;
        if self.attachments.is_plugged(&v.id) {
            return Ok(());
        }
        // Recorded before the claim, so a crash leaves it releasable.
        self.update(|s| {
            if !s.volumes.iter().any(|o| o.id == v.id) {
                s.volumes.push(v.clone());
            }
        });
        let forget = |me: &Pod| {
            me.update(|s| s.volumes.retain(|o| o.id != v.id));
            me.asked_at.lock().expect("asked_at").remove(&v.target);
        };
        if let Err(e) = claim(
            &self.discovery,
            &self.store,
            &self.id,
            v,
            &self.cfg.runtime_cli,
        ) {
            forget(self);
            return Err(e.into());
        }
        let plug_t0 = Instant::now();
        let ports = GuestPorts {
            qmp: &vm.qmp,
            agent: &vm.agent,
            mount_timeout: self.cfg.runtime.boot_timeout,
            file_device_roots: &self.cfg.runtime.file_device_roots,
            records: Some(&self.discovery),
        };
        match plug::plug(&self.attachments, &ports, v).await {
            Ok(Some(io)) => {
                self.update(|s| {
                    s.block_io.insert(v.target.clone(), io);
                });
            }
            Ok(None) => {}
            Err(e) => {
                release_all(&self.discovery, &self.id, std::slice::from_ref(v));
                forget(self);
                return Err(RuntimeError::from(e).into());
            }
        }
        self.note_handover_latency(&v.target, plug_t0);
        Ok(())
    }

    /// A handed-over volume is mounted in the guest: its event gets the
    /// request-to-mounted and hot-plug-and-mount times.
    fn note_handover_latency(&self, target: &str, plug_t0: Instant) {
        let asked = self.asked_at.lock().expect("asked_at").remove(target);
        if let Some(t0) = asked {
            self.update(handover::mounted(target, t0, plug_t0));
        }
    }

    /// Makes the guest's memory cover the pod's: the overhead plus the
    /// larger of the pod's own limit and its containers' limits (the
    /// balloon deflated, then DIMMs added: [`crust_sandbox::resize::grow`]).
    /// Never shrinks.
    pub async fn reserve_memory(
        &self,
        vm: &PodVm,
        cid: &str,
        limit: Option<u64>,
        pod_limit: Option<u64>,
    ) -> Result<(), PodError> {
        let mut s = self.sizing.lock().await;
        if let Some(l) = limit {
            s.memory.insert(cid.to_string(), l);
        }
        if let Some(p) = pod_limit {
            s.pod_limit = s.pod_limit.max(p);
        }
        let needed = s.needed_mib(&s.memory, self.cfg.overhead_mib);
        if needed <= s.held_mib {
            return Ok(());
        }
        let step = crust_sandbox::resize::grow_step(&s, needed, self.cfg.max_memory_mib).map_err(
            |why| PodError::NoMemory {
                pod: self.id.clone(),
                why,
            },
        )?;
        crust_sandbox::resize::grow(vm, &mut s, step).await?;
        tracing::info!("pod {}: guest memory {} MiB", self.id, s.held_mib);
        Ok(())
    }

    /// In-place resize of container `cid` ([`crust_sandbox::resize::apply`]),
    /// one at a time per pod.
    pub async fn resize(&self, vm: &PodVm, cid: &str, new: Limits) -> Result<(), PodError> {
        let mut s = self.sizing.lock().await;
        Ok(crust_sandbox::resize::apply(vm, &mut s, cid, new, self.cfg.bounds(), &self.id).await?)
    }

    /// A container left: its limits no longer count (the VM keeps its size).
    pub async fn forget_limits(&self, cid: &str) {
        let mut s = self.sizing.lock().await;
        s.memory.remove(cid);
        s.cpu.remove(cid);
    }

    /// Hot-plugs the host block device `d` names (by major:minor, as the
    /// OCI spec gives it) once per pod, through the plug routine every
    /// door uses for devices ([`plug::plug_raw`]: exclusive hold, alias
    /// check, kubelet's loop held too); returns its virtio-blk serial.
    async fn plug_device(
        &self,
        vm: &PodVm,
        d: &crust_sandbox::spec::HostDevice,
        kubelet: &volumes::KubeletLoop,
    ) -> Result<String, PodError> {
        let v = raw_volume(d)?;
        let ports = GuestPorts {
            qmp: &vm.qmp,
            agent: &vm.agent,
            mount_timeout: self.cfg.runtime.boot_timeout,
            file_device_roots: &self.cfg.runtime.file_device_roots,
            records: None,
        };
        plug::plug_raw(&self.attachments, &ports, &v, kubelet)
            .await
            .map_err(RuntimeError::from)?;
        Ok(v.serial)
    }

    /// The raw devices of a pod's first container, checked before its VM
    /// boots: one mounted or held on the host refuses the pod then.
    pub fn check_devices(&self, bundle: &Path, plan: &ContainerPlan) -> Result<(), PodError> {
        if plan.devices.is_empty() {
            return Ok(());
        }
        let b = Bundle::load(bundle).map_err(RuntimeError::from)?;
        let discovery = self.discovery.for_bundle(&b).map_err(RuntimeError::from)?;
        let kubelet = kubelet_loop(&discovery, &b);
        for d in &plan.devices {
            plug::check_raw(&raw_volume(d)?, &kubelet).map_err(RuntimeError::from)?;
        }
        Ok(())
    }

    /// Undoes a container's host side (its rootfs and binds in the share).
    pub fn release_container(&self, cid: &str) {
        if let Err(e) = share::remove_container(&self.share_dir(), cid) {
            tracing::warn!("container {cid}: {e}");
        }
    }

    pub async fn volumes(&self) -> Vec<Volume> {
        self.attachments.volumes()
    }

    /// Unmounts the volumes in the guest, powers it off (or kills it),
    /// releases the claims, removes the share and the sandbox record.
    /// Idempotent. Runs to its end in a task of its own: the RPC that asks
    /// for it (Delete, Shutdown) is dropped at containerd's deadline (ttrpc
    /// cancels a handler whose request timed out, and containerd gives a
    /// TaskExit's Delete 10 s), and a teardown cut there would leave the
    /// VM, the record, the share and the shim itself behind.
    pub async fn teardown(self: &Arc<Self>) {
        let pod = Arc::clone(self);
        if let Err(e) = tokio::spawn(async move { pod.teardown_steps().await }).await {
            tracing::error!("teardown of pod {}: {e}", self.id);
        }
    }

    /// [`Self::teardown`]'s steps, each logged with its time, so a
    /// teardown that hangs names the step in the shim's log.
    async fn teardown_steps(&self) {
        let _g = match self.boot.try_lock() {
            Ok(g) => g,
            Err(_) => {
                tracing::info!("teardown of pod {} waits for a boot or teardown", self.id);
                self.boot.lock().await
            }
        };
        let vm = self.vm.write().await.take();
        let vols: Vec<Volume> = self.snapshot().map(|s| s.volumes).unwrap_or_default();
        tracing::info!(
            "teardown of pod {}: {} volume(s), VM {}",
            self.id,
            vols.len(),
            match &vm {
                None => "not booted",
                Some(v) if v.exit.borrow().is_none() => "running",
                Some(_) => "gone",
            }
        );
        // No record: nothing recorded to release.
        let state = self
            .snapshot()
            .unwrap_or_else(|| SandboxState::for_bundle_dir(&self.id, PathBuf::new()));
        let share = self.share_dir();
        lifecycle::teardown(lifecycle::Teardown {
            id: &self.id,
            // Containers are stopped by containerd before the pod (and die
            // with the guest otherwise).
            guest: vm.as_ref().map(|vm| {
                let stop = crust_sandbox::vm::GuestStop {
                    guest: &vm.guest,
                    qmp: &vm.qmp,
                    agent: &vm.agent,
                    timeout: self.cfg.runtime.timeout,
                };
                (stop, vm.exit.borrow().is_none())
            }),
            attachments: &self.attachments,
            discovery: &self.discovery,
            handover: &Handover::new(&self.cfg.runtime),
            state: &state,
            share: Some(&share),
        })
        .await;
        self.update(|s| s.status = Status::Stopped);
        self.stop_api();
        let _ = self.store.remove(&self.id);
        *self.state.lock().expect("state") = None;
        tracing::info!("teardown of pod {} done", self.id);
    }

    /// After QEMU died on its own: the record says so, which makes the
    /// claims stale (another pod may take the volumes; stats answer
    /// "not running"); Delete releases them for good.
    pub async fn vm_died(&self, reason: &str) {
        // No guest can use the devices any more.
        self.attachments.guest_gone();
        self.update(|s| {
            s.status = Status::Stopped;
            s.reason = Some(format!("QEMU exited ({reason})"));
        });
    }
}

/// The host block device node with number `major:minor`.
/// The raw device record of `d`: its host node, read-only when the
/// container may not write it.
fn raw_volume(d: &crust_sandbox::spec::HostDevice) -> Result<Volume, PodError> {
    Ok(Volume::raw_device(
        &host_block_device(d.major, d.minor)?,
        d.readonly,
    ))
}

/// kubelet's keep-busy loop rule for `b`'s pod: kubelet's root is the
/// parent of the pods directory its discovery found.
fn kubelet_loop(discovery: &Discovery, b: &Bundle) -> volumes::KubeletLoop {
    volumes::KubeletLoop {
        kubelet_root: Path::new(discovery.pods_dir())
            .parent()
            .unwrap_or(Path::new("/var/lib/kubelet"))
            .to_path_buf(),
        pod_uid: b.pod_uid.clone(),
    }
}

fn host_block_device(major: i64, minor: i64) -> Result<PathBuf, PodError> {
    let uevent = format!("/sys/dev/block/{major}:{minor}/uevent");
    let name = std::fs::read_to_string(&uevent)
        .ok()
        .and_then(|u| {
            u.lines()
                .find_map(|l| l.strip_prefix("DEVNAME=").map(str::to_owned))
        })
        .ok_or(PodError::NoHostDevice { major, minor })?;
    let path = Path::new("/dev").join(name);
    if !crust_blockdev::is_block_device(&path) {
        return Err(PodError::NotBlockDevice(path));
    }
    Ok(path)
}

/// The container's mounts as the guest takes them: a crust volume's bind
/// names the volume; any other host path is bound into the share (with
/// its read-only kind and propagation) and named there.
fn container_mounts(
    root: BorrowedFd<'_>,
    cid: &str,
    plan: &ContainerPlan,
    vplan: &crust_sandbox::discovery::Plan,
) -> Result<Vec<ContainerMount>, PodError> {
    let mut mounts = Vec::new();
    for (i, m) in plan.mounts.iter().enumerate() {
        match m {
            Planned::Guest(g) => mounts.push(g.clone()),
            Planned::HostBind {
                destination,
                source,
                readonly,
                propagation,
                options,
            } => {
                let ro = *readonly != share::ReadOnly::No;
                if let Some(w) = vplan.mounts.iter().find(|w| &w.destination == destination) {
                    mounts.push(ContainerMount {
                        destination: destination.clone(),
                        source: MountSource::Volume {
                            volume: w.volume.clone(),
                            subpath: (!w.subpath.is_empty()).then(|| w.subpath.clone()),
                        },
                        readonly: ro || w.readonly,
                        options: options.clone(),
                        submounts: Vec::new(),
                    });
                    continue;
                }
                let name = format!("m{i}");
                let submounts = share::bind_into(
                    root,
                    &format!("{cid}/{name}"),
                    source,
                    *readonly,
                    *propagation,
                )
                .map_err(RuntimeError::from)?;
                mounts.push(ContainerMount {
                    destination: destination.clone(),
                    source: MountSource::Share(ShareRef {
                        tag: SHARE_TAG.into(),
                        path: format!("{cid}/{name}"),
                    }),
                    readonly: ro,
                    options: options.clone(),
                    submounts,
                });
            }
        }
    }
    Ok(mounts)
}

/// Mounts the container's rootfs (the snapshotter's mounts, usually one
/// overlay) at `rel` in the share; with no mounts, binds `root_path`.
fn mount_rootfs(
    root: BorrowedFd<'_>,
    rel: &str,
    rootfs: &[containerd_shim_protos::api::Mount],
    root_path: &Path,
) -> Result<(), PodError> {
    if rootfs.is_empty() {
        share::bind_into(
            root,
            rel,
            root_path,
            share::ReadOnly::No,
            share::Propagation::Private,
        )
        .map_err(RuntimeError::from)?;
        return Ok(());
    }
    if rootfs.len() > 1 {
        return Err(PodError::host(
            "rootfs",
            format!("{} rootfs mounts; one is supported", rootfs.len()),
        ));
    }
    let m = &rootfs[0];
    let fs = FsSpec::new(&m.type_, &m.source, &m.options);
    let res = match m.type_.as_str() {
        "bind" | "rbind" => share::bind_into(
            root,
            rel,
            Path::new(&m.source),
            fs.attrs.contains(MountAttrFlags::MOUNT_ATTR_RDONLY).into(),
            share::Propagation::Private,
        )
        .map(drop),
        _ => share::mount_into(root, rel, &fs),
    };
    Ok(res.map_err(RuntimeError::from)?)
}

/// The pod's sandbox record as the hand-over routine reads and saves it.
struct PodLog<'a>(&'a Pod);

impl handover::StateLog for PodLog<'_> {
    fn answered(&self, source: &str) -> bool {
        let g = self.0.state.lock().expect("state");
        g.as_ref()
            .is_some_and(|s| s.events.iter().any(|e| e.target == source))
    }

    fn update(&mut self, f: impl FnOnce(&mut SandboxState)) -> Result<(), RuntimeError> {
        let mut g = self.0.state.lock().expect("state");
        match g.as_mut() {
            Some(st) => {
                f(st);
                Ok(self.0.store.save(st)?)
            }
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// containerd drops a Delete or Shutdown at its deadline (ttrpc then
    /// drops the handler's future): the teardown it started still runs
    /// to its end. Here the caller gives up while the teardown waits for
    /// a boot; once the boot ends, the pod's record is gone all the same.
    #[tokio::test]
    async fn a_teardown_outlives_its_caller_giving_up() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::config::for_tests(dir.path());
        for d in [
            &cfg.runtime.root,
            &cfg.runtime.crust_root,
            &cfg.runtime.kata_root,
        ] {
            std::fs::create_dir_all(d).unwrap();
        }
        let bundle = dir.path().join("bundle");
        std::fs::create_dir_all(&bundle).unwrap();
        let pod = Arc::new(Pod::new("p-deadline", cfg).unwrap());
        pod.create_record(&bundle).unwrap();
        assert!(pod.store().exists("p-deadline"));

        let boot = pod.boot.lock().await;
        let gave_up = tokio::time::timeout(Duration::from_millis(50), pod.teardown()).await;
        assert!(gave_up.is_err(), "the teardown waits for the boot");
        drop(boot);

        let until = Instant::now() + Duration::from_secs(10);
        while pod.store().exists("p-deadline") && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            !pod.store().exists("p-deadline"),
            "the record outlived a teardown whose caller gave up"
        );
        assert!(pod.snapshot().is_none());
    }
}
