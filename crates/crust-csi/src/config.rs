//! Plugin configuration: the command line (in the style of the CSI
//! sidecars, every flag also settable as `CRUST_CSI_*`) and the resolved
//! [`Config`] that [`crate::serve`] runs with.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crust_ops::{LayoutMode, OpsConfig};
use crust_proto::endpoint::Endpoint;

/// Default size of a volume whose CreateVolume request sets no capacity.
pub const DEFAULT_VOLUME_SIZE: u64 = 1 << 30;

/// Where the Handover service listens by default (the VM runtime's
/// default too).
pub const DEFAULT_HANDOVER_ENDPOINT: &str = "unix:///run/crust/handover.sock";

/// Default plugin name (`GetPluginInfo.name`, topology key prefix).
pub const DEFAULT_DRIVER_NAME: &str = "blk.crust.dev";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--endpoint {0:?}: {1}")]
    Endpoint(String, String),
    #[error("--driver-name {0:?}: {1}")]
    DriverName(String, String),
    #[error("--node-id {0:?}: {1}")]
    NodeId(String, String),
    #[error("size {0:?}: {1}")]
    Size(String, String),
    #[error("{0}")]
    Backend(String),
    #[error("duration {0:?}: expected a number with unit ms, s or m (e.g. 500ms, 5s)")]
    Duration(String),
    #[error("--state-dir {0:?}: must be an absolute path")]
    StateDir(PathBuf),
    #[error("{0}")]
    Deferral(String),
    #[error("{0}")]
    Peer(String),
}

/// How this plugin reaches the other nodes' plugins, and is reached by
/// them, for controller RPCs of volumes another node owns (`crate::peer`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerConfig {
    /// Where the other nodes' requests are served (TCP); None: not served.
    pub listen: Option<SocketAddr>,
    /// `host:port` of the other nodes' plugins, each resolved to all its
    /// addresses at every request (a headless Service's name gives every
    /// node); empty: a volume not on this node is NOT_FOUND.
    pub peers: Vec<String>,
    /// The key every node shares, read at each request (a Secret that is
    /// created or rotated later is picked up without a restart).
    pub key_file: Option<PathBuf>,
    /// How long a forwarded request may take, the owner's work included.
    pub timeout: Duration,
}

impl PeerConfig {
    /// Whether a ModifyVolume of an unknown volume is asked of the peers.
    pub fn forwards(&self) -> bool {
        !self.peers.is_empty()
    }
}

/// Which backend serves the volumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendConfig {
    /// Sparse files in `dir`, attached as loop devices, at most
    /// `capacity_bytes` allocated in total.
    Pool { dir: PathBuf, capacity_bytes: u64 },
    /// Pre-provisioned block devices, one volume each; `declared_blank`
    /// are formatted without first reading them whole.
    Static {
        devices: Vec<PathBuf>,
        declared_blank: Vec<PathBuf>,
    },
}

/// Test-only hooks; production configurations leave them empty.
#[derive(Clone, Default)]
pub struct Hooks {
    /// NodeStageVolume waits on this gate after taking the volume's
    /// operation guard, so a test can race a second call deterministically.
    pub stage_gate: Option<Arc<Gate>>,
    /// The plugin SIGKILLs itself at this step of a handover (the crash
    /// tests; the binary reads `CRUST_CSI_TEST_HANDOVER_CRASH`).
    pub handover_crash: Option<crate::records::HandoverStep>,
    /// HandOver waits on this gate after taking the volume's operation
    /// guard (races against NodeUnpublish/NodeExpand).
    pub handover_gate: Option<Arc<Gate>>,
    /// The plugin SIGKILLs itself at this step of a host publish (the
    /// binary reads `CRUST_CSI_TEST_PUBLISH_CRASH`).
    pub publish_crash: Option<crate::records::PublishStep>,
}

/// Test-only: the handover step at which the `crust-csi` binary kills
/// itself (see [`Hooks::handover_crash`]).
pub const HANDOVER_CRASH_ENV: &str = "CRUST_CSI_TEST_HANDOVER_CRASH";

/// Test-only: the publish step at which the `crust-csi` binary kills
/// itself (see [`Hooks::publish_crash`]).
pub const PUBLISH_CRASH_ENV: &str = "CRUST_CSI_TEST_PUBLISH_CRASH";

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("stage_gate", &self.stage_gate.is_some())
            .field("handover_crash", &self.handover_crash)
            .field("handover_gate", &self.handover_gate.is_some())
            .field("publish_crash", &self.publish_crash)
            .finish()
    }
}

/// A one-shot rendezvous: the first operation that reaches it signals
/// `entered` and waits for `release`; later ones pass straight through.
pub struct Gate {
    armed: std::sync::atomic::AtomicBool,
    pub entered: tokio::sync::Notify,
    pub release: tokio::sync::Notify,
}

