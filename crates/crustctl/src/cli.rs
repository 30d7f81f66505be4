//! The `crustctl` command line: clap definitions and their dispatch. The
//! binary only parses and calls [`run`]. `flow`, `demo` and `bench
//! --deferred` print their steps as they happen (stdout, or stderr when
//! stdout carries JSON) and exit 1 when a step failed (after teardown).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use crust_proto::csi::v1 as csi;
use crust_proto::endpoint::Endpoint;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};

use crate::bench::{self, BenchConfig, Limit, Scenario};
use crate::client::{ConnectError, Csi};
use crate::demo::{DemoConfig, run_demo};
use crate::flow::{DeferVia, Flow, FlowConfig, StepReport, Workload};
use crate::fmt::{OutputFormat, Render, render};
use crate::parse::{KeyValue, parse_duration, parse_key_value, parse_size, to_map};
use crate::runtime_cli::RuntimeCli;

/// Exit code for errors reported by the driver or the connection.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code for bad command lines (clap uses the same).
pub const EXIT_USAGE: u8 = 2;
/// Exit code after Ctrl-C (128 + SIGINT), once cleanup ran.
pub const EXIT_INTERRUPTED: u8 = 130;

#[derive(Debug, Parser)]
#[command(
    name = "crustctl",
    version,
    about = "Drive any CSI driver the way a CO would: every Identity, Controller and Node RPC, and a load generator"
)]
pub struct Cli {
    /// CSI endpoint: unix:///path/to/csi.sock or http://host:port.
    #[arg(
        long,
        env = "CSI_ENDPOINT",
        global = true,
        default_value = "unix:///csi/csi.sock",
        value_parser = Endpoint::parse
    )]
    pub endpoint: Endpoint,

    /// Deadline for each RPC (e.g. 500ms, 60s, 2m).
    #[arg(long, global = true, default_value = "60s", value_parser = parse_duration)]
    pub timeout: Duration,

    /// Output format.
    #[arg(
        short = 'o',
        long = "output",
        global = true,
        value_enum,
        default_value_t
    )]
    pub output: OutputFormat,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Identity service RPCs.
    #[command(subcommand)]
    Identity(IdentityCmd),
    /// Controller service RPCs.
    #[command(subcommand)]
    Controller(ControllerCmd),
    /// Node service RPCs (including the KEP-2857 deferral fields).
    #[command(subcommand)]
    Node(NodeCmd),
    /// GroupController service RPCs (volume group snapshots).
    #[command(subcommand)]
    Group(GroupCmd),
    /// Load-test a CSI endpoint with standard CSI calls (or, with
    /// --deferred, the deferred stats/expand paths of one running pod).
    Bench(BenchArgs),
    /// Play kubelet for one pod: create, stage, publish with deferral, run
    /// the pod in the VM runtime, stats, expand, stop, unpublish, unstage,
    /// delete; each step reported as it happens.
    Flow(FlowArgs),
    /// Run the whole stack from nothing (as root): pool, plugin, guest,
    /// one pod through the flow, and a check that nothing is left behind.
    Demo(DemoArgs),
}

/// Where the VM runtime is and how it runs.
#[derive(Debug, Clone, Args)]
pub struct RuntimeArgs {
    /// The crust-runtime binary [default: next to crustctl, else on PATH].
    #[arg(long = "runtime", value_name = "PATH")]
    pub runtime_bin: Option<PathBuf>,
    /// The runtime's sandbox state dir [default: the runtime's].
    #[arg(long, value_name = "DIR")]
    pub runtime_root: Option<PathBuf>,
    /// KEP-2857 hand-off root the runtime reads [default: the runtime's].
    #[arg(long, value_name = "DIR")]
    pub crust_root: Option<PathBuf>,
    /// Kata direct-volumes root the runtime reads [default: the runtime's].
    #[arg(long, value_name = "DIR")]
    pub kata_root: Option<PathBuf>,
    /// Guest kernel [default: the runtime's].
    #[arg(long, value_name = "PATH")]
    pub guest_kernel: Option<PathBuf>,
    /// Guest initramfs [default: next to the kernel].
    #[arg(long, value_name = "PATH")]
    pub guest_initrd: Option<PathBuf>,
    /// QEMU acceleration: tcg, kvm or auto [default: the runtime's].
    #[arg(long, value_parser = ["tcg", "kvm", "auto"])]
    pub accel: Option<String>,
    /// Bound on each runtime command (create boots a guest).
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    pub runtime_timeout: Duration,
}

impl RuntimeArgs {
    pub fn build(&self) -> RuntimeCli {
        let mut r = RuntimeCli::new(
            self.runtime_bin
                .clone()
                .unwrap_or_else(RuntimeCli::default_bin),
        );
        r.root = self.runtime_root.clone();
        r.crust_root = self.crust_root.clone();
        r.kata_root = self.kata_root.clone();
        r.guest_kernel = self.guest_kernel.clone();
        r.guest_initrd = self.guest_initrd.clone();
        r.accel = self.accel.clone();
        r.timeout = self.runtime_timeout;
        r
    }
}

