//! What a sandbox serves on its shim API about its volumes (stats, resize,
//! freeze, thaw, throttle), its metrics and a command in its guest: one
//! implementation for both doors, which say only whether their guest can
//! be reached. Changes to one volume (resize, throttle) are serialised by
//! one lock per volume.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_agent_proto::AgentClient;
use crust_qmp::QmpClient;

use crate::error::RuntimeError;
use crate::plug::Attachments;
use crate::records::{SandboxState, Volume};
use crate::shim::{ApiError, ExecRequest, ExecResponse};
use crate::stats::{
    FreezeRequest, ResizeRequest, ResizeResponse, ThawRequest, ThawResponse, ThrottleRequest,
    VolumeStats,
};
use crate::volumes;

type ApiResult<T> = Result<T, ApiError>;

/// One lock per volume: a resize and a throttle of one volume never run
/// at once.
#[derive(Default)]
pub struct VolumeLocks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl VolumeLocks {
    pub fn of(&self, volume: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.0
            .lock()
            .expect("volume locks")
            .entry(volume.to_string())
            .or_default()
            .clone()
    }
}

/// The sandbox's guest as a call finds it.
pub enum Reach<'a> {
    Live {
        qmp: &'a QmpClient,
        agent: &'a AgentClient,
    },
    /// Why it cannot be reached (QEMU exited, shutting down, not booted).
    Down(String),
}

/// A sandbox as its shim API serves it.
pub struct Served<'a> {
    pub state: SandboxState,
    pub reach: Reach<'a>,
    pub attachments: &'a Attachments,
    pub locks: &'a VolumeLocks,
    /// The bound on one guest request.
    pub timeout: Duration,
    /// The bound on a slow one (a mount, a filesystem grown).
    pub slow_timeout: Duration,
    /// The container whose mount namespace `exec` runs in (the CLI's
    /// workload, once created); none: the guest's.
    pub exec_in: Option<String>,
}

impl<'a> Served<'a> {
    /// The volume `path` names: its target (the volume path), its host
    /// device (what Kata's CLI sends), or its guest mount path.
    pub fn volume(&self, path: &str) -> Result<Volume, RuntimeError> {
        let vols = &self.state.volumes;
        vols.iter()
            .find(|v| v.target == path)
            .or_else(|| {
                vols.iter()
                    .find(|v| v.device == path || volumes::guest_path(v) == path)
            })
            .cloned()
            .ok_or_else(|| RuntimeError::NoVolume {
                sandbox: self.state.id.clone(),
                path: path.to_string(),
            })
    }

    /// The live guest, or the call's refusal.
    fn live(&self) -> Result<(&'a QmpClient, &'a AgentClient), RuntimeError> {
        match self.reach {
            Reach::Live { qmp, agent } => Ok((qmp, agent)),
            Reach::Down(ref reason) => Err(RuntimeError::SandboxDown {
                id: self.state.id.clone(),
                reason: reason.clone(),
            }),
        }
    }

    /// A sandbox that is down reports the volume abnormal, not an error
    /// (kubelet's volume health).
    pub async fn stats(&self, path: &str) -> ApiResult<VolumeStats> {
        let v = self.volume(path)?;
        let agent = match &self.reach {
            Reach::Live { agent, .. } => *agent,
            Reach::Down(reason) => {
                return Ok(VolumeStats::abnormal(format!(
                    "sandbox {} is not running ({reason})",
                    self.state.id
                )));
            }
        };
        Ok(
            crate::alias_watch::stats(self.attachments.alias_watch(), agent, &v, self.timeout)
                .await?,
        )
    }

    pub async fn resize(&self, req: ResizeRequest) -> ApiResult<ResizeResponse> {
        let v = self.volume(&req.volume_path)?;
        let (qmp, agent) = self.live()?;
        let lock = self.locks.of(&v.id);
        let _one = lock.lock().await;
        let capacity_bytes =
            volumes::resize(qmp, agent, &v, req.size, req.max_bytes, self.slow_timeout).await?;
        Ok(ResizeResponse { capacity_bytes })
    }

    pub async fn freeze(&self, req: FreezeRequest) -> ApiResult<()> {
        let v = self.volume(&req.volume_path)?;
        let (_, agent) = self.live()?;
        let max_frozen = Duration::from_millis(req.max_frozen_ms);
        Ok(volumes::freeze(agent, &v, max_frozen, self.timeout).await?)
    }

    pub async fn thaw(&self, req: ThawRequest) -> ApiResult<ThawResponse> {
        let v = self.volume(&req.volume_path)?;
        let (_, agent) = self.live()?;
        Ok(volumes::thaw(agent, &v, self.timeout).await?)
    }

