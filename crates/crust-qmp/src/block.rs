//! Block devices: protocol nodes (by path or by descriptor), virtio-blk
//! devices with their iothreads, I/O throttling and resize (the node
//! scheme is in the crate docs).

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::blockio::{Aio, BlockIo};
use crate::ids::{validate_id, validate_node_name, validate_serial};
use crate::types::{self, BlockInfo, BlockNode, QmpEvent};
use crate::{QmpClient, QmpError};

impl QmpClient {
    /// Opens `path` in QEMU as block node `node_name` (see the crate docs
    /// for the node scheme). `path` must be absolute and name a block device
    /// (driver `host_device`) or a regular file (driver `file`). Returns how
    /// QEMU opened it ([`BlockIo`]).
    ///
    /// Idempotent: if the node already exists on the same file with the same
    /// read-only flag this succeeds; any other clash is QEMU's error.
    pub async fn blockdev_add_file(
        &self,
        node_name: &str,
        path: &Path,
        readonly: bool,
    ) -> Result<BlockIo, QmpError> {
        validate_node_name(node_name)?;
        let driver = file_driver(path).await?;
        let file = path
            .to_str()
            .ok_or_else(|| QmpError::InvalidArgument(format!("{} is not UTF-8", path.display())))?;
        let args = json!({
            "driver": driver,
            "node-name": node_name,
            "filename": file,
            "read-only": readonly,
            // Guest discards punch holes: sparse volumes stay sparse.
            "discard": "unmap",
        });
        match self.blockdev_add_best(node_name, args, None).await {
            Err(err @ QmpError::Command { .. }) => {
                let same = self.query_named_block_nodes().await?.into_iter().find(|n| {
                    n.node_name == node_name && n.file == file && n.read_only == readonly
                });
                match same {
                    Some(n) => Ok(self.opened_with(&n)),
                    None => Err(err),
                }
            }
            other => other,
        }
    }

