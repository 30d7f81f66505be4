//! The task service containerd calls (task API v2, served as v3 too):
//! each RPC is a short pipeline over the pod ([`crate::pod`]), the guest
//! agent and the stdio relays, with events published to containerd.
//!
//! | RPC | what happens |
//! |---|---|
//! | Create | first container boots the pod's VM; rootfs + binds into the share, deferred volumes plugged; agent CreateContainer; `/tasks/create` |
//! | Start | agent StartContainer (or ExecProcess); waiter started; `/tasks/start` / `/tasks/exec-started` |
//! | Exec | process recorded, stdio relay opened; `/tasks/exec-added` |
//! | Kill | agent SignalProcess (`all`: every process of the container) |
//! | Wait | until the waiter saw the exit |
//! | Delete | agent RemoveContainer, share entries undone; the pod's owner also ends the VM; `/tasks/delete` |
//! | State, Pids, Stats, ResizePty, CloseIO, Connect, Shutdown | as named |
//! | Update | new memory/CPU limits in place ([`crust_sandbox::resize`]) |
//! | Pause, Resume, Checkpoint | UNIMPLEMENTED |
//!
//! Every process reports the pid of the pod's QEMU: the host process that
//! runs it (guest pids mean nothing on the host; Pids lists them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim::asynchronous::publisher::RemotePublisher;
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::well_known_types::wrappers::StringValue;
use containerd_shim::protos::protobuf::{Message, MessageDyn, MessageField};
use containerd_shim::protos::shim_async::Task;
use containerd_shim::protos::ttrpc;
use containerd_shim::protos::ttrpc::r#async::TtrpcContext;
use containerd_shim_protos::api;
use containerd_shim_protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat,
};
use containerd_shim_protos::events::task::{
    TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskOOM, TaskStart,
};
use containerd_shim_protos::topics;
use crust_agent_proto::{
    ClientError, ContainerPids, ContainerStats, ExecProcess, ProcessRef, RemoveContainer,
    ResizePty, SignalProcess, StartContainer, WaitProcess,
};

use crate::io::{self, StdioPaths};
use crate::pod::Pod;
use crust_sandbox::cgroup::Placement;
use crust_sandbox::spec;
use crust_sandbox::vm::PodVm;

mod create;
mod procs;
mod status;

use procs::{Ctr, Exit, Proc, State};
use status::{agent_err, spec_err, status, timestamp};

type TtResult<T> = ttrpc::Result<T>;

/// containerd event topic of a declined handover (the volume stays on the
/// host and is shared over virtio-fs): `ctr events` shows it.
pub const FALLBACK_TOPIC: &str = "/crust/volume/fallback";

/// containerd event topic of an AppArmor profile or SELinux label the
/// guest does not enforce (once per pod and setting): `ctr events` shows it.
pub const LSM_TOPIC: &str = "/crust/lsm/not-enforced";

/// How long the output of an exited process gets to drain.
const DRAIN: Duration = Duration::from_secs(3);

/// The task service of one shim (one pod).
pub struct Service {
    pub pod: Arc<Pod>,
    namespace: String,
    publisher: Arc<RemotePublisher>,
    containers: Mutex<HashMap<String, Arc<Ctr>>>,
    exit: Arc<ExitSignal>,
    cgroup: Mutex<Option<Placement>>,
    /// AppArmor/SELinux settings already logged for this pod.
    lsm_logged: Mutex<std::collections::HashSet<spec::LsmSetting>>,
}

impl Service {
    pub fn new(
        pod: Arc<Pod>,
        namespace: String,
        publisher: Arc<RemotePublisher>,
        exit: Arc<ExitSignal>,
        born_in: Option<Placement>,
    ) -> Service {
        Service {
            pod,
            namespace,
            publisher,
            containers: Mutex::new(HashMap::new()),
            exit,
            cgroup: Mutex::new(born_in),
            lsm_logged: Mutex::new(Default::default()),
        }
    }

