//! crust-ops
