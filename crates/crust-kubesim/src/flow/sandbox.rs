//! The container manager's side: the pod's OCI bundle and the VM
//! runtime's create, start, kill and delete.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::config::{FlowConfig, MOUNT_DESTINATION};
use super::host::pid_is_qemu;
use super::report::FlowError;
use super::{Flow, Undo, guarded};

impl Flow {
    /// The pod's OCI bundle, with the volume's target as a mount source.
    pub(super) fn bundle(&mut self, source: &str) -> Result<PathBuf, FlowError> {
        let t0 = Instant::now();
        let bundle = self.cfg.bundle_dir();
        let r = self.write_bundle(&bundle, source);
        let r = r.map(|()| {
            format!(
                "{}: {} with {} <- {}",
                bundle.join("config.json").display(),
                self.cfg
                    .workload
                    .args
                    .first()
                    .map(String::as_str)
                    .unwrap_or("?"),
                MOUNT_DESTINATION,
                source
            )
        });
        self.record("OCI bundle", t0, r)?;
        Ok(bundle)
    }

    /// Runtime create (the guest boots and mounts the volume) and start.
    pub(super) async fn start_sandbox(&mut self, bundle: &Path) -> Result<(), FlowError> {
        let stop = self.stop.clone();
        let rt = self.cfg.runtime.clone();
        let id = self.cfg.sandbox_id.clone();
        let pods = self.cfg.pods_dir().display().to_string();
        let bundle_s = bundle.display().to_string();
        self.undo.push(Undo::Sandbox(id.clone()));
        self.sandbox_up = true;
        let t0 = Instant::now();
        let r = guarded(&stop, async {
            rt.ok(&[
                "--pods-layer-stop",
                &pods,
                "create",
                "--bundle",
                &bundle_s,
                &id,
            ])
            .await
            .map_err(|e| e.to_string())?;
            rt.json(&["state", &id]).await.map_err(|e| e.to_string())
        })
        .await;
        let st = match r {
            Ok(st) => st,
            Err(e) => return self.record("runtime create", t0, Err(e)),
        };
        self.report.qemu_pid = st["qemu"]["pid"].as_i64().map(|p| p as i32);
        self.report.accel = st["accel"]["accel"].as_str().map(str::to_string);
        self.report.accel_reason = st["accel"]["reason"].as_str().map(str::to_string);
        let vol_entry = st["volumes"]
            .as_array()
            .and_then(|vs| vs.iter().find(|v| v["target"] == self.target.as_str()))
            .cloned();
        let r = match vol_entry {
            Some(v) => {
                let gp = format!(
                    "/run/crust/volumes/{}",
                    v["id"].as_str().unwrap_or_default()
                );
                self.report.guest_volume_path = Some(gp.clone());
                Ok(format!(
                    "sandbox {id}: QEMU pid {} ({}), {} ({} {}) mounted at {gp} in the guest",
                    self.report
                        .qemu_pid
                        .map(|p| p.to_string())
                        .unwrap_or_else(|| "?".into()),
                    self.report.accel.as_deref().unwrap_or("?"),
                    v["device"].as_str().unwrap_or("?"),
                    v["fstype"].as_str().unwrap_or("?"),
                    v["layout"].as_str().unwrap_or("?"),
                ))
            }
            None => Err(format!(
                "the runtime found no hand-off record for {} (it would not be in the guest)",
                self.target
            )),
        };
        self.record("runtime create", t0, r)?;
        let t0 = Instant::now();
        let r = guarded(&stop, async {
            rt.ok(&["--pods-layer-stop", &pods, "start", &id])
                .await
                .map_err(|e| e.to_string())?;
            Ok(format!(
                "workload {:?} running",
                self.cfg.workload.args.join(" ")
            ))
        })
        .await;
        self.record("runtime start", t0, r)
    }

