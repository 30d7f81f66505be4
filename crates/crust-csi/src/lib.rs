//! crust-csi
