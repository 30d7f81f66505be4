//! The error of a runtime command, one variant per cause. Which API code
//! each cause answers is decided at the API edge alone
//! ([`crate::shim::codes`]): the domain code names what went wrong, never
//! how the shim API or containerd reports it. The causes below the
//! wrapped errors carry no `source`, as the message they replace had
//! none: error chains read as before.

use std::path::PathBuf;
use std::time::Duration;

use crust_agent_proto::{ClientError, FreezeLimitError};
use crust_handoff::{HandoffError, QosError};

use crate::bundle::BundleError;
use crate::discovery::DiscoveryError;
use crate::sandbox::SandboxError;
use crate::share::ShareError;
use crate::shim::ShimError;
use crate::volumes::{AgentCallError, VolumeError};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Shim(#[from] ShimError),
    #[error(transparent)]
    Handoff(#[from] HandoffError),
    #[error(transparent)]
    Volume(#[from] VolumeError),
    #[error(transparent)]
    Share(#[from] ShareError),
    #[error(transparent)]
    AgentCall(#[from] AgentCallError),
    /// The sandbox's network namespace cannot go into its VM (or holds
    /// netfilter rules the node refuses).
    #[error(transparent)]
    Network(#[from] crust_podnet::NetError),
    /// The guest did not take its network.
    #[error("the sandbox's network: {0}")]
    GuestNetwork(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    // ---- the command line and the sandbox's life ----------------------
    #[error("settings from the environment: {0}")]
    EnvSettings(clap::Error),
    #[error("unknown signal {0:?}")]
    UnknownSignal(String),
    /// `crust-runtime shim` reached the ordinary dispatch.
    #[error("the shim is not dispatched here")]
    ShimNotDispatched,
    #[error("{what} {} not found (build it with guest/build-image.sh)", path.display())]
    GuestImageMissing { what: &'static str, path: PathBuf },
    #[error("sandbox {id} was not ready within {wait:?}")]
    ShimNotReady { id: String, wait: Duration },
    /// The shim's ready line said it failed, without an error.
    #[error("the shim failed without saying why")]
    ShimFailedSilently,
    #[error(
        "the shim of sandbox {id} exited before the sandbox was ready; its log ends with:\n{log_tail}"
    )]
    ShimExited { id: String, log_tail: String },
    #[error("binding the shim socket: {0}")]
    ShimSocket(std::io::Error),
    #[error("linking the shim socket for Kata's CLI: {0}")]
    KataLink(String),
    #[error("sandbox {id} does not exist")]
    NoSandbox { id: String },
    #[error("sandbox {id} is {status}, not created")]
    NotCreated { id: String, status: &'static str },
    #[error("sandbox {id} is {status}, not running")]
    NotRunning { id: String, status: &'static str },
    #[error("sandbox {id} is running; kill it first or use --force")]
    StillRunning { id: String },
    /// The shim's VM is gone or going: it cannot serve the call.
    #[error("sandbox {id} is not running ({reason})")]
    SandboxDown { id: String, reason: String },
    #[error("sandbox {id} stopped without a workload exit status: {reason}")]
    NoExitStatus { id: String, reason: String },

    // ---- the guest -----------------------------------------------------
    #[error("launching QEMU: {0}")]
    Launch(crust_vmm::VmError),
    /// QEMU started but the agent did not answer in time.
    #[error("the guest agent did not come up: {0}")]
    GuestNotReady(crust_vmm::VmError),
    #[error("the guest agent did not come up: {cause} (console: {console})")]
    AgentNotReady { cause: ClientError, console: String },
    #[error("QMP: {0}")]
    QmpConnect(crust_qmp::QmpError),

    // ---- volumes -------------------------------------------------------
    /// `what` is the volume path, or `volume <path>` where it reads better.
    #[error("no hand-off record for {what}")]
    NoRecord { what: String },
    #[error("volume {target} is not used by any sandbox")]
    Unclaimed { target: String },
    /// Why the sandbox that claimed a volume cannot serve it now.
    #[error("{0}")]
    NotServed(String),
    #[error("sandbox {sandbox} has no volume {path}")]
    NoVolume { sandbox: String, path: String },
    #[error("volume id {0} is taken")]
    VolumeIdTaken(String),
    #[error(
        "the hand-off record for {target} changed while sandbox {sandbox} was claiming it \
         ({reason}); nothing was attached, retry"
    )]
    RecordChanged {
        target: String,
        sandbox: String,
        reason: String,
    },
    #[error("executable path is not UTF-8")]
    ExeNotUtf8,
    #[error("{0}")]
    BadFreezeLimit(FreezeLimitError),
    #[error("{0}")]
    BadIoLimits(QosError),
    #[error("max {max} is smaller than min {min}")]
    MaxBelowMin { min: u64, max: u64 },
    #[error(
        "volume {target} has {capacity} bytes after the resize, outside [{min}, {}]",
        bound(*max)
    )]
    ResizedOutOfRange {
        target: String,
        capacity: u64,
        min: u64,
        /// 0: unbounded.
        max: u64,
    },
    #[error("--mount-info: {0}")]
    BadMountInfo(String),
    /// `direct-volume add` of a device someone holds (mounted, claimed).
    #[error("{0}")]
    DeviceHeld(crust_blockdev::ClaimError),

    // ---- runtime-driven handover (crust-csi's Handover service) ---------
    #[error("deferral is required for {target} but the handover service cannot be reached: {why}")]
    HandoverRequired { target: String, why: String },
    #[error("{0}")]
    HandoverUnreachable(String),
    #[error("the handover service answered nothing for {target}")]
    HandoverSilent { target: String },
    #[error("{what} did not answer within {after:?}")]
    HandoverTimeout { what: String, after: Duration },
    /// The plugin's own refusal, with its gRPC code.
    #[error("crust-csi would not hand over {target}: {message}")]
    HandoverRefused {
        target: String,
        code: tonic::Code,
        message: String,
    },
}

fn bound(max: u64) -> String {
    if max > 0 {
        max.to_string()
    } else {
        "unbounded".into()
    }
}

impl RuntimeError {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RuntimeError {
        let context = context.into();
        move |source| RuntimeError::Io { context, source }
    }
}
