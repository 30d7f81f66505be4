//! What the report says besides timings: the guest's statfs against
//! CSI stats, how each mount looks from the guest, native features.

use std::time::Duration;

use crust_proto::csi::v1 as csi;
use serde_json::Value;
use tokio::sync::watch;

use super::report::{FeatureRow, GuestIoReport, MountReport, Outcome, Side};
use super::workload::HELPER;
use crust_kubesim::flow::{Flow, MOUNT_DESTINATION};

use super::host;
use super::measure::{Bench, Guest};
use super::{GuestIoConfig, VIRTIOFS_DESTINATION};

/// The guest's statfs of a mount against NodeGetVolumeStats of its volume
/// (taken between two guest readings, the volume idle).
pub(crate) async fn statfs_vs_csi(bench: &Bench<'_>, side: Side, flow: &Flow) -> Outcome {
    let fail = |detail: String| Outcome {
        works: false,
        detail,
    };
    let before = match bench.statfs(side).await {
        Ok(v) => v,
        Err(e) => return fail(e),
    };
    let stats = match flow.stats().await {
        Ok(s) => s,
        Err(s) => {
            return fail(format!(
                "NodeGetVolumeStats: {:?}: {}",
                s.code(),
                s.message()
            ));
        }
    };
    let after = bench.statfs(side).await.unwrap_or(Value::Null);
    let usage = |unit: csi::volume_usage::Unit| {
        stats
            .usage
            .iter()
            .find(|u| u.unit == unit as i32)
            .map(|u| (u.total as u64, u.used as u64, u.available as u64))
    };
    let (Some(b), Some(i)) = (
        usage(csi::volume_usage::Unit::Bytes),
        usage(csi::volume_usage::Unit::Inodes),
    ) else {
        return fail(format!(
            "NodeGetVolumeStats has no bytes or inodes usage: {stats:?}"
        ));
    };
    let guest = |v: &Value| {
        let n = |k: &str| v[k].as_u64().unwrap_or(u64::MAX);
        (
            (n("bytes_total"), n("bytes_used"), n("bytes_available")),
            (n("inodes_total"), n("inodes_used"), n("inodes_available")),
        )
    };
    if guest(&before) == (b, i) || guest(&after) == (b, i) {
        Outcome {
            works: true,
            detail: format!(
                "bytes total/used/available {}/{}/{}, inodes {}/{}/{}",
                b.0, b.1, b.2, i.0, i.1, i.2
            ),
        }
    } else {
        fail(format!(
            "CSI says bytes {b:?} inodes {i:?}, the guest's statfs {:?}",
            guest(&before)
        ))
    }
}

/// What the report says of each volume: where it is, how the guest sees it.
pub(crate) fn describe_mounts(
    rep: &mut GuestIoReport,
    blk: &Flow,
    vfs: &Flow,
    vfs_target: &str,
    seen: &Seen,
) {
    let volume = |f: &Flow, dest: &str, path: String, guest: &(String, String)| MountReport {
        destination: dest.into(),
        volume_id: f.volume_id().unwrap_or_default().to_string(),
        capacity_bytes: f
            .report()
            .volume
            .as_ref()
            .map(|v| v.capacity_bytes)
            .unwrap_or(0),
        fs_type: f
            .report()
            .volume
            .as_ref()
            .map(|v| v.fs_type.clone())
            .unwrap_or_default(),
        path,
        guest_source: guest.0.clone(),
        guest_fs_type: guest.1.clone(),
        host_target: f.target_path().to_string(),
        host_sees_bench_files: false,
    };
    rep.block = volume(
        blk,
        MOUNT_DESTINATION,
        format!(
            "virtio-blk {}, {}, mounted in the guest (deferred publish); QEMU on {}",
            seen.block.0, seen.block.1, seen.block_io
        ),
        &seen.block,
    );
    rep.virtiofs = volume(
        vfs,
        VIRTIOFS_DESTINATION,
        format!(
            "host mount {} shared by virtiofsd {} (the containerd shim's settings)",
            vfs_target,
            rep.virtiofsd_args.join(" ")
        ),
        &seen.virtiofs,
    );
}