    pub(super) fn write_bundle(&mut self, bundle: &Path, source: &str) -> Result<(), String> {
        if bundle.exists() {
            return Err(format!("{} already exists", bundle.display()));
        }
        self.make_dirs(bundle.parent().expect("bundle has a parent"))?;
        std::fs::create_dir(bundle).map_err(|e| format!("create {}: {e}", bundle.display()))?;
        self.undo.push(Undo::Tree(bundle.to_path_buf()));
        std::fs::create_dir(bundle.join("rootfs")).map_err(|e| format!("create rootfs: {e}"))?;
        let spec = bundle_spec(&self.cfg, source);
        let bytes = serde_json::to_vec_pretty(&spec).expect("spec serializes");
        std::fs::write(bundle.join("config.json"), bytes)
            .map_err(|e| format!("write config.json: {e}"))
    }

    /// `kill` (TERM, then KILL if it lingers) and `delete`, then checks
    /// the sandbox's QEMU is gone.
    pub(super) async fn stop_sandbox(&mut self, id: &str) {
        self.sandbox_up = false;
        let rt = self.cfg.runtime.clone();
        let t0 = Instant::now();
        let status = |st: &Value| st["status"].as_str().unwrap_or("").to_string();
        let r: Result<String, String> = async {
            let st = match rt.json(&["state", id]).await {
                Ok(st) => st,
                // create never got far enough: delete --force tidies up.
                Err(_) => return Ok("no sandbox state (nothing to stop)".into()),
            };
            if status(&st) != "running" {
                return Ok(format!("sandbox {}", status(&st)));
            }
            rt.ok(&["kill", id, "TERM"])
                .await
                .map_err(|e| e.to_string())?;
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let st = rt.json(&["state", id]).await.map_err(|e| e.to_string())?;
                if status(&st) != "running" {
                    let exit = st["exitStatus"]
                        .as_i64()
                        .map(|c| format!("exit status {c}"))
                        .unwrap_or_else(|| "no exit status".into());
                    return Ok(format!("workload stopped by SIGTERM ({exit})"));
                }
                if Instant::now() > deadline {
                    rt.ok(&["kill", id, "KILL"])
                        .await
                        .map_err(|e| e.to_string())?;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    return Ok("workload ignored SIGTERM for 20s; sent SIGKILL".into());
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        .await;
        let _ = self.record("runtime kill", t0, r);

        let t0 = Instant::now();
        let qemu = self.report.qemu_pid;
        let r = async {
            rt.ok(&["delete", "--force", id])
                .await
                .map_err(|e| e.to_string())?;
            if let Some(pid) = qemu {
                let deadline = Instant::now() + Duration::from_secs(15);
                while pid_is_qemu(pid) {
                    if Instant::now() > deadline {
                        return Err(format!("QEMU pid {pid} still runs after delete"));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok(format!("sandbox {id} deleted, QEMU pid {pid} gone"))
            } else {
                Ok(format!("sandbox {id} deleted"))
            }
        }
        .await;
        let _ = self.record("runtime delete", t0, r);
    }
}

/// The OCI runtime spec of the pod's container.
pub fn bundle_spec(cfg: &FlowConfig, source: &str) -> Value {
    let mut env =
        vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string()];
    env.extend(cfg.workload.env.iter().cloned());
    let mut user = json!({"uid": 0, "gid": 0});
    if let Some(g) = cfg.fs_group {
        // kubelet adds the fsGroup to the container's groups.
        user["additionalGids"] = json!([g]);
    }
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({
            "destination": MOUNT_DESTINATION,
            "type": "bind",
            "source": source,
            "options": ["rbind", "rw"],
        }),
    ];
    for (dest, src) in &cfg.extra_mounts {
        mounts.push(
            json!({"destination": dest, "type": "bind", "source": src, "options": ["rbind", "rw"]}),
        );
    }
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": user,
            "args": cfg.workload.args,
            "env": env,
            "cwd": cfg.workload.cwd,
        },
        "root": {"path": "rootfs"},
        "hostname": cfg.sandbox_id,
        "mounts": mounts,
        "annotations": {
            "io.kubernetes.pod.uid": cfg.pod_uid,
        },
    })
}
