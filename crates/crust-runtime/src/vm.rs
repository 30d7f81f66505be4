//! The sandbox's QEMU guest (adapter over crust-vmm).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::watch;

use crate::config::Config;
use crate::error::RuntimeError;
use crate::sandbox::ProcRef;
use crate::shim::Code;

pub struct Guest {
    run_dir: PathBuf,
}

impl Guest {
    pub async fn launch(_cfg: &Config, run_dir: &Path, _id: &str) -> Result<Guest, RuntimeError> {
        let _ = Guest { run_dir: run_dir.to_path_buf() };
        Err(RuntimeError::new(Code::Internal, "crust-vmm is not wired in yet"))
    }
    pub fn proc_ref(&self) -> ProcRef {
        ProcRef::current()
    }
    pub fn qmp_socket(&self) -> PathBuf {
        self.run_dir.join("qmp.sock")
    }
    pub fn agent_socket(&self) -> PathBuf {
        self.run_dir.join("agent.sock")
    }
    pub fn console_tail(&self) -> String {
        String::new()
    }
    pub fn hotplug_buses(&self) -> Vec<String> {
        Vec::new()
    }
    pub fn set_exit_notifier(&self, _tx: watch::Sender<Option<String>>) {}
    pub async fn wait_exit(&self, _t: Duration) -> bool {
        true
    }
    pub async fn kill(&self) {}
}
