//! One plug and one release of a deferred volume in a running guest, for
//! both front doors (the CLI's per-sandbox process and the containerd
//! shim's pod): createFilesystem, the exclusive hold on the
//! host device, hot-plug, guest mount, and the rollback of each step.
//!
//! The hold ([`crust_blockdev::ExclusiveDevice`]) covers the whole time a
//! guest may write to the device: it is taken before `blockdev-add` and
//! dropped only once the device is gone from QEMU (`blockdev-del`
//! returned) or QEMU itself has exited. A device whose unplug failed may
//! still be in QEMU: its hold stays (stranded) until QEMU exits.
//!
//! What differs between the doors stays outside: which bus comes first
//! (the order of the list given to [`Attachments::set_buses`]), the
//! hand-off claim and the sandbox record (each door's own bookkeeping).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crust_agent_proto::AgentClient;
use crust_blockdev::ExclusiveDevice;
use crust_qmp::QmpClient;

use crate::discovery::Discovery;
use crate::records::{Volume, VolumeIo};
use crate::volumes::{self, VolumeError};

/// What the plug routine needs of a running guest.
pub struct GuestPorts<'a> {
    pub qmp: &'a QmpClient,
    pub agent: &'a AgentClient,
    /// Bound on the guest's mount (fsGroup may walk the whole volume).
    pub mount_timeout: Duration,
    /// Where a regular file may be a volume's disk ([`Config::file_device_roots`]).
    ///
    /// [`Config::file_device_roots`]: crate::config::Config::file_device_roots
    pub file_device_roots: &'a [std::path::PathBuf],
    /// The hand-off stores a volume's record is in: a record without a
    /// device identity gets the one found at its first plug. None where
    /// no record stands behind the volume.
    pub records: Option<&'a Discovery>,
}

/// A volume in the guest: the bus it sits on and the hold on its device
/// (None once QEMU has exited).
struct Attached {
    volume: Volume,
    bus: String,
    hold: Option<ExclusiveDevice>,
    /// Other devices exposing the same data that are held with it (a raw
    /// device's kubelet loop, [`volumes::KubeletLoop`]).
    also: Vec<ExclusiveDevice>,
    /// A raw device node for a container, not a mounted volume.
    raw: bool,
}

/// A sandbox's hot-plug buses and the volumes plugged on them, each with
/// the exclusive hold on its host device.
#[derive(Default)]
pub struct Attachments {
    /// Free buses; the last one is taken first.
    free: Mutex<Vec<String>>,
    plugged: Mutex<HashMap<String, Attached>>,
    /// Holds of devices whose unplug failed: kept until QEMU exits.
    stranded: Mutex<Vec<ExclusiveDevice>>,
    /// One plug at a time: a volume is plugged once per sandbox.
    plugging: tokio::sync::Mutex<()>,
    /// The alias scans of the stats polls ([`crate::alias_watch`]).
    alias: crate::alias_watch::AliasWatch,
}

impl Attachments {
    /// The guest's hot-plug buses in its order: the first is taken first
    /// (both doors plug in the same order).
    pub fn set_buses(&self, buses: Vec<String>) {
        *self.free.lock().expect("buses") = buses.into_iter().rev().collect();
    }

    /// A free bus (for other hot-plugged devices, too).
    pub fn take_bus(&self) -> Option<String> {
        self.free.lock().expect("buses").pop()
    }

    pub fn return_bus(&self, bus: String) {
        self.free.lock().expect("buses").push(bus);
    }

    /// The sandbox's alias scans, for its stats polls.
    pub fn alias_watch(&self) -> &crate::alias_watch::AliasWatch {
        &self.alias
    }

    pub fn is_plugged(&self, id: &str) -> bool {
        self.plugged.lock().expect("plugged").contains_key(id)
    }

    /// The volumes plugged into the guest (not the raw devices).
    pub fn volumes(&self) -> Vec<Volume> {
        let p = self.plugged.lock().expect("plugged");
        p.values()
            .filter(|a| !a.raw)
            .map(|a| a.volume.clone())
            .collect()
    }

    /// QEMU has exited (and been reaped): no guest can use the devices any
    /// more, so every hold goes. The volumes stay listed until
    /// [`release_after_exit`].
    pub fn guest_gone(&self) {
        for a in self.plugged.lock().expect("plugged").values_mut() {
            a.hold = None;
            a.also.clear();
        }
        self.stranded.lock().expect("stranded").clear();
    }