impl Gate {
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate {
            armed: std::sync::atomic::AtomicBool::new(true),
            entered: tokio::sync::Notify::new(),
            release: tokio::sync::Notify::new(),
        })
    }

    /// Called by the plugin from a blocking thread.
    pub(crate) fn pass(&self) {
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            self.entered.notify_one();
            tokio::runtime::Handle::current().block_on(self.release.notified());
        }
    }
}

/// Everything the plugin needs to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Unix socket to serve on.
    pub socket: PathBuf,
    /// Root-only unix socket of the Handover service (runtime-driven
    /// deferral); None: not served.
    pub handover_socket: Option<PathBuf>,
    pub node_id: String,
    pub driver_name: String,
    /// Per-volume records live in `<state_dir>/volumes`.
    pub state_dir: PathBuf,
    pub backend: BackendConfig,
    /// NodeGetInfo.max_volumes_per_node; 0 = no limit reported.
    pub max_volumes_per_node: i64,
    /// How long a computed VolumeCondition is reused.
    pub health_ttl: Duration,
    /// Upper bound for one health check or statvfs; past it the volume is
    /// reported abnormal instead of hanging the RPC.
    pub health_timeout: Duration,
    /// Deferred filesystem operations (KEP-2857).
    pub deferral: DeferralConfig,
    /// Which CSI generation's surface is advertised and served.
    pub csi_spec: CsiSpec,
    /// Where `/metrics` is served (Prometheus text format); None: not served.
    pub metrics_address: Option<SocketAddr>,
    /// How long a connection to the peer or metrics port (both reachable
    /// from the pod network) may stay without a request.
    pub listener_idle: Duration,
    /// Which service grows a volume's backing store.
    pub expansion: Expansion,
    /// Node-to-node requests (ControllerModifyVolume of another node's
    /// volume); off by default.
    pub peer: PeerConfig,
    pub hooks: Hooks,
}

/// Deferred filesystem operations: whether they are offered, and how the
/// in-process crust_ops writes and serves hand-off records.
#[derive(Debug, Clone)]
pub struct DeferralConfig {
    /// Advertise DEFER_FS_OPS* and accept deferral requests. When false
    /// the hand-off settings are still used to clean up records of
    /// volumes published with deferral before a downgrade (KEP story 5).
    pub enabled: bool,
    pub ops: OpsConfig,
}

impl Default for DeferralConfig {
    fn default() -> Self {
        DeferralConfig {
            enabled: true,
            ops: OpsConfig::default(),
        }
    }
}

impl Config {
    /// The topology key of this plugin: `<driver-name>/node`.
    pub fn topology_key(&self) -> String {
        format!("{}/node", self.driver_name)
    }

    /// This node's topology segments: `{ "<driver>/node": <node-id> }`.
    pub(crate) fn segments(&self) -> std::collections::HashMap<String, String> {
        std::collections::HashMap::from([(self.topology_key(), self.node_id.clone())])
    }

    pub(crate) fn topology(&self) -> crust_proto::csi::v1::Topology {
        crust_proto::csi::v1::Topology {
            segments: self.segments(),
        }
    }

    /// Whether a topology requirement entry selects this node: every
    /// segment it names must be one of ours with the same value.
    pub(crate) fn topology_matches(&self, t: &crust_proto::csi::v1::Topology) -> bool {
        let ours = self.segments();
        !t.segments.is_empty() && t.segments.iter().all(|(k, v)| ours.get(k) == Some(v))
    }

    /// A pool-backed configuration with defaults for everything else;
    /// convenient for tests and for `crustctl demo`.
    pub fn pool(socket: PathBuf, state_dir: PathBuf, pool_dir: PathBuf, capacity: u64) -> Config {
        Config {
            socket,
            handover_socket: None,
            node_id: default_node_id(),
            driver_name: DEFAULT_DRIVER_NAME.to_string(),
            state_dir,
            backend: BackendConfig::Pool {
                dir: pool_dir,
                capacity_bytes: capacity,
            },
            max_volumes_per_node: 0,
            health_ttl: Duration::from_secs(5),
            health_timeout: Duration::from_secs(3),
            deferral: DeferralConfig::default(),
            csi_spec: CsiSpec::Both,
            metrics_address: None,
            listener_idle: Duration::from_secs(30),
            expansion: Expansion::Controller,
            peer: PeerConfig::default(),
            hooks: Hooks::default(),
        }
    }
}

