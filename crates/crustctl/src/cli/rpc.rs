//! One CSI call per command: send the built request, print the answer.

use super::args::IdentityCmd;
use super::request::{ControllerReq, GroupReq, NodeReq};
use super::{CliError, emit};
use crust_csi_client::Csi;
use crust_report::OutputFormat;

/// Identity calls (no request to build).
pub(super) async fn identity(c: &Csi, cmd: IdentityCmd, out: OutputFormat) -> Result<(), CliError> {
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

/// Controller calls.
pub(super) async fn controller(
    c: &Csi,
    req: ControllerReq,
    out: OutputFormat,
) -> Result<(), CliError> {
    match req {
        ControllerReq::Create(r) => emit(out, &c.create_volume(r).await?, ""),
        ControllerReq::Delete(r) => {
            let id = r.volume_id.clone();
            emit(
                out,
                &c.delete_volume(r).await?,
                &format!("volume {id} deleted"),
            )
        }
        ControllerReq::Get(r) => emit(out, &c.controller_get_volume(r).await?, ""),
        ControllerReq::Health(r) => emit(out, &c.controller_get_volume_health(r).await?, ""),
        ControllerReq::ListHealth(r, true) => emit(out, &c.list_all_volume_health(r).await?, ""),
        ControllerReq::ListHealth(r, false) => {
            emit(out, &c.controller_list_volume_health(r).await?, "")
        }
        ControllerReq::List(r, true) => emit(
            out,
            &c.list_all_volumes(r.max_entries, r.starting_token).await?,
            "",
        ),
        ControllerReq::List(r, false) => emit(out, &c.list_volumes(r).await?, ""),
        ControllerReq::Capacity(r) => emit(out, &c.get_capacity(r).await?, ""),
        ControllerReq::Expand(r) => emit(out, &c.controller_expand_volume(r).await?, ""),
        ControllerReq::Validate(r) => emit(out, &c.validate_volume_capabilities(r).await?, ""),
        ControllerReq::Capabilities => emit(
            out,
            &c.controller_get_capabilities(Default::default()).await?,
            "",
        ),
        ControllerReq::Publish(r) => emit(out, &c.controller_publish_volume(r).await?, ""),
        ControllerReq::Unpublish(r) => {
            let id = r.volume_id.clone();
            emit(
                out,
                &c.controller_unpublish_volume(r).await?,
                &format!("volume {id} unpublished"),
            )
        }
        ControllerReq::Modify(r) => {
            let id = r.volume_id.clone();
            emit(
                out,
                &c.controller_modify_volume(r).await?,
                &format!("volume {id} modified"),
            )
        }
        ControllerReq::SnapCreate(r) => emit(out, &c.create_snapshot(r).await?, ""),
        ControllerReq::SnapDelete(r) => {
            let id = r.snapshot_id.clone();
            emit(
                out,
                &c.delete_snapshot(r).await?,
                &format!("snapshot {id} deleted"),
            )
        }
        ControllerReq::SnapList(r, true) => emit(out, &c.list_all_snapshots(r).await?, ""),
        ControllerReq::SnapList(r, false) => emit(out, &c.list_snapshots(r).await?, ""),
        ControllerReq::SnapGet(r) => emit(out, &c.get_snapshot(r).await?, ""),
    }
    Ok(())
}

/// GroupController calls.
pub(super) async fn group(c: &Csi, req: GroupReq, out: OutputFormat) -> Result<(), CliError> {
    match req {
        GroupReq::Capabilities => emit(
            out,
            &c.group_controller_get_capabilities(Default::default())
                .await?,
            "",
        ),
        GroupReq::Create(r) => emit(out, &c.create_volume_group_snapshot(r).await?, ""),
        GroupReq::Delete(r) => {
            let msg = format!("group snapshot {} deleted", r.group_snapshot_id);
            emit(out, &c.delete_volume_group_snapshot(r).await?, &msg)
        }
        GroupReq::Get(r) => emit(out, &c.get_volume_group_snapshot(r).await?, ""),
    }
    Ok(())
}

/// Node calls.
pub(super) async fn node(c: &Csi, req: NodeReq, out: OutputFormat) -> Result<(), CliError> {
    match req {
        NodeReq::Stage(r) => {
            let msg = format!("volume {} staged at {}", r.volume_id, r.staging_target_path);
            emit(out, &c.node_stage_volume(r).await?, &msg)
        }
        NodeReq::Unstage(r) => {
            let msg = format!(
                "volume {} unstaged from {}",
                r.volume_id, r.staging_target_path
            );
            emit(out, &c.node_unstage_volume(r).await?, &msg)
        }
        NodeReq::Publish(r) => {
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
        NodeReq::Unpublish(r) => {
            let msg = format!("volume {} unpublished from {}", r.volume_id, r.target_path);
            emit(out, &c.node_unpublish_volume(r).await?, &msg)
        }
        NodeReq::Stats(r) => emit(out, &c.node_get_volume_stats(r).await?, ""),
        NodeReq::Health(r) => emit(out, &c.node_get_volume_health(r).await?, ""),
        NodeReq::StorageHealth => emit(
            out,
            &c.node_get_storage_health(Default::default()).await?,
            "",
        ),
        NodeReq::Expand(r) => emit(out, &c.node_expand_volume(r).await?, ""),
        NodeReq::Capabilities => emit(out, &c.node_get_capabilities(Default::default()).await?, ""),
        NodeReq::Info => emit(out, &c.node_get_info(Default::default()).await?, ""),
    }
    Ok(())
}
