//! The pod's crust shim API (`<runtime root>/<pod>/shim.sock`), the same
//! HTTP surface as crust-runtime's own shim: the `crust-runtime` CLI that a
//! hand-off claim names (`crust stats|resize`, Kata's `direct-volume
//! stats|resize`) reaches containerd pods through it. Lifecycle endpoints
//! belong to containerd here and are refused.

use crust_sandbox::discovery::Volume;
use crust_sandbox::sandbox::SandboxState;
use crust_sandbox::served::{Reach, Served};
use crust_sandbox::shim::{ApiError, Code, ExecRequest, ExecResponse, LogsResponse, ShimHandler};
use crust_sandbox::stats::{
    FreezeRequest, ResizeRequest, ResizeResponse, ThawRequest, ThawResponse, ThrottleRequest,
    VolumeStats,
};
use crust_sandbox::vm::PodVm;

use crate::pod::{Pod, PodError};
use std::sync::Arc;

type ApiResult<T> = Result<T, ApiError>;

/// Refusal of a lifecycle endpoint: containerd runs the pod.
fn managed(pod: &Pod) -> ApiError {
    ApiError::new(
        Code::FailedPrecondition,
        format!(
            "pod {} is run by containerd: use the container manager for its lifecycle",
            pod.id
        ),
    )
}

/// The pod's sandbox record.
fn record(pod: &Pod) -> ApiResult<SandboxState> {
    pod.snapshot()
        .ok_or_else(|| ApiError::new(Code::NotFound, format!("pod {} has no sandbox", pod.id)))
}

/// The pod as its shim API serves it: `vm` is [`Pod::vm`]'s answer.
fn served<'a>(pod: &'a Pod, vm: &'a Result<Arc<PodVm>, PodError>) -> ApiResult<Served<'a>> {
    let state = record(pod)?;
    let reach = match vm {
        Ok(vm) => Reach::Live {
            qmp: &vm.qmp,
            agent: &vm.agent,
        },
        Err(PodError::VmGone(r)) => Reach::Down(r.clone()),
        Err(e) => Reach::Down(e.to_string()),
    };
    Ok(Served {
        state,
        reach,
        attachments: &pod.attachments,
        locks: &pod.volume_locks,
        timeout: pod.cfg.runtime.timeout,
        slow_timeout: pod.cfg.runtime.boot_timeout,
        exec_in: None,
    })
}

/// The pod serves its own shim API: implemented here, at the API edge,
/// so that [`crate::pod`] hands itself to the server without naming this
/// module. Calls name the trait ([`ShimHandler::resize`] is not
/// [`Pod::resize`], which resizes a container).
impl ShimHandler for Pod {
    async fn state(&self) -> ApiResult<SandboxState> {
        record(self)
    }

    async fn start(&self) -> ApiResult<SandboxState> {
        Err(managed(self))
    }

    async fn kill(&self, _signal: i32) -> ApiResult<()> {
        Err(managed(self))
    }

    async fn shutdown(&self) -> ApiResult<()> {
        Err(managed(self))
    }

    async fn metrics(&self) -> ApiResult<String> {
        let vm = self.vm().await;
        Ok(served(self, &vm)?.metrics().await)
    }

    async fn stats(&self, path: String) -> ApiResult<VolumeStats> {
        let vm = self.vm().await;
        served(self, &vm)?.stats(&path).await
    }

    async fn resize(&self, req: ResizeRequest) -> ApiResult<ResizeResponse> {
        let vm = self.vm().await;
        served(self, &vm)?.resize(req).await
    }

    async fn freeze(&self, req: FreezeRequest) -> ApiResult<()> {
        let vm = self.vm().await;
        served(self, &vm)?.freeze(req).await
    }

    async fn thaw(&self, req: ThawRequest) -> ApiResult<ThawResponse> {
        let vm = self.vm().await;
        served(self, &vm)?.thaw(req).await
    }

    async fn throttle(&self, req: ThrottleRequest) -> ApiResult<()> {
        let vm = self.vm().await;
        served(self, &vm)?.throttle(req).await
    }

    async fn add_volume(&self, _volume_path: String) -> ApiResult<Volume> {
        Err(managed(self))
    }

    async fn exec(&self, req: ExecRequest) -> ApiResult<ExecResponse> {
        let vm = self.vm().await;
        served(self, &vm)?.exec(req).await
    }

    async fn logs(&self) -> ApiResult<LogsResponse> {
        Err(managed(self))
    }
}