/// The CSI generation(s) whose surface the plugin presents. CSI has no
/// version negotiation, and strict conformance clients reject capability
/// values they do not know, so an operator can pick one generation
/// exactly; real COs ignore values they do not know and are served best by
/// `both`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CsiSpec {
    /// v1.12: VOLUME_CONDITION capabilities and condition fields; the
    /// v1.13 health RPCs answer UNIMPLEMENTED.
    #[value(name = "1.12")]
    V1_12,
    /// v1.13: the health RPCs and their capabilities; no condition fields.
    #[value(name = "1.13")]
    V1_13,
    /// Everything of both.
    Both,
}

impl CsiSpec {
    /// Whether the v1.12 VolumeCondition surface is served.
    pub fn serves_condition(self) -> bool {
        self != CsiSpec::V1_13
    }

    /// Whether the v1.13 volume-health surface is served.
    pub fn serves_health_api(self) -> bool {
        self != CsiSpec::V1_12
    }
}

/// Command line of the `crust-csi` binary.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "crust-csi",
    version,
    about = "CSI plugin serving local block volumes (Identity, Controller and Node on one socket)",
    long_about = "CSI plugin serving local block volumes: sparse files on loop devices (pool \
backend) or pre-provisioned block devices (static backend), with ext4/xfs, raw block, online \
expansion, capacity, node topology and volume health. One process serves Identity, Controller \
and Node on a unix socket, so it runs on every node (distributed provisioning). Every flag can \
also be set through the environment variable shown."
)]
pub struct Cli {
    /// CSI endpoint to serve on (unix:///path/to/csi.sock). The socket is
    /// created mode 0600; a missing parent directory is created mode 0700;
    /// a stale socket is replaced, any other file there is refused.
    #[arg(
        long,
        env = "CRUST_CSI_ENDPOINT",
        default_value = crust_proto::endpoint::DEFAULT_CSI_ENDPOINT
    )]
    pub endpoint: String,

    /// Root-only unix socket of the Handover service, through which the
    /// crust VM runtime takes a host-published volume into its guest
    /// (runtime-driven deferral, StorageClass deferFsOps=auto) and gives
    /// it back. Empty: not served (runtimes then share host mounts).
    #[arg(
        long,
        env = "CRUST_CSI_HANDOVER_ENDPOINT",
        default_value = DEFAULT_HANDOVER_ENDPOINT
    )]
    pub handover_endpoint: String,

    /// Node id reported by NodeGetInfo and used as the topology segment
    /// (default: the host name).
    #[arg(long, env = "CRUST_CSI_NODE_ID")]
    pub node_id: Option<String>,

    /// Plugin name (GetPluginInfo); the topology key is <driver-name>/node.
    #[arg(long, env = "CRUST_CSI_DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME)]
    pub driver_name: String,

    /// Directory for the plugin's per-volume records (created 0700).
    #[arg(
        long,
        env = "CRUST_CSI_STATE_DIR",
        default_value = "/var/lib/crust-csi"
    )]
    pub state_dir: PathBuf,

    /// Volume backend: `pool` (sparse files attached as loop devices) or
    /// `static` (pre-provisioned block devices given with --static-device).
    #[arg(long, env = "CRUST_CSI_BACKEND", value_enum, default_value_t = BackendKind::Pool)]
    pub backend: BackendKind,

    /// Pool backend: directory holding the sparse backing files
    /// (default: <state-dir>/pool).
    #[arg(long, env = "CRUST_CSI_POOL_DIR")]
    pub pool_dir: Option<PathBuf>,

    /// Pool backend: total bytes the pool may allocate, e.g. 10Gi, 512Mi,
    /// 20G or a plain byte count.
    #[arg(long, env = "CRUST_CSI_POOL_CAPACITY", default_value = "10Gi")]
    pub pool_capacity: String,

    /// Static backend: a block device to hand out as one volume; repeat
    /// the flag (or separate with commas in the environment) for more.
    #[arg(
        long = "static-device",
        env = "CRUST_CSI_STATIC_DEVICE",
        value_delimiter = ','
    )]
    pub static_devices: Vec<PathBuf>,

    /// Static backend: declares a --static-device blank (it holds nothing
    /// worth keeping), so it is formatted without first being read whole.
    /// Without it, a device is formatted only after a full background read
    /// finds it all zeros (NodeStageVolume answers ABORTED meanwhile) or
    /// after a crust volume on it was deleted. Repeat the flag (or separate
    /// with commas in the environment) for more.
    #[arg(
        long = "static-device-blank",
        env = "CRUST_CSI_STATIC_DEVICE_BLANK",
        value_delimiter = ','
    )]
    pub static_device_blank: Vec<PathBuf>,

    /// NodeGetInfo.max_volumes_per_node (0: no limit reported).
    #[arg(long, env = "CRUST_CSI_MAX_VOLUMES_PER_NODE", default_value_t = 0)]
    pub max_volumes_per_node: i64,

    /// How long a computed volume condition is reused before it is
    /// checked again (e.g. 5s, 500ms, 0s to always re-check).
    #[arg(long, env = "CRUST_CSI_HEALTH_TTL", default_value = "5s")]
    pub health_ttl: String,

    /// Time bound of one health check or statvfs; a volume whose check
    /// does not finish in time is reported abnormal (hung filesystem).
    #[arg(long, env = "CRUST_CSI_HEALTH_TIMEOUT", default_value = "3s")]
    pub health_timeout: String,

    /// Deferred filesystem operations (KEP-2857): `enabled` advertises
    /// DEFER_FS_OPS (with the supplemental-group capabilities) and hands
    /// deferred volumes to the pod's runtime through hand-off records;
    /// `disabled` refuses deferral requests with FAILED_PRECONDITION.
    #[arg(long, env = "CRUST_CSI_DEFERRAL", value_enum, default_value_t = Deferral::Enabled)]
    pub deferral: Deferral,

    /// Hand-off record layout written for deferred volumes: `crust`
    /// (KEP-2857, <crust-root>/<sha256 of target>/), `kata` (Kata direct
    /// volumes, <kata-root>/<base64url of target>/) or `both`.
    #[arg(long, env = "CRUST_CSI_HANDOFF_LAYOUT", value_enum, default_value_t = HandoffLayout::Crust)]
    pub handoff_layout: HandoffLayout,

    /// Root of the CRUST hand-off layout.
    #[arg(long, env = "CRUST_CSI_CRUST_ROOT", default_value = crust_handoff::DEFAULT_CRUST_ROOT)]
    pub crust_root: PathBuf,

    /// Root of the Kata direct-volume layout.
    #[arg(long, env = "CRUST_CSI_KATA_ROOT", default_value = crust_handoff::DEFAULT_KATA_ROOT)]
    pub kata_root: PathBuf,

    /// The Kata runtime CLI (`direct-volume stats|resize`) for the Kata layout.
    #[arg(long, env = "CRUST_CSI_KATA_RUNTIME", default_value = crust_ops::DEFAULT_KATA_RUNTIME)]
    pub kata_runtime: PathBuf,

    /// How long a runtime CLI call (stats, resize) may take before it is
    /// killed (DEADLINE_EXCEEDED).
    #[arg(long, env = "CRUST_CSI_RUNTIME_CLI_TIMEOUT", default_value = "30s")]
    pub runtime_cli_timeout: String,

    /// Deferred publish targets must lie beneath this directory; repeat
    /// the flag (or separate with commas in the environment) for more.
    /// None: any absolute path. Kubelet deployments set
    /// /var/lib/kubelet/pods/.
    #[arg(
        long = "allowed-target-prefix",
        env = "CRUST_CSI_ALLOWED_TARGET_PREFIX",
        value_delimiter = ','
    )]
    pub allowed_target_prefixes: Vec<String>,

    /// CSI surface to present: `1.12` (VOLUME_CONDITION in stats,
    /// ListVolumes and ControllerGetVolume), `1.13` (the volume-health
    /// RPCs), or `both` (what Kubernetes' kubelet and sidecars of either
    /// generation handle: they ignore what they do not know).
    #[arg(long, env = "CRUST_CSI_SPEC", value_enum, default_value_t = CsiSpec::Both)]
    pub csi_spec: CsiSpec,

    /// Serve Prometheus metrics at http://<address>/metrics (e.g.
    /// 127.0.0.1:9808; port 0 picks a free port, logged at start).
    #[arg(long, env = "CRUST_CSI_METRICS_ADDRESS")]
    pub metrics_address: Option<SocketAddr>,

    /// A connection to the peer or metrics port (reachable from the pod
    /// network) that holds no request this long is closed; a client
    /// reconnects at its next request.
    #[arg(long, env = "CRUST_CSI_LISTENER_IDLE_TIMEOUT", default_value = "30s")]
    pub listener_idle_timeout: String,

    /// Who grows a volume's backing store: `controller` (ControllerExpandVolume,
    /// then NodeExpandVolume grows the filesystem) or `node` (EXPAND_VOLUME
    /// is not advertised by the controller; NodeExpandVolume grows the
    /// backing store and then the filesystem). Kubernetes deployments use
    /// `node`: the external-resizer runs centrally and cannot reach a file
    /// that lives on one node.
    #[arg(long, env = "CRUST_CSI_EXPANSION", value_enum, default_value_t = Expansion::Controller)]
    pub expansion: Expansion,

    /// Serve other nodes' crust-csi on this TCP address (e.g. [::]:9811):
    /// ControllerModifyVolume of a volume this node owns, sealed with
    /// --peer-key-file. Needs --peer-key-file.
    #[arg(long, env = "CRUST_CSI_PEER_ADDRESS")]
    pub peer_address: Option<SocketAddr>,

    /// The other nodes' crust-csi, comma-separated host:port (a headless
    /// Service's name resolves to every node): a ControllerModifyVolume of
    /// a volume not on this node is passed to them. Needs --peer-key-file.
    #[arg(long, env = "CRUST_CSI_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,

    /// The key all nodes share (at least 32 bytes; a Secret's file), read
    /// at each peer request.
    #[arg(long, env = "CRUST_CSI_PEER_KEY_FILE")]
    pub peer_key_file: Option<PathBuf>,

    /// How long a request passed to the other nodes may take, the owner's
    /// live change included (the external-resizer's --timeout is longer).
    #[arg(long, env = "CRUST_CSI_PEER_TIMEOUT", default_value = "45s")]
    pub peer_timeout: String,

    /// Log level: error, warn, info, debug, trace, a klog-style number
    /// (0-2 info, 3-4 debug, 5+ trace) or a tracing filter directive.
    #[arg(
        short = 'v',
        long = "log-level",
        env = "CRUST_CSI_LOG_LEVEL",
        default_value = "info"
    )]
    pub log_level: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    Pool,
    Static,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Deferral {
    Enabled,
    Disabled,
}

