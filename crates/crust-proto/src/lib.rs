//! Generated gRPC bindings used across crust.
//!
//! - [`csi::v1`]: the CSI v1.13 wire format, the v1.12 condition fields COs
//!   built on v1.12 still read, and the KEP-2857 extension
//!   (`defer_fs_ops`, supplemental group fields, DEFER_FS_OPS capabilities).
//! - [`runtime::v1alpha1`]: the KEP-2857 `Runtime` service of crust_ops.
//! - [`handover::v1alpha1`]: crust-csi's `Handover` service (runtime-driven
//!   deferral: a VM runtime takes a host-published volume into its guest).
//! - [`peer::v1alpha1`]: crust-csi to crust-csi across nodes (a
//!   ModifyVolume for a volume another node owns, sealed with a shared key).
//! - [`server::incoming`]: how every crust gRPC server accepts
//!   connections (the unix-socket `:authority` of non-Go clients is
//!   rewritten before h2 sees it, see [`authority`]).

pub mod csi {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic)]
        tonic::include_proto!("csi.v1");
    }
}

pub mod runtime {
    pub mod v1alpha1 {
        #![allow(clippy::all, clippy::pedantic)]
        tonic::include_proto!("crust.runtime.v1alpha1");
    }
}

pub mod handover {
    pub mod v1alpha1 {
        #![allow(clippy::all, clippy::pedantic)]
        tonic::include_proto!("crust.handover.v1alpha1");
    }
}

pub mod peer {
    pub mod v1alpha1 {
        #![allow(clippy::all, clippy::pedantic)]
        tonic::include_proto!("crust.peer.v1alpha1");
    }
}

/// The `:authority` front (its own crate so the fuzz targets build it
/// without the gRPC stack).
pub use crust_h2_authority as authority;
pub mod endpoint;
pub mod server;

/// Every KEP-2857 number crust uses in `csi.proto`, next to the number CSI
/// spec pull request #526 proposes, for docs and the wire tests (which
/// check that none equals a number a released CSI version uses).
pub mod kep2857 {
    /// `(message, field, PR #526 number, crust's number)`.
    pub const FIELDS: &[(&str, &str, u32, u32)] = &[
        ("NodePublishVolumeRequest", "defer_fs_ops", 9, 9),
        ("NodeUnpublishVolumeRequest", "defer_fs_ops", 3, 3),
        ("NodeGetVolumeStatsRequest", "defer_fs_ops", 4, 4),
        ("NodeExpandVolumeRequest", "defer_fs_ops", 7, 2857),
        (
            "VolumeCapability.MountVolume",
            "volume_supplemental_group",
            4,
            4,
        ),
        (
            "VolumeCapability.MountVolume",
            "volume_supplemental_group_change_policy",
            5,
            5,
        ),
        ("NodeGetInfoResponse", "supported_file_systems", 4, 4),
    ];

    /// `(NodeServiceCapability.RPC.Type value name, PR #526 value, crust's value)`.
    pub const NODE_CAPABILITIES: &[(&str, i32, i32)] = &[
        ("DEFER_FS_OPS", 7, 2857),
        ("DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP", 8, 2858),
        (
            "DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY",
            9,
            2859,
        ),
    ];
}
