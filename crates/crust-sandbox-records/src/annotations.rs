//! OCI annotations the runtime reads.

/// OCI annotation (pod or container): `required` refuses any fallback to
/// a shared host mount; `auto` (default) shares what is not handed over.
pub const DEFER_ANNOTATION: &str = "io.crust.defer-fs-ops";
