//! crust-handoff
