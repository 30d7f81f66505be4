//! crust-qmp
