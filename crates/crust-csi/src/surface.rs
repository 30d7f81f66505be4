//! What the plugin advertises, per CSI generation (`--csi-spec`).
//!
//! | capability | 1.12 | 1.13 | both |
//! |---|---|---|---|
//! | controller VOLUME_CONDITION (11, compat) | yes | – | yes |
//! | controller GET_VOLUME_HEALTH (16), LIST_VOLUME_HEALTH (17) | – | yes | yes |
//! | node VOLUME_CONDITION (4, compat) | yes | – | yes |
//! | node GET_VOLUME_HEALTH (7), GET_STORAGE_HEALTH (8) | – | yes | yes |
//! | node DEFER_FS_OPS* (KEP-2857: 2857–2859) | – | with `--deferral enabled` | with `--deferral enabled` |
//! | controller EXPAND_VOLUME | with `--expansion controller` (the default), in every mode |||
//! | node VOLUME_MOUNT_GROUP (6) | in every mode |||
//! | snapshot and clone capabilities, GroupController | with a backend that copies (the pool) |||
//!
//! Mode `1.12` is the strict v1.12 surface: a v1.12 client refuses any
//! value it does not know, and KEP-2857's are in no released spec (a
//! deferred publication still works there: the StorageClass's
//! `deferFsOps`, the runtime's handover). Everything else is the same in
//! every mode. The condition fields of
//! NodeGetVolumeStats, ListVolumes and ControllerGetVolume are filled
//! unless the mode is `1.13`; the health RPCs answer UNIMPLEMENTED in mode
//! `1.12`.

use crust_proto::csi::v1 as csi;
use csi::controller_service_capability::rpc::Type as CtlRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;

use tonic::Status;

use crate::config::{CsiSpec, Expansion};

/// The Controller service's capabilities; `snapshots`: the backend copies
/// (snapshots and clones); EXPAND_VOLUME only when the controller grows
/// volumes (`--expansion controller`).
pub fn controller_capabilities(
    spec: CsiSpec,
    snapshots: bool,
    expansion: Expansion,
) -> Vec<csi::ControllerServiceCapability> {
    let mut caps = vec![
        CtlRpc::CreateDeleteVolume,
        CtlRpc::ListVolumes,
        CtlRpc::GetCapacity,
        CtlRpc::ListVolumesPublishedNodes,
        CtlRpc::GetVolume,
        CtlRpc::SingleNodeMultiWriter,
        CtlRpc::ModifyVolume,
    ];
    if expansion == Expansion::Controller {
        caps.push(CtlRpc::ExpandVolume);
    }
    if spec.serves_condition() {
        caps.push(CtlRpc::VolumeCondition);
    }
    if spec.serves_health_api() {
        caps.extend([CtlRpc::GetVolumeHealth, CtlRpc::ListVolumeHealth]);
    }
    if snapshots {
        caps.extend([
            CtlRpc::CreateDeleteSnapshot,
            CtlRpc::ListSnapshots,
            CtlRpc::GetSnapshot,
            CtlRpc::CloneVolume,
        ]);
    }
    caps.into_iter()
        .map(|t| csi::ControllerServiceCapability {
            r#type: Some(csi::controller_service_capability::Type::Rpc(
                csi::controller_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect()
}

/// The plugin's capabilities (Identity).
pub fn plugin_capabilities(spec: CsiSpec, snapshots: bool) -> Vec<csi::PluginCapability> {
    use csi::plugin_capability::service::Type as Svc;
    use csi::plugin_capability::volume_expansion::Type as Expansion;
    use csi::plugin_capability::{Service, Type, VolumeExpansion};
    let svc = |t: Svc| csi::PluginCapability {
        r#type: Some(Type::Service(Service { r#type: t as i32 })),
    };
    let mut caps = vec![
        svc(Svc::ControllerService),
        svc(Svc::VolumeAccessibilityConstraints),
        csi::PluginCapability {
            r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                r#type: Expansion::Online as i32,
            })),
        },
    ];
    if snapshots {
        caps.push(svc(Svc::GroupControllerService));
        // Snapshots stay on their volume's node (v1.13's value 5).
        if spec.serves_health_api() {
            caps.push(svc(Svc::SnapshotAccessibilityConstraints));
        }
    }
    caps
}

