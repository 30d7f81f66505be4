//! Create: the steps from an OCI bundle to a container created in the
//! guest, and what a failed step undoes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use containerd_shim::protos::protobuf::MessageField;
use containerd_shim::protos::ttrpc;
use containerd_shim_protos::api;
use containerd_shim_protos::events::task::{TaskCreate, TaskIO};
use containerd_shim_protos::topics;
use crust_agent_proto::RemoveContainer;

use super::procs::{Ctr, Proc};
use super::status::{agent_err, spec_err, status};
use super::{Service, TtResult};
use crate::io::{self, StdioPaths};
use crate::pod::PodError;
use crust_sandbox::cgroup::Placement;
use crust_sandbox::error::RuntimeError;
use crust_sandbox::spec::{self, Role};
use crust_sandbox::vm::PodVm;

impl Service {
    pub(super) async fn create_task(
        &self,
        req: api::CreateTaskRequest,
    ) -> TtResult<api::CreateTaskResponse> {
        self.check_new(&req.id)?;
        let bundle = PathBuf::from(&req.bundle);
        let oci = spec::load(&bundle).map_err(spec_err)?;
        let mut plan = spec::plan(&oci, &bundle).map_err(spec_err)?;
        spec::check_lsm(&plan.lsm, self.pod.cfg.lsm_policy).map_err(spec_err)?;
        spec::check_host_namespaces(&plan.ipc, &plan.pid, &self.pod.cfg.host_namespaces)
            .map_err(spec_err)?;
        spec::check_host_network(&plan.network, self.pod.cfg.host_network).map_err(spec_err)?;
        self.tell_lsm(&req.id, &plan.lsm).await;
        let owner = self.owner_of(&req.id, &plan.role)?;
        let paths = StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let vm = if owner {
            self.boot_vm(&bundle, &plan).await?
        } else {
            self.pod.vm().await?
        };
        // Every container's spec carries the pod's annotations: each is
        // held to the caps, not only the one that sized the VM.
        let placement = self.cgroup.lock().expect("cgroup").clone();
        if let Err(e) = self.pod_memory(&plan, placement.as_ref()) {
            return Err(self.fail_create(owner, e).await);
        }
        let pod_limit = plan.asked_memory.or(plan.pod_memory);
        if let Err(e) = self
            .pod
            .reserve_memory(&vm, &req.id, plan.memory_limit, pod_limit)
            .await
        {
            return Err(self.fail_create(owner, e.into()).await);
        }
        let stream = self.pod.stream();
        let relay = match io::start(&vm.stdio, stream, &paths) {
            Ok(r) => r,
            Err(e) => {
                return Err(self
                    .fail_create(owner, status(ttrpc::Code::INVALID_ARGUMENT, e.to_string()))
                    .await);
            }
        };
        let prepared = self
            .pod
            .prepare(&vm, &req.id, &bundle, &plan, &req.rootfs)
            .await;
        self.publish_fallbacks(&req.id).await;
        let mut guest = match prepared {
            Ok(g) => g,
            Err(e) => return Err(self.fail_create(owner, e.into()).await),
        };
        plan.process.terminal = req.terminal;
        guest.process.terminal = req.terminal;
        guest.process.stdio = paths.spec(stream);
        if let Err(e) = vm
            .agent
            .call_with_timeout(guest, self.pod.cfg.runtime.boot_timeout)
            .await
        {
            self.pod.release_container(&req.id);
            return Err(self
                .fail_create(owner, agent_err("creating the container in the guest")(e))
                .await);
        }
        if let Err(e) = self.apply_cpu_limit(&vm, &req.id, plan.cpu_max).await {
            return Err(self.fail_create(owner, e).await);
        }
        let pid = vm.guest.proc_ref().pid as u32;
        let ctr = Arc::new(Ctr {
            id: req.id.clone(),
            bundle,
            owner,
            init: Proc::new("", stream, paths, None, relay),
            execs: Mutex::new(HashMap::new()),
        });
        self.record_created(&req, ctr, pid).await;
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    /// A container id is created once.
    fn check_new(&self, id: &str) -> TtResult<()> {
        if self.containers.lock().expect("containers").contains_key(id) {
            return Err(status(
                ttrpc::Code::ALREADY_EXISTS,
                format!("container {id} exists"),
            ));
        }
        Ok(())
    }

    /// Whether the container is the pod's owner (it boots the VM) or a
    /// member of this shim's pod; any other container is refused.
    fn owner_of(&self, id: &str, role: &Role) -> TtResult<bool> {
        match role {
            Role::PodOwner if id == self.pod.id => Ok(true),
            Role::Member { sandbox_id } if *sandbox_id == self.pod.id => Ok(false),
            _ => Err(status(
                ttrpc::Code::FAILED_PRECONDITION,
                format!("container {id} does not belong to pod {}", self.pod.id),
            )),
        }
    }

    /// The owner's Create: the pod's cgroup placement, then the VM boot
    /// (its vCPUs follow the CPU limit, within the host's cores).
    async fn boot_vm(&self, bundle: &Path, plan: &spec::ContainerPlan) -> TtResult<Arc<PodVm>> {
        let placement = self.placement(plan.cgroups_path.as_deref())?;
        *self.cgroup.lock().expect("cgroup") = placement.clone();
        let memory = match self.pod_memory(plan, placement.as_ref()) {
            Ok(m) => m,
            Err(e) => return Err(self.fail_create(true, e).await),
        };
        // A device the host holds refuses the pod before QEMU starts.
        if let Err(e) = self.pod.check_devices(bundle, plan) {
            return Err(self.fail_create(true, e.into()).await);
        }
        let host = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        let cpus = plan
            .cpus
            .unwrap_or(self.pod.cfg.runtime.cpus)
            .clamp(1, host.max(self.pod.cfg.runtime.cpus));
        let boot = self
            .pod
            .boot(
                bundle,
                self.pod.cfg.guest_memory_mib(memory.unwrap_or(0)),
                cpus,
                placement.as_ref(),
                &plan.network,
                crust_sandbox::net::NetPolicy {
                    rules: self.pod.cfg.runtime.netns_rules,
                    anti_spoofing: plan.anti_spoofing,
                },
            )
            .await;
        let vm = match boot {
            Ok(vm) => vm,
            Err(e) => {
                if let PodError::Runtime(RuntimeError::Network(n)) = &e
                    && let Some(body) = crate::net::rules_event(&self.pod.id, n)
                {
                    self.publish_json(crate::net::NETFILTER_TOPIC, body).await;
                }
                return Err(self.fail_create(true, e.into()).await);
            }
        };
        self.spawn_vm_watch(vm.clone());
        Ok(vm)
    }

    /// The pod's cgroup placement: the one this shim was born in when it
    /// is the spec's, else resolved from the spec.
    fn placement(&self, cgroups_path: Option<&str>) -> TtResult<Option<Placement>> {
        let Some(path) = cgroups_path else {
            return Ok(None);
        };
        let born = self.cgroup.lock().expect("cgroup").take();
        if let Some(cg) = born {
            if cg.source() == path {
                return Ok(Some(cg));
            }
            cg.leave_self();
            cg.remove();
        }
        Placement::resolve(path)
            .map(Some)
            .map_err(|e| status(ttrpc::Code::FAILED_PRECONDITION, e))
    }

    /// Records the created container and tells containerd (`/tasks/create`).
    async fn record_created(&self, req: &api::CreateTaskRequest, ctr: Arc<Ctr>, pid: u32) {
        let paths = ctr.init.paths.clone();
        self.containers
            .lock()
            .expect("containers")
            .insert(req.id.clone(), ctr);
        let ev = TaskCreate {
            container_id: req.id.clone(),
            bundle: req.bundle.clone(),
            rootfs: req.rootfs.clone(),
            io: MessageField::some(TaskIO {
                stdin: paths.stdin,
                stdout: paths.stdout,
                stderr: paths.stderr,
                terminal: paths.terminal,
                ..Default::default()
            }),
            pid,
            ..Default::default()
        };
        self.publish(topics::TASK_CREATE_EVENT_TOPIC, Box::new(ev))
            .await;
    }

    /// A new container's CFS limit, through the resize path (vCPUs
    /// hot-plugged when the pod's quotas need them); on failure the
    /// container is removed from the guest again.
    pub(super) async fn apply_cpu_limit(
        &self,
        vm: &PodVm,
        cid: &str,
        cpu: Option<crust_agent_proto::CpuMax>,
    ) -> TtResult<()> {
        if cpu.is_none() {
            return Ok(());
        }
        let limits = crust_sandbox::spec::Limits { memory: None, cpu };
        if let Err(e) = self.pod.resize(vm, cid, limits).await {
            let _ = vm.agent.call(RemoveContainer { id: cid.into() }).await;
            self.pod.release_container(cid);
            self.pod.forget_limits(cid).await;
            return Err(e.into());
        }
        Ok(())
    }

    /// A failed Create of the pod's owner ends the VM it booted.
    pub(super) async fn fail_create(&self, owner: bool, e: ttrpc::Error) -> ttrpc::Error {
        if owner {
            self.end_pod().await;
        }
        e
    }
}