/// Which service grows a volume's backing store (see `--expansion`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Expansion {
    /// ControllerExpandVolume grows it; NodeExpandVolume grows the filesystem.
    Controller,
    /// NodeExpandVolume grows both; the controller does not advertise
    /// EXPAND_VOLUME, so the external-resizer leaves the work to kubelet.
    Node,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HandoffLayout {
    Crust,
    Kata,
    Both,
}

impl HandoffLayout {
    pub fn to_ops(self) -> LayoutMode {
        match self {
            HandoffLayout::Crust => LayoutMode::Crust,
            HandoffLayout::Kata => LayoutMode::Kata,
            HandoffLayout::Both => LayoutMode::Both,
        }
    }
}

impl Cli {
    /// Validates the flags and resolves defaults.
    pub fn into_config(self) -> Result<Config, ConfigError> {
        let endpoint = Endpoint::parse(&self.endpoint)
            .map_err(|e| ConfigError::Endpoint(self.endpoint.clone(), e.to_string()))?;
        let socket = endpoint
            .unix_path()
            .ok_or_else(|| {
                ConfigError::Endpoint(
                    self.endpoint.clone(),
                    "only unix:// endpoints are served".into(),
                )
            })?
            .to_path_buf();
        let handover_socket = match self.handover_endpoint.as_str() {
            "" => None,
            e => Some(
                Endpoint::parse(e)
                    .ok()
                    .and_then(|ep| ep.unix_path().map(Path::to_path_buf))
                    .ok_or_else(|| {
                        ConfigError::Endpoint(
                            e.to_string(),
                            "--handover-endpoint must be a unix:// socket path (or empty)".into(),
                        )
                    })?,
            ),
        };
        validate_driver_name(&self.driver_name)?;
        let node_id = match &self.node_id {
            Some(n) => n.clone(),
            None => default_node_id(),
        };
        validate_node_id(&node_id)?;
        if !self.state_dir.is_absolute() {
            return Err(ConfigError::StateDir(self.state_dir));
        }
        let backend = self.backend_config()?;
        let ops = self.ops_config()?;
        let peer = self.peer_config()?;
        let hooks = Hooks {
            handover_crash: std::env::var(HANDOVER_CRASH_ENV)
                .ok()
                .and_then(|s| crate::records::HandoverStep::parse(&s)),
            publish_crash: std::env::var(PUBLISH_CRASH_ENV)
                .ok()
                .and_then(|s| crate::records::PublishStep::parse(&s)),
            ..Hooks::default()
        };
        Ok(Config {
            socket,
            handover_socket,
            node_id,
            driver_name: self.driver_name,
            state_dir: self.state_dir,
            backend,
            max_volumes_per_node: self.max_volumes_per_node.max(0),
            health_ttl: parse_duration(&self.health_ttl)?,
            health_timeout: parse_duration(&self.health_timeout)?.max(Duration::from_millis(10)),
            deferral: DeferralConfig {
                enabled: self.deferral == Deferral::Enabled,
                ops,
            },
            csi_spec: self.csi_spec,
            metrics_address: self.metrics_address,
            listener_idle: parse_duration(&self.listener_idle_timeout)?
                .max(Duration::from_millis(100)),
            expansion: self.expansion,
            peer,
            hooks,
        })
    }