    fn forget_all(&self) {
        self.guest_gone();
        let mut p = self.plugged.lock().expect("plugged");
        let mut free = self.free.lock().expect("buses");
        free.extend(p.drain().map(|(_, a)| a.bus));
    }
}

/// Plugs `v` into the guest once per sandbox: createFilesystem, exclusive
/// hold, `blockdev-add` + `device_add`, guest mount. Returns false when
/// it was plugged already. On failure nothing of it is left: the device
/// is detached, the hold dropped (kept, when the detach failed, until
/// QEMU exits) and the bus free again. The hand-off claim is the caller's.
pub async fn plug(
    att: &Attachments,
    g: &GuestPorts<'_>,
    v: &Volume,
) -> Result<Option<VolumeIo>, VolumeError> {
    let _one = att.plugging.lock().await;
    if att.is_plugged(&v.id) {
        return Ok(None);
    }
    let bus = att.take_bus().ok_or_else(|| VolumeError::Precondition {
        target: v.target.clone(),
        reason: "no free hot-plug slot left in the guest".into(),
    })?;
    match plug_on(g, v, &bus).await {
        Ok((hold, io)) => {
            tracing::info!(target = %v.target, device = %v.device, "volume in the guest; QEMU does its I/O on {io}");
            att.plugged.lock().expect("plugged").insert(
                v.id.clone(),
                Attached {
                    volume: v.clone(),
                    bus,
                    hold: Some(hold),
                    also: Vec::new(),
                    raw: false,
                },
            );
            Ok(Some(io))
        }
        Err((e, stranded)) => {
            if let Some(h) = stranded {
                att.stranded.lock().expect("stranded").push(h);
            }
            att.return_bus(bus);
            Err(e)
        }
    }
}

/// Plugs the raw device `v` ([`Volume::raw_device`], a container's OCI
/// `linux.devices` entry) into the guest once per sandbox, by the same
/// rule as a volume: the exclusive hold ([`volumes::hold_raw_device`]:
/// refused when mounted, held or exposed by another device, except this
/// pod's kubelet loop, which is held too), the same `blockdev-add` +
/// `device_add` ([`volumes::attach`]: QEMU keeps a copy of the hold), no
/// filesystem and no mount; the container gets a device node. Returns
/// false when it was plugged already. On failure nothing of it is left.
pub async fn plug_raw(
    att: &Attachments,
    g: &GuestPorts<'_>,
    v: &Volume,
    kubelet: &volumes::KubeletLoop,
) -> Result<bool, VolumeError> {
    let _one = att.plugging.lock().await;
    if att.is_plugged(&v.id) {
        return Ok(false);
    }
    let bus = att.take_bus().ok_or_else(|| VolumeError::Precondition {
        target: v.target.clone(),
        reason: "no free hot-plug slot left in the guest".into(),
    })?;
    let held = match volumes::hold_raw_device(v, kubelet) {
        Ok(h) => h,
        Err(e) => {
            att.return_bus(bus);
            return Err(e);
        }
    };
    if let Err(e) = volumes::attach(g.qmp, v, Some(&bus), None, &held.device).await {
        if let Err(d) = volumes::detach(g.qmp, v).await {
            tracing::error!(device = %v.device,
                "rolling back a failed plug: {d}; the device stays held until QEMU exits");
            let mut stranded = att.stranded.lock().expect("stranded");
            stranded.push(held.device);
            stranded.extend(held.aliases);
        }
        att.return_bus(bus);
        return Err(e);
    }
    tracing::info!(device = %v.device, readonly = v.readonly, "raw device in the guest");
    att.plugged.lock().expect("plugged").insert(
        v.id.clone(),
        Attached {
            volume: v.clone(),
            bus,
            hold: Some(held.device),
            also: held.aliases,
            raw: true,
        },
    );
    Ok(true)
}

/// [`plug_raw`]'s hold taken and let go: a sandbox whose first container
/// names a device that is mounted or held is refused before its VM boots.
pub fn check_raw(v: &Volume, kubelet: &volumes::KubeletLoop) -> Result<(), VolumeError> {
    volumes::hold_raw_device(v, kubelet).map(drop)
}