/// What the guest's /proc/mounts says of each mount: (source, fs type).
pub(crate) struct Seen {
    pub(crate) block: (String, String),
    pub(crate) virtiofs: (String, String),
    /// The block volume's device on the host (the runtime's state).
    pub(crate) block_device: String,
    /// What QEMU opened for the block volume and how it does the I/O, as
    /// the runtime recorded it ("the loop device's backing file,
    /// cache.direct=on aio=io_uring").
    pub(crate) block_io: String,
}

/// The runtime's record of how QEMU opened the volume (`blockIo` of its
/// state, one entry), checked against what the bench asked for: an A/B
/// whose modes did not take effect measures nothing.
fn block_io_of(st: &serde_json::Value, host_cache: bool) -> Result<String, String> {
    let one = st["blockIo"]
        .as_object()
        .filter(|m| m.len() == 1)
        .and_then(|m| m.values().next())
        .ok_or_else(|| {
            format!(
                "the runtime's state records no I/O mode of the block volume: {}",
                st["blockIo"]
            )
        })?;
    let io: crust_sandbox_records::VolumeIo = serde_json::from_value(one.clone())
        .map_err(|e| format!("unreadable I/O mode in the runtime's state: {one}: {e}"))?;
    if host_cache && io.io.direct {
        return Err("--host-cache did not take effect: QEMU opened the volume with O_DIRECT (does the runtime know CRUST_RUNTIME_HOST_CACHE?)".into());
    }
    Ok(io.to_string())
}

/// Both mounts are where they should be in the guest and the bench tools
/// are there. Returns the guest, the pids whose CPU is counted, and what
/// the guest's /proc/mounts shows.
pub(crate) async fn check_sandbox(
    blk: &Flow,
    cfg: &GuestIoConfig,
    stop: watch::Receiver<bool>,
) -> Result<(Guest, Vec<i32>, Seen), String> {
    let id = blk.sandbox().ok_or("no sandbox runs")?.to_string();
    let rt = blk.runtime().clone();
    let st = rt.json(&["state", &id]).await.map_err(|e| e.to_string())?;
    let shared = st["sharedMounts"]
        .as_array()
        .is_some_and(|m| m.iter().any(|m| m["destination"] == VIRTIOFS_DESTINATION));
    if !shared {
        return Err(format!(
            "the runtime did not share {VIRTIOFS_DESTINATION} over virtio-fs (state: {st}); \
             crust-runtime needs --share-binds support"
        ));
    }
    if st["volumes"].as_array().map(Vec::len) != Some(1) {
        return Err(format!(
            "the sandbox should hold exactly the block volume: {}",
            st["volumes"]
        ));
    }
    let block_io = block_io_of(&st, cfg.host_cache)?;
    let block_device = st["volumes"][0]["device"]
        .as_str()
        .ok_or("no device of the block volume in the sandbox state")?
        .to_string();
    let qemu = st["qemu"]["pid"]
        .as_i64()
        .ok_or("no QEMU pid in the sandbox state")? as i32;
    let shim = st["shim"]["pid"]
        .as_i64()
        .ok_or("no shim pid in the sandbox state")? as i32;
    let mut pids = vec![qemu];
    pids.extend(host::virtiofsd_pids(shim));
    if pids.len() < 2 {
        return Err(format!(
            "no virtiofsd found below the sandbox's shim (pid {shim})"
        ));
    }
    let guest = Guest { rt, id, stop };
    let mounts = guest
        .sh("cat /proc/mounts", Duration::from_secs(60))
        .await?;
    let find = |dest: &str| {
        mounts.lines().find_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() > 2 && f[1] == dest).then(|| (f[0].to_string(), f[2].to_string()))
        })
    };
    let block = match find(MOUNT_DESTINATION) {
        Some((dev, fs)) if dev.starts_with("/dev/vd") && fs == cfg.fs_type => (dev, fs),
        other => {
            return Err(format!(
                "{MOUNT_DESTINATION} in the guest is {other:?}, not a {} virtio-blk disk",
                cfg.fs_type
            ));
        }
    };
    let virtiofs = match find(VIRTIOFS_DESTINATION) {
        Some((tag, fs)) if fs == "virtiofs" => (tag, fs),
        other => {
            return Err(format!(
                "{VIRTIOFS_DESTINATION} in the guest is {other:?}, not virtio-fs"
            ));
        }
    };
    guest
        .sh(
            &format!("command -v fio && command -v {HELPER} && fio --version"),
            Duration::from_secs(60),
        )
        .await
        .map_err(|e| {
            format!(
                "the guest image has no fio/{HELPER} ({e}): build the bench image with \
                 `guest/build-image.sh --bench` and pass it with --guest-kernel/--guest-initrd"
            )
        })?;
    Ok((
        guest,
        pids,
        Seen {
            block,
            virtiofs,
            block_device,
            block_io,
        },
    ))
}