    /// `--peer-*`: both directions need the key; every peer names a port.
    fn peer_config(&self) -> Result<PeerConfig, ConfigError> {
        let peers: Vec<String> = self
            .peers
            .iter()
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect();
        for p in &peers {
            let port = p.rsplit_once(':').map(|(_, port)| port.parse::<u16>());
            if !matches!(port, Some(Ok(n)) if n > 0) {
                return Err(ConfigError::Peer(format!(
                    "--peers {p:?}: expected host:port (e.g. crust-csi-peers.crust-system.svc:9811)"
                )));
            }
        }
        if (self.peer_address.is_some() || !peers.is_empty()) && self.peer_key_file.is_none() {
            return Err(ConfigError::Peer(
                "--peer-address and --peers need --peer-key-file (the key all nodes share)".into(),
            ));
        }
        Ok(PeerConfig {
            listen: self.peer_address,
            peers,
            key_file: self.peer_key_file.clone(),
            timeout: parse_duration(&self.peer_timeout)?.max(Duration::from_secs(1)),
        })
    }

    /// The tracing filter directive for `--log-level`.
    pub fn log_filter(&self) -> String {
        log_filter(&self.log_level)
    }

    /// Where volume bytes live: the pool (the default) or static devices.
    fn backend_config(&self) -> Result<BackendConfig, ConfigError> {
        Ok(match self.backend {
            BackendKind::Pool => {
                if !self.static_devices.is_empty() || !self.static_device_blank.is_empty() {
                    return Err(ConfigError::Backend(
                        "--static-device and --static-device-blank are only valid with --backend static"
                            .into(),
                    ));
                }
                let capacity_bytes = parse_size(&self.pool_capacity)?;
                if capacity_bytes == 0 {
                    return Err(ConfigError::Size(
                        self.pool_capacity.clone(),
                        "the pool capacity must be greater than zero".into(),
                    ));
                }
                let dir = self
                    .pool_dir
                    .clone()
                    .unwrap_or_else(|| self.state_dir.join("pool"));
                if !dir.is_absolute() {
                    return Err(ConfigError::Backend(format!(
                        "--pool-dir {}: must be an absolute path",
                        dir.display()
                    )));
                }
                BackendConfig::Pool {
                    dir,
                    capacity_bytes,
                }
            }
            BackendKind::Static => {
                if self.static_devices.is_empty() {
                    return Err(ConfigError::Backend(
                        "--backend static needs at least one --static-device".into(),
                    ));
                }
                // Each must be a --static-device: checked by the backend,
                // which compares device numbers, not spellings.
                BackendConfig::Static {
                    devices: self.static_devices.clone(),
                    declared_blank: self.static_device_blank.clone(),
                }
            }
        })
    }