    async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        if let Err(e) = self
            .publisher
            .publish(
                ttrpc::context::Context::default(),
                topic,
                &self.namespace,
                event,
            )
            .await
        {
            tracing::warn!("publishing {topic}: {e}");
        }
    }

    /// A JSON body as a `google.protobuf.StringValue` event on `topic`.
    async fn publish_json(&self, topic: &str, body: String) {
        let msg = StringValue {
            value: body,
            ..Default::default()
        };
        self.publish(topic, Box::new(msg)).await;
    }

    /// Each declined handover (an `auto` volume left on the host and
    /// shared over virtio-fs) as a containerd event on
    /// [`FALLBACK_TOPIC`]: a JSON `google.protobuf.StringValue` naming the
    /// container, the volume's target, its destination and why.
    async fn publish_fallbacks(&self, container: &str) {
        for ev in self.pod.take_fallbacks() {
            let body = serde_json::json!({
                "container_id": container,
                "target": ev.target,
                "destination": ev.destination,
                "reason": ev.message,
            });
            let msg = StringValue {
                value: body.to_string(),
                ..Default::default()
            };
            self.publish(FALLBACK_TOPIC, Box::new(msg)).await;
        }
    }

    /// Says once per pod and setting that the guest does not enforce it
    /// (CRI gives every container of a pod the same profile: once), in the
    /// log and as a containerd event on [`LSM_TOPIC`] (a JSON
    /// `google.protobuf.StringValue` naming the container and the setting).
    async fn tell_lsm(&self, container: &str, settings: &[spec::LsmSetting]) {
        let new: Vec<spec::LsmSetting> = {
            let mut told = self.lsm_logged.lock().expect("lsm");
            settings
                .iter()
                .filter(|s| told.insert((*s).clone()))
                .cloned()
                .collect()
        };
        for s in new {
            let reason = "not enforced in the guest (no such module in its kernel; the VM is the boundary; CRUST_SHIM_LSM_POLICY=refuse refuses it)";
            tracing::warn!(
                "pod {}: container {container} asks for {s}; {reason}",
                self.pod.id
            );
            let body = serde_json::json!({
                "container_id": container,
                "setting": s.to_string(),
                "reason": reason,
            });
            let msg = StringValue {
                value: body.to_string(),
                ..Default::default()
            };
            self.publish(LSM_TOPIC, Box::new(msg)).await;
        }
    }

    fn ctr(&self, id: &str) -> TtResult<Arc<Ctr>> {
        self.containers
            .lock()
            .expect("containers")
            .get(id)
            .cloned()
            .ok_or_else(|| status(ttrpc::Code::NOT_FOUND, format!("container {id} not found")))
    }

    fn proc(&self, id: &str, exec_id: &str) -> TtResult<(Arc<Ctr>, Arc<Proc>)> {
        let c = self.ctr(id)?;
        if exec_id.is_empty() {
            let p = c.init.clone();
            return Ok((c, p));
        }
        let p = c
            .execs
            .lock()
            .expect("execs")
            .get(exec_id)
            .cloned()
            .ok_or_else(|| {
                status(
                    ttrpc::Code::NOT_FOUND,
                    format!("exec {exec_id} of container {id} not found"),
                )
            })?;
        Ok((c, p))
    }

    async fn task_pid(&self) -> u32 {
        match self.pod.booted().await {
            Some(vm) => vm.guest.proc_ref().pid as u32,
            None => 0,
        }
    }

    /// The pod's memory in bytes (see [`crate::config::ShimConfig::pod_memory`]):
    /// kubelet's sandbox memory, else the first container's own limit, or
    /// the pod's annotation within the caps; refused before QEMU starts.
    fn pod_memory(
        &self,
        plan: &spec::ContainerPlan,
        placement: Option<&Placement>,
    ) -> TtResult<Option<u64>> {
        let kubelet = plan.pod_memory.or(plan.memory_limit);
        let cgroup_limit = placement.and_then(Placement::parent_memory_limit);
        self.pod
            .cfg
            .pod_memory(kubelet, plan.asked_memory, cgroup_limit)
            .map_err(|e| status(ttrpc::Code::INVALID_ARGUMENT, e.to_string()))
    }

    /// Waits for a started process to exit, lets its output drain,
    /// records the exit and tells containerd.
    fn spawn_waiter(&self, vm: Arc<PodVm>, cid: String, p: Arc<Proc>, pid: u32) {
        let publisher = self.publisher.clone();
        let ns = self.namespace.clone();
        tokio::spawn(async move {
            let r = ProcessRef {
                container: cid.clone(),
                exec_id: (!p.exec_id.is_empty()).then(|| p.exec_id.clone()),
            };
            let (code, oom_kills) = loop {
                if vm.exit.borrow().is_some() {
                    break (137, 0);
                }
                let w = vm
                    .agent
                    .call_with_timeout(
                        WaitProcess {
                            process: r.clone(),
                            timeout_ms: 20_000,
                        },
                        Duration::from_secs(30),
                    )
                    .await;
                match w {
                    Ok(w) => {
                        if let Some(e) = w.exited {
                            break (e.exit_code.clamp(0, 255) as u32, e.oom_kills);
                        }
                    }
                    Err(e) => {
                        tracing::debug!("waiting for {cid}/{}: {e}", p.exec_id);
                        let mut exit = vm.exit.clone();
                        let _ = tokio::time::timeout(
                            Duration::from_secs(1),
                            exit.wait_for(|x| x.is_some()),
                        )
                        .await;
                    }
                }
            };
            if let Some(relay) = p.relay.lock().await.as_mut() {
                relay.drained(DRAIN).await;
            }
            if oom_kills > 0 && p.exec_id.is_empty() {
                // Before the exit, as runc's shim has it: CRI's status
                // reason is then "OOMKilled" from the first look.
                tracing::info!(
                    "container {cid}: {oom_kills} process(es) killed by the guest's OOM killer"
                );
                let ev = TaskOOM {
                    container_id: cid.clone(),
                    ..Default::default()
                };
                if let Err(e) = publisher
                    .publish(
                        ttrpc::context::Context::default(),
                        topics::TASK_OOM_EVENT_TOPIC,
                        &ns,
                        Box::new(ev),
                    )
                    .await
                {
                    tracing::warn!("publishing the OOM kill in {cid}: {e}");
                }
            }
            let at = SystemTime::now();
            *p.state.lock().expect("state") = State::Stopped;
            p.exit.send_replace(Some(Exit { code, at }));
            let ev = TaskExit {
                container_id: cid.clone(),
                id: if p.exec_id.is_empty() {
                    cid.clone()
                } else {
                    p.exec_id.clone()
                },
                pid,
                exit_status: code,
                exited_at: MessageField::some(timestamp(at)),
                ..Default::default()
            };
            if let Err(e) = publisher
                .publish(
                    ttrpc::context::Context::default(),
                    topics::TASK_EXIT_EVENT_TOPIC,
                    &ns,
                    Box::new(ev),
                )
                .await
            {
                tracing::warn!("publishing the exit of {cid}: {e}");
            }
        });
    }

    /// The pod's teardown, then its cgroup (empty once QEMU is gone), in
    /// a task of their own that outlives this RPC if containerd's deadline
    /// drops it (see [`Pod::teardown`]).
    async fn end_pod(&self) {
        let pod = self.pod.clone();
        let cgroup = self.cgroup.lock().expect("cgroup").take();
        let end = tokio::spawn(async move {
            pod.teardown().await;
            if let Some(cg) = cgroup {
                cg.leave_self();
                cg.remove();
            }
        });
        if let Err(e) = end.await {
            tracing::error!("ending pod {}: {e}", self.pod.id);
        }
    }

    /// When the VM dies on its own, what it held is released at once.
    fn spawn_vm_watch(&self, vm: Arc<PodVm>) {
        let pod = self.pod.clone();
        tokio::spawn(async move {
            let mut rx = vm.exit.clone();
            let Ok(reason) = rx.wait_for(|r| r.is_some()).await.map(|r| r.clone()) else {
                return;
            };
            let reason = reason.unwrap_or_default();
            if pod.booted().await.is_some() {
                tracing::error!("the pod's VM exited: {reason}");
                pod.vm_died(&reason).await;
            }
        });
    }

    async fn start_task(&self, req: api::StartRequest) -> TtResult<api::StartResponse> {
        let (c, p) = self.proc(&req.id, &req.exec_id)?;
        let vm = self.pod.vm().await?;
        let pid = vm.guest.proc_ref().pid as u32;
        if p.state() != State::Created {
            return Err(status(
                ttrpc::Code::FAILED_PRECONDITION,
                format!("{} {} was already started", req.id, req.exec_id),
            ));
        }
        let started = if req.exec_id.is_empty() {
            vm.agent
                .call_with_timeout(
                    StartContainer { id: req.id.clone() },
                    self.pod.cfg.runtime.boot_timeout,
                )
                .await
                .map(drop)
                .map_err(agent_err("starting the container"))
        } else {
            let mut process = p.spec.clone().expect("exec has a spec");
            process.terminal = p.paths.terminal;
            process.stdio = p.paths.spec(p.stream);
            vm.agent
                .call_with_timeout(
                    ExecProcess {
                        container: c.id.clone(),
                        exec_id: req.exec_id.clone(),
                        process,
                    },
                    self.pod.cfg.runtime.boot_timeout,
                )
                .await
                .map(drop)
                .map_err(agent_err("starting the exec"))
        };
        if let Err(e) = started {
            // It never ran: its FIFOs close and Wait answers, so nobody
            // hangs on a process that does not exist.
            if let Some(r) = p.relay.lock().await.as_mut() {
                r.abort();
            }
            *p.state.lock().expect("state") = State::Stopped;
            p.exit.send_replace(Some(Exit {
                code: 255,
                at: SystemTime::now(),
            }));
            return Err(e);
        }
        *p.state.lock().expect("state") = State::Running;
        self.spawn_waiter(vm, c.id.clone(), p.clone(), pid);
        if req.exec_id.is_empty() {
            let ev = TaskStart {
                container_id: req.id.clone(),
                pid,
                ..Default::default()
            };
            self.publish(topics::TASK_START_EVENT_TOPIC, Box::new(ev))
                .await;
        } else {
            let ev = TaskExecStarted {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                pid,
                ..Default::default()
            };
            self.publish(topics::TASK_EXEC_STARTED_EVENT_TOPIC, Box::new(ev))
                .await;
        }
        Ok(api::StartResponse {
            pid,
            ..Default::default()
        })
    }

    async fn delete_task(&self, req: api::DeleteRequest) -> TtResult<api::DeleteResponse> {
        let (c, p) = self.proc(&req.id, &req.exec_id)?;
        let pid = self.task_pid().await;
        if p.state() == State::Running {
            return Err(status(
                ttrpc::Code::FAILED_PRECONDITION,
                format!("{} {} is still running; kill it first", req.id, req.exec_id),
            ));
        }
        let exit = p.exited().unwrap_or(Exit {
            code: 0,
            at: SystemTime::now(),
        });
        let resp = api::DeleteResponse {
            pid,
            exit_status: exit.code,
            exited_at: MessageField::some(timestamp(exit.at)),
            ..Default::default()
        };
        if !req.exec_id.is_empty() {
            c.execs.lock().expect("execs").remove(&req.exec_id);
            return Ok(resp);
        }
        if let Ok(vm) = self.pod.vm().await
            && let Err(e) = vm
                .agent
                .call_with_timeout(
                    RemoveContainer { id: req.id.clone() },
                    self.pod.cfg.runtime.boot_timeout,
                )
                .await
        {
            tracing::warn!("removing container {} in the guest: {e}", req.id);
        }
        self.pod.release_container(&req.id);
        self.pod.forget_limits(&req.id).await;
        self.containers.lock().expect("containers").remove(&req.id);
        if c.owner {
            self.end_pod().await;
        }
        let ev = TaskDelete {
            container_id: req.id.clone(),
            id: req.id.clone(),
            pid,
            exit_status: exit.code,
            exited_at: MessageField::some(timestamp(exit.at)),
            ..Default::default()
        };
        self.publish(topics::TASK_DELETE_EVENT_TOPIC, Box::new(ev))
            .await;
        Ok(resp)
    }

    async fn exec_task(&self, req: api::ExecProcessRequest) -> TtResult<()> {
        let c = self.ctr(&req.id)?;
        if c.execs.lock().expect("execs").contains_key(&req.exec_id) {
            return Err(status(
                ttrpc::Code::ALREADY_EXISTS,
                format!("exec {} exists", req.exec_id),
            ));
        }
        if c.init.state() != State::Running {
            return Err(status(
                ttrpc::Code::FAILED_PRECONDITION,
                format!("container {} is not running", req.id),
            ));
        }
        let any = req
            .spec
            .as_ref()
            .ok_or_else(|| status(ttrpc::Code::INVALID_ARGUMENT, "exec without a process spec"))?;
        let process: oci_spec::runtime::Process =
            serde_json::from_slice(&any.value).map_err(|e| {
                status(
                    ttrpc::Code::INVALID_ARGUMENT,
                    format!("exec process spec: {e}"),
                )
            })?;
        let spec = spec::process_spec(&process);
        if spec.args.is_empty() {
            return Err(status(
                ttrpc::Code::INVALID_ARGUMENT,
                "exec with empty args",
            ));
        }
        let vm = self.pod.vm().await?;
        let paths = StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let stream = self.pod.stream();
        let relay = io::start(&vm.stdio, stream, &paths)
            .map_err(|e| status(ttrpc::Code::INVALID_ARGUMENT, e.to_string()))?;
        let p = Proc::new(&req.exec_id, stream, paths, Some(spec), relay);
        c.execs
            .lock()
            .expect("execs")
            .insert(req.exec_id.clone(), p);
        let ev = TaskExecAdded {
            container_id: req.id.clone(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        };
        self.publish(topics::TASK_EXEC_ADDED_EVENT_TOPIC, Box::new(ev))
            .await;
        Ok(())
    }

    async fn kill_task(&self, req: api::KillRequest) -> TtResult<()> {
        let (_, p) = self.proc(&req.id, &req.exec_id)?;
        if p.state() == State::Stopped {
            return Err(status(ttrpc::Code::NOT_FOUND, "process already finished"));
        }
        let vm = self.pod.vm().await?;
        if vm.exit.borrow().is_some() {
            return Err(dead_vm_kill(&vm, &p).await);
        }
        let signalled = vm
            .agent
            .call(SignalProcess {
                process: ProcessRef {
                    container: req.id.clone(),
                    exec_id: (!req.exec_id.is_empty()).then(|| req.exec_id.clone()),
                },
                signal: req.signal as i32,
                all: req.all,
            })
            .await;
        match signalled {
            Ok(_) => Ok(()),
            // The VM may be dying under the call (the agent's socket gone):
            // its watch says so within a few polls. An answer of the agent
            // is not that.
            Err(e) => {
                let transport = matches!(
                    e,
                    ClientError::Connect { .. }
                        | ClientError::Disconnected
                        | ClientError::Timeout { .. }
                );
                let mut exit = vm.exit.clone();
                let died = transport
                    && matches!(
                        tokio::time::timeout(VM_EXIT_NOTICE, exit.wait_for(|x| x.is_some())).await,
                        Ok(Ok(_))
                    );
                if died {
                    Err(dead_vm_kill(&vm, &p).await)
                } else {
                    Err(agent_err("signalling")(e))
                }
            }
        }
    }

    async fn state_task(&self, req: api::StateRequest) -> TtResult<api::StateResponse> {
        let (c, p) = self.proc(&req.id, &req.exec_id)?;
        let st = match p.state() {
            State::Created => api::Status::CREATED,
            State::Running => api::Status::RUNNING,
            State::Stopped => api::Status::STOPPED,
        };
        let exit = p.exited();
        Ok(api::StateResponse {
            id: req.id.clone(),
            bundle: c.bundle.to_string_lossy().into_owned(),
            pid: self.task_pid().await,
            status: st.into(),
            stdin: p.paths.stdin.clone(),
            stdout: p.paths.stdout.clone(),
            stderr: p.paths.stderr.clone(),
            terminal: p.paths.terminal,
            exit_status: exit.map(|e| e.code).unwrap_or(0),
            exited_at: match exit {
                Some(e) => MessageField::some(timestamp(e.at)),
                None => MessageField::none(),
            },
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }
}

/// Forwarding from the generated trait to the pipelines above.
#[async_trait]
impl Task for Service {
    async fn create(
        &self,
        _: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtResult<api::CreateTaskResponse> {
        tracing::info!("Create {} (bundle {})", req.id, req.bundle);
        let r = self.create_task(req).await;
        if let Err(e) = &r {
            tracing::error!("Create: {e:?}");
        }
        r
    }

    async fn start(
        &self,
        _: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtResult<api::StartResponse> {
        tracing::info!("Start {} {}", req.id, req.exec_id);
        self.start_task(req).await
    }

    async fn delete(
        &self,
        _: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtResult<api::DeleteResponse> {
        tracing::info!("Delete {} {}", req.id, req.exec_id);
        let r = self.delete_task(req).await;
        if let Err(e) = &r {
            tracing::warn!("Delete: {e:?}");
        }
        r
    }

    async fn state(
        &self,
        _: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtResult<api::StateResponse> {
        self.state_task(req).await
    }

    async fn kill(&self, _: &TtrpcContext, req: api::KillRequest) -> TtResult<api::Empty> {
        tracing::info!(
            "Kill {} {} signal {} all {}",
            req.id,
            req.exec_id,
            req.signal,
            req.all
        );
        self.kill_task(req).await.map(|_| api::Empty::new())
    }

    async fn exec(&self, _: &TtrpcContext, req: api::ExecProcessRequest) -> TtResult<api::Empty> {
        tracing::info!("Exec {} {}", req.id, req.exec_id);
        self.exec_task(req).await.map(|_| api::Empty::new())
    }

    async fn wait(&self, _: &TtrpcContext, req: api::WaitRequest) -> TtResult<api::WaitResponse> {
        let (_, p) = self.proc(&req.id, &req.exec_id)?;
        let mut rx = p.exit.subscribe();
        let e = rx
            .wait_for(|e| e.is_some())
            .await
            .map_err(|_| status(ttrpc::Code::INTERNAL, "process record dropped"))?
            .expect("waited for some");
        Ok(api::WaitResponse {
            exit_status: e.code,
            exited_at: MessageField::some(timestamp(e.at)),
            ..Default::default()
        })
    }

    async fn pids(&self, _: &TtrpcContext, req: api::PidsRequest) -> TtResult<api::PidsResponse> {
        self.ctr(&req.id)?;
        let vm = self.pod.vm().await?;
        let r = vm
            .agent
            .call(ContainerPids { id: req.id.clone() })
            .await
            .map_err(agent_err("listing processes"))?;
        Ok(api::PidsResponse {
            processes: r
                .pids
                .into_iter()
                .map(|pid| api::ProcessInfo {
                    pid,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    }

    async fn stats(
        &self,
        _: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtResult<api::StatsResponse> {
        self.ctr(&req.id)?;
        let vm = self.pod.vm().await?;
        let s = vm
            .agent
            .call(ContainerStats { id: req.id.clone() })
            .await
            .map_err(agent_err("container stats"))?;
        let m = Metrics {
            memory: MessageField::some(MemoryStat {
                usage: MessageField::some(MemoryEntry {
                    usage: s.memory_bytes,
                    limit: s.memory_limit_bytes.unwrap_or(u64::MAX),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            cpu: MessageField::some(CPUStat {
                usage: MessageField::some(CPUUsage {
                    total: s.cpu_usage_ns,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            pids: MessageField::some(PidsStat {
                current: s.pids,
                ..Default::default()
            }),
            ..Default::default()
        };
        let value = m
            .write_to_bytes()
            .map_err(|e| status(ttrpc::Code::INTERNAL, e.to_string()))?;
        Ok(api::StatsResponse {
            stats: MessageField::some(Any {
                type_url: "io.containerd.cgroups.v1.Metrics".into(),
                value,
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    async fn resize_pty(
        &self,
        _: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtResult<api::Empty> {
        self.proc(&req.id, &req.exec_id)?;
        let vm = self.pod.vm().await?;
        vm.agent
            .call(ResizePty {
                process: ProcessRef {
                    container: req.id.clone(),
                    exec_id: (!req.exec_id.is_empty()).then(|| req.exec_id.clone()),
                },
                width: req.width.min(u16::MAX as u32) as u16,
                height: req.height.min(u16::MAX as u32) as u16,
            })
            .await
            .map_err(agent_err("resizing the terminal"))?;
        Ok(api::Empty::new())
    }

    async fn close_io(&self, _: &TtrpcContext, req: api::CloseIORequest) -> TtResult<api::Empty> {
        let (_, p) = self.proc(&req.id, &req.exec_id)?;
        if req.stdin
            && let Some(r) = p.relay.lock().await.as_mut()
        {
            r.close_stdin();
        }
        Ok(api::Empty::new())
    }

    async fn connect(
        &self,
        _: &TtrpcContext,
        _req: api::ConnectRequest,
    ) -> TtResult<api::ConnectResponse> {
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid: self.task_pid().await,
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        })
    }

    async fn shutdown(&self, _: &TtrpcContext, _req: api::ShutdownRequest) -> TtResult<api::Empty> {
        {
            let left = self.containers.lock().expect("containers");
            if !left.is_empty() {
                let ids: Vec<&String> = left.keys().collect();
                tracing::info!("Shutdown: staying for {} container(s): {ids:?}", ids.len());
                return Ok(api::Empty::new());
            }
        }
        tracing::info!("Shutdown: no container left, the shim ends");
        // The shim ends even if containerd stops waiting for this answer
        // (its Shutdown has a 3 s deadline, at which ttrpc drops this
        // handler): the teardown and the exit live in their own task.
        let pod = self.pod.clone();
        let exit = self.exit.clone();
        let (done, torn_down) = tokio::sync::oneshot::channel();
        let cgroup = self.cgroup.lock().expect("cgroup").take();
        tokio::spawn(async move {
            pod.teardown().await;
            // A pod that never booted still leaves the groups the shim
            // was born in.
            if let Some(cg) = cgroup {
                cg.leave_self();
                cg.remove();
            }
            let _ = done.send(());
            // Answer first: the server stops once the exit is signalled.
            tokio::time::sleep(Duration::from_millis(200)).await;
            exit.signal();
        });
        let _ = torn_down.await;
        Ok(api::Empty::new())
    }

    async fn pause(&self, _: &TtrpcContext, _: api::PauseRequest) -> TtResult<api::Empty> {
        Err(status(
            ttrpc::Code::UNIMPLEMENTED,
            "pause is not supported by crust",
        ))
    }

    async fn resume(&self, _: &TtrpcContext, _: api::ResumeRequest) -> TtResult<api::Empty> {
        Err(status(
            ttrpc::Code::UNIMPLEMENTED,
            "resume is not supported by crust",
        ))
    }

    async fn checkpoint(
        &self,
        _: &TtrpcContext,
        _: api::CheckpointTaskRequest,
    ) -> TtResult<api::Empty> {
        Err(status(
            ttrpc::Code::UNIMPLEMENTED,
            "checkpoint is not supported by crust",
        ))
    }

    /// In-place resize ([`crust_sandbox::resize`]): the container's cgroup in the
    /// guest, the VM's memory and vCPUs; all or nothing.
    async fn update(&self, _: &TtrpcContext, req: api::UpdateTaskRequest) -> TtResult<api::Empty> {
        self.ctr(&req.id)?;
        let any = req.resources.as_ref().ok_or_else(|| {
            status(
                ttrpc::Code::INVALID_ARGUMENT,
                format!("update of {}: no resources", req.id),
            )
        })?;
        let limits = spec::update_limits(&any.type_url, &any.value).map_err(spec_err)?;
        let vm = self.pod.vm().await?;
        self.pod.resize(&vm, &req.id, limits).await?;
        Ok(api::Empty::new())
    }
}

/// How long a failed signal waits for the VM's exit watch (QEMU is polled
/// every 100 ms).
const VM_EXIT_NOTICE: Duration = Duration::from_secs(2);
/// How long a kill on a dead VM waits for the process's exit record (its
/// waiter records 137 once its output has drained).
const DEAD_VM_EXIT_WAIT: Duration = Duration::from_secs(10);

/// A kill of a process whose VM is gone: it died with the VM, and its
/// waiter records that (137, as SIGKILL) and tells containerd. Answered as
/// runc answers a kill of a finished process (NOT_FOUND), once the exit is
/// on record, so containerd's forced delete goes on to wait and delete.
async fn dead_vm_kill(vm: &PodVm, p: &Proc) -> ttrpc::Error {
    // A process never started has no waiter: nothing to wait for.
    if p.state() != State::Created {
        let mut rx = p.exit.subscribe();
        let _ = tokio::time::timeout(DEAD_VM_EXIT_WAIT, rx.wait_for(|e| e.is_some())).await;
    }
    let why = vm.exit.borrow().clone().unwrap_or_default();
    status(
        ttrpc::Code::NOT_FOUND,
        format!("process already finished: the pod's VM exited ({why})"),
    )
}