    /// `blockdev-add` of `args` with the first of [`BlockIo::candidates`]
    /// QEMU accepts: its refusal of one (an engine it lacks, O_DIRECT on a
    /// filesystem without it) moves on to the next; the last refusal is
    /// the answer. `fd`, the descriptor in the node's fd set, gets the
    /// O_DIRECT flag of each try (QEMU up to 9.0 sets it on the shared
    /// file description itself, later ones pick only a descriptor that
    /// already matches).
    async fn blockdev_add_best(
        &self,
        node_name: &str,
        args: Value,
        fd: Option<&OwnedFd>,
    ) -> Result<BlockIo, QmpError> {
        let candidates = BlockIo::candidates();
        let mut refused: Option<QmpError> = None;
        for io in &candidates {
            if let Some(fd) = fd
                && let Err(e) = set_direct(fd, io.direct)
            {
                tracing::debug!(
                    node = node_name,
                    "O_DIRECT={} on its descriptor: {e}",
                    io.direct
                );
                continue;
            }
            let mut a = args.clone();
            io.apply(&mut a);
            match self.execute("blockdev-add", a).await {
                Ok(_) => {
                    if io != &candidates[0] {
                        tracing::warn!(
                            node = node_name,
                            "QEMU opened it with {io} ({} refused: {})",
                            candidates[0],
                            refused
                                .as_ref()
                                .map(ToString::to_string)
                                .unwrap_or_default()
                        );
                    } else {
                        tracing::debug!(node = node_name, "opened with {io}");
                    }
                    self.shared.lock().opened.insert(node_name.to_string(), *io);
                    return Ok(*io);
                }
                Err(e @ QmpError::Command { .. }) => refused = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(refused.unwrap_or_else(|| {
            QmpError::InvalidArgument(format!("no way to open {node_name} was accepted"))
        }))
    }

    /// How an existing node was opened: as recorded by this client, else
    /// what QEMU reports (not its engine).
    fn opened_with(&self, node: &BlockNode) -> BlockIo {
        self.shared
            .lock()
            .opened
            .get(&node.node_name)
            .copied()
            .unwrap_or(BlockIo {
                direct: node.direct,
                aio: Aio::Unknown,
            })
    }

    /// Opens the device behind `fd` (a block device or a regular file the
    /// caller opened and checked) as block node `node_name`, without QEMU
    /// ever resolving a path: the descriptor goes into a new fd set
    /// (`add-fd`, tagged with the node name) and the node is opened from
    /// `/dev/fdset/<id>`. `fd`'s access mode must match `readonly` (QEMU
    /// picks from the set by it); its O_DIRECT flag is set to match the
    /// cache mode chosen. The set lives until [`blockdev_del`]
    /// (QEMU may reopen the node from it).
    ///
    /// Idempotent: a node of that name already opened from an fd set
    /// succeeds (and `fd` is closed).
    ///
    /// [`blockdev_del`]: Self::blockdev_del
    pub async fn blockdev_add_fd(
        &self,
        node_name: &str,
        fd: OwnedFd,
        readonly: bool,
    ) -> Result<BlockIo, QmpError> {
        validate_node_name(node_name)?;
        let st = rustix::fs::fstat(&fd)
            .map_err(|e| QmpError::InvalidArgument(format!("descriptor for {node_name}: {e}")))?;
        let driver = match rustix::fs::FileType::from_raw_mode(st.st_mode) {
            rustix::fs::FileType::BlockDevice => "host_device",
            rustix::fs::FileType::RegularFile => "file",
            _ => {
                return Err(QmpError::InvalidArgument(format!(
                    "descriptor for {node_name} is neither a block device nor a regular file"
                )));
            }
        };
        let writable = rustix::fs::fcntl_getfl(&fd)
            .map(|f| f.contains(rustix::fs::OFlags::RDWR))
            .unwrap_or(false);
        if writable == readonly {
            return Err(QmpError::InvalidArgument(format!(
                "descriptor for {node_name} is opened {}, the node is {}",
                if writable { "read-write" } else { "read-only" },
                if readonly { "read-only" } else { "read-write" }
            )));
        }
        if let Some(n) = self
            .query_named_block_nodes()
            .await?
            .into_iter()
            .find(|n| n.node_name == node_name && n.file.starts_with(FDSET_PREFIX))
        {
            return Ok(self.opened_with(&n));
        }
        // Shares the file description QEMU gets: its status flags are set
        // through this copy.
        let ours = fd
            .try_clone()
            .map_err(|e| QmpError::io("duplicating a volume descriptor", e))?;
        let added = self
            .execute_with_fd("add-fd", json!({ "opaque": fdset_tag(node_name) }), fd)
            .await?;
        let set = added
            .get("fdset-id")
            .and_then(Value::as_u64)
            .ok_or_else(|| QmpError::Protocol(format!("add-fd answered {added}")))?;
        let args = json!({
            "driver": driver,
            "node-name": node_name,
            "filename": format!("{FDSET_PREFIX}{set}"),
            "read-only": readonly,
            "discard": "unmap",
        });
        match self.blockdev_add_best(node_name, args, Some(&ours)).await {
            Ok(io) => Ok(io),
            Err(e) => {
                let _ = self.execute("remove-fd", json!({ "fdset-id": set })).await;
                Err(e)
            }
        }
    }

    /// Removes block node `node_name`. Succeeds if it does not exist.
    /// Fails while a device still uses it. An fd set that
    /// [`blockdev_add_fd`](Self::blockdev_add_fd) made for it goes too.
    pub async fn blockdev_del(&self, node_name: &str) -> Result<(), QmpError> {
        validate_node_name(node_name)?;
        match self
            .execute("blockdev-del", json!({ "node-name": node_name }))
            .await
        {
            Err(err @ QmpError::Command { .. }) => {
                let exists = self
                    .query_named_block_nodes()
                    .await?
                    .iter()
                    .any(|n| n.node_name == node_name);
                if exists {
                    return Err(err);
                }
            }
            other => {
                other?;
            }
        }
        self.shared.lock().opened.remove(node_name);
        self.release_descriptors(node_name).await
    }

    /// `closefd` of the descriptor QEMU kept for `node_name` ([`keep_fd`]),
    /// first (what keeps the host away), then `remove-fd` of every fd set
    /// made for it, found by its tag in `query-fdsets` (also one a client
    /// before a restart made).
    ///
    /// [`keep_fd`]: Self::keep_fd
    async fn release_descriptors(&self, node_name: &str) -> Result<(), QmpError> {
        match self
            .execute("closefd", json!({ "fdname": keep_tag(node_name) }))
            .await
        {
            // None kept is fine.
            Ok(_) | Err(QmpError::Command { .. }) => {}
            Err(e) => return Err(e),
        }
        for set in self.fdsets_tagged(&[fdset_tag(node_name)]).await? {
            match self.execute("remove-fd", json!({ "fdset-id": set })).await {
                // Already gone is fine.
                Ok(_) | Err(QmpError::Command { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The ids of the fd sets holding a descriptor tagged with one of `tags`
    /// (none where QEMU refuses the query).
    async fn fdsets_tagged(&self, tags: &[String]) -> Result<Vec<u64>, QmpError> {
        let sets: Vec<types::FdSet> = match self.query("query-fdsets", json!({})).await {
            Ok(sets) => sets,
            Err(QmpError::Command { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        Ok(sets
            .into_iter()
            .filter(|s| {
                s.fds
                    .iter()
                    .any(|f| f.opaque.as_ref().is_some_and(|o| tags.contains(o)))
            })
            .map(|s| s.id)
            .collect())
    }

    /// Gives QEMU a descriptor to keep, not to open: `getfd` under a name
    /// made from `node_name`, closed with that node by
    /// [`blockdev_del`](Self::blockdev_del). Not an fd set: QEMU 7.2
    /// closes a set no node uses once no QMP client is connected (while
    /// the VM runs), while a named descriptor stays until `closefd` or
    /// QEMU's exit. crust's QEMU has one QMP monitor, so every client of
    /// it sees the name. crust hands QEMU a
    /// copy of its exclusive hold on a loop device whose backing file the
    /// node reads, so that the device stays held, and QEMU is seen using
    /// it, for as long as QEMU may write the file, even if its runtime dies.
    ///
    /// Idempotent: the name's earlier descriptor is replaced.
    pub async fn keep_fd(&self, node_name: &str, fd: OwnedFd) -> Result<(), QmpError> {
        validate_node_name(node_name)?;
        self.execute_with_fd("getfd", json!({ "fdname": keep_tag(node_name) }), fd)
            .await
            .map(drop)
    }

    /// Hot-plugs a `virtio-blk-pci` device `id` backed by node `node_name`.
    /// The guest sees `serial` in `/sys/block/vd*/serial` (and udev's
    /// `/dev/disk/by-id/virtio-<serial>`). `bus` is the id of a free PCIe
    /// root port (q35 cannot hot-plug onto `pcie.0`); `None` lets QEMU pick.
    /// The device gets [`VirtioBlkOptions`]: queues for every vCPU the VM
    /// can have, its own iothread, the host device's sector size.
    ///
    /// Idempotent: succeeds if device `id` already exists on `node_name`.
    pub async fn device_add_virtio_blk(
        &self,
        id: &str,
        node_name: &str,
        serial: &str,
        bus: Option<&str>,
        opts: &VirtioBlkOptions,
    ) -> Result<(), QmpError> {
        validate_id(id)?;
        validate_node_name(node_name)?;
        validate_serial(serial)?;
        let mut args = json!({
            "driver": "virtio-blk-pci",
            "id": id,
            "drive": node_name,
            "serial": serial,
        });
        if let Some(bus) = bus {
            validate_id(bus)?;
            args["bus"] = json!(bus);
        }
        let queues = match opts.num_queues {
            Some(n) => Some(n),
            // A machine without CPU hot-plug slots: QEMU's default (one
            // queue per vCPU since QEMU 5.2).
            None => match self.max_vcpus().await {
                Ok(n) => Some(n),
                Err(QmpError::Command { desc, .. }) => {
                    tracing::debug!("query-hotpluggable-cpus: {desc}");
                    None
                }
                Err(e) => return Err(e),
            },
        };
        if let Some(n) = queues {
            args["num-queues"] = json!(n.max(1));
        }
        if opts.block_size != 0 {
            if !(512..=4096).contains(&opts.block_size) || !opts.block_size.is_power_of_two() {
                return Err(QmpError::InvalidArgument(format!(
                    "block size {} of {id}: a power of two from 512 to 4096",
                    opts.block_size
                )));
            }
            args["logical_block_size"] = json!(opts.block_size);
            args["physical_block_size"] = json!(opts.block_size);
        }
        let iothread = iothread_id(id);
        if opts.iothread {
            self.add_iothread(&iothread).await?;
            args["iothread"] = json!(iothread);
        }
        let res = match self.execute("device_add", args).await {
            Err(err @ QmpError::Command { .. }) => {
                let same = self.query_block().await?.iter().any(|b| {
                    b.is_device(id)
                        && b.inserted
                            .as_ref()
                            .is_some_and(|n| n.node_name == node_name)
                });
                if same { Ok(()) } else { Err(err) }
            }
            other => other.map(drop),
        };
        if res.is_err() && opts.iothread {
            let _ = self.del_iothread(&iothread).await;
        }
        res
    }

    /// How many vCPUs the VM can have (`query-hotpluggable-cpus`: every
    /// slot, plugged or not); asked once per client.
    pub async fn max_vcpus(&self) -> Result<u16, QmpError> {
        if let Some(n) = self.shared.lock().max_vcpus {
            return Ok(n);
        }
        let cpus = self.execute("query-hotpluggable-cpus", Value::Null).await?;
        let n = cpus.as_array().map_or(1, |a| a.len().clamp(1, 1024) as u16);
        self.shared.lock().max_vcpus = Some(n);
        Ok(n)
    }

    /// Ids of the VM's iothreads (`query-iothreads`).
    pub async fn query_iothreads(&self) -> Result<Vec<String>, QmpError> {
        let v = self.execute("query-iothreads", Value::Null).await?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.get("id").and_then(Value::as_str).map(str::to_owned))
            .collect())
    }

    async fn add_iothread(&self, id: &str) -> Result<(), QmpError> {
        if self.query_iothreads().await?.iter().any(|t| t == id) {
            return Ok(());
        }
        self.execute("object-add", json!({ "qom-type": "iothread", "id": id }))
            .await
            .map(drop)
    }

    /// Deletes iothread `id`; gone already is fine.
    async fn del_iothread(&self, id: &str) -> Result<(), QmpError> {
        if !self.query_iothreads().await?.iter().any(|t| t == id) {
            return Ok(());
        }
        self.execute("object-del", json!({ "id": id }))
            .await
            .map(drop)
    }

    /// Asks QEMU to unplug device `id` and waits up to `timeout` for its
    /// `DEVICE_DELETED` event, then deletes its iothread, if it has one.
    /// Succeeds at once if no such device exists.
    ///
    /// PCI unplug needs the guest's cooperation: QEMU presses the slot's
    /// attention button and only removes the device once the guest OS
    /// releases it. A paused (`-S`) or OS-less guest never does, so this
    /// then returns [`QmpError::Timeout`] and the device stays. Calling
    /// again is safe: QEMU refuses a second request while one is pending
    /// ("already in the process of unplug"), which is taken as "keep
    /// waiting" rather than an error.
    pub async fn device_del(&self, id: &str, timeout: Duration) -> Result<(), QmpError> {
        validate_id(id)?;
        // Subscribe first: the event may beat the command's reply.
        let mut rx = self.events();
        match self.execute("device_del", json!({ "id": id })).await {
            Err(QmpError::Command { class, .. }) if class == "DeviceNotFound" => {
                return self.del_iothread(&iothread_id(id)).await;
            }
            // QEMU's wording since 6.2; an earlier request is still pending.
            Err(QmpError::Command { desc, .. }) if desc.contains("in the process of unplug") => {
                Value::Null
            }
            res => res?,
        };
        let is_ours = |ev: &QmpEvent| ev.data.get("device").and_then(Value::as_str) == Some(id);
        self.next_event(&mut rx, "DEVICE_DELETED", is_ours, timeout)
            .await
            .map_err(|e| match e {
                QmpError::Timeout { after, .. } => QmpError::Timeout {
                    what: format!("DEVICE_DELETED of {id} (the guest must release the device)"),
                    after,
                },
                e => e,
            })?;
        self.del_iothread(&iothread_id(id)).await
    }

    /// Throttles the I/O of virtio device `id` (its qdev id) to `limits`;
    /// all zero lifts every limit. Takes effect at once, guest running.
    pub async fn block_set_io_throttle(
        &self,
        id: &str,
        limits: &IoThrottle,
    ) -> Result<(), QmpError> {
        validate_id(id)?;
        // The backend belongs to the proxy's inner device
        // (`…/<id>/virtio-backend`), not to the qdev `id` itself: QEMU
        // takes its QOM path, as query-block reports it.
        let qdev = self
            .query_block()
            .await?
            .into_iter()
            .find(|b| b.is_device(id))
            .and_then(|b| b.qdev)
            .ok_or_else(|| QmpError::Command {
                class: "DeviceNotFound".into(),
                desc: format!("no block device {id}"),
            })?;
        // QEMU 7.2 wants all six rates; bursts are optional.
        let mut args = json!({
            "id": qdev,
            "iops": limits.iops, "iops_rd": limits.iops_rd, "iops_wr": limits.iops_wr,
            "bps": limits.bps, "bps_rd": limits.bps_rd, "bps_wr": limits.bps_wr,
            "iops_max": limits.iops_max, "iops_rd_max": limits.iops_rd_max,
            "iops_wr_max": limits.iops_wr_max, "bps_max": limits.bps_max,
            "bps_rd_max": limits.bps_rd_max, "bps_wr_max": limits.bps_wr_max,
        });
        if limits.max_length > 0 {
            // Only for a burst that is set: QEMU refuses a length without one.
            for (name, max) in [
                ("iops_max", limits.iops_max),
                ("iops_rd_max", limits.iops_rd_max),
                ("iops_wr_max", limits.iops_wr_max),
                ("bps_max", limits.bps_max),
                ("bps_rd_max", limits.bps_rd_max),
                ("bps_wr_max", limits.bps_wr_max),
            ] {
                if max > 0 {
                    args[format!("{name}_length")] = json!(limits.max_length);
                }
            }
        }
        self.execute("block_set_io_throttle", args).await.map(drop)
    }

    /// Sets the size of node `node_name` to `size` bytes and tells the
    /// guest. For a block device node, grow the device first (e.g.
    /// `losetup -c`) and pass its new size; a regular file is grown by QEMU.
    pub async fn block_resize(&self, node_name: &str, size: u64) -> Result<(), QmpError> {
        validate_node_name(node_name)?;
        if size == 0 || size > i64::MAX as u64 {
            return Err(QmpError::InvalidArgument(format!(
                "block size {size} out of range"
            )));
        }
        self.execute(
            "block_resize",
            json!({ "node-name": node_name, "size": size }),
        )
        .await
        .map(drop)
    }

    /// Block backends (what guest devices are attached to) with their nodes.
    pub async fn query_block(&self) -> Result<Vec<BlockInfo>, QmpError> {
        let raw: Vec<types::RawBlockInfo> = self.query("query-block", Value::Null).await?;
        Ok(raw.into_iter().map(BlockInfo::from).collect())
    }

    /// Every named block node, attached or not (flat: no child recursion).
    pub async fn query_named_block_nodes(&self) -> Result<Vec<BlockNode>, QmpError> {
        let raw: Vec<types::RawNode> = self
            .query("query-named-block-nodes", json!({ "flat": true }))
            .await?;
        Ok(raw.into_iter().map(BlockNode::from).collect())
    }
}

/// How QEMU names a file in an fd set.
pub(crate) const FDSET_PREFIX: &str = "/dev/fdset/";

/// The iothread of device `id`.
pub(crate) fn iothread_id(id: &str) -> String {
    format!("iothread-{id}")
}

/// Sets or clears O_DIRECT on `fd`'s file description.
pub(crate) fn set_direct(fd: &OwnedFd, direct: bool) -> rustix::io::Result<()> {
    use rustix::fs::OFlags;
    let mut fl = rustix::fs::fcntl_getfl(fd)?;
    fl.set(OFlags::DIRECT, direct);
    rustix::fs::fcntl_setfl(fd, fl)
}

/// Limits of [`QmpClient::block_set_io_throttle`], QEMU's names; 0 =
/// unlimited. A total and its read/write split exclude each other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoThrottle {
    pub iops: u64,
    pub iops_rd: u64,
    pub iops_wr: u64,
    pub bps: u64,
    pub bps_rd: u64,
    pub bps_wr: u64,
    /// Burst rates (`*_max`), each at least its rate.
    pub iops_max: u64,
    pub iops_rd_max: u64,
    pub iops_wr_max: u64,
    pub bps_max: u64,
    pub bps_rd_max: u64,
    pub bps_wr_max: u64,
    /// Seconds a burst may last (`*_max_length`); 0: QEMU's 1 s.
    pub max_length: u64,
}

/// How a `virtio-blk-pci` device is set up
/// ([`QmpClient::device_add_virtio_blk`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtioBlkOptions {
    /// `num-queues`; `None`: one per vCPU the VM can have
    /// ([`QmpClient::max_vcpus`]).
    pub num_queues: Option<u16>,
    /// An iothread of its own (`iothread-<id>`), created with the device
    /// and deleted after it.
    pub iothread: bool,
    /// Logical and physical sector size the guest sees; 0: QEMU's 512.
    /// Pass the host device's, so a filesystem the guest makes mounts on
    /// the host too.
    pub block_size: u32,
}

impl Default for VirtioBlkOptions {
    fn default() -> Self {
        VirtioBlkOptions {
            num_queues: None,
            iothread: true,
            block_size: 0,
        }
    }
}

/// The `opaque` tag of the fd set made for block node `node_name`.
pub(crate) fn fdset_tag(node_name: &str) -> String {
    format!("crust-node:{node_name}")
}

/// The name of the descriptor QEMU keeps for `node_name`
/// ([`QmpClient::keep_fd`]).
pub(crate) fn keep_tag(node_name: &str) -> String {
    format!("crust-keep-{node_name}")
}

pub(crate) async fn file_driver(path: &Path) -> Result<&'static str, QmpError> {
    use std::os::unix::fs::FileTypeExt;
    if !path.is_absolute() {
        return Err(QmpError::InvalidArgument(format!(
            "{} is not an absolute path",
            path.display()
        )));
    }
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(|e| QmpError::InvalidArgument(format!("{}: {e}", path.display())))?;
    let ft = meta.file_type();
    if ft.is_block_device() {
        Ok("host_device")
    } else if ft.is_file() {
        Ok("file")
    } else {
        Err(QmpError::InvalidArgument(format!(
            "{} is neither a block device nor a regular file",
            path.display()
        )))
    }
}