    /// The hand-off settings, checked as crust_ops checks them at start.
    fn ops_config(&self) -> Result<OpsConfig, ConfigError> {
        let cli_timeout = parse_duration(&self.runtime_cli_timeout)?;
        if cli_timeout.is_zero() {
            return Err(ConfigError::Deferral(
                "--runtime-cli-timeout must be greater than zero".into(),
            ));
        }
        for (flag, p) in [
            ("--crust-root", &self.crust_root),
            ("--kata-root", &self.kata_root),
            ("--kata-runtime", &self.kata_runtime),
        ] {
            if !p.is_absolute() {
                return Err(ConfigError::Deferral(format!(
                    "{flag} {}: must be an absolute path",
                    p.display()
                )));
            }
        }
        let ops = OpsConfig {
            layout: self.handoff_layout.to_ops(),
            crust_root: self.crust_root.clone(),
            kata_root: self.kata_root.clone(),
            kata_runtime: self.kata_runtime.clone(),
            cli_timeout,
            allowed_target_prefixes: self.allowed_target_prefixes.clone(),
            ..OpsConfig::default()
        };
        // Same checks crust_ops makes when the plugin starts: report a
        // bad prefix as a flag error, not a start-up failure.
        crust_ops::CrustOps::new(ops.clone())
            .map_err(|e| ConfigError::Deferral(format!("hand-off settings: {e}")))?;
        Ok(ops)
    }
}

/// Maps `-v` values to a tracing filter: names pass through, klog-style
/// numbers are translated.
pub fn log_filter(level: &str) -> String {
    match level.trim().parse::<u32>() {
        Ok(0..=2) => "info".into(),
        Ok(3..=4) => "debug".into(),
        Ok(_) => "trace".into(),
        Err(_) => level.trim().to_string(),
    }
}

/// The host name, the default node id.
pub fn default_node_id() -> String {
    let uname = rustix::system::uname();
    let name = uname.nodename().to_string_lossy().into_owned();
    if name.is_empty() {
        "localhost".to_string()
    } else {
        name
    }
}