/// Human names of the helper's probes.
pub(crate) fn feature_label(name: &str) -> &str {
    match name {
        "o_direct" => "O_DIRECT",
        "xattr" => "xattrs (user.*)",
        "posix_acl" => "POSIX ACLs",
        "fallocate_punch_hole" => "fallocate + punch hole",
        "flock" => "flock, two processes",
        "fcntl_lock" => "fcntl locks, two processes",
        "inotify" => "inotify",
        "mmap_shared_write" => "mmap shared writes",
        other => other,
    }
}

pub(crate) async fn feature_table(
    bench: &Bench<'_>,
    blk: &Flow,
    vfs: &Flow,
) -> Result<Vec<FeatureRow>, String> {
    let b = bench.features(Side::Block).await?;
    let v = bench.features(Side::Virtiofs).await?;
    let mut rows = Vec::new();
    for (name, checks, outcome) in b {
        let other = v
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, _, o)| o.clone())
            .unwrap_or(Outcome {
                works: false,
                detail: "not probed".into(),
            });
        rows.push(FeatureRow {
            feature: feature_label(&name).to_string(),
            checks,
            block: outcome,
            virtiofs: other,
        });
    }
    rows.push(FeatureRow {
        feature: "statfs = CSI stats".into(),
        checks: "the guest's statvfs of the mount equals NodeGetVolumeStats (bytes and inodes)"
            .into(),
        block: statfs_vs_csi(bench, Side::Block, blk).await,
        virtiofs: statfs_vs_csi(bench, Side::Virtiofs, vfs).await,
    });
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_recorded_io_mode_must_match_the_ask() {
        let st = |direct: bool| json!({"blockIo": {"/k/pods/p/volumes/v/mount": {"direct": direct, "aio": "io_uring", "backingFile": true}}});
        assert_eq!(
            block_io_of(&st(true), false).unwrap(),
            "the loop device's backing file, cache.direct=on aio=io_uring"
        );
        // Buffered without asking is the runtime's fallback: reported, not refused.
        assert_eq!(
            block_io_of(&st(false), false).unwrap(),
            "the loop device's backing file, cache.direct=off aio=io_uring"
        );
        // A record from before the route was recorded: the device.
        let old = json!({"blockIo": {"t": {"direct": true, "aio": "native"}}});
        assert_eq!(
            block_io_of(&old, false).unwrap(),
            "the device, cache.direct=on aio=native"
        );
        assert!(block_io_of(&st(false), true).is_ok());
        assert!(
            block_io_of(&st(true), true)
                .unwrap_err()
                .contains("--host-cache did not take effect")
        );
        // No record, two records, or an unreadable one: refused.
        assert!(block_io_of(&json!({}), false).is_err());
        let two = json!({"blockIo": {"a": {"direct": true, "aio": "native"}, "b": {"direct": true, "aio": "native"}}});
        assert!(block_io_of(&two, false).is_err());
        assert!(block_io_of(&json!({"blockIo": {"a": {"direct": "yes"}}}), false).is_err());
    }
}
