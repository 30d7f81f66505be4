//! Growing and shrinking a running VM: vCPU hot-plug by the slots
//! `query-hotpluggable-cpus` lists (their driver and socket/core/thread
//! properties depend on the accelerator and `-smp`, so they are read, not
//! built), and the virtio-balloon target.

use serde_json::{Value, json};

use crate::{QmpClient, QmpError};

/// Id given to the vCPU hot-plugged into slot `i` of the listing.
fn vcpu_id(i: usize) -> String {
    format!("crust-vcpu{i}")
}

impl QmpClient {
    /// vCPUs present now (plugged slots).
    pub async fn plugged_vcpus(&self) -> Result<u32, QmpError> {
        let slots = self.execute("query-hotpluggable-cpus", Value::Null).await?;
        Ok(slots.as_array().map_or(0, |a| {
            a.iter().filter(|s| s.get("qom-path").is_some()).count()
        }) as u32)
    }

    /// Plugs vCPUs into free slots until `want` are present (never
    /// unplugs); returns how many are present. Asking for more than the
    /// VM's `maxcpus` is an `InvalidArgument` before anything is plugged.
    pub async fn plug_vcpus(&self, want: u32) -> Result<u32, QmpError> {
        let slots = self.execute("query-hotpluggable-cpus", Value::Null).await?;
        let slots = slots.as_array().cloned().unwrap_or_default();
        if want as usize > slots.len() {
            return Err(QmpError::InvalidArgument(format!(
                "{want} vCPUs asked; the VM has {} slots (maxcpus)",
                slots.len()
            )));
        }
        let mut present = slots.iter().filter(|s| s.get("qom-path").is_some()).count();
        // QEMU lists slots highest first: plug the lowest free ones.
        for (i, s) in slots.iter().enumerate().rev() {
            if present >= want as usize {
                break;
            }
            if s.get("qom-path").is_some() {
                continue;
            }
            let driver = s.get("type").and_then(Value::as_str).ok_or_else(|| {
                QmpError::Protocol(format!("hot-pluggable CPU slot without a type: {s}"))
            })?;
            let mut args = json!({"driver": driver, "id": vcpu_id(i)});
            if let Some(props) = s.get("props").and_then(Value::as_object) {
                for (k, v) in props {
                    // node-id is only set with -numa cpu bindings.
                    if k != "node-id" {
                        args[k] = v.clone();
                    }
                }
            }
            self.execute("device_add", args).await?;
            present += 1;
        }
        Ok(present as u32)
    }

    /// Sets the balloon's target: the memory the guest should keep.
    pub async fn balloon_target(&self, bytes: u64) -> Result<(), QmpError> {
        self.execute("balloon", json!({ "value": bytes }))
            .await
            .map(drop)
    }

    /// The memory the guest holds now (its RAM less the balloon).
    pub async fn balloon_actual(&self) -> Result<u64, QmpError> {
        let v = self.execute("query-balloon", Value::Null).await?;
        v.get("actual")
            .and_then(Value::as_u64)
            .ok_or_else(|| QmpError::Protocol(format!("query-balloon without actual: {v}")))
    }
}
