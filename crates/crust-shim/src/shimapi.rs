//! The pod's crust shim API (`<runtime root>/<pod>/shim.sock`), the same
//! HTTP surface as crust-runtime's own shim: the `crust-runtime` CLI that a
//! hand-off claim names (`crust stats|resize`, Kata's `direct-volume
//! stats|resize`) reaches containerd pods through it. Lifecycle endpoints
//! belong to containerd here and are refused.

use crust_sandbox::discovery::Volume;
use crust_sandbox::sandbox::SandboxState;
use crust_sandbox::shim::{ApiError, Code, ExecRequest, ExecResponse, LogsResponse, ShimHandler};
use crust_sandbox::stats::{
    FreezeRequest, ResizeRequest, ResizeResponse, ThawRequest, ThawResponse, ThrottleRequest,
    VolumeStats,
};
use crust_sandbox::volumes;

use crate::pod::Pod;

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

/// The pod's volume named by `path`: its target, host device or guest path.
fn volume(pod: &Pod, path: &str) -> ApiResult<Volume> {
    let vols = pod.snapshot().map(|s| s.volumes).unwrap_or_default();
    vols.iter()
        .find(|v| v.target == path)
        .or_else(|| {
            vols.iter()
                .find(|v| v.device == path || volumes::guest_path(v) == path)
        })
        .cloned()
        .ok_or_else(|| {
            ApiError::new(
                Code::NotFound,
                format!("pod {} has no volume {path}", pod.id),
            )
        })
}

/// The pod serves its own shim API: implemented here, at the API edge,
/// so that [`crate::pod`] hands itself to the server without naming this
/// module. Calls name the trait ([`ShimHandler::resize`] is not
/// [`Pod::resize`], which resizes a container).
impl ShimHandler for Pod {
    async fn state(&self) -> ApiResult<SandboxState> {
        self.snapshot()
            .ok_or_else(|| ApiError::new(Code::NotFound, format!("pod {} has no sandbox", self.id)))
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
        let st = ShimHandler::state(self).await?;
        let vm = self.vm().await.ok();
        let mut text = crust_sandbox::metrics::sandbox_metrics(
            &st,
            vm.as_ref().map(|vm| &vm.agent),
            self.attachments.alias_watch(),
            self.cfg.runtime.timeout,
        )
        .await;
        let (netns, links) = (st.network_namespace.clone(), st.network_links.clone());
        let guard = tokio::task::spawn_blocking(move || {
            crust_sandbox::net::guard_metrics(netns.as_deref(), &links)
        })
        .await
        .unwrap_or_default();
        text.push_str(&guard);
        Ok(text)
    }

    async fn stats(&self, path: String) -> ApiResult<VolumeStats> {
        let v = volume(self, &path)?;
        let vm = match self.vm().await {
            Ok(vm) => vm,
            Err(e) => {
                return Ok(VolumeStats::abnormal(format!(
                    "pod {} is not running ({e})",
                    self.id
                )));
            }
        };
        Ok(crust_sandbox::alias_watch::stats(
            self.attachments.alias_watch(),
            &vm.agent,
            &v,
            self.cfg.runtime.timeout,
        )
        .await?)
    }

    async fn resize(&self, req: ResizeRequest) -> ApiResult<ResizeResponse> {
        let v = volume(self, &req.volume_path)?;
        let vm = self
            .vm()
            .await
            .map_err(|e| ApiError::new(Code::Unavailable, e.to_string()))?;
        let capacity_bytes = volumes::resize(
            &vm.qmp,
            &vm.agent,
            &v,
            req.size,
            req.max_bytes,
            self.cfg.runtime.boot_timeout,
        )
        .await?;
        Ok(ResizeResponse { capacity_bytes })
    }

    async fn freeze(&self, req: FreezeRequest) -> ApiResult<()> {
        let v = volume(self, &req.volume_path)?;
        let vm = self
            .vm()
            .await
            .map_err(|e| ApiError::new(Code::Unavailable, e.to_string()))?;
        Ok(volumes::freeze(
            &vm.agent,
            &v,
            std::time::Duration::from_millis(req.max_frozen_ms),
            self.cfg.runtime.timeout,
        )
        .await?)
    }

    async fn thaw(&self, req: ThawRequest) -> ApiResult<ThawResponse> {
        let v = volume(self, &req.volume_path)?;
        let vm = self
            .vm()
            .await
            .map_err(|e| ApiError::new(Code::Unavailable, e.to_string()))?;
        Ok(volumes::thaw(&vm.agent, &v, self.cfg.runtime.timeout).await?)
    }

    async fn throttle(&self, req: ThrottleRequest) -> ApiResult<()> {
        let v = volume(self, &req.volume_path)?;
        let vm = self
            .vm()
            .await
            .map_err(|e| ApiError::new(Code::Unavailable, e.to_string()))?;
        Ok(volumes::throttle_request(&vm.qmp, &v, &req.limits).await?)
    }

    async fn add_volume(&self, _volume_path: String) -> ApiResult<Volume> {
        Err(managed(self))
    }

    async fn exec(&self, req: ExecRequest) -> ApiResult<ExecResponse> {
        let vm = self
            .vm()
            .await
            .map_err(|e| ApiError::new(Code::Unavailable, e.to_string()))?;
        Ok(volumes::exec_in_guest(&vm.agent, req, self.cfg.runtime.timeout).await?)
    }

    async fn logs(&self) -> ApiResult<LogsResponse> {
        Err(managed(self))
    }
}
