//! crustctl
