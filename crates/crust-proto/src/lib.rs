//! Generated gRPC bindings used across crust.
//!
//! - [`csi::v1`]: the CSI v1.12 wire format plus the KEP-2857 extension
//!   (`defer_fs_ops`, supplemental group fields, DEFER_FS_OPS capabilities).
//! - [`runtime::v1alpha1`]: the KEP-2857 `Runtime` service of crust_ops.
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

pub mod authority;
pub mod endpoint;
pub mod server;
