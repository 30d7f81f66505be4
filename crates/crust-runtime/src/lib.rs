//! crust-runtime