/// Parses a size such as `10Gi`, `512Mi`, `20G` or `4096`: an integer
/// (fractions are refused) with an optional binary suffix Ki Mi Gi Ti Pi or
/// decimal suffix k/K M G T P, optionally followed by `B`.
pub fn parse_size(s: &str) -> Result<u64, ConfigError> {
    let bad = |why: &str| ConfigError::Size(s.to_string(), why.to_string());
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return Err(bad(
            "expected an integer optionally followed by Ki, Mi, Gi, Ti, K, M, G or T",
        ));
    }
    let n: u64 = t[..digits_end]
        .parse()
        .map_err(|_| bad("number too large"))?;
    let suffix = t[digits_end..].trim();
    let suffix = suffix.strip_suffix('B').unwrap_or(suffix);
    let mult: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "k" | "K" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        _ => return Err(bad("unknown unit; use Ki, Mi, Gi, Ti, Pi, K, M, G, T or P")),
    };
    n.checked_mul(mult)
        .filter(|v| *v <= i64::MAX as u64)
        .ok_or_else(|| bad("size too large"))
}

/// Parses `500ms`, `5s`, `2m` or a plain number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, ConfigError> {
    let t = s.trim();
    let bad = || ConfigError::Duration(s.to_string());
    let (num, unit) = match t.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => (&t[..i], &t[i..]),
        None => (t, "s"),
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n.checked_mul(60).ok_or_else(bad)?)),
        _ => Err(bad()),
    }
}

fn validate_driver_name(name: &str) -> Result<(), ConfigError> {
    let bad = |why: &str| ConfigError::DriverName(name.to_string(), why.to_string());
    if name.is_empty() || name.len() > 63 {
        return Err(bad("must be 1 to 63 characters"));
    }
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    let first = name.as_bytes()[0];
    let last = name.as_bytes()[name.len() - 1];
    if !ok_chars || !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
        return Err(bad(
            "must be a domain-style name: letters, digits, '-' and '.', starting and ending with a letter or digit",
        ));
    }
    Ok(())
}

