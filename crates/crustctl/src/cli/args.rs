//! The command line as clap sees it: every subcommand and flag, with the
//! parsers of single values. Turning flags into requests is `request`'s job.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use crust_handoff::FsGroupChangePolicy;
use crust_proto::csi::v1::volume_capability::access_mode::Mode;
use crust_proto::endpoint::Endpoint;

use crate::parse::{KeyValue, parse_change_policy, parse_key_value};
use crust_bench::Scenario;
use crust_kubesim::flow::DeferVia;
use crust_report::OutputFormat;
use crust_report::units::{parse_duration, parse_size};

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
        default_value = crust_proto::endpoint::DEFAULT_CSI_ENDPOINT,
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
    /// The pod's fsGroupChangePolicy: Always or OnRootMismatch.
    #[arg(long, value_parser = parse_change_policy, requires = "fs_group")]
    pub fs_group_change_policy: Option<FsGroupChangePolicy>,
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
    #[arg(long, default_value = "ext4",
          value_parser = clap::builder::PossibleValuesParser::new(crust_fs::FsType::NAMES))]
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
    /// KEP-2857 MountVolume.volume_supplemental_group_change_policy:
    /// Always or OnRootMismatch.
    #[arg(long, value_parser = parse_change_policy)]
    pub supplemental_group_change_policy: Option<FsGroupChangePolicy>,
    /// Access mode [default: single-node-writer].
    #[arg(long, value_enum)]
    pub access_mode: Option<AccessModeArg>,
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
    /// Deferred mode: each worker waits this long after each stats or
    /// health call, so that calls reach an idle guest as kubelet's
    /// once-a-minute polls do (e.g. 20ms) [default: back to back].
    #[arg(long, value_parser = parse_duration, requires = "deferred")]
    pub pause: Option<std::time::Duration>,
    /// Deferred and guest I/O modes: work dir (kubelet root, bundles)
    /// [default: a fresh /var/tmp/crust-bench-<pid>, removed afterwards].
    #[arg(long, value_name = "DIR", requires = "pod_mode")]
    pub work_dir: Option<PathBuf>,
    #[command(flatten)]
    pub guest_io: crust_bench::guest_io::GuestIoArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
}