/// The GroupController service's capabilities.
pub fn group_controller_capabilities(
    snapshots: bool,
) -> Vec<csi::GroupControllerServiceCapability> {
    use csi::group_controller_service_capability::{Rpc, Type, rpc::Type as G};
    if !snapshots {
        return Vec::new();
    }
    vec![csi::GroupControllerServiceCapability {
        r#type: Some(Type::Rpc(Rpc {
            r#type: G::CreateDeleteGetVolumeGroupSnapshot as i32,
        })),
    }]
}

/// The Node service's capabilities.
pub fn node_capabilities(spec: CsiSpec, deferral: bool) -> Vec<csi::NodeServiceCapability> {
    let mut caps = vec![
        NodeRpc::StageUnstageVolume,
        NodeRpc::GetVolumeStats,
        NodeRpc::ExpandVolume,
        NodeRpc::SingleNodeMultiWriter,
        // kubelet then passes the pod's fsGroup as volume_mount_group and
        // leaves it to the driver: the host publication applies it, a
        // handover carries it to the guest (no KEP field needed).
        NodeRpc::VolumeMountGroup,
    ];
    if spec.serves_condition() {
        caps.push(NodeRpc::VolumeCondition);
    }
    if spec.serves_health_api() {
        caps.extend([NodeRpc::GetVolumeHealth, NodeRpc::GetStorageHealth]);
    }
    if deferral && spec != CsiSpec::V1_12 {
        caps.extend([
            NodeRpc::DeferFsOps,
            NodeRpc::DeferFsOpsWithSupplementalGroup,
            NodeRpc::DeferFsOpsWithSupplementalGroupChangePolicy,
        ]);
    }
    caps.into_iter()
        .map(|t| csi::NodeServiceCapability {
            r#type: Some(csi::node_service_capability::Type::Rpc(
                csi::node_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect()
}

/// The v1.13 health RPCs in a plugin started with `--csi-spec 1.12`.
pub(crate) fn health_api_off(rpc: &str) -> Status {
    Status::unimplemented(format!(
        "{rpc} is a CSI v1.13 RPC; this plugin serves the v1.12 surface (--csi-spec 1.12)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctl(spec: CsiSpec) -> Vec<i32> {
        controller_capabilities(spec, false, Expansion::Controller)
            .into_iter()
            .map(|c| match c.r#type {
                Some(csi::controller_service_capability::Type::Rpc(r)) => r.r#type,
                None => 0,
            })
            .collect()
    }

    fn node(spec: CsiSpec, deferral: bool) -> Vec<i32> {
        node_capabilities(spec, deferral)
            .into_iter()
            .map(|c| match c.r#type {
                Some(csi::node_service_capability::Type::Rpc(r)) => r.r#type,
                None => 0,
            })
            .collect()
    }

    #[test]
    fn each_generation_sees_its_own_values() {
        assert!(ctl(CsiSpec::V1_12).contains(&11));
        assert!(!ctl(CsiSpec::V1_12).iter().any(|v| *v == 16 || *v == 17));
        assert!(!ctl(CsiSpec::V1_13).contains(&11));
        assert!(ctl(CsiSpec::V1_13).contains(&16) && ctl(CsiSpec::V1_13).contains(&17));
        assert!(node(CsiSpec::V1_12, false).contains(&4));
        assert!(
            !node(CsiSpec::V1_12, false)
                .iter()
                .any(|v| *v == 7 || *v == 8)
        );
        assert!(!node(CsiSpec::V1_13, false).contains(&4));
        let both = node(CsiSpec::Both, true);
        for v in [4, 7, 8, 2857, 2858, 2859] {
            assert!(both.contains(&v), "{v} missing from {both:?}");
        }
        assert!(!node(CsiSpec::Both, false).iter().any(|v| *v >= 2857));
        assert!(!node(CsiSpec::V1_12, true).iter().any(|v| *v >= 2857));
    }
}