/// The pod and its volume (shared by `flow` and `bench --deferred`).
#[derive(Debug, Clone, Args)]
pub struct PodArgs {
    /// Work dir: kubelet's root is <work-dir>/kubelet, bundles go to
    /// <work-dir>/bundles [default: a fresh /var/tmp/crust-flow-<pid>,
    /// removed afterwards].
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    /// Driver name in kubelet's staging path [default: GetPluginInfo's].
    #[arg(long)]
    pub driver_name: Option<String>,
    /// CreateVolume name [default: pvc-<uuid>].
    #[arg(long)]
    pub name: Option<String>,
    /// PV name in the publish path [default: the volume name].
    #[arg(long)]
    pub pv_name: Option<String>,
    /// Pod UID in the publish path [default: a random UUID].
    #[arg(long)]
    pub pod_uid: Option<String>,
    /// Sandbox (container) id for the runtime [default: crust-pod-<8 hex>].
    #[arg(long)]
    pub sandbox_id: Option<String>,
    /// Volume size.
    #[arg(long, default_value = "256Mi", value_parser = parse_size)]
    pub size: u64,
    /// Filesystem type.
    #[arg(long, default_value = "ext4")]
    pub fs_type: String,
    /// Mount flag for the filesystem (repeatable).
    #[arg(long = "mount-flag", value_name = "FLAG")]
    pub mount_flags: Vec<String>,
    /// The pod's fsGroup (sent as volume_supplemental_group).
    #[arg(long, value_name = "GID")]
    pub fs_group: Option<u32>,
    /// The pod's fsGroupChangePolicy.
    #[arg(long, value_enum, ignore_case = true, requires = "fs_group")]
    pub fs_group_change_policy: Option<ChangePolicy>,
    /// How deferral is asked for: request (defer_fs_ops), storage-class
    /// (parameter deferFsOps=true in the volume context) or none.
    #[arg(long, value_enum, default_value_t = DeferVia::Request)]
    pub defer_via: DeferVia,
    /// CreateVolume parameter (repeatable).
    #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub params: Vec<KeyValue>,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

impl PodArgs {
    fn flow_config(&self, work_dir: PathBuf) -> Result<FlowConfig, CliError> {
        let mut f = FlowConfig::new(work_dir, self.runtime.build());
        f.driver_name = self.driver_name.clone();
        if let Some(n) = &self.name {
            f.volume_name = n.clone();
        }
        f.pv_name = self.pv_name.clone();
        if let Some(u) = &self.pod_uid {
            check_name("--pod-uid", u)?;
            f.pod_uid = u.clone();
        }
        if let Some(i) = &self.sandbox_id {
            check_name("--sandbox-id", i)?;
            f.sandbox_id = i.clone();
        }
        if let Some(p) = &self.pv_name {
            check_name("--pv-name", p)?;
        }
        check_name("--name", &f.volume_name)?;
        f.size = self.size;
        f.fs_type = self.fs_type.clone();
        f.mount_flags = self.mount_flags.clone();
        f.fs_group = self.fs_group;
        f.change_policy = self.fs_group_change_policy;
        f.defer_via = self.defer_via;
        f.params = map(&self.params, "--param")?;
        if f.defer_via == DeferVia::None && f.fs_group.is_some() {
            return Err(CliError::Usage(
                "--fs-group is sent as volume_supplemental_group, which needs deferral".into(),
            ));
        }
        Ok(f)
    }
}

/// A path component kubelet would accept.
fn check_name(flag: &str, v: &str) -> Result<(), CliError> {
    if v.is_empty() || v == "." || v == ".." || v.contains('/') || v.contains('\0') || v.len() > 253
    {
        return Err(CliError::Usage(format!(
            "{flag} {v:?}: must be a single non-empty path component"
        )));
    }
    Ok(())
}

#[derive(Debug, Clone, Args)]
pub struct FlowArgs {
    #[command(flatten)]
    pub pod: PodArgs,
    /// Expand the volume to this size while the pod runs.
    #[arg(long, default_value = "512Mi", value_parser = parse_size, conflicts_with = "no_expand")]
    pub expand_to: u64,
    /// Skip ControllerExpandVolume/NodeExpandVolume.
    #[arg(long)]
    pub no_expand: bool,
    /// The container's volumeMount subPath (the runtime resolves it in the guest).
    #[arg(long)]
    pub sub_path: Option<String>,
    /// Container environment entry (repeatable).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Container working directory.
    #[arg(long, default_value = "/")]
    pub cwd: String,
    /// Keep the volume (and its data): no DeleteVolume at the end.
    #[arg(long)]
    pub keep_volume: bool,
    /// Shell command run in the guest before the pod stops; its output
    /// goes into the report (e.g. 'cat /data/out.txt').
    #[arg(long, value_name = "SCRIPT")]
    pub collect: Option<String>,
    /// Stop after NodePublishVolume: leave the hand-off record unconsumed
    /// (no sandbox; stats and expansion are skipped).
    #[arg(long, conflicts_with_all = ["collect", "sub_path"])]
    pub no_sandbox: bool,
    /// The workload [default: append `date` to /data/out.txt every second].
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Work dir (empty or new) [default: a fresh /var/tmp/crust-demo-<pid>].
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    /// Keep the work dir (pool files, logs) afterwards.
    #[arg(long)]
    pub keep: bool,
    /// The crust-csi binary [default: next to crustctl].
    #[arg(long, value_name = "PATH")]
    pub crust_csi: Option<PathBuf>,
    /// The crust-runtime binary [default: next to crustctl].
    #[arg(long = "runtime", value_name = "PATH")]
    pub runtime_bin: Option<PathBuf>,
    /// Guest image dir (vmlinuz, initramfs.cpio.gz), built there if missing
    /// [default: $CRUST_GUEST_DIR, <exe>/../guest-image or <checkout>/target/guest-image].
    #[arg(long, value_name = "DIR")]
    pub guest_dir: Option<PathBuf>,
    /// QEMU acceleration: tcg, kvm or auto [default: the runtime's].
    #[arg(long, value_parser = ["tcg", "kvm", "auto"])]
    pub accel: Option<String>,
    /// Volume size.
    #[arg(long, default_value = "256Mi", value_parser = parse_size)]
    pub size: u64,
    /// Size after the online expansion.
    #[arg(long, default_value = "512Mi", value_parser = parse_size)]
    pub expand_to: u64,
    /// Filesystem type.
    #[arg(long, default_value = "ext4", value_parser = ["ext4", "xfs"])]
    pub fs_type: String,
    /// The pool's capacity.
    #[arg(long, default_value = "2Gi", value_parser = parse_size)]
    pub pool_capacity: u64,
}

#[derive(Debug, Subcommand)]
pub enum IdentityCmd {
    /// GetPluginInfo.
    Info,
    /// GetPluginCapabilities.
    Capabilities,
    /// Probe.
    Probe,
}

/// CSI access modes, spelled in kebab-case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AccessModeArg {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

impl AccessModeArg {
    pub fn mode(self) -> Mode {
        match self {
            AccessModeArg::SingleNodeWriter => Mode::SingleNodeWriter,
            AccessModeArg::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
            AccessModeArg::MultiNodeReaderOnly => Mode::MultiNodeReaderOnly,
            AccessModeArg::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
            AccessModeArg::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
            AccessModeArg::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
            AccessModeArg::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
        }
    }
}

/// Kubernetes' fsGroupChangePolicy values, spelled as Kubernetes does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ChangePolicy {
    #[value(name = "Always")]
    Always,
    #[value(name = "OnRootMismatch")]
    OnRootMismatch,
}

impl ChangePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangePolicy::Always => "Always",
            ChangePolicy::OnRootMismatch => "OnRootMismatch",
        }
    }
}

/// Flags that build one `VolumeCapability`.
#[derive(Debug, Clone, Default, Args)]
pub struct CapabilityArgs {
    /// Raw block access instead of a mounted filesystem.
    #[arg(long, conflicts_with_all = ["fs_type", "mount_flags", "volume_mount_group",
        "supplemental_group", "supplemental_group_change_policy"])]
    pub block: bool,
    /// Filesystem type (empty: the driver's default).
    #[arg(long)]
    pub fs_type: Option<String>,
    /// Mount flag (repeatable).
    #[arg(long = "mount-flag", value_name = "FLAG")]
    pub mount_flags: Vec<String>,
    /// MountVolume.volume_mount_group (VOLUME_MOUNT_GROUP).
    #[arg(long, value_name = "GID")]
    pub volume_mount_group: Option<u32>,
    /// KEP-2857 MountVolume.volume_supplemental_group (the pod's fsGroup).
    #[arg(long, value_name = "GID")]
    pub supplemental_group: Option<u32>,
    /// KEP-2857 MountVolume.volume_supplemental_group_change_policy.
    #[arg(long, value_enum, ignore_case = true)]
    pub supplemental_group_change_policy: Option<ChangePolicy>,
    /// Access mode [default: single-node-writer].
    #[arg(long, value_enum)]
    pub access_mode: Option<AccessModeArg>,
}

impl CapabilityArgs {
    /// Whether any capability flag was given (for RPCs where it is optional).
    pub fn given(&self) -> bool {
        self.block
            || self.fs_type.is_some()
            || !self.mount_flags.is_empty()
            || self.volume_mount_group.is_some()
            || self.supplemental_group.is_some()
            || self.supplemental_group_change_policy.is_some()
            || self.access_mode.is_some()
    }

    pub fn build(&self) -> csi::VolumeCapability {
        let access_type = if self.block {
            AccessType::Block(BlockVolume {})
        } else {
            AccessType::Mount(MountVolume {
                fs_type: self.fs_type.clone().unwrap_or_default(),
                mount_flags: self.mount_flags.clone(),
                volume_mount_group: self
                    .volume_mount_group
                    .map(|g| g.to_string())
                    .unwrap_or_default(),
                volume_supplemental_group: self
                    .supplemental_group
                    .map(|g| g.to_string())
                    .unwrap_or_default(),
                volume_supplemental_group_change_policy: self
                    .supplemental_group_change_policy
                    .map(|p| p.as_str().to_string())
                    .unwrap_or_default(),
            })
        };
        csi::VolumeCapability {
            access_type: Some(access_type),
            access_mode: Some(AccessMode {
                mode: self
                    .access_mode
                    .unwrap_or(AccessModeArg::SingleNodeWriter)
                    .mode() as i32,
            }),
        }
    }

    fn optional(&self) -> Option<csi::VolumeCapability> {
        self.given().then(|| self.build())
    }
}

