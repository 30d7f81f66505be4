//! Another device exposing a volume's data while a guest has it (a host
//! tool's second loop device on its pool file): reported by the stats
//! polls of both doors, with the scans bounded ([`ALIAS_RESCAN`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crust_agent_proto::AgentClient;

use crate::records::Volume;
use crate::volumes::{self, VolumeError};

/// Per volume id: when its device was last scanned, and what was found.
#[derive(Default)]
pub struct AliasWatch {
    scans: Mutex<HashMap<String, (std::time::Instant, Option<String>)>>,
}

/// How often a volume in a guest is scanned for another device exposing
/// its data (a host tool's second loop device on its pool file): at most
/// once per this period per volume, on a stats poll (kubelet polls every
/// minute by default); between scans the last verdict stands. A scan
/// costs one `/sys/block` listing and an open and ioctl per loop device
/// on the node (`crust-blockdev`'s `tests/bench.rs` measures it with
/// 1,000 loops), so the bound is one scan per volume per period.
pub const ALIAS_RESCAN: Duration = Duration::from_secs(30);

/// A volume's stats from the guest, for both doors: abnormal, naming the
/// device, when another block device on the host exposes its data while
/// the guest has it ([`ALIAS_RESCAN`] bounds the scans); logged when it
/// starts and when it ends.
pub async fn stats(
    watch: &AliasWatch,
    agent: &AgentClient,
    v: &Volume,
    timeout: Duration,
) -> Result<crate::stats::VolumeStats, VolumeError> {
    let mut s = volumes::stats(agent, v, timeout).await?;
    if let Some(alias) = alias_verdict(watch, v).await {
        s.volume_condition.abnormal = true;
        s.volume_condition.message = if s.volume_condition.message.is_empty() {
            alias
        } else {
            format!("{alias} (the guest says: {})", s.volume_condition.message)
        };
    }
    Ok(s)
}

/// The last alias verdict of `v`'s device, scanned again when older than
/// [`ALIAS_RESCAN`].
async fn alias_verdict(watch: &AliasWatch, v: &Volume) -> Option<String> {
    let now = std::time::Instant::now();
    let last = watch.scans.lock().expect("alias scans").get(&v.id).cloned();
    if let Some((at, verdict)) = &last
        && now.duration_since(*at) < ALIAS_RESCAN
    {
        return verdict.clone();
    }
    let dev = std::path::PathBuf::from(&v.device);
    let found = tokio::task::spawn_blocking(move || {
        match crust_blockdev::ensure_no_aliases(&dev, "leave it to the guest alone") {
            Ok(()) => None,
            Err(crust_blockdev::AliasError::Found { aliases, .. }) => Some(format!(
                "another device on the host exposes this volume's data while the guest has it: {}",
                aliases
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            )),
            // A scan that cannot finish says nothing either way.
            Err(e) => {
                tracing::debug!("alias scan: {e}");
                None
            }
        }
    })
    .await
    .ok()
    .flatten();
    let was = last.and_then(|(_, v)| v);
    match (&was, &found) {
        (None, Some(now)) => tracing::error!(target = %v.target, device = %v.device, "{now}"),
        (Some(_), None) => tracing::info!(target = %v.target, device = %v.device,
            "no other device exposes the volume's data any more"),
        _ => {}
    }
    watch
        .scans
        .lock()
        .expect("alias scans")
        .insert(v.id.clone(), (now, found.clone()));
    found
}