/// The steps of [`plug`]; on failure, the hold of a device that may still
/// be in QEMU comes back with the error.
async fn plug_on(
    g: &GuestPorts<'_>,
    v: &Volume,
    bus: &str,
) -> Result<(ExclusiveDevice, VolumeIo), (VolumeError, Option<ExclusiveDevice>)> {
    // The doors check this before booting; a plug never goes without it.
    volumes::check_for_guest(v).map_err(|e| (e, None))?;
    // A file device is opened once, by the one rule; QEMU gets that
    // descriptor and the hold is a copy of it.
    let file = volumes::open_file_device(v, g.file_device_roots).map_err(|e| (e, None))?;
    // The identity to record once the plug succeeded (a record without one).
    let mut pin = None;
    let hold = match &file {
        Some(fd) => {
            if v.create_fs {
                tracing::warn!(target = %v.target, device = %v.device,
                    "createFilesystem is not applied to a file device (its CSI driver formats it)");
            }
            let copy = fd.try_clone().map_err(|e| {
                let reason = format!("duplicating its descriptor: {e}");
                (volumes::host_device_error(v, reason), None)
            })?;
            ExclusiveDevice::regular_file(copy, v.device.clone().into())
        }
        None => {
            let hold = volumes::hold_host_device(v).map_err(|e| (e, None))?;
            // Before anything is written or attached: the device is the
            // record's, proven through the hold.
            pin = volumes::check_identity(v, &hold).map_err(|e| (e, None))?;
            if v.create_fs && !v.readonly {
                // mkfs needs the device to itself: the hold goes for it.
                drop(hold);
                volumes::format_if_requested(v)
                    .await
                    .map_err(|e| (e, None))?;
                let hold = volumes::hold_host_device(v).map_err(|e| (e, None))?;
                pin = volumes::check_identity(v, &hold).map_err(|e| (e, None))?;
                hold
            } else {
                hold
            }
        }
    };
    let res = async {
        let io = volumes::attach(g.qmp, v, Some(bus), file, &hold).await?;
        // Before the guest mounts it: the workload never sees it unthrottled.
        let limits = volumes::io_limits(v)?;
        if !limits.is_unlimited() {
            volumes::throttle(g.qmp, v, &limits).await?;
            tracing::info!(target = %v.target, limits = %limits.to_wire(), "I/O limits applied");
        }
        crate::handover::crash_point("attached");
        volumes::mount(g.agent, v, g.mount_timeout).await?;
        Ok(io)
    }
    .await;
    match res {
        Ok(io) => {
            if let (Some(id), Some(records)) = (pin, g.records) {
                pin_identity(records, v, &id);
            }
            Ok((hold, io))
        }
        Err(e) => match volumes::detach(g.qmp, v).await {
            // Both steps are idempotent: Ok means QEMU has no such node.
            Ok(()) => Err((e, None)),
            Err(d) => {
                tracing::error!(target = %v.target, device = %v.device,
                    "rolling back a failed plug: {d}; the device stays held until QEMU exits");
                Err((e, Some(hold)))
            }
        },
    }
}

/// Records `id` in `v`'s hand-off record, which had none (Kata's driver
/// writes none): the device this first plug proved exclusive is the one
/// every later plug must find. A record that cannot take it is logged;
/// the plug stands, as it would have before identities existed.
fn pin_identity(records: &Discovery, v: &Volume, id: &crust_blockdev::DeviceIdentity) {
    match records
        .store(v.layout)
        .pin_device_identity(&v.target, &id.to_string())
    {
        Ok(true) => tracing::info!(target = %v.target, device = %v.device,
            "the record named its device by path alone: {id} recorded, every later plug is held to it"),
        Ok(false) => {}
        Err(e) => tracing::warn!(target = %v.target, device = %v.device,
            "recording the device identity {id}: {e}"),
    }
}

/// The release once the guest is gone (QEMU exited or was killed, and
/// reaped): the holds go first, then the hand-off claims of `volumes`
/// (every volume the sandbox recorded, plugged or not), so a claim never
/// goes while a hold remains.
pub fn release_after_exit(att: &Attachments, discovery: &Discovery, id: &str, volumes: &[Volume]) {
    att.forget_all();
    crate::claims::release_all(discovery, id, volumes);
}

/// The host side of a sandbox whose guest is gone, the one order both
/// doors use: [`release_after_exit`] (holds, then claims), then the
/// volumes handed over by crust-csi given back (`asked`, every offer on
/// record). What the door keeps besides (a network, a share, the record)
/// goes after this.
pub async fn release_host_side(
    att: &Attachments,
    discovery: &Discovery,
    handover: &crate::handover::Handover,
    id: &str,
    volumes: &[Volume],
    asked: &[String],
) {
    release_after_exit(att, discovery, id, volumes);
    crate::handover::give_back(handover, discovery, id, asked).await;
}