#[derive(Debug, Subcommand)]
pub enum ControllerCmd {
    /// CreateVolume.
    Create {
        /// Volume name (the idempotency key).
        #[arg(long)]
        name: String,
        /// Required capacity (1Gi, 512Mi, 1G, bytes).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Capacity limit.
        #[arg(long, value_parser = parse_size)]
        limit: Option<u64>,
        #[command(flatten)]
        cap: CapabilityArgs,
        /// StorageClass-style parameter (repeatable).
        #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        params: Vec<KeyValue>,
        /// Mutable parameter (repeatable).
        #[arg(long = "mutable-param", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        mutable_params: Vec<KeyValue>,
        /// Secret (repeatable; never printed).
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
        /// Topology segment, used as requisite and preferred (repeatable).
        #[arg(long = "topology", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        topology: Vec<KeyValue>,
        /// Clone from this snapshot.
        #[arg(long, conflicts_with = "source_volume")]
        source_snapshot: Option<String>,
        /// Clone from this volume.
        #[arg(long)]
        source_volume: Option<String>,
    },
    /// DeleteVolume.
    Delete {
        volume_id: String,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
    /// ControllerGetVolume.
    Get { volume_id: String },
    /// ControllerGetVolumeHealth (CSI v1.13).
    VolumeHealth { volume_id: String },
    /// ControllerListVolumeHealth (CSI v1.13): volumes with an adverse
    /// condition.
    ListVolumeHealth {
        #[arg(long)]
        max_entries: Option<i32>,
        #[arg(long)]
        starting_token: Option<String>,
        /// Follow next_token through every page.
        #[arg(long)]
        all: bool,
    },
    /// ListVolumes.
    List {
        #[arg(long)]
        max_entries: Option<i32>,
        #[arg(long)]
        starting_token: Option<String>,
        /// Follow next_token through every page.
        #[arg(long)]
        all: bool,
    },
    /// GetCapacity.
    Capacity {
        #[command(flatten)]
        cap: CapabilityArgs,
        #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        params: Vec<KeyValue>,
        #[arg(long = "topology", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        topology: Vec<KeyValue>,
    },
    /// ControllerExpandVolume.
    Expand {
        volume_id: String,
        #[arg(long, value_parser = parse_size)]
        size: u64,
        #[arg(long, value_parser = parse_size)]
        limit: Option<u64>,
        #[command(flatten)]
        cap: CapabilityArgs,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
    /// ValidateVolumeCapabilities.
    Validate {
        volume_id: String,
        #[command(flatten)]
        cap: CapabilityArgs,
        #[arg(long = "volume-context", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        volume_context: Vec<KeyValue>,
        #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        params: Vec<KeyValue>,
        #[arg(long = "mutable-param", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        mutable_params: Vec<KeyValue>,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
    /// ControllerGetCapabilities.
    Capabilities,
    /// ControllerPublishVolume.
    Publish {
        volume_id: String,
        #[arg(long)]
        node_id: String,
        #[command(flatten)]
        cap: CapabilityArgs,
        #[arg(long)]
        readonly: bool,
        #[arg(long = "volume-context", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        volume_context: Vec<KeyValue>,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
    /// ControllerUnpublishVolume.
    Unpublish {
        volume_id: String,
        /// Empty: unpublish from every node.
        #[arg(long, default_value = "")]
        node_id: String,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
    /// ControllerModifyVolume.
    Modify {
        volume_id: String,
        #[arg(long = "mutable-param", value_name = "KEY=VALUE", value_parser = parse_key_value, required = true)]
        mutable_params: Vec<KeyValue>,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
    /// CreateSnapshot.
    SnapshotCreate {
        #[arg(long)]
        source_volume: String,
        #[arg(long)]
        name: String,
        #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        params: Vec<KeyValue>,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
    /// DeleteSnapshot.
    SnapshotDelete {
        snapshot_id: String,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
    /// ListSnapshots.
    SnapshotList {
        #[arg(long)]
        max_entries: Option<i32>,
        #[arg(long)]
        starting_token: Option<String>,
        #[arg(long)]
        source_volume: Option<String>,
        #[arg(long)]
        snapshot_id: Option<String>,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
        /// Follow next_token through every page.
        #[arg(long)]
        all: bool,
    },
    /// GetSnapshot.
    SnapshotGet {
        snapshot_id: String,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
}

#[derive(Debug, Subcommand)]
pub enum GroupCmd {
    /// GroupControllerGetCapabilities.
    Capabilities,
    /// CreateVolumeGroupSnapshot: one crash-consistent snapshot of every
    /// volume.
    Create {
        /// Group snapshot name (the idempotency key).
        #[arg(long)]
        name: String,
        /// A source volume (repeat for each).
        #[arg(long = "volume", value_name = "VOLUME_ID", required = true)]
        volumes: Vec<String>,
        #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        params: Vec<KeyValue>,
    },
    /// DeleteVolumeGroupSnapshot (with its member snapshots).
    Delete {
        group_snapshot_id: String,
        /// Member snapshot ids, checked against the group (repeatable).
        #[arg(long = "snapshot-id")]
        snapshot_ids: Vec<String>,
    },
    /// GetVolumeGroupSnapshot.
    Get {
        group_snapshot_id: String,
        #[arg(long = "snapshot-id")]
        snapshot_ids: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum NodeCmd {
    /// NodeStageVolume.
    Stage {
        volume_id: String,
        /// staging_target_path (must exist, like kubelet's globalmount).
        #[arg(long)]
        staging_path: PathBuf,
        #[command(flatten)]
        cap: CapabilityArgs,
        #[arg(long = "publish-context", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        publish_context: Vec<KeyValue>,
        #[arg(long = "volume-context", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        volume_context: Vec<KeyValue>,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
    },
    /// NodeUnstageVolume.
    Unstage {
        volume_id: String,
        #[arg(long)]
        staging_path: PathBuf,
    },
    /// NodePublishVolume.
    Publish {
        volume_id: String,
        /// target_path (its parent must exist).
        #[arg(long)]
        target_path: PathBuf,
        #[arg(long)]
        staging_path: Option<PathBuf>,
        #[command(flatten)]
        cap: CapabilityArgs,
        #[arg(long)]
        readonly: bool,
        #[arg(long = "publish-context", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        publish_context: Vec<KeyValue>,
        #[arg(long = "volume-context", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        volume_context: Vec<KeyValue>,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
        /// KEP-2857: leave the filesystem to the container runtime.
        #[arg(long)]
        defer_fs_ops: bool,
    },
    /// NodeUnpublishVolume.
    Unpublish {
        volume_id: String,
        #[arg(long)]
        target_path: PathBuf,
        /// KEP-2857 deferral flag.
        #[arg(long)]
        defer_fs_ops: bool,
    },
    /// NodeGetVolumeHealth (CSI v1.13).
    VolumeHealth {
        volume_id: String,
        /// volume_publish_path (optional).
        #[arg(long)]
        volume_path: Option<PathBuf>,
        #[arg(long)]
        staging_path: Option<PathBuf>,
    },
    /// NodeGetStorageHealth (CSI v1.13): the node's storage backend.
    StorageHealth,
    /// NodeGetVolumeStats.
    Stats {
        volume_id: String,
        #[arg(long)]
        volume_path: PathBuf,
        #[arg(long)]
        staging_path: Option<PathBuf>,
        /// KEP-2857 deferral flag.
        #[arg(long)]
        defer_fs_ops: bool,
    },
    /// NodeExpandVolume.
    Expand {
        volume_id: String,
        #[arg(long)]
        volume_path: PathBuf,
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        #[arg(long, value_parser = parse_size)]
        limit: Option<u64>,
        #[arg(long)]
        staging_path: Option<PathBuf>,
        #[command(flatten)]
        cap: CapabilityArgs,
        #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        secrets: Vec<KeyValue>,
        /// KEP-2857 deferral flag.
        #[arg(long)]
        defer_fs_ops: bool,
    },
    /// NodeGetCapabilities.
    Capabilities,
    /// NodeGetInfo.
    Info,
}

#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("pod_mode").args(["deferred", "guest_io"]).multiple(true)))]
pub struct BenchArgs {
    /// Comma-separated scenarios: create-delete, stage-publish-cycle, stats,
    /// volume-health (CSI v1.13 NodeGetVolumeHealth).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "create-delete,stage-publish-cycle,stats"
    )]
    pub scenarios: Vec<Scenario>,
    /// Parallel workers per scenario.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub concurrency: u32,
    /// Run each scenario this long (e.g. 10s).
    #[arg(long, value_parser = parse_duration, conflicts_with = "ops")]
    pub duration: Option<Duration>,
    /// Run each scenario for this many operations (default 100 when no --duration).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub ops: Option<u64>,
    /// Volume size.
    #[arg(long, default_value = "64Mi", value_parser = parse_size)]
    pub size: u64,
    #[command(flatten)]
    pub cap: CapabilityArgs,
    /// CreateVolume parameter (repeatable).
    #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub params: Vec<KeyValue>,
    /// Secret for create/delete/stage/publish (repeatable; never printed).
    #[arg(long = "secret", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub secrets: Vec<KeyValue>,
    /// Root under which per-op staging directories are made (default: a temp dir).
    #[arg(long)]
    pub staging_dir: Option<PathBuf>,
    /// Root under which per-op target parent directories are made (default: a temp dir).
    #[arg(long)]
    pub target_dir: Option<PathBuf>,
    /// How many published volumes the stats scenario queries round robin;
    /// a comma-separated list (16,256,1024) runs once per value and prints
    /// the cost against the number of volumes.
    #[arg(long, value_delimiter = ',', default_value = "4", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub stats_volumes: Vec<u32>,
    /// Hold this many unrelated loop devices (sparse files under /var/tmp)
    /// for the whole run, as other software on a node would; released
    /// afterwards.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=4096))]
    pub idle_loops: u32,
    /// Set the KEP-2857 defer_fs_ops field (needs DEFER_FS_OPS).
    #[arg(long)]
    pub defer_fs_ops: bool,
    /// Attempts per cleanup call before giving up on it.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub cleanup_retries: u32,
    /// Deferred mode: set up one pod with `flow` (stage, deferred publish,
    /// sandbox) and measure deferred NodeGetVolumeStats and
    /// ControllerExpandVolume+NodeExpandVolume instead of --scenarios.
    #[arg(long, conflicts_with_all = ["scenarios", "stats_volumes", "defer_fs_ops", "staging_dir", "target_dir"])]
    pub deferred: bool,
    /// Deferred mode: bytes added by each expansion.
    #[arg(long, default_value = "4Mi", value_parser = parse_size, requires = "deferred")]
    pub expand_step: u64,
    /// Deferred and guest I/O modes: work dir (kubelet root, bundles)
    /// [default: a fresh /var/tmp/crust-bench-<pid>, removed afterwards].
    #[arg(long, value_name = "DIR", requires = "pod_mode")]
    pub work_dir: Option<PathBuf>,
    #[command(flatten)]
    pub guest_io: crate::bench::guest_io::GuestIoArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// Why a command failed; [`CliError::exit_code`] maps it to the process
/// exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{}: {}", .0.code_name(), .0.message())]
    Grpc(tonic::Status),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Bench(#[from] bench::BenchError),
}

trait CodeName {
    fn code_name(&self) -> String;
}

impl CodeName for tonic::Status {
    /// `NotFound`, `InvalidArgument`, ... (the variant name).
    fn code_name(&self) -> String {
        format!("{:?}", self.code())
    }
}

impl From<tonic::Status> for CliError {
    fn from(s: tonic::Status) -> Self {
        CliError::Grpc(s)
    }
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Usage(_) => ExitCode::from(EXIT_USAGE),
            _ => ExitCode::from(EXIT_FAILURE),
        }
    }
}

fn map(pairs: &[KeyValue], what: &str) -> Result<HashMap<String, String>, CliError> {
    to_map(pairs, what).map_err(CliError::Usage)
}

fn topology(pairs: &[KeyValue]) -> Result<Option<csi::Topology>, CliError> {
    if pairs.is_empty() {
        return Ok(None);
    }
    Ok(Some(csi::Topology {
        segments: map(pairs, "--topology")?,
    }))
}

fn capacity(size: Option<u64>, limit: Option<u64>) -> Result<Option<csi::CapacityRange>, CliError> {
    if let (Some(s), Some(l)) = (size, limit)
        && l < s
    {
        return Err(CliError::Usage(format!(
            "--limit ({l}) is smaller than --size ({s})"
        )));
    }
    if size.is_none() && limit.is_none() {
        return Ok(None);
    }
    Ok(Some(csi::CapacityRange {
        required_bytes: size.unwrap_or(0) as i64,
        limit_bytes: limit.unwrap_or(0) as i64,
    }))
}

fn path_str(p: &std::path::Path) -> Result<String, CliError> {
    p.to_str()
        .map(str::to_string)
        .ok_or_else(|| CliError::Usage(format!("path {} is not UTF-8", p.display())))
}

fn opt_path(p: &Option<PathBuf>) -> Result<String, CliError> {
    p.as_deref().map(path_str).unwrap_or(Ok(String::new()))
}

/// Prints a response; a response without data prints `done` in text mode so
/// scripts and humans see the call succeeded.
/// Prints a bench report; the exit code says whether cleanup left anything
/// behind or the run was interrupted.
fn finish_bench(out: OutputFormat, report: &bench::BenchReport) -> ExitCode {
    emit(out, report, "");
    if !report.cleanup.leftovers.is_empty() {
        say(&format!(
            "error: cleanup left {} item(s) behind (listed in the report)",
            report.cleanup.leftovers.len()
        ));
        return ExitCode::from(EXIT_FAILURE);
    }
    if report.interrupted {
        return ExitCode::from(EXIT_INTERRUPTED);
    }
    ExitCode::SUCCESS
}

fn emit<T: Render>(format: OutputFormat, resp: &T, done: &str) {
    use std::io::Write;
    let s = render(resp, format);
    // Nobody reading stdout any more is not a reason to panic.
    let _ = if s.is_empty() {
        writeln!(std::io::stdout(), "{done}")
    } else if s.ends_with('\n') {
        write!(std::io::stdout(), "{s}")
    } else {
        writeln!(std::io::stdout(), "{s}")
    };
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> Result<ExitCode, CliError> {
    let out = cli.output;
    // Validate the command's own input before touching the network.
    match cli.command {
        Command::Identity(cmd) => {
            let c = Csi::connect(&cli.endpoint, cli.timeout).await?;
            identity(&c, cmd, out).await?;
        }
        Command::Controller(cmd) => controller(&cli.endpoint, cli.timeout, cmd, out).await?,
        Command::Node(cmd) => node(&cli.endpoint, cli.timeout, cmd, out).await?,
        Command::Group(cmd) => group(&cli.endpoint, cli.timeout, cmd, out).await?,
        Command::Bench(args) if args.deferred => {
            return bench_deferred_cmd(&cli.endpoint, cli.timeout, args, out).await;
        }
        Command::Bench(args) if args.guest_io.guest_io => {
            return bench_guest_io_cmd(&cli.endpoint, cli.timeout, args, out).await;
        }
        Command::Bench(args) => return bench_cmd(&cli.endpoint, cli.timeout, args, out).await,
        Command::Flow(args) => return flow_cmd(&cli.endpoint, cli.timeout, args, out).await,
        Command::Demo(args) => return demo_cmd(cli.timeout, args, out).await,
    }
    Ok(ExitCode::SUCCESS)
}

async fn identity(c: &Csi, cmd: IdentityCmd, out: OutputFormat) -> Result<(), CliError> {
    match cmd {
        IdentityCmd::Info => emit(out, &c.get_plugin_info(Default::default()).await?, ""),
        IdentityCmd::Capabilities => emit(
            out,
            &c.get_plugin_capabilities(Default::default()).await?,
            "",
        ),
        IdentityCmd::Probe => emit(out, &c.probe(Default::default()).await?, ""),
    }
    Ok(())
}

async fn controller(
    ep: &Endpoint,
    timeout: Duration,
    cmd: ControllerCmd,
    out: OutputFormat,
) -> Result<(), CliError> {
    use ControllerCmd as C;
    // Build the request first so bad input fails without connecting.
    enum Req {
        Create(csi::CreateVolumeRequest),
        Delete(csi::DeleteVolumeRequest),
        Get(csi::ControllerGetVolumeRequest),
        Health(csi::ControllerGetVolumeHealthRequest),
        ListHealth(csi::ControllerListVolumeHealthRequest, bool),
        List(csi::ListVolumesRequest, bool),
        Capacity(csi::GetCapacityRequest),
        Expand(csi::ControllerExpandVolumeRequest),
        Validate(csi::ValidateVolumeCapabilitiesRequest),
        Capabilities,
        Publish(csi::ControllerPublishVolumeRequest),
        Unpublish(csi::ControllerUnpublishVolumeRequest),
        Modify(csi::ControllerModifyVolumeRequest),
        SnapCreate(csi::CreateSnapshotRequest),
        SnapDelete(csi::DeleteSnapshotRequest),
        SnapList(csi::ListSnapshotsRequest, bool),
        SnapGet(csi::GetSnapshotRequest),
    }
    let req = match cmd {
        C::Create {
            name,
            size,
            limit,
            cap,
            params,
            mutable_params,
            secrets,
            topology: topo,
            source_snapshot,
            source_volume,
        } => {
            use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
            let content = match (source_snapshot, source_volume) {
                (Some(s), _) => Some(Type::Snapshot(SnapshotSource { snapshot_id: s })),
                (None, Some(v)) => Some(Type::Volume(VolumeSource { volume_id: v })),
                (None, None) => None,
            };
            Req::Create(csi::CreateVolumeRequest {
                name,
                capacity_range: capacity(size, limit)?,
                volume_capabilities: vec![cap.build()],
                parameters: map(&params, "--param")?,
                secrets: map(&secrets, "--secret")?,
                volume_content_source: content
                    .map(|t| csi::VolumeContentSource { r#type: Some(t) }),
                accessibility_requirements: topology(&topo)?.map(|t| csi::TopologyRequirement {
                    requisite: vec![t.clone()],
                    preferred: vec![t],
                }),
                mutable_parameters: map(&mutable_params, "--mutable-param")?,
            })
        }
        C::Delete { volume_id, secrets } => Req::Delete(csi::DeleteVolumeRequest {
            volume_id,
            secrets: map(&secrets, "--secret")?,
        }),
        C::Get { volume_id } => Req::Get(csi::ControllerGetVolumeRequest { volume_id }),
        C::VolumeHealth { volume_id } => Req::Health(csi::ControllerGetVolumeHealthRequest {
            volume_id,
            secrets: Default::default(),
        }),
        C::ListVolumeHealth {
            max_entries,
            starting_token,
            all,
        } => {
            if max_entries.is_some_and(|m| m < 0) {
                return Err(CliError::Usage("--max-entries must not be negative".into()));
            }
            Req::ListHealth(
                csi::ControllerListVolumeHealthRequest {
                    max_entries: max_entries.unwrap_or(0),
                    starting_token: starting_token.unwrap_or_default(),
                    secrets: Default::default(),
                },
                all,
            )
        }
        C::List {
            max_entries,
            starting_token,
            all,
        } => {
            if max_entries.is_some_and(|m| m < 0) {
                return Err(CliError::Usage("--max-entries must not be negative".into()));
            }
            Req::List(
                csi::ListVolumesRequest {
                    max_entries: max_entries.unwrap_or(0),
                    starting_token: starting_token.unwrap_or_default(),
                },
                all,
            )
        }
        C::Capacity {
            cap,
            params,
            topology: topo,
        } => Req::Capacity(csi::GetCapacityRequest {
            volume_capabilities: cap.optional().into_iter().collect(),
            parameters: map(&params, "--param")?,
            accessible_topology: topology(&topo)?,
        }),
        C::Expand {
            volume_id,
            size,
            limit,
            cap,
            secrets,
        } => Req::Expand(csi::ControllerExpandVolumeRequest {
            volume_id,
            capacity_range: capacity(Some(size), limit)?,
            secrets: map(&secrets, "--secret")?,
            volume_capability: cap.optional(),
        }),
        C::Validate {
            volume_id,
            cap,
            volume_context,
            params,
            mutable_params,
            secrets,
        } => Req::Validate(csi::ValidateVolumeCapabilitiesRequest {
            volume_id,
            volume_context: map(&volume_context, "--volume-context")?,
            volume_capabilities: vec![cap.build()],
            parameters: map(&params, "--param")?,
            secrets: map(&secrets, "--secret")?,
            mutable_parameters: map(&mutable_params, "--mutable-param")?,
        }),
        C::Capabilities => Req::Capabilities,
        C::Publish {
            volume_id,
            node_id,
            cap,
            readonly,
            volume_context,
            secrets,
        } => Req::Publish(csi::ControllerPublishVolumeRequest {
            volume_id,
            node_id,
            volume_capability: Some(cap.build()),
            readonly,
            secrets: map(&secrets, "--secret")?,
            volume_context: map(&volume_context, "--volume-context")?,
        }),
        C::Unpublish {
            volume_id,
            node_id,
            secrets,
        } => Req::Unpublish(csi::ControllerUnpublishVolumeRequest {
            volume_id,
            node_id,
            secrets: map(&secrets, "--secret")?,
        }),
        C::Modify {
            volume_id,
            mutable_params,
            secrets,
        } => Req::Modify(csi::ControllerModifyVolumeRequest {
            volume_id,
            secrets: map(&secrets, "--secret")?,
            mutable_parameters: map(&mutable_params, "--mutable-param")?,
        }),
        C::SnapshotCreate {
            source_volume,
            name,
            params,
            secrets,
        } => Req::SnapCreate(csi::CreateSnapshotRequest {
            accessibility_requirements: None,
            source_volume_id: source_volume,
            name,
            secrets: map(&secrets, "--secret")?,
            parameters: map(&params, "--param")?,
        }),
        C::SnapshotDelete {
            snapshot_id,
            secrets,
        } => Req::SnapDelete(csi::DeleteSnapshotRequest {
            snapshot_id,
            secrets: map(&secrets, "--secret")?,
        }),
        C::SnapshotList {
            max_entries,
            starting_token,
            source_volume,
            snapshot_id,
            secrets,
            all,
        } => {
            if max_entries.is_some_and(|m| m < 0) {
                return Err(CliError::Usage("--max-entries must not be negative".into()));
            }
            Req::SnapList(
                csi::ListSnapshotsRequest {
                    max_entries: max_entries.unwrap_or(0),
                    starting_token: starting_token.unwrap_or_default(),
                    source_volume_id: source_volume.unwrap_or_default(),
                    snapshot_id: snapshot_id.unwrap_or_default(),
                    secrets: map(&secrets, "--secret")?,
                },
                all,
            )
        }
        C::SnapshotGet {
            snapshot_id,
            secrets,
        } => Req::SnapGet(csi::GetSnapshotRequest {
            snapshot_id,
            secrets: map(&secrets, "--secret")?,
        }),
    };

    let c = Csi::connect(ep, timeout).await?;
    match req {
        Req::Create(r) => emit(out, &c.create_volume(r).await?, ""),
        Req::Delete(r) => {
            let id = r.volume_id.clone();
            emit(
                out,
                &c.delete_volume(r).await?,
                &format!("volume {id} deleted"),
            )
        }
        Req::Get(r) => emit(out, &c.controller_get_volume(r).await?, ""),
        Req::Health(r) => emit(out, &c.controller_get_volume_health(r).await?, ""),
        Req::ListHealth(r, true) => emit(out, &c.list_all_volume_health(r).await?, ""),
        Req::ListHealth(r, false) => emit(out, &c.controller_list_volume_health(r).await?, ""),
        Req::List(r, true) => emit(
            out,
            &c.list_all_volumes(r.max_entries, r.starting_token).await?,
            "",
        ),
        Req::List(r, false) => emit(out, &c.list_volumes(r).await?, ""),
        Req::Capacity(r) => emit(out, &c.get_capacity(r).await?, ""),
        Req::Expand(r) => emit(out, &c.controller_expand_volume(r).await?, ""),
        Req::Validate(r) => emit(out, &c.validate_volume_capabilities(r).await?, ""),
        Req::Capabilities => emit(
            out,
            &c.controller_get_capabilities(Default::default()).await?,
            "",
        ),
        Req::Publish(r) => emit(out, &c.controller_publish_volume(r).await?, ""),
        Req::Unpublish(r) => {
            let id = r.volume_id.clone();
            emit(
                out,
                &c.controller_unpublish_volume(r).await?,
                &format!("volume {id} unpublished"),
            )
        }
        Req::Modify(r) => {
            let id = r.volume_id.clone();
            emit(
                out,
                &c.controller_modify_volume(r).await?,
                &format!("volume {id} modified"),
            )
        }
        Req::SnapCreate(r) => emit(out, &c.create_snapshot(r).await?, ""),
        Req::SnapDelete(r) => {
            let id = r.snapshot_id.clone();
            emit(
                out,
                &c.delete_snapshot(r).await?,
                &format!("snapshot {id} deleted"),
            )
        }
        Req::SnapList(r, true) => emit(out, &c.list_all_snapshots(r).await?, ""),
        Req::SnapList(r, false) => emit(out, &c.list_snapshots(r).await?, ""),
        Req::SnapGet(r) => emit(out, &c.get_snapshot(r).await?, ""),
    }
    Ok(())
}

async fn group(
    ep: &Endpoint,
    timeout: Duration,
    cmd: GroupCmd,
    out: OutputFormat,
) -> Result<(), CliError> {
    use GroupCmd as G;
    enum Req {
        Capabilities,
        Create(csi::CreateVolumeGroupSnapshotRequest),
        Delete(csi::DeleteVolumeGroupSnapshotRequest),
        Get(csi::GetVolumeGroupSnapshotRequest),
    }
    let req = match cmd {
        G::Capabilities => Req::Capabilities,
        G::Create {
            name,
            volumes,
            params,
        } => Req::Create(csi::CreateVolumeGroupSnapshotRequest {
            name,
            source_volume_ids: volumes,
            secrets: Default::default(),
            parameters: map(&params, "--param")?,
        }),
        G::Delete {
            group_snapshot_id,
            snapshot_ids,
        } => Req::Delete(csi::DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id,
            snapshot_ids,
            secrets: Default::default(),
        }),
        G::Get {
            group_snapshot_id,
            snapshot_ids,
        } => Req::Get(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id,
            snapshot_ids,
            secrets: Default::default(),
        }),
    };
    let c = Csi::connect(ep, timeout).await?;
    match req {
        Req::Capabilities => emit(
            out,
            &c.group_controller_get_capabilities(Default::default())
                .await?,
            "",
        ),
        Req::Create(r) => emit(out, &c.create_volume_group_snapshot(r).await?, ""),
        Req::Delete(r) => {
            let msg = format!("group snapshot {} deleted", r.group_snapshot_id);
            emit(out, &c.delete_volume_group_snapshot(r).await?, &msg)
        }
        Req::Get(r) => emit(out, &c.get_volume_group_snapshot(r).await?, ""),
    }
    Ok(())
}

async fn node(
    ep: &Endpoint,
    timeout: Duration,
    cmd: NodeCmd,
    out: OutputFormat,
) -> Result<(), CliError> {
    use NodeCmd as N;
    enum Req {
        Stage(csi::NodeStageVolumeRequest),
        Unstage(csi::NodeUnstageVolumeRequest),
        Publish(csi::NodePublishVolumeRequest),
        Unpublish(csi::NodeUnpublishVolumeRequest),
        Stats(csi::NodeGetVolumeStatsRequest),
        Health(csi::NodeGetVolumeHealthRequest),
        StorageHealth,
        Expand(csi::NodeExpandVolumeRequest),
        Capabilities,
        Info,
    }
    let req = match cmd {
        N::Stage {
            volume_id,
            staging_path,
            cap,
            publish_context,
            volume_context,
            secrets,
        } => Req::Stage(csi::NodeStageVolumeRequest {
            volume_id,
            publish_context: map(&publish_context, "--publish-context")?,
            staging_target_path: path_str(&staging_path)?,
            volume_capability: Some(cap.build()),
            secrets: map(&secrets, "--secret")?,
            volume_context: map(&volume_context, "--volume-context")?,
        }),
        N::Unstage {
            volume_id,
            staging_path,
        } => Req::Unstage(csi::NodeUnstageVolumeRequest {
            volume_id,
            staging_target_path: path_str(&staging_path)?,
        }),
        N::Publish {
            volume_id,
            target_path,
            staging_path,
            cap,
            readonly,
            publish_context,
            volume_context,
            secrets,
            defer_fs_ops,
        } => Req::Publish(csi::NodePublishVolumeRequest {
            volume_id,
            publish_context: map(&publish_context, "--publish-context")?,
            staging_target_path: opt_path(&staging_path)?,
            target_path: path_str(&target_path)?,
            volume_capability: Some(cap.build()),
            readonly,
            secrets: map(&secrets, "--secret")?,
            volume_context: map(&volume_context, "--volume-context")?,
            defer_fs_ops,
        }),
        N::Unpublish {
            volume_id,
            target_path,
            defer_fs_ops,
        } => Req::Unpublish(csi::NodeUnpublishVolumeRequest {
            volume_id,
            target_path: path_str(&target_path)?,
            defer_fs_ops,
        }),
        N::VolumeHealth {
            volume_id,
            volume_path,
            staging_path,
        } => Req::Health(csi::NodeGetVolumeHealthRequest {
            volume_id,
            volume_publish_path: opt_path(&volume_path)?,
            staging_target_path: opt_path(&staging_path)?,
        }),
        N::StorageHealth => Req::StorageHealth,
        N::Stats {
            volume_id,
            volume_path,
            staging_path,
            defer_fs_ops,
        } => Req::Stats(csi::NodeGetVolumeStatsRequest {
            volume_id,
            volume_path: path_str(&volume_path)?,
            staging_target_path: opt_path(&staging_path)?,
            defer_fs_ops,
        }),
        N::Expand {
            volume_id,
            volume_path,
            size,
            limit,
            staging_path,
            cap,
            secrets,
            defer_fs_ops,
        } => Req::Expand(csi::NodeExpandVolumeRequest {
            volume_id,
            volume_path: path_str(&volume_path)?,
            capacity_range: capacity(size, limit)?,
            staging_target_path: opt_path(&staging_path)?,
            // kubelet always sends the capability; so do we.
            volume_capability: Some(cap.build()),
            secrets: map(&secrets, "--secret")?,
            defer_fs_ops,
        }),
        N::Capabilities => Req::Capabilities,
        N::Info => Req::Info,
    };

    let c = Csi::connect(ep, timeout).await?;
    match req {
        Req::Stage(r) => {
            let msg = format!("volume {} staged at {}", r.volume_id, r.staging_target_path);
            emit(out, &c.node_stage_volume(r).await?, &msg)
        }
        Req::Unstage(r) => {
            let msg = format!(
                "volume {} unstaged from {}",
                r.volume_id, r.staging_target_path
            );
            emit(out, &c.node_unstage_volume(r).await?, &msg)
        }
        Req::Publish(r) => {
            let msg = format!(
                "volume {} published at {}{}",
                r.volume_id,
                r.target_path,
                if r.defer_fs_ops {
                    " (filesystem deferred to the runtime)"
                } else {
                    ""
                }
            );
            emit(out, &c.node_publish_volume(r).await?, &msg)
        }
        Req::Unpublish(r) => {
            let msg = format!("volume {} unpublished from {}", r.volume_id, r.target_path);
            emit(out, &c.node_unpublish_volume(r).await?, &msg)
        }
        Req::Stats(r) => emit(out, &c.node_get_volume_stats(r).await?, ""),
        Req::Health(r) => emit(out, &c.node_get_volume_health(r).await?, ""),
        Req::StorageHealth => emit(
            out,
            &c.node_get_storage_health(Default::default()).await?,
            "",
        ),
        Req::Expand(r) => emit(out, &c.node_expand_volume(r).await?, ""),
        Req::Capabilities => emit(out, &c.node_get_capabilities(Default::default()).await?, ""),
        Req::Info => emit(out, &c.node_get_info(Default::default()).await?, ""),
    }
    Ok(())
}

async fn bench_cmd(
    ep: &Endpoint,
    timeout: Duration,
    a: BenchArgs,
    out: OutputFormat,
) -> Result<ExitCode, CliError> {
    // The KEP fields go on the wire only in a deferral run.
    if !a.defer_fs_ops
        && (a.cap.supplemental_group.is_some() || a.cap.supplemental_group_change_policy.is_some())
    {
        return Err(CliError::Usage(
            "--supplemental-group and --supplemental-group-change-policy need --defer-fs-ops in bench"
                .into(),
        ));
    }
    let limit = match (a.duration, a.ops) {
        (Some(d), _) => Limit::Duration(d),
        (None, Some(n)) => Limit::Ops(n),
        (None, None) => Limit::Ops(100),
    };
    let mut scenarios = Vec::new();
    for s in a.scenarios {
        if !scenarios.contains(&s) {
            scenarios.push(s);
        }
    }
    let mut sweep: Vec<usize> = Vec::new();
    for n in a.stats_volumes {
        if !sweep.contains(&(n as usize)) {
            sweep.push(n as usize);
        }
    }
    let config = BenchConfig {
        scenarios,
        concurrency: a.concurrency as usize,
        limit,
        size: a.size,
        capability: a.cap.build(),
        params: map(&a.params, "--param")?,
        secrets: map(&a.secrets, "--secret")?,
        staging_dir: a.staging_dir,
        target_dir: a.target_dir,
        stats_volumes: sweep[0],
        defer_fs_ops: a.defer_fs_ops,
        cleanup_retries: a.cleanup_retries,
        run_id: None,
    };
    let c = Csi::connect(ep, timeout).await?;
    let idle = match a.idle_loops {
        0 => None,
        n => Some(bench::scale::IdleLoops::hold(n)?),
    };
    let (stop_rx, signals) = stop_on_signals();
    let mut runs = Vec::new();
    for &n in &sweep {
        let cfg = BenchConfig {
            stats_volumes: n,
            ..config.clone()
        };
        let mut report = match bench::run_bench(&c, cfg, stop_rx.clone()).await {
            Ok(r) => r,
            Err(e) => {
                signals.abort();
                return Err(e.into());
            }
        };
        if let Some(idle) = &idle {
            report.notes.push(format!(
                "{} idle loop devices held during the run (files in {})",
                idle.len(),
                idle.dir().display()
            ));
        }
        let stop = report.interrupted || !report.cleanup.leftovers.is_empty();
        runs.push((n, report));
        if stop {
            break;
        }
    }
    signals.abort();
    drop(idle);
    if sweep.len() == 1 {
        let (_, report) = runs.pop().expect("one run");
        return Ok(finish_bench(out, &report));
    }
    let sweep = bench::scale::Sweep { runs };
    emit(out, &sweep, "");
    let mut code = ExitCode::SUCCESS;
    for (_, r) in &sweep.runs {
        if r.interrupted {
            code = ExitCode::from(EXIT_INTERRUPTED);
        }
        if !r.cleanup.leftovers.is_empty() {
            say("error: cleanup left item(s) behind (listed in the report)");
            return Ok(ExitCode::from(EXIT_FAILURE));
        }
    }
    Ok(code)
}

/// A line on stderr that never panics: when whoever read our output is
/// gone (EPIPE), teardown must still run to its end.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Step lines as they happen: stdout for text, stderr when stdout is JSON
/// (write errors ignored, see [`say`]).
fn progress_printer(out: OutputFormat) -> crate::flow::Progress {
    std::sync::Arc::new(move |s: &StepReport| match out {
        OutputFormat::Text => {
            use std::io::Write;
            let _ = writeln!(std::io::stdout(), "{}", s.line());
        }
        OutputFormat::Json => say(&s.line()),
    })
}

/// First Ctrl-C/SIGTERM: stop and tear down. Second: leave now.
fn stop_on_signals() -> (
    tokio::sync::watch::Receiver<bool>,
    tokio::task::JoinHandle<()>,
) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let signals = tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        interrupted(&mut term).await;
        let _ = stop_tx.send(true);
        say("interrupted: tearing down (interrupt again to abort the teardown)");
        interrupted(&mut term).await;
        say("teardown aborted; resources may be left behind");
        std::process::exit(EXIT_INTERRUPTED as i32);
    });
    (stop_rx, signals)
}

/// The given work dir (created if missing) or a fresh
/// `/var/tmp/<prefix>-<pid>`; says whether we created it.
fn work_dir(given: Option<PathBuf>, prefix: &str) -> Result<(PathBuf, bool), CliError> {
    let dir =
        given.unwrap_or_else(|| PathBuf::from(format!("/var/tmp/{prefix}-{}", std::process::id())));
    if !dir.is_absolute() {
        return Err(CliError::Usage(format!(
            "--work-dir {}: must be an absolute path",
            dir.display()
        )));
    }
    if dir.is_dir() {
        return Ok((dir, false));
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError::Usage(format!("cannot create {}: {e}", dir.display())))?;
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
    Ok((dir, true))
}

/// Removes a work dir we created, if the flow left it empty.
fn drop_work_dir(dir: &std::path::Path, made: bool) {
    if made && let Err(e) = std::fs::remove_dir(dir) {
        say(&format!("warning: work dir {} not removed: {e}", dir.display()));
    }
}

async fn flow_cmd(
    ep: &Endpoint,
    timeout: Duration,
    a: FlowArgs,
    out: OutputFormat,
) -> Result<ExitCode, CliError> {
    if let Some(sp) = &a.sub_path
        && (sp.is_empty()
            || sp.starts_with('/')
            || sp.split('/').any(|c| c == "..")
            || sp.contains('\0'))
    {
        return Err(CliError::Usage(format!(
            "--sub-path {sp:?}: must be a relative path without '..'"
        )));
    }
    if a.sub_path.is_some() && a.pod.defer_via == DeferVia::None {
        return Err(CliError::Usage(
            "--sub-path is resolved by the VM runtime in the guest; it needs deferral".into(),
        ));
    }
    if !a.no_expand && a.expand_to <= a.pod.size {
        return Err(CliError::Usage(format!(
            "--expand-to ({}) must be larger than --size ({}); or use --no-expand",
            a.expand_to, a.pod.size
        )));
    }
    let c = Csi::connect(ep, timeout).await?;
    let (work, made) = work_dir(a.pod.work_dir.clone(), "crust-flow")?;
    let mut cfg = match a.pod.flow_config(work.clone()) {
        Ok(c) => c,
        Err(e) => {
            drop_work_dir(&work, made);
            return Err(e);
        }
    };
    cfg.expand_to = (!a.no_expand).then_some(a.expand_to);
    cfg.sub_path = a.sub_path;
    if !a.command.is_empty() {
        cfg.workload.args = a.command;
    }
    cfg.workload.env = a.env;
    cfg.workload.cwd = a.cwd;
    cfg.keep_volume = a.keep_volume;
    cfg.collect = a.collect;
    cfg.start_sandbox = !a.no_sandbox;
    let (stop, signals) = stop_on_signals();
    let report = Flow::new(cfg, c, progress_printer(out))
        .with_stop(stop.clone())
        .run()
        .await;
    signals.abort();
    drop_work_dir(&work, made);
    emit(out, &report, "");
    if *stop.borrow() {
        return Ok(ExitCode::from(EXIT_INTERRUPTED));
    }
    if !report.ok {
        if let (Some(s), Some(e)) = (&report.failed_step, &report.error) {
            say(&format!("error: {s} failed: {e}"));
        }
        return Ok(ExitCode::from(EXIT_FAILURE));
    }
    Ok(ExitCode::SUCCESS)
}

async fn demo_cmd(timeout: Duration, a: DemoArgs, out: OutputFormat) -> Result<ExitCode, CliError> {
    if a.expand_to <= a.size {
        return Err(CliError::Usage(format!(
            "--expand-to ({}) must be larger than --size ({})",
            a.expand_to, a.size
        )));
    }
    if a.expand_to > a.pool_capacity {
        return Err(CliError::Usage(format!(
            "--expand-to ({}) does not fit the pool (--pool-capacity {})",
            a.expand_to, a.pool_capacity
        )));
    }
    let cfg = DemoConfig {
        work_dir: a.work_dir,
        keep: a.keep,
        crust_csi: a.crust_csi,
        runtime_bin: a.runtime_bin,
        guest_dir: a.guest_dir,
        accel: a.accel,
        size: a.size,
        expand_to: a.expand_to,
        fs_type: a.fs_type,
        pool_capacity: a.pool_capacity,
        rpc_timeout: timeout.max(Duration::from_secs(120)),
        ..DemoConfig::default()
    };
    let (stop, signals) = stop_on_signals();
    if out == OutputFormat::Text {
        use std::io::Write;
        let _ = writeln!(
            std::io::stdout(),
            "crust demo: one pod with a deferred volume, end to end\n"
        );
    }
    let report = run_demo(cfg, progress_printer(out), stop.clone()).await;
    signals.abort();
    emit(out, &report, "");
    if *stop.borrow() {
        return Ok(ExitCode::from(EXIT_INTERRUPTED));
    }
    if !report.ok {
        if let (Some(s), Some(e)) = (&report.failed_step, &report.error) {
            say(&format!("error: {s} failed: {e}"));
        }
        return Ok(ExitCode::from(EXIT_FAILURE));
    }
    Ok(ExitCode::SUCCESS)
}

async fn bench_deferred_cmd(
    ep: &Endpoint,
    timeout: Duration,
    a: BenchArgs,
    out: OutputFormat,
) -> Result<ExitCode, CliError> {
    if a.cap.block {
        return Err(CliError::Usage(
            "--deferred hands a filesystem to the runtime; --block does not apply".into(),
        ));
    }
    let limit = match (a.duration, a.ops) {
        (Some(d), _) => Limit::Duration(d),
        (None, Some(n)) => Limit::Ops(n),
        (None, None) => Limit::Ops(100),
    };
    let c = Csi::connect(ep, timeout).await?;
    let (work, made) = work_dir(a.work_dir.clone(), "crust-bench")?;
    let mut f = FlowConfig::new(work.clone(), a.runtime.build());
    let run = bench::new_run_id();
    f.volume_name = run.clone();
    f.sandbox_id = run;
    f.size = a.size;
    f.fs_type = a.cap.fs_type.clone().unwrap_or_else(|| "ext4".into());
    f.mount_flags = a.cap.mount_flags.clone();
    f.fs_group = a.cap.supplemental_group;
    f.change_policy = a.cap.supplemental_group_change_policy;
    f.params = match map(&a.params, "--param") {
        Ok(p) => p,
        Err(e) => {
            drop_work_dir(&work, made);
            return Err(e);
        }
    };
    f.workload = Workload {
        args: vec![
            "sh".into(),
            "-c".into(),
            "trap 'exit 0' TERM; while true; do sleep 1; done".into(),
        ],
        ..Workload::default()
    };
    let cfg = bench::deferred::DeferredConfig {
        flow: f,
        concurrency: a.concurrency as usize,
        limit,
        expand_step: a.expand_step,
    };
    let (stop, signals) = stop_on_signals();
    // Set-up and teardown steps go to stderr: stdout is the table.
    let progress: crate::flow::Progress = std::sync::Arc::new(|s: &StepReport| say(&s.line()));
    let report = bench::deferred::run_deferred(&c, cfg, progress, stop).await;
    signals.abort();
    drop_work_dir(&work, made);
    Ok(finish_bench(out, &report?))
}

async fn bench_guest_io_cmd(
    ep: &Endpoint,
    timeout: Duration,
    a: BenchArgs,
    out: OutputFormat,
) -> Result<ExitCode, CliError> {
    use crate::bench::guest_io::{GuestIoConfig, run_guest_io};
    if a.cap.block {
        return Err(CliError::Usage(
            "--guest-io mounts filesystems; --block does not apply".into(),
        ));
    }
    let mut rt = a.runtime.build();
    if rt.guest_kernel.is_none() {
        // The bench image next to the binaries (target/guest-image-bench).
        let dir = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join("../guest-image-bench")))
            .filter(|d| d.join("vmlinuz").is_file())
            .ok_or_else(|| {
                CliError::Usage(
                    "no bench guest image next to crustctl: build it with `guest/build-image.sh --bench` \
                     or pass --guest-kernel/--guest-initrd of one"
                        .into(),
                )
            })?;
        rt.guest_kernel = Some(dir.join("vmlinuz"));
        rt.guest_initrd = Some(dir.join("initramfs.cpio.gz"));
    }
    let run = bench::new_run_id();
    let (work, made) = work_dir(a.work_dir.clone(), "crust-bench")?;
    let mut cfg = GuestIoConfig::new(work.clone(), rt, &run);
    cfg.fs_type = a.cap.fs_type.clone().unwrap_or_else(|| "ext4".into());
    cfg.mount_flags = a.cap.mount_flags.clone();
    let prepared = map(&a.params, "--param").and_then(|p| {
        cfg.params = p;
        cfg.apply(&a.guest_io).map_err(CliError::Usage)
    });
    if let Err(e) = prepared {
        drop_work_dir(&work, made);
        return Err(e);
    }
    let c = match Csi::connect(ep, timeout).await {
        Ok(c) => c,
        Err(e) => {
            drop_work_dir(&work, made);
            return Err(e.into());
        }
    };
    let (stop, signals) = stop_on_signals();
    // Steps go to stderr: stdout is the report.
    let progress: crate::flow::Progress = std::sync::Arc::new(|s: &StepReport| say(&s.line()));
    let report = run_guest_io(&c, cfg, progress, stop).await;
    signals.abort();
    drop_work_dir(&work, made);
    let report = report?;
    emit(out, &report, "");
    let failed = !report.cleanup.leftovers.is_empty() || !report.errors.is_empty();
    if failed {
        say(&format!(
            "error: {} failed run(s)/probe(s), {} item(s) left behind (listed in the report)",
            report.errors.len(),
            report.cleanup.leftovers.len()
        ));
    }
    Ok(ExitCode::from(match (failed, report.interrupted) {
        (true, _) => EXIT_FAILURE,
        (false, true) => EXIT_INTERRUPTED,
        (false, false) => 0,
    }))
}

/// Waits for Ctrl-C or SIGTERM.
async fn interrupted(term: &mut Option<tokio::signal::unix::Signal>) {
    match term {
        Some(t) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = t.recv() => {}
            }
        }
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn capability_from_flags() {
        let cli = Cli::try_parse_from([
            "crustctl",
            "node",
            "publish",
            "v1",
            "--target-path",
            "/t",
            "--fs-type",
            "xfs",
            "--supplemental-group",
            "100",
            "--supplemental-group-change-policy",
            "onrootmismatch",
            "--access-mode",
            "single-node-multi-writer",
        ])
        .unwrap();
        let Command::Node(NodeCmd::Publish { cap, .. }) = cli.command else {
            panic!("wrong command")
        };
        let c = cap.build();
        let Some(AccessType::Mount(m)) = c.access_type else {
            panic!("not a mount")
        };
        assert_eq!(m.fs_type, "xfs");
        assert_eq!(m.volume_supplemental_group, "100");
        assert_eq!(m.volume_supplemental_group_change_policy, "OnRootMismatch");
        assert_eq!(
            c.access_mode.unwrap().mode,
            Mode::SingleNodeMultiWriter as i32
        );
    }

    #[test]
    fn usage_errors() {
        for bad in [
            vec![
                "crustctl",
                "controller",
                "create",
                "--name",
                "x",
                "--size",
                "1GB",
            ],
            vec![
                "crustctl",
                "controller",
                "create",
                "--name",
                "x",
                "--block",
                "--fs-type",
                "ext4",
            ],
            vec![
                "crustctl",
                "controller",
                "create",
                "--name",
                "x",
                "--param",
                "novalue",
            ],
            vec![
                "crustctl",
                "node",
                "publish",
                "v",
                "--target-path",
                "/t",
                "--supplemental-group",
                "abc",
            ],
            vec![
                "crustctl",
                "--endpoint",
                "relative.sock",
                "identity",
                "info",
            ],
            vec!["crustctl", "--timeout", "0s", "identity", "info"],
            vec!["crustctl", "bench", "--scenarios", "nope"],
            vec!["crustctl", "bench", "--ops", "5", "--duration", "1s"],
        ] {
            let e = Cli::try_parse_from(&bad).unwrap_err();
            assert_eq!(e.exit_code(), EXIT_USAGE as i32, "{bad:?}");
        }
    }

    #[test]
    fn flow_demo_and_deferred_bench_parse() {
        let cli = Cli::try_parse_from([
            "crustctl",
            "flow",
            "--work-dir",
            "/w",
            "--fs-group",
            "2000",
            "--fs-group-change-policy",
            "onrootmismatch",
            "--sub-path",
            "a/b",
            "--defer-via",
            "storage-class",
            "--runtime-root",
            "/r",
            "--accel",
            "tcg",
            "--",
            "sh",
            "-c",
            "true",
        ])
        .unwrap();
        let Command::Flow(f) = cli.command else {
            panic!("not flow")
        };
        assert_eq!(f.command, ["sh", "-c", "true"]);
        assert_eq!(f.pod.defer_via, DeferVia::StorageClass);
        let cfg = f.pod.flow_config("/w".into()).unwrap();
        assert_eq!(cfg.fs_group, Some(2000));
        assert_eq!(cfg.change_policy, Some(ChangePolicy::OnRootMismatch));
        assert_eq!(
            cfg.runtime.root.as_deref(),
            Some(std::path::Path::new("/r"))
        );
        assert_eq!(cfg.runtime.accel.as_deref(), Some("tcg"));
        assert_eq!(f.expand_to, 512 << 20);

        let cli = Cli::try_parse_from(["crustctl", "demo", "--keep", "--size", "64Mi"]).unwrap();
        let Command::Demo(d) = cli.command else {
            panic!("not demo")
        };
        assert!(d.keep && d.size == 64 << 20 && d.pool_capacity == 2 << 30);

        let cli = Cli::try_parse_from([
            "crustctl",
            "bench",
            "--deferred",
            "--expand-step",
            "8Mi",
            "--ops",
            "3",
        ])
        .unwrap();
        let Command::Bench(b) = cli.command else {
            panic!("not bench")
        };
        assert!(b.deferred && b.expand_step == 8 << 20);

        for bad in [
            // the policy needs a group
            vec!["crustctl", "flow", "--fs-group-change-policy", "Always"],
            // deferred-mode flags without --deferred
            vec!["crustctl", "bench", "--expand-step", "8Mi"],
            // standard scenarios and --deferred do not mix
            vec!["crustctl", "bench", "--deferred", "--scenarios", "stats"],
            vec!["crustctl", "flow", "--no-expand", "--expand-to", "1Gi"],
            vec!["crustctl", "demo", "--fs-type", "btrfs"],
        ] {
            let e = Cli::try_parse_from(&bad).unwrap_err();
            assert_eq!(e.exit_code(), EXIT_USAGE as i32, "{bad:?}");
        }
        // fsGroup travels as volume_supplemental_group: deferral only.
        let cli =
            Cli::try_parse_from(["crustctl", "flow", "--defer-via", "none", "--fs-group", "1"])
                .unwrap();
        let Command::Flow(f) = cli.command else {
            panic!()
        };
        assert!(matches!(
            f.pod.flow_config("/w".into()),
            Err(CliError::Usage(_))
        ));
        assert!(check_name("--pod-uid", "a/b").is_err());
        assert!(check_name("--pod-uid", "..").is_err());
        assert!(check_name("--pod-uid", "uid-1").is_ok());
    }

    #[test]
    fn limit_below_size_is_a_usage_error() {
        let e = capacity(Some(10), Some(5)).unwrap_err();
        assert!(matches!(e, CliError::Usage(_)));
        assert_eq!(capacity(None, None).unwrap(), None);
    }

    #[test]
    fn grpc_error_text() {
        let e = CliError::from(tonic::Status::not_found("volume x"));
        assert_eq!(e.to_string(), "NotFound: volume x");
        assert_eq!(e.exit_code(), ExitCode::from(EXIT_FAILURE));
    }
}
