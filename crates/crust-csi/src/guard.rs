//! Per-volume operation guard: at most one mutating operation per volume
//! at a time. A second one is refused at once (ABORTED, as the CSI spec
//! asks) instead of queueing behind slow work; operations on different
//! volumes never wait for each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, thiserror::Error)]
#[error("operation {running} already in progress for volume {volume}")]
pub struct Busy {
    pub volume: String,
    pub running: &'static str,
}

/// The set of volumes with an operation in flight.
#[derive(Debug, Default, Clone)]
pub struct OpGuards {
    inflight: Arc<Mutex<HashMap<String, &'static str>>>,
}

/// Held for the duration of one operation; releases the volume on drop.
#[derive(Debug)]
pub struct OpGuard {
    inflight: Arc<Mutex<HashMap<String, &'static str>>>,
    volume: String,
}

impl OpGuards {
    /// Claims `volume` for `op`, or reports which operation holds it.
    pub fn try_begin(&self, volume: &str, op: &'static str) -> Result<OpGuard, Busy> {
        let mut map = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(running) = map.get(volume) {
            return Err(Busy {
                volume: volume.to_string(),
                running,
            });
        }
        map.insert(volume.to_string(), op);
        Ok(OpGuard {
            inflight: self.inflight.clone(),
            volume: volume.to_string(),
        })
    }

    /// Number of operations in flight (for tests and logs).
    pub fn len(&self) -> usize {
        self.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        self.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.volume);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_operation_on_same_volume_is_refused_until_the_first_ends() {
        let g = OpGuards::default();
        let a = g.try_begin("vol-a", "NodeStageVolume").unwrap();
        let err = g.try_begin("vol-a", "NodePublishVolume").unwrap_err();
        assert_eq!(err.running, "NodeStageVolume");
        assert_eq!(
            err.to_string(),
            "operation NodeStageVolume already in progress for volume vol-a"
        );
        // another volume is independent
        let b = g.try_begin("vol-b", "CreateVolume").unwrap();
        assert_eq!(g.len(), 2);
        drop(a);
        let _a2 = g.try_begin("vol-a", "NodePublishVolume").unwrap();
        drop(b);
        assert_eq!(g.len(), 1);
    }
}
