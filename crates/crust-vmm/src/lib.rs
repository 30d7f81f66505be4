//! crust-vmm
