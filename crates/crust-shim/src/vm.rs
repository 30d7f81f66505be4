//! A booted pod VM: the handles that the pod ([`crate::pod`]), in-place
//! resize ([`crate::resize`]) and the task service use to reach it.

use crust_agent_proto::AgentClient;
use crust_agent_proto::stdio::StdioMux;
use crust_qmp::QmpClient;
use crust_sandbox::vm::Guest;
use tokio::sync::watch;

/// A booted pod VM.
pub struct PodVm {
    pub guest: Guest,
    pub qmp: QmpClient,
    pub agent: AgentClient,
    pub stdio: StdioMux,
    /// Port-forward into the guest; `None` without a pod network.
    pub forward: Option<crate::forward::Forwarder>,
    /// Some(reason) once QEMU has exited.
    pub exit: watch::Receiver<Option<String>>,
}
