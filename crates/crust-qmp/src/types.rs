//! Typed views of the QMP replies the runtime needs. Only the fields crust
//! uses are kept; everything else QEMU sends is ignored.

use std::time::{Duration, SystemTime};

use serde::Deserialize;
use serde_json::Value;

/// QEMU version announced in the QMP greeting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuVersion {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
    /// Distribution package string, e.g. `Debian 1:7.2+dfsg-7`.
    pub package: String,
}

/// An asynchronous QMP event (`SHUTDOWN`, `DEVICE_DELETED`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    /// Event name as QEMU spells it.
    pub name: String,
    /// The event's `data` member (`Value::Null` when absent).
    pub data: Value,
    /// When QEMU emitted the event, if it said.
    pub timestamp: Option<SystemTime>,
}

impl QmpEvent {
    pub(crate) fn from_message(mut obj: serde_json::Map<String, Value>) -> QmpEvent {
        let name = match obj.remove("event") {
            Some(Value::String(s)) => s,
            _ => String::new(),
        };
        let timestamp = obj.get("timestamp").and_then(|t| {
            let secs = t.get("seconds")?.as_u64()?;
            let micros = t.get("microseconds")?.as_u64()?;
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros))
        });
        QmpEvent {
            name,
            data: obj.remove("data").unwrap_or(Value::Null),
            timestamp,
        }
    }
}

/// A block driver node (from `query-named-block-nodes`, or the root node
/// of a block backend in `query-block`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockNode {
    /// Node name (`#block123` for nodes QEMU named itself).
    pub node_name: String,
    /// Image file name (the host path for `file`/`host_device` nodes
    /// opened by path, `/dev/fdset/N` for those opened by descriptor).
    pub file: String,
    /// Virtual size in bytes: what the guest sees.
    pub size: u64,
    /// Block driver: `file`, `host_device`, `raw`, ...
    pub driver: String,
    pub read_only: bool,
    /// Opened with `cache.direct=on` (O_DIRECT: no host page cache).
    pub direct: bool,
}

/// A block backend (from `query-block`): what a guest device is attached to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockInfo {
    /// Backend name; empty for the anonymous backends `device_add` creates.
    pub device: String,
    /// QOM path of the guest device, e.g. `/machine/peripheral/vd0/virtio-backend`.
    pub qdev: Option<String>,
    /// The root node, if a medium is inserted.
    pub inserted: Option<BlockNode>,
}

impl BlockInfo {
    /// Whether this backend belongs to the device added with `id`.
    pub fn is_device(&self, id: &str) -> bool {
        let Some(qdev) = &self.qdev else { return false };
        let prefix = format!("/machine/peripheral/{id}");
        qdev == &prefix || qdev.starts_with(&format!("{prefix}/"))
    }
}

/// Run state from `query-status`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct VmStatus {
    /// Whether guest CPUs are running.
    pub running: bool,
    /// QEMU's run state: `prelaunch`, `running`, `paused`, `shutdown`, ...
    pub status: String,
}

/// One PCI function from `query-pci`, with bridges flattened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    pub bus: u32,
    pub slot: u32,
    pub function: u32,
    /// PCI class code (e.g. 0x0100 for SCSI/virtio-blk storage).
    pub class: u32,
    pub vendor: u32,
    pub device: u32,
    /// The `id` given to `device_add`/`-device`; empty for built-ins.
    pub qdev_id: String,
    /// For bridges and root ports: the bus number behind them (0 until the
    /// guest firmware has numbered buses).
    pub secondary_bus: Option<u32>,
}

#[derive(Deserialize)]
pub(crate) struct RawNode {
    #[serde(rename = "node-name", default)]
    node_name: String,
    #[serde(default)]
    file: String,
    #[serde(default)]
    drv: String,
    #[serde(default)]
    ro: bool,
    image: Option<RawImage>,
    cache: Option<RawCache>,
}

#[derive(Deserialize)]
struct RawCache {
    #[serde(default)]
    direct: bool,
}

#[derive(Deserialize)]
struct RawImage {
    #[serde(rename = "virtual-size")]
    virtual_size: u64,
}

impl From<RawNode> for BlockNode {
    fn from(raw: RawNode) -> BlockNode {
        BlockNode {
            node_name: raw.node_name,
            file: raw.file,
            size: raw.image.map_or(0, |i| i.virtual_size),
            driver: raw.drv,
            read_only: raw.ro,
            direct: raw.cache.is_some_and(|c| c.direct),
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct RawBlockInfo {
    device: String,
    qdev: Option<String>,
    inserted: Option<RawNode>,
}

impl From<RawBlockInfo> for BlockInfo {
    fn from(raw: RawBlockInfo) -> BlockInfo {
        BlockInfo {
            device: raw.device,
            qdev: raw.qdev,
            inserted: raw.inserted.map(BlockNode::from),
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct RawPciBus {
    devices: Vec<RawPciDevice>,
}

#[derive(Deserialize)]
struct RawPciDevice {
    bus: u32,
    slot: u32,
    function: u32,
    class_info: RawPciClass,
    id: RawPciId,
    #[serde(default)]
    qdev_id: String,
    pci_bridge: Option<RawPciBridge>,
}

#[derive(Deserialize)]
struct RawPciClass {
    class: u32,
}

#[derive(Deserialize)]
struct RawPciId {
    vendor: u32,
    device: u32,
}

#[derive(Deserialize)]
struct RawPciBridge {
    bus: RawPciBridgeBus,
    #[serde(default)]
    devices: Vec<RawPciDevice>,
}

#[derive(Deserialize)]
struct RawPciBridgeBus {
    secondary: u32,
}

pub(crate) fn flatten_pci(buses: Vec<RawPciBus>) -> Vec<PciDevice> {
    fn walk(devices: Vec<RawPciDevice>, out: &mut Vec<PciDevice>) {
        for d in devices {
            out.push(PciDevice {
                bus: d.bus,
                slot: d.slot,
                function: d.function,
                class: d.class_info.class,
                vendor: d.id.vendor,
                device: d.id.device,
                qdev_id: d.qdev_id,
                secondary_bus: d.pci_bridge.as_ref().map(|b| b.bus.secondary),
            });
            if let Some(bridge) = d.pci_bridge {
                walk(bridge.devices, out);
            }
        }
    }
    let mut out = Vec::new();
    for bus in buses {
        walk(bus.devices, &mut out);
    }
    out
}

/// One entry of `query-fdsets`.
#[derive(Deserialize)]
pub(crate) struct FdSet {
    #[serde(rename = "fdset-id")]
    pub(crate) id: u64,
    #[serde(default)]
    pub(crate) fds: Vec<FdSetFd>,
}

#[derive(Deserialize)]
pub(crate) struct FdSetFd {
    #[serde(default)]
    pub(crate) opaque: Option<String>,
}