    pub async fn throttle(&self, req: ThrottleRequest) -> ApiResult<()> {
        let v = self.volume(&req.volume_path)?;
        let (qmp, _) = self.live()?;
        let lock = self.locks.of(&v.id);
        let _one = lock.lock().await;
        Ok(volumes::throttle_request(qmp, &v, &req.limits).await?)
    }

    /// A command in the guest (the CLI's `exec`).
    pub async fn exec(&self, req: ExecRequest) -> ApiResult<ExecResponse> {
        let (_, agent) = self.live()?;
        let container = self.exec_in.clone();
        Ok(volumes::exec_in_guest(agent, req, container, self.timeout).await?)
    }

    /// The sandbox's metrics: QEMU, the guest, its volumes, and the pod
    /// network's anti-spoofing guard.
    pub async fn metrics(&self) -> String {
        let agent = self.live().ok().map(|(_, a)| a);
        let mut text = crate::metrics::sandbox_metrics(
            &self.state,
            agent,
            self.attachments.alias_watch(),
            self.timeout,
        )
        .await;
        let (netns, links) = (
            self.state.network_namespace.clone(),
            self.state.network_links.clone(),
        );
        let guard = tokio::task::spawn_blocking(move || {
            crate::net::guard_metrics(netns.as_deref(), &links)
        })
        .await
        .unwrap_or_default();
        text.push_str(&guard);
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::LayoutKind;
    use crate::shim::Code;
    use crust_handoff::MountInfo;

    fn served<'a>(att: &'a Attachments, locks: &'a VolumeLocks, reach: Reach<'a>) -> Served<'a> {
        let mut state = SandboxState::for_bundle_dir("sb", "/b".into());
        state.volumes = vec![Volume::from_record(
            LayoutKind::Crust,
            "/pods/u/volumes/pvc",
            &MountInfo::block("/dev/loop7", "ext4"),
            false,
        )];
        Served {
            state,
            reach,
            attachments: att,
            locks,
            timeout: Duration::from_secs(1),
            slow_timeout: Duration::from_secs(1),
            exec_in: None,
        }
    }

    #[test]
    fn a_volume_is_named_by_its_target_its_device_or_its_guest_path() {
        let (att, locks) = (Attachments::default(), VolumeLocks::default());
        let s = served(&att, &locks, Reach::Down("QEMU exited".into()));
        let v = s.volume("/pods/u/volumes/pvc").unwrap();
        assert_eq!(s.volume("/dev/loop7").unwrap().id, v.id);
        assert_eq!(s.volume(&volumes::guest_path(&v)).unwrap().id, v.id);
        let e = ApiError::from(s.volume("/pods/u/volumes/other").unwrap_err());
        assert_eq!(e.code, Code::NotFound);
        assert_eq!(e.message, "sandbox sb has no volume /pods/u/volumes/other");
    }

    #[tokio::test]
    async fn a_sandbox_that_is_down_reports_its_volumes_abnormal_and_refuses_changes() {
        let (att, locks) = (Attachments::default(), VolumeLocks::default());
        let s = served(&att, &locks, Reach::Down("QEMU exited".into()));
        let st = s.stats("/pods/u/volumes/pvc").await.unwrap();
        assert!(st.volume_condition.abnormal);
        assert_eq!(
            st.volume_condition.message,
            "sandbox sb is not running (QEMU exited)"
        );
        let resize = ResizeRequest {
            volume_path: "/pods/u/volumes/pvc".into(),
            size: 1,
            max_bytes: None,
        };
        let e = s.resize(resize.clone()).await.unwrap_err();
        assert_eq!(e.code, Code::Unavailable, "{e:?}");
        assert!(e.message.contains("not running (QEMU exited)"), "{e:?}");
        // An unknown volume is NOT_FOUND before the sandbox's state counts.
        let e = s
            .resize(ResizeRequest {
                volume_path: "/nope".into(),
                ..resize
            })
            .await
            .unwrap_err();
        assert_eq!(e.code, Code::NotFound, "{e:?}");
        let e = s
            .exec(ExecRequest {
                args: vec!["true".into()],
                env: Vec::new(),
                timeout_ms: None,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code, Code::Unavailable, "{e:?}");
    }

    #[test]
    fn one_lock_per_volume() {
        let locks = VolumeLocks::default();
        assert!(Arc::ptr_eq(&locks.of("a"), &locks.of("a")));
        assert!(!Arc::ptr_eq(&locks.of("a"), &locks.of("b")));
    }
}
