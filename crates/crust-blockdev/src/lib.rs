//! crust-blockdev