fn validate_node_id(id: &str) -> Result<(), ConfigError> {
    if id.is_empty() || id.len() > 128 {
        return Err(ConfigError::NodeId(
            id.to_string(),
            "must be 1 to 128 bytes".into(),
        ));
    }
    // The node id becomes a topology label value in Kubernetes.
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    {
        return Err(ConfigError::NodeId(
            id.to_string(),
            "only letters, digits, '-', '.' and '_' are allowed".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("10Gi").unwrap(), 10 << 30);
        assert_eq!(parse_size("512Mi").unwrap(), 512 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("2G").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("1KiB").unwrap(), 1024);
        assert!(parse_size("Gi").is_err());
        assert!(parse_size("1.5Gi").is_err());
        assert!(parse_size("10Xi").is_err());
        assert!(parse_size("99999999999Pi").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("5h").is_err());
    }

    #[test]
    fn cli_resolves_defaults_and_rejects_bad_flags() {
        let cfg = Cli::parse_from([
            "crust-csi",
            "--endpoint",
            "unix:///tmp/x/csi.sock",
            "--node-id",
            "n1",
            "--state-dir",
            "/tmp/st",
            "--pool-capacity",
            "512Mi",
        ])
        .into_config()
        .unwrap();
        assert_eq!(cfg.socket, PathBuf::from("/tmp/x/csi.sock"));
        assert_eq!(cfg.topology_key(), "blk.crust.dev/node");
        assert_eq!(
            cfg.backend,
            BackendConfig::Pool {
                dir: "/tmp/st/pool".into(),
                capacity_bytes: 512 << 20
            }
        );
        let bad = |args: &[&str]| {
            let mut v = vec!["crust-csi", "--node-id", "n1"];
            v.extend_from_slice(args);
            Cli::try_parse_from(v)
                .map(|c| c.into_config().is_err())
                .unwrap_or(true)
        };
        assert!(bad(&["--endpoint", "relative.sock"]));
        assert!(bad(&["--endpoint", "http://127.0.0.1:1"]));
        assert!(bad(&["--driver-name=-bad"]));
        assert!(bad(&["--driver-name", "a_b"]));
        assert!(bad(&["--backend", "static"]));
        assert!(bad(&["--static-device", "/dev/loop0"]));
        assert!(bad(&["--static-device-blank", "/dev/loop0"]));
        assert!(bad(&["--pool-capacity", "0"]));
        assert!(bad(&["--state-dir", "rel"]));
        assert_eq!(log_filter("5"), "trace");
        assert_eq!(log_filter("debug"), "debug");
    }

    #[test]
    fn peer_flags_need_the_key_and_ports() {
        let parse = |args: &[&str]| {
            let mut v = vec!["crust-csi", "--node-id", "n1"];
            v.extend_from_slice(args);
            Cli::parse_from(v).into_config()
        };
        let off = parse(&[]).unwrap().peer;
        assert!(!off.forwards() && off.listen.is_none());
        let on = parse(&[
            "--peer-address=[::]:9811",
            "--peers",
            "crust-csi-peers.crust-system.svc:9811, 10.0.0.2:9811",
            "--peer-key-file=/etc/crust-csi/peer/key",
        ])
        .unwrap()
        .peer;
        assert!(on.forwards());
        assert_eq!(
            on.peers,
            ["crust-csi-peers.crust-system.svc:9811", "10.0.0.2:9811"]
        );
        assert_eq!(on.timeout, Duration::from_secs(45));
        for bad in [
            &["--peers=h:9811"][..],
            &["--peer-address=0.0.0.0:9811"],
            &["--peers=nohost", "--peer-key-file=/k"],
            &["--peers=h:0", "--peer-key-file=/k"],
            &["--peers=h:99999", "--peer-key-file=/k"],
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("--peer"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn deferral_flags() {
        let base = ["crust-csi", "--node-id", "n1"];
        let cfg = Cli::parse_from(base).into_config().unwrap();
        assert!(cfg.deferral.enabled, "enabled by default");
        assert_eq!(cfg.deferral.ops.layout, LayoutMode::Crust);
        assert_eq!(cfg.deferral.ops.crust_root, PathBuf::from("/var/run/crust"));
        assert_eq!(
            cfg.deferral.ops.kata_root,
            PathBuf::from("/run/kata-containers/shared/direct-volumes")
        );
        assert_eq!(
            cfg.deferral.ops.kata_runtime,
            PathBuf::from("/usr/bin/kata-runtime")
        );
        assert_eq!(cfg.deferral.ops.cli_timeout, Duration::from_secs(30));
        assert!(cfg.deferral.ops.allowed_target_prefixes.is_empty());
        assert_eq!(cfg.metrics_address, None);

        let mut args = base.to_vec();
        args.extend([
            "--deferral",
            "disabled",
            "--handoff-layout",
            "both",
            "--crust-root",
            "/srv/crust",
            "--kata-root",
            "/srv/kata",
            "--kata-runtime",
            "/opt/kata/bin/kata-runtime",
            "--runtime-cli-timeout",
            "1500ms",
            "--allowed-target-prefix",
            "/var/lib/kubelet/pods/",
            "--allowed-target-prefix",
            "/srv/pods",
            "--metrics-address",
            "127.0.0.1:9808",
        ]);
        let cfg = Cli::parse_from(args).into_config().unwrap();
        assert!(!cfg.deferral.enabled);
        assert_eq!(cfg.deferral.ops.layout, LayoutMode::Both);
        assert_eq!(cfg.deferral.ops.crust_root, PathBuf::from("/srv/crust"));
        assert_eq!(cfg.deferral.ops.kata_root, PathBuf::from("/srv/kata"));
        assert_eq!(cfg.deferral.ops.cli_timeout, Duration::from_millis(1500));
        assert_eq!(
            cfg.deferral.ops.allowed_target_prefixes,
            vec![
                "/var/lib/kubelet/pods/".to_string(),
                "/srv/pods".to_string()
            ]
        );
        assert_eq!(cfg.metrics_address, Some("127.0.0.1:9808".parse().unwrap()));

        let bad = |extra: &[&str]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            Cli::try_parse_from(v)
                .map(|c| c.into_config().is_err())
                .unwrap_or(true)
        };
        assert!(bad(&["--deferral", "maybe"]));
        assert!(bad(&["--handoff-layout", "docker"]));
        assert!(bad(&["--crust-root", "relative"]));
        assert!(bad(&["--kata-runtime", "kata-runtime"]));
        assert!(bad(&["--runtime-cli-timeout", "0s"]));
        assert!(bad(&["--runtime-cli-timeout", "soon"]));
        assert!(bad(&["--allowed-target-prefix", "pods"]));
        assert!(bad(&["--metrics-address", "localhost"]));
    }

    #[test]
    fn static_backend_flags() {
        let cfg = Cli::parse_from([
            "crust-csi",
            "--node-id",
            "n1",
            "--backend",
            "static",
            "--static-device",
            "/dev/a",
            "--static-device",
            "/dev/b",
            "--static-device-blank",
            "/dev/b",
        ])
        .into_config()
        .unwrap();
        assert_eq!(
            cfg.backend,
            BackendConfig::Static {
                devices: vec!["/dev/a".into(), "/dev/b".into()],
                declared_blank: vec!["/dev/b".into()],
            }
        );
        // The backend's refusals tell the operator to use this very flag.
        use clap::CommandFactory;
        let flag = crust_backend::DECLARE_BLANK_SETTING;
        assert!(
            Cli::command()
                .get_arguments()
                .any(|a| a.get_long().is_some_and(|l| format!("--{l}") == flag)),
            "{flag} is not a crust-csi flag"
        );
    }
}
